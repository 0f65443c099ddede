"""The executor conformance kit: one call that says whether an executor can be relied on.

`check_executor(executor)` runs two checks on anything `statecore.DataLoader(executor=...)`
accepts (a registered name or a factory):

1. The torch comparison matrix (`matrix`): fixed configurations that each exercise one
   promise: batching and drop_last, shuffling, custom samplers, batch samplers and collate
   functions, nested batches, sharded iterable datasets, prefetch depths, out-of-order
   loading, persistent workers over several epochs, epochs abandoned part-way, and dataset
   errors raised in their turn. statecore's loader and torch's load each configuration for a
   few epochs; the outcomes (batches and errors) must match, in order or, out of order, as a
   multiset.
2. The Hypothesis machine (`statecore.models.conformance.executor_machine`): configurations
   and consumer behaviour drawn at random, checked step by step against torch, with the
   scheduler's invariants checked between steps and no child process left at the end.

The first difference raises `ConformanceError` naming the configuration and both outcomes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.utils.data
from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test

from statecore.executors._protocol import ExecutorFactory
from statecore.models.conformance import (
    ConformanceError,
    MapDataset,
    Outcome,
    ShardedIterable,
    executor_machine,
    loads_in_process,
    stop_torch_workers,
    take_outcome,
)

__all__ = ["Case", "KitReport", "Records", "check_executor", "matrix", "run_case", "tagged"]

SEED = 20241122


class Records(torch.utils.data.Dataset[dict[str, Any]]):
    """Item i is a nested record: a tensor, an int, a string and a tuple holding a tensor."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "x": torch.full((2,), float(index)),
            "label": index % 3,
            "name": f"item-{index}",
            "pair": (torch.tensor([index, -index]), index * 10),
        }


def tagged(items: list[int]) -> dict[str, Any]:
    """A collate function: a dict holding the batch as a tensor and as a list of strings."""
    return {"values": torch.tensor(items), "names": [str(item) for item in items]}


class _Backwards(torch.utils.data.Sampler[int]):
    """Every index, last first: a sampler torch cannot infer from shuffle."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.size - 1, -1, -1))


class _Uneven(torch.utils.data.Sampler[list[int]]):
    """A batch sampler with batches of sizes 1, 2, 3, ...: no fixed batch size."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[list[int]]:
        start, width = 0, 1
        while start < self.size:
            yield list(range(start, min(start + width, self.size)))
            start, width = start + width, width + 1


@attrs.frozen
class Case:
    """One configuration of the matrix: a dataset, the loader's arguments, what to compare."""

    name: str
    dataset: Callable[[], Any]
    arguments: Callable[[], dict[str, Any]]
    epochs: int = 2
    in_order: bool = True
    abandon_after: int | None = None
    """Break out of every epoch but the last after this many batches (an abandoned epoch)."""


def _fixed(**arguments: Any) -> Callable[[], dict[str, Any]]:
    """Loader arguments, with a freshly seeded generator each time they are asked for."""

    def build() -> dict[str, Any]:
        return {**arguments, "generator": torch.Generator().manual_seed(SEED)}

    return build


def matrix(in_process: bool, workers: int = 2) -> list[Case]:
    """The configurations the kit compares with torch: num_workers 0 for an in-process executor.

    `workers` is the largest num_workers used; cases with workers also use 1.
    """
    many = 0 if in_process else workers
    one = 0 if in_process else 1
    cases = [
        Case("sequential, batch 3", lambda: MapDataset(10), _fixed(batch_size=3, num_workers=many)),
        Case(
            "drop_last",
            lambda: MapDataset(10),
            _fixed(batch_size=3, drop_last=True, num_workers=many),
        ),
        Case("unbatched", lambda: MapDataset(5), _fixed(batch_size=None, num_workers=one)),
        Case(
            "shuffled by a generator",
            lambda: MapDataset(12),
            _fixed(batch_size=2, shuffle=True, num_workers=many),
            epochs=3,
        ),
        Case(
            "custom sampler and collate_fn",
            lambda: MapDataset(9),
            lambda: {
                "batch_size": 2,
                "sampler": _Backwards(9),
                "collate_fn": tagged,
                "num_workers": many,
            },
        ),
        Case(
            "batch sampler",
            lambda: MapDataset(12),
            lambda: {"batch_sampler": _Uneven(12), "num_workers": many},
        ),
        Case("nested records", lambda: Records(7), _fixed(batch_size=3, num_workers=many)),
        Case(
            "dataset error in its turn",
            lambda: MapDataset(8, failing=4),
            _fixed(batch_size=2, num_workers=many),
        ),
        Case(
            "iterable, sharded by worker",
            # shards of different lengths, one per worker (one in-process)
            lambda: ShardedIterable(tuple(5 - w % 3 for w in range(max(1, many)))),
            _fixed(batch_size=2, num_workers=many),
        ),
        Case(
            "iterable with an error, drop_last",
            lambda: ShardedIterable((6,) * max(1, many), failing=2),
            _fixed(batch_size=4, drop_last=True, num_workers=many),
        ),
        Case(
            "abandoned epochs",
            lambda: MapDataset(10),
            _fixed(batch_size=2, shuffle=True, num_workers=many),
            epochs=3,
            abandon_after=2,
        ),
    ]
    if not in_process:
        cases += [
            Case(
                "prefetch 1, one worker",
                lambda: MapDataset(7),
                _fixed(batch_size=2, num_workers=1, prefetch_factor=1),
            ),
            Case(
                "prefetch 3",
                lambda: MapDataset(15),
                _fixed(batch_size=2, num_workers=many, prefetch_factor=3),
            ),
            Case(
                "persistent workers",
                lambda: MapDataset(9),
                _fixed(batch_size=2, shuffle=True, num_workers=many, persistent_workers=True),
                epochs=3,
            ),
            Case(
                "persistent workers, abandoned epochs",
                lambda: ShardedIterable((4,) * many),
                _fixed(batch_size=3, num_workers=many, persistent_workers=True),
                epochs=3,
                abandon_after=1,
            ),
            Case(
                "out of order",
                lambda: MapDataset(14, failing=5),
                _fixed(batch_size=2, num_workers=many, in_order=False),
                in_order=False,
            ),
            Case(
                "out of order, iterable",
                lambda: ShardedIterable((5,) * many),
                _fixed(batch_size=2, num_workers=many, in_order=False),
                in_order=False,
            ),
        ]
    return cases


