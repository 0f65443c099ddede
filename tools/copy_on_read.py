"""The datasets of the copy-on-read workloads of `python -m statecore bench` (pytorch#13246).

A map-style dataset that holds millions of small Python objects in a list, as an annotation
file loaded at start-up does: worker processes forked from the main process share its pages
until they touch them, and reading an object writes its reference count, so the pages of every
record a worker reads, and of every object its garbage collector walks, become its own copy.
The tree of a main process and 4 workers then holds several times the list.

`Records` is that dataset; with `shared=True` it keeps the same records in a
`statecore.SharedSequence` (one flat buffer of pickles that nothing writes), the opt-in helper
for it. The workloads are in `tools/workloads.py`; docs/performance.md ("Copy-on-read memory")
has the figures.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch.utils.data

__all__ = ["Records", "record", "shared_records"]


def record(number: int) -> dict[str, Any]:
    """Record `number`: a small dict, as an annotation file holds one per sample."""
    return {
        "id": number,
        "path": f"images/{number // 1000:04d}/{number:08d}.jpg",
        "label": number % 1000,
    }


def _records(size: int) -> Iterator[dict[str, Any]]:
    return (record(number) for number in range(size))


class Records(torch.utils.data.Dataset[tuple[int, int]]):
    """`size` small dicts held in memory; item i: record i's label and the length of its path.

    With `shared=True` the records are kept in a `statecore.SharedSequence`, built from a
    generator so that the list of dicts never exists in this process; else in a list.
    """

    def __init__(self, size: int, shared: bool = False) -> None:
        from statecore.executors._shared_sequence import SharedSequence

        self.records: Sequence[dict[str, Any]] = (
            SharedSequence(_records(size)) if shared else list(_records(size))
        )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[int, int]:
        # What a real dataset does with its record: open the file at its path, label it.
        found = self.records[index]
        return found["label"], len(found["path"])


def shared_records(size: int) -> Records:
    """`Records(size, shared=True)`: the dataset of the workload with the helper."""
    return Records(size, shared=True)
