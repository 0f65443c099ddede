"""A persistent worker lost in a later epoch: its replacement starts where the lost worker's
dataset stood as that epoch began, not where the dataset stood when the loader was given it.

Persistent workers keep their copy of an iterable dataset from one epoch to the next, and a
dataset may keep state across epochs (`CountsEpochs` counts them, `CountsItems` numbers every
item it ever read). A replacement is brought to the lost worker's state at the epoch's start
the way a checkpoint's resume brings a worker there (the mark of its last answer of the epoch
before, that part run dry or, after a `break`, read to that mark, and `iter()` called again),
then to its last answer of this epoch, if any. So the epoch's batches equal an unbroken run's.
A dataset without `state_dict` cannot be brought there: the restart's warning says what may
repeat.

The losses are the datasets' own doing, once: item 0 (worker 0's first of an epoch) or item 4
(its third) read the second time, that is in the second epoch, ends the worker. Files in the
test's directory count the reads across processes and threads, so the replacement reads it
again unharmed.
"""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _datasets import CountsEpochs, CountsItems, share_of_range
from _processes import faulted, load_number
from torch.utils.data import IterableDataset, get_worker_info

import statecore
from statecore import ResumeWorker, TaskCompleted, WorkerExhausted, WorkerRestartedWarning
from statecore.executors._driver import WorkerMarks
from statecore.executors._incarnation import Carried, replacement_setup
from statecore.executors._mp.worker import Restart
from statecore.executors._worker import WorkerSetup

EXECUTORS = [
    pytest.param("mp", "fork", id="fork"),
    pytest.param("mp", "spawn", id="spawn", marks=pytest.mark.exhaustive),
    pytest.param("thread", None, id="thread"),
]
"""(executor, start method): how a worker is lost differs (a process SIGKILLs itself, a thread's
runtime ends with SystemExit); the replacement's setup is the same."""
RAY = pytest.param("ray", None, id="ray", marks=pytest.mark.exhaustive)
"""An actor SIGKILLs its own process; against a local Ray instance (`ray_cluster`)."""


@pytest.fixture
def ray_cluster() -> Iterator[Any]:
    """A local Ray instance for this module's Ray tests (tests/_ray_local.py); skipped where
    Ray is not installed. Asked for only by them, so the others need no Ray."""
    pytest.importorskip("ray")
    from _ray_local import local_cluster

    yield from local_cluster()


def lose_worker(marker: Path | None, loads: int, executor: str) -> None:
    """End this worker on the `loads`-th read (counted across workers by files next to
    `marker`), leaving a file that names it for `faulted`; no marker, no loss."""
    if marker is None or load_number(marker) != loads:
        return
    info = get_worker_info()
    how = "exit" if executor == "thread" else "kill"
    Path(f"{marker}-{how}-{os.getpid()}").write_text(str(None if info is None else info.id))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(3)  # a worker thread's runtime ends


class Loses:
    """A dataset whose worker reading `item` the `loads`-th time is lost (see `lose_worker`)."""

    def setup_loss(self, item: int, loads: int, marker: Path | None, executor: str) -> None:
        self.item, self.loads, self.marker, self.executor = item, loads, marker, executor

    def reading(self, items: Iterator[tuple[int, int]]) -> Iterator[tuple[int, int]]:
        for pair in items:
            if pair[0] == self.item:
                lose_worker(self.marker, self.loads, self.executor)
            yield pair


class CountsEpochsLost(Loses, CountsEpochs):
    """`CountsEpochs` (its state: the epochs it ran through), losing a worker once."""

    def __init__(self, n: int, item: int, marker: Path | None, executor: str) -> None:
        super().__init__(n)
        self.setup_loss(item, 2, marker, executor)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return self.reading(super().__iter__())


class CountsItemsLost(Loses, CountsItems):
    """`CountsItems` (its state: every item it ever read, and where it stands), losing a
    worker once."""

    def __init__(self, n: int, item: int, marker: Path | None, executor: str) -> None:
        super().__init__(n)
        self.setup_loss(item, 2, marker, executor)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return self.reading(super().__iter__())


