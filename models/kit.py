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
3. For an executor that declares `Capabilities.replaces_workers`, the replacement cases
   (`replace_cases`, `check_replacing`): the executor driven by hand, as the driver drives it,
   through `ReplaceWorker` commands. A replacement says `WorkerStarted` with its incarnation
   before anything else of it; every answer of it carries that incarnation; every task sent
   to it again is answered exactly once, in the order sent, with the right batch (for an
   iterable dataset, from where the mark it was given left its worker's part); and after a
   replacement, whatever still comes from the lost incarnation carries the lost one's number.

The first difference raises `ConformanceError` naming the configuration and both outcomes.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import attrs
import torch
import torch.utils.data
from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test
from torch.utils.data import default_collate
from torch.utils.data.dataloader import _DatasetKind

from statecore import (
    Event,
    ReplaceWorker,
    SendTask,
    TaskCompleted,
    TaskFailed,
    WorkerDied,
    WorkerExhausted,
    WorkerStarted,
)
from statecore.executors._protocol import (
    ExecutorFactory,
    Launch,
    capabilities_of,
    confirmer_of,
    replacer_of,
)
from statecore.executors._registry import resolve_executor
from statecore.executors._worker import WorkerSetup
from statecore.models.conformance import (
    ConformanceError,
    MapDataset,
    Outcome,
    ShardedIterable,
    canonical,
    executor_machine,
    loads_in_process,
    stop_torch_workers,
    take_outcome,
)

__all__ = [
    "Case",
    "KitReport",
    "Records",
    "ReplaceCase",
    "check_executor",
    "check_replacing",
    "declares_replacing",
    "matrix",
    "replace_cases",
    "run_case",
    "tagged",
]

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
    replace_cases: tuple[str, ...] = ()
    """The replacement cases run: none for an executor that does not replace workers."""

    def describe(self) -> str:
        replaced = (
            f", and its {len(self.replace_cases)} replacement cases passed"
            if self.replace_cases
            else ""
        )
        return (
            f"executor {self.executor}: {len(self.cases)} configurations matched torch's, "
            f"the conformance machine passed (up to {self.max_examples} drawn runs){replaced}"
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
    starts real loaders, so keep it small). `cases` replaces the matrix. An executor that
    declares `replaces_workers` also runs the replacement cases (`replace_cases`).
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
    replaced = check_replacing(executor) if not in_process and declares_replacing(executor) else ()
    return KitReport(
        executor=repr(executor),
        cases=tuple(case.name for case in chosen),
        max_examples=machine_settings.max_examples,
        replace_cases=replaced,
    )


# --- replacing workers ----------------------------------------------------------------------------

ANSWER_WITHIN = 60.0
"""How long a replacement case waits for the executor's next event before it fails."""


def declares_replacing(executor: str | ExecutorFactory) -> bool:
    """Whether `executor` (a name or a factory, loading in workers) declares
    `Capabilities.replaces_workers`."""
    factory, _ = resolve_executor(executor, num_workers=2)
    return capabilities_of(factory).replaces_workers


def _map_setup(workers: int) -> WorkerSetup:
    """Workers loading `MapDataset`: the batch for index [i] is tensor([i])."""
    return WorkerSetup(
        dataset=MapDataset(32),
        dataset_kind=_DatasetKind.Map,
        auto_collation=True,
        collate_fn=default_collate,
        drop_last=False,
        base_seed=SEED,
        num_workers=workers,
    )


def _iterable_setup(workers: int) -> WorkerSetup:
    """Workers loading a `ShardedIterable` of 8 items each: worker w's k-th is 100 * w + k."""
    return attrs.evolve(
        _map_setup(workers),
        dataset=ShardedIterable((8,) * workers),
        dataset_kind=_DatasetKind.Iterable,
    )


class _Driven:
    """An executor driven by hand as the driver drives it, every event it said checked as it
    comes against the incarnations the case started, and kept."""

    def __init__(self, executor: str | ExecutorFactory, setup: WorkerSetup, case: str) -> None:
        self.case = case
        self.name = repr(executor)
        factory, _ = resolve_executor(executor, setup.num_workers)
        self.executor = factory(Launch(setup, setup.num_workers))
        self.confirm = confirmer_of(self.executor)
        replacer = replacer_of(self.executor)
        if replacer is None:
            self.fail(
                "the executor it made does not declare replaces_workers, though its factory does"
            )
        self.replacer = replacer
        self.incarnations = [0] * setup.num_workers
        self.sent: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
        """(worker, incarnation) -> the tasks sent to that incarnation, in order."""
        self.events: list[Event] = []
        self.executor.start()

    def fail(self, problem: str) -> NoReturn:
        seen = "\n  ".join(repr(event) for event in getattr(self, "events", ()))
        raise ConformanceError(
            f"replacement case {self.case!r}, executor={self.name}: {problem}\n"
            f"events so far:\n  {seen}"
        )

    def send(self, worker: int, task: int, index: Any) -> None:
        self.sent[worker, self.incarnations[worker]].append(task)
        self.executor.dispatch(SendTask(worker, task, index))

    def replace(self, worker: int, mark: Any = None) -> int:
        incarnation = self.incarnations[worker] = self.incarnations[worker] + 1
        self.replacer.replace(ReplaceWorker(worker, incarnation, 0), mark)
        return incarnation

    def until(self, done: Callable[[], bool], waiting_for: str) -> None:
        """Poll until `done()`; fail if no event comes within `ANSWER_WITHIN` seconds."""
        while not done():
            deadline = time.monotonic() + ANSWER_WITHIN
            while True:
                event = self.executor.poll(min(1.0, max(0.0, deadline - time.monotonic())))
                if event is not None:
                    break
                if time.monotonic() >= deadline:
                    self.fail(f"no event within {ANSWER_WITHIN:.0f} s, waiting for {waiting_for}")
            if self.confirm is not None:
                self.confirm()
            self.events.append(event)
            self._check(event)

    def _check(self, event: Event) -> None:
        worker = getattr(event, "worker", None)
        if worker is None:
            self.fail(f"{event!r} is no worker's event")
        incarnation = getattr(event, "incarnation", 0)
        if incarnation > self.incarnations[worker]:
            self.fail(f"{event!r} carries an incarnation never started in worker {worker}'s slot")
        if type(event) is WorkerStarted:
            if event.incarnation != self.incarnations[worker] or any(
                getattr(seen, "worker", None) == worker
                and getattr(seen, "incarnation", 0) == incarnation
                for seen in self.events[:-1]
            ):
                self.fail(
                    f"{event!r} is not the first event of the incarnation {worker}'s slot was "
                    "last given"
                )
        elif incarnation > 0 and not self.started(worker, incarnation):
            self.fail(f"{event!r} came before WorkerStarted({worker}, {incarnation})")
        task = getattr(event, "task", None)
        if task is not None:
            sent = self.sent[worker, incarnation]
            answered = [a.task for a in self.answers(worker, incarnation)]  # type: ignore[attr-defined]
            if answered.count(task) > sent.count(task):
                self.fail(
                    f"{event!r} answers task {task}, which incarnation {incarnation} of worker "
                    f"{worker} was sent {sent.count(task)} time(s) (it was sent {sent})"
                )
        if type(event) is WorkerDied and incarnation == self.incarnations[worker]:
            # A lost incarnation's death may be told (under its own number); no other.
            self.fail(f"{event!r}: no worker of this case dies")

    def started(self, worker: int, incarnation: int) -> bool:
        return WorkerStarted(worker, incarnation) in self.events

    def answers(self, worker: int, incarnation: int) -> list[Event]:
        """The answers (not WorkerStarted) of that incarnation of `worker`, in order."""
        return [
            event
            for event in self.events
            if type(event) in (TaskCompleted, TaskFailed, WorkerExhausted)
            and getattr(event, "worker", None) == worker
            and getattr(event, "incarnation", 0) == incarnation
        ]

    def expect_answers(
        self, worker: int, incarnation: int, expected: list[tuple[int, Any]], sent_before: int
    ) -> list[TaskCompleted]:
        """Check that incarnation `incarnation` of `worker` answered exactly `expected` (task,
        batch), in that order, and that any answer of an earlier incarnation is to a task that
        was sent to it (numbered below `sent_before`), each at most once."""
        got = self.answers(worker, incarnation)
        if [type(event) for event in got] != [TaskCompleted] * len(got) or [
            (event.task, canonical(event.payload))  # type: ignore[attr-defined]
            for event in got
        ] != [(task, canonical(batch)) for task, batch in expected]:
            self.fail(
                f"incarnation {incarnation} of worker {worker} should have answered each of "
                f"{expected} exactly once, in that order, and answered {got}"
            )
        for earlier in range(incarnation):
            tasks = [event.task for event in self.answers(worker, earlier)]  # type: ignore[attr-defined]
            if len(tasks) != len(set(tasks)) or any(task >= sent_before for task in tasks):
                self.fail(
                    f"the lost incarnation {earlier} of worker {worker} answered tasks {tasks}: "
                    f"only tasks sent to it (below {sent_before}), each once"
                )
        return got  # type: ignore[return-value]

    def close(self) -> None:
        for worker in range(len(self.incarnations)):
            self.executor.stop_worker(worker)
        self.executor.shutdown()


def _answered(driven: _Driven, worker: int, incarnation: int, count: int) -> Callable[[], bool]:
    return lambda: len(driven.answers(worker, incarnation)) >= count


def _start(driven: _Driven, worker: int, mark: Any = None) -> int:
    """Replace `worker` and wait for its replacement to say it started; its incarnation."""
    incarnation = driven.replace(worker, mark)
    driven.until(
        lambda: driven.started(worker, incarnation), f"WorkerStarted({worker}, {incarnation})"
    )
    return incarnation


def _replaced_holding_tasks(executor: str | ExecutorFactory) -> None:
    driven = _Driven(executor, _map_setup(2), "a replacement answers the tasks sent to it again")
    try:
        # Worker 0 holds six tasks as it is replaced (it may have answered some: as the lost
        # incarnation, which the scheduler drops); worker 1 holds three.
        held = [0, 2, 3, 5, 6, 8]
        for task in range(9):
            driven.send(0 if task in held else 1, task, [task])
        incarnation = _start(driven, 0)
        for task in held:
            driven.send(0, task, [task])
        driven.until(_answered(driven, 0, incarnation, len(held)), "the tasks sent again")
        driven.until(_answered(driven, 1, 0, 3), "worker 1's tasks")
        driven.expect_answers(0, incarnation, [(t, torch.tensor([t])) for t in held], 9)
        driven.expect_answers(1, 0, [(t, torch.tensor([t])) for t in (1, 4, 7)], 9)
    finally:
        driven.close()


def _replaced_twice(executor: str | ExecutorFactory) -> None:
    driven = _Driven(executor, _map_setup(1), "a slot replaced twice numbers each incarnation")
    try:
        driven.send(0, 0, [0])
        for _ in range(2):
            incarnation = _start(driven, 0)
            driven.send(0, 0, [0])
            driven.send(0, incarnation, [incarnation])
            driven.until(_answered(driven, 0, incarnation, 2), "the tasks sent to it")
            batches = [(0, torch.tensor([0])), (incarnation, torch.tensor([incarnation]))]
            driven.expect_answers(0, incarnation, batches, incarnation + 1)
    finally:
        driven.close()


def _replaced_at_its_mark(executor: str | ExecutorFactory) -> None:
    driven = _Driven(
        executor, _iterable_setup(2), "a replacement goes on from the mark it is given"
    )
    pair = [None, None]
    try:
        driven.send(0, 0, pair)
        driven.send(0, 1, pair)
        driven.until(_answered(driven, 0, 0, 2), "worker 0's first two batches")
        mark = driven.answers(0, 0)[-1].mark  # type: ignore[attr-defined]
        driven.send(0, 2, pair)
        # Lost holding its third batch: the replacement restores its part to the second's mark.
        incarnation = _start(driven, 0, mark)
        driven.send(0, 2, pair)
        driven.send(0, 3, pair)
        driven.until(_answered(driven, 0, incarnation, 2), "the batches after the mark")
        driven.expect_answers(
            0, incarnation, [(2, torch.tensor([4, 5])), (3, torch.tensor([6, 7]))], 3
        )
    finally:
        driven.close()


@attrs.frozen
class ReplaceCase:
    """One replacement case: `check(executor)` raises `ConformanceError` on a broken promise."""

    name: str
    check: Callable[[str | ExecutorFactory], None]


def replace_cases() -> list[ReplaceCase]:
    """The cases an executor that declares `replaces_workers` must pass."""
    # The slot replaced twice first: it sends a replacement a task its lost incarnation never
    # had, so answers that are not stamped fail it at once rather than after `ANSWER_WITHIN`.
    return [
        ReplaceCase("a slot replaced twice numbers each incarnation", _replaced_twice),
        ReplaceCase("a replacement answers the tasks sent to it again", _replaced_holding_tasks),
        ReplaceCase("a replacement goes on from the mark it is given", _replaced_at_its_mark),
    ]


def check_replacing(executor: str | ExecutorFactory) -> tuple[str, ...]:
    """Run the replacement cases on `executor` (one that declares `replaces_workers` and loads
    in workers); raise `ConformanceError` on the first broken promise. Returns their names."""
    cases = replace_cases()
    for case in cases:
        case.check(executor)
    return tuple(case.name for case in cases)
