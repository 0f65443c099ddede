"""The conformance kit's datasets (`statecore.models.conformance`, `statecore.models.kit`).

A worker that is not a fork of the main process (a spawned one, a Ray actor) imports the
module that defines its dataset to unpickle it. These live here, in a module that imports only
torch, so that such a worker does not also import Hypothesis and the models (about 0.2 s of
every worker's start, paid by each actor the kit starts on Ray).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.utils.data

__all__ = ["STRIDE", "InjectedFailure", "MapDataset", "ShardedIterable"]

STRIDE = 100
"""`ShardedIterable`'s worker w numbers its items STRIDE * w + k: every item is distinct."""


class InjectedFailure(Exception):
    """Raised by the test datasets when they load the item chosen to fail."""


class MapDataset(torch.utils.data.Dataset[int]):
    """Item i is the integer i; loading item `failing` raises `InjectedFailure`."""

    def __init__(self, size: int, failing: int | None = None) -> None:
        self.size = size
        self.failing = failing

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        if index == self.failing:
            raise InjectedFailure(f"injected failure at index {index}")
        return int(index)


class _Shard:
    """One worker's share of a `ShardedIterable`: an iterator that goes on after a failure."""

    def __init__(self, items: range, failing: int | None) -> None:
        self.items = iter(items)
        self.failing = failing

    def __iter__(self) -> _Shard:
        return self

    def __next__(self) -> int:
        item = next(self.items)
        if item == self.failing:
            raise InjectedFailure(f"injected failure at item {item}")
        return item


class ShardedIterable(torch.utils.data.IterableDataset[int]):
    """Worker w (by torch's get_worker_info; 0 in the main process) yields `lengths[w]` items.

    Its k-th item is `100 * w + k`; loading the item `failing` raises `InjectedFailure`, and the
    shard goes on with the next item, so the epoch continues after the error.
    """

    def __init__(self, lengths: tuple[int, ...], failing: int | None = None) -> None:
        self.lengths = lengths
        self.failing = failing

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        start = STRIDE * worker
        return _Shard(range(start, start + self.lengths[worker]), self.failing)