class EpochsUncounted(Loses, IterableDataset):  # type: ignore[type-arg]
    """(item, epoch) as `CountsEpochs` gives them, with no `state_dict` to say its count."""

    def __init__(self, n: int, marker: Path | None) -> None:
        self.n, self.epoch = n, 0
        self.setup_loss(0, 2, marker, "thread")

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return self.reading(self._items())

    def _items(self) -> Iterator[tuple[int, int]]:
        for item in share_of_range(self.n):
            yield item, self.epoch
        self.epoch += 1


def loader(dataset: Any, executor: str, method: str | None, **options: Any) -> Any:
    """A persistent loader with two workers and one restart."""
    if method is not None:
        options["multiprocessing_context"] = method
    return statecore.DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        worker_restarts=1,
        executor=executor,
        **options,
    )


def pairs(batches: Any) -> list[list[tuple[int, int]]]:
    """Each batch of (item, count) pairs as a list of pairs."""
    return [list(zip(items.tolist(), counts.tolist(), strict=True)) for items, counts in batches]


def epochs(loader: Any, count: int) -> tuple[list[list[list[tuple[int, int]]]], list[str]]:
    """`count` whole epochs of `loader`, and the texts of its restart warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [pairs(loader) for _ in range(count)]
    told = [str(w.message) for w in caught if issubclass(w.category, WorkerRestartedWarning)]
    return got, told


Run = Callable[[Path | None], tuple[list[Any], list[str]]]
"""A program run with worker 0 lost once (a marker for `lose_worker`) or unbroken (None): the
batches it got, epoch by epoch, and the texts of its restart warnings."""


def lost_and_unbroken(run: Run, executor: str, tmp_path: Path) -> tuple[list[Any], list[Any]]:
    """The batches of `run` with worker 0 lost, and unbroken; the loss checked to have ended
    worker 0, once, and to have been told once."""
    marker = tmp_path / "read"
    got, told = run(marker)
    unbroken, _ = run(None)
    [(_, worker)] = faulted(marker, "exit" if executor == "thread" else "kill")
    assert worker == 0
    assert len(told) == 1, told
    return got, unbroken


# --- lost before its first answer of the epoch -------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("executor", "method"), [*EXECUTORS, RAY])
def test_a_worker_lost_before_its_first_answer_of_a_later_epoch_counts_on_from_its_epochs(
    executor: str, method: str | None, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if executor == "ray":
        request.getfixturevalue("ray_cluster")

    def run(marker: Path | None) -> tuple[list[Any], list[str]]:
        return epochs(loader(CountsEpochsLost(20, 0, marker, executor), executor, method), 3)

    got, unbroken = lost_and_unbroken(run, executor, tmp_path)
    assert got == unbroken
    # Worker 0's dataset had run through one epoch: its replacement says so, not 0 again.
    assert {count for batch in got[1] for _, count in batch} == {1}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("executor", "method"), EXECUTORS[::2])
def test_a_worker_lost_before_its_first_answer_after_a_break_goes_on_from_its_stale_loads(
    executor: str, method: str | None, tmp_path: Path
) -> None:
    # The first epoch is broken off after two batches: each worker loads the tasks it still
    # holds (answers nobody receives) before it starts the second, and its count goes on by
    # them. Worker 0 is then lost reading its first item of the second epoch.
    def run(marker: Path | None) -> tuple[list[Any], list[str]]:
        counting = loader(CountsItemsLost(40, 0, marker, executor), executor, method)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            broken = iter(counting)
            first = pairs([next(broken), next(broken)])
            del broken
            second = pairs(counting)
        told = [str(w.message) for w in caught if issubclass(w.category, WorkerRestartedWarning)]
        return [first, second], told

    got, unbroken = lost_and_unbroken(run, executor, tmp_path)
    assert got == unbroken


# --- lost after answers of the epoch -------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("executor", "method"), EXECUTORS[::2])
def test_a_worker_lost_between_its_state_snapshots_of_a_later_epoch_counts_on_from_its_epochs(
    executor: str, method: str | None, tmp_path: Path
) -> None:
    # Worker 0 sends its dataset's state with every fourth batch only: its one answer of the
    # second epoch before it is lost (reading item 4) carries a count of batches, no state,
    # and the state it stands on is the one it carried in from the first epoch.
    def run(marker: Path | None) -> tuple[list[Any], list[str]]:
        lost = CountsEpochsLost(20, 4, marker, executor)
        return epochs(loader(lost, executor, method, snapshot_every_n_steps=4), 2)

    got, unbroken = lost_and_unbroken(run, executor, tmp_path)
    assert got == unbroken
    assert {count for batch in got[1] for _, count in batch} == {1}


# --- a dataset without a state -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_replacement_in_a_later_epoch_warns_that_a_dataset_without_state_starts_afresh(
    tmp_path: Path,
) -> None:
    # Its epoch count lives in the lost worker's copy only: the replacement counts from 0
    # again, and the warning says that this worker's part of the epoch may repeat.
    got, told = epochs(loader(EpochsUncounted(20, tmp_path / "read"), "thread", None), 2)
    [message] = told
    assert "worker 0" in message
    assert "state_dict" in message
    assert "may repeat" in message
    assert {count for batch in got[1] for item, count in batch if item % 2 == 1} == {1}
    assert {count for batch in got[1] for item, count in batch if item % 2 == 0} == {0}


@pytest.mark.timeout(120)
def test_a_replacement_in_the_first_epoch_does_not_warn_of_state_from_earlier_epochs(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "read"
    dataset = EpochsUncounted(20, marker)
    dataset.loads = 1  # lost reading item 0 the first time: in the first epoch
    _, told = epochs(loader(dataset, "thread", None), 1)
    [message] = told
    assert "may repeat" not in message


# --- what the driver and the executors make of it ------------------------------------------------


def test_the_marks_restore_a_later_epochs_iterable_worker_from_where_the_epoch_began() -> None:
    ended = (0, {"dataset": {"epoch": 0}})
    first = WorkerMarks().begin({})
    assert first.restoring(0, iterable=True) is None  # the executor's own start of the epoch
    ran = first.answer(TaskCompleted(0, 0, mark=ended), base=0)
    marks = ran.answer(WorkerExhausted(1, 0), base=0).begin({})
    assert marks.restoring(0, iterable=True, carried=True) == Carried(ended, False, None)
    # Worker 1 answered nothing and was not found dry: the epoch was left (a `break`) before
    # its part was read, so its part is not run dry as it is brought back.
    assert marks.restoring(1, iterable=True, carried=True) == Carried(None, True, None)
    now = (1, {"dataset": {"epoch": 1}})
    answered = marks.answer(TaskCompleted(5, 0, mark=now), base=4)
    assert answered.restoring(0, iterable=True, carried=True) == Carried(ended, False, now)
    # A new iterator's workers start from the loader's dataset, as the executor starts them.
    assert answered.restoring(0, iterable=True) == now


def _setup(workers: int = 2) -> WorkerSetup:
    return WorkerSetup(
        dataset=None,
        dataset_kind=1,
        auto_collation=True,
        collate_fn=None,
        drop_last=False,
        base_seed=0,
        num_workers=workers,
        resume=((3, None), (4, None)),
        ended=((1, None), (2, None)),
    )


@pytest.mark.parametrize("open_", [False, True])
def test_every_executor_puts_a_carried_worker_where_a_checkpoint_puts_it(open_: bool) -> None:
    # The mp executor's `Restart` and the helper the thread and Ray executors use agree: the
    # epoch before's mark where a checkpoint's `ended` goes, this epoch's where its `resume`.
    carried = Carried((7, None), open_, (2, None))
    threads = replacement_setup(_setup(), 1, carried, ResumeWorker(1, 2, 99))
    processes = Restart(1, 99, carried, later_epoch=True).setup_for(_setup(), 1)
    for setup in (threads, processes):
        assert setup.ended == (None, (7, None))
        assert setup.ended_open == (frozenset({1}) if open_ else frozenset())
        assert setup.resume == (None, (2, None))
        assert setup.shared_seed == 99