def _outcomes(iterator: Iterator[Any], limit: int | None) -> list[Outcome]:
    """The epoch's outcomes, or only its first `limit`."""
    got: list[Outcome] = []
    while limit is None or len(got) < limit:
        outcome = take_outcome(iterator)
        if outcome is None:
            break
        got.append(outcome)
    return got


def run_case(executor: str | ExecutorFactory, case: Case) -> None:
    """Load `case` through statecore with `executor` and through torch; raise on a difference."""
    from statecore import DataLoader

    ours = DataLoader(case.dataset(), **case.arguments(), executor=executor)
    theirs = torch.utils.data.DataLoader(case.dataset(), **case.arguments())
    try:
        for epoch in range(1, case.epochs + 1):
            limit = case.abandon_after if epoch < case.epochs else None
            ours_iterator, torch_iterator = iter(ours), iter(theirs)
            got = _outcomes(ours_iterator, limit)
            expected = _outcomes(torch_iterator, limit)
            del ours_iterator
            if torch_iterator is not getattr(theirs, "_iterator", None):
                stop_torch_workers(torch_iterator)
            same = (
                got == expected
                if case.in_order
                else collections.Counter(got) == collections.Counter(expected)
            )
            if not same:
                raise ConformanceError(
                    f"{case.name!r}, epoch {epoch}: statecore with executor={executor!r} "
                    f"handed over\n  {got}\nbut torch handed over\n  {expected}"
                )
    finally:
        stop_torch_workers(getattr(theirs, "_iterator", None))


@attrs.frozen
class KitReport:
    """What the kit ran: the matrix's cases and the machine's settings."""

    executor: str
    cases: tuple[str, ...]
    max_examples: int
    """The machine's example budget (Hypothesis may stop sooner once it has seen enough)."""

    def describe(self) -> str:
        return (
            f"executor {self.executor}: {len(self.cases)} configurations matched torch's, "
            f"and the conformance machine passed (up to {self.max_examples} drawn runs)"
        )


def check_executor(
    executor: str | ExecutorFactory,
    *,
    in_process: bool | None = None,
    workers: int = 2,
    settings: Settings | None = None,
    cases: Sequence[Case] | None = None,
) -> KitReport:
    """Run the whole conformance kit on `executor`; raise `ConformanceError` on a difference.

    `in_process` says whether the executor loads in the calling thread (num_workers=0); left
    out, `loads_in_process(executor)` decides. `workers` is the most workers a configuration uses.
    `settings` tunes the Hypothesis machine (default: 10 derandomized examples of 6 steps; each
    starts real loaders, so keep it small). `cases` replaces the matrix.
    """
    if in_process is None:
        in_process = loads_in_process(executor)
    chosen = list(matrix(in_process, workers) if cases is None else cases)
    for case in chosen:
        run_case(executor, case)
    machine_settings = settings or Settings(
        max_examples=10, stateful_step_count=6, deadline=None, derandomize=True
    )
    machine = executor_machine(executor, in_process=in_process, max_workers=workers)
    run_state_machine_as_test(machine, settings=machine_settings)  # type: ignore[no-untyped-call, unused-ignore]
    return KitReport(
        executor=repr(executor),
        cases=tuple(case.name for case in chosen),
        max_examples=machine_settings.max_examples,
    )
