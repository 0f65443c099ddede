"""Worker threads that come and go: with `worker_restarts`, a worker thread whose runtime ends
(SystemExit raised by the dataset, as tests/test_thread_exits.py provokes it) is replaced, and the
epoch hands over what an uninterrupted run does; a stuck thread cannot be killed, so it fails
the loader with its stack, restarts or not."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from _datasets import FailsAt, Numbers
from _launch import launch
from _side_by_side import threaded
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from statecore import (
    SendTask,
    TaskCompleted,
    WorkerDiedError,
    WorkerHungError,
    WorkerRestartedWarning,
)
from statecore.executors._thread.executor import ThreadExecutor


class EndsOnceAt(Dataset):  # type: ignore[type-arg]
    """Numbers(n), except that the first load of `index` raises SystemExit(3), ending the worker
    thread that loads it. The record of that is shared by every worker's (shallow) copy."""

    def __init__(self, n: int, index: int | None) -> None:
        self.n = n
        self.index = index
        self.ended: list[str] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.index and not self.ended:
            self.ended.append(threading.current_thread().name)
            raise SystemExit(3)
        return index


class EndsOnceIn(IterableDataset):  # type: ignore[type-arg]
    """range(n) dealt round by worker; the first time item `item` is read, SystemExit(3)."""

    def __init__(self, n: int, item: int | None) -> None:
        self.n = n
        self.item = item
        self.ended: list[int] = []

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None
        for item in range(info.id, self.n, info.num_workers):
            if item == self.item and not self.ended:
                self.ended.append(item)
                raise SystemExit(3)
            yield item


class HangsOnceAt(Dataset):  # type: ignore[type-arg]
    """Numbers(n), except that the first load of `index` waits for `release`, set by the test
    at its end so that the thread ends."""

    def __init__(self, n: int, index: int) -> None:
        self.n = n
        self.index = index
        self.release = threading.Event()
        self.waiting: list[threading.Thread] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.index and not self.waiting:
            self.waiting.append(threading.current_thread())
            self.release.wait()  # the stuck line
        return index


def batches(loader: Any) -> list[Any]:
    return [batch.tolist() for batch in loader]


def loaded(dataset: Any, **options: Any) -> tuple[list[list[int]], list[warnings.WarningMessage]]:
    """What a thread loader with one restart hands over, and the restart warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batches(threaded(dataset, worker_restarts=1, **options))
    return got, [w for w in caught if issubclass(w.category, WorkerRestartedWarning)]


def shuffled(seed: int = 7) -> dict[str, Any]:
    return {"batch_size": 2, "shuffle": True, "generator": torch.Generator().manual_seed(seed)}


@pytest.mark.timeout(120)
def test_a_worker_thread_ended_mid_epoch_is_replaced_and_the_epoch_is_torchs() -> None:
    dataset = EndsOnceAt(24, 9)
    got, restarts = loaded(dataset, **shuffled())
    expected = batches(torch.utils.data.DataLoader(EndsOnceAt(24, None), **shuffled()))
    assert dataset.ended  # the worker did end
    assert got == expected
    assert len(restarts) == 1
    assert "worker_restarts" in str(restarts[0].message)


class SaysWho(EndsOnceAt):
    """EndsOnceAt, whose every load records the loading thread's name and WorkerInfo."""

    def __init__(self, n: int, index: int | None) -> None:
        super().__init__(n, index)
        self.who: dict[int, tuple[str, int, int]] = {}

    def __getitem__(self, index: int) -> int:
        info = get_worker_info()
        assert info is not None
        self.who[index] = (threading.current_thread().name, info.id, info.seed)
        return super().__getitem__(index)


STARTED: list[tuple[str, int]] = []


def record_start(worker_id: int) -> None:
    STARTED.append((threading.current_thread().name, worker_id))


@pytest.mark.timeout(120)
def test_the_replacement_thread_is_set_up_as_the_lost_one() -> None:
    STARTED.clear()
    dataset = SaysWho(8, 3)
    got, _ = loaded(dataset, batch_size=1, worker_init_fn=record_start)
    assert got == [[i] for i in range(8)]
    # Worker 1 loads the odd indices (round robin) and was ended at index 3: its replacement,
    # incarnation 1 of the slot, loads 3 again and what follows, with worker 1's WorkerInfo.
    assert dataset.ended == ["statecore-worker-1"]
    seed = dataset.who[1][2]
    assert dataset.who[1] == ("statecore-worker-1", 1, seed)
    assert {dataset.who[i] for i in (3, 5, 7)} == {("statecore-worker-1.1", 1, seed)}
    assert sorted(STARTED) == [
        ("statecore-worker-0", 0),
        ("statecore-worker-1", 1),
        ("statecore-worker-1.1", 1),
    ]


def exits_in_worker_1_once(worker_id: int) -> None:
    STARTED.append((threading.current_thread().name, worker_id))
    if worker_id == 1 and len([who for who in STARTED if who[1] == 1]) == 1:
        raise SystemExit(2)


@pytest.mark.timeout(120)
def test_a_worker_thread_ended_in_worker_init_fn_is_replaced_too() -> None:
    STARTED.clear()
    got, restarts = loaded(Numbers(6), batch_size=2, worker_init_fn=exits_in_worker_1_once)
    assert got == [[0, 1], [2, 3], [4, 5]]
    assert ("statecore-worker-1.1", 1) in STARTED
    (warned,) = restarts
    assert "SystemExit(2)" in str(warned.message)


@pytest.mark.timeout(120)
def test_a_persistent_worker_thread_ended_in_a_later_epoch_is_replaced_for_that_epoch() -> None:
    dataset = EndsOnceAt(12, 5)
    dataset.ended.append("not yet")  # the first epoch runs through
    loader = threaded(dataset, worker_restarts=1, persistent_workers=True, **shuffled())
    theirs = torch.utils.data.DataLoader(
        EndsOnceAt(12, None), num_workers=2, persistent_workers=True, **shuffled()
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = batches(loader)
        dataset.ended.clear()
        second = batches(loader)
    assert dataset.ended  # the second epoch lost a worker
    assert [first, second] == [batches(theirs), batches(theirs)]
    assert sum(issubclass(w.category, WorkerRestartedWarning) for w in caught) == 1


@pytest.mark.timeout(120)
def test_an_iterable_worker_thread_ended_mid_shard_goes_on_from_its_last_batch() -> None:
    dataset = EndsOnceIn(30, 13)
    got, restarts = loaded(dataset, batch_size=2)
    expected = batches(
        torch.utils.data.DataLoader(EndsOnceIn(30, None), batch_size=2, num_workers=2)
    )
    assert dataset.ended
    assert got == expected
    assert len(restarts) == 1


@pytest.mark.timeout(120)
def test_restarts_spent_fail_the_loader_naming_every_death() -> None:
    # Index 5 ends its thread every time: the replacement is ended by it too.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(WorkerDiedError) as raised:
            batches(threaded(FailsAt(8, [5], SystemExit(3)), worker_restarts=1))
    message = str(raised.value)
    assert raised.value.worker == 1
    assert raised.value.exitcode == 3
    assert "restart(s) (worker_restarts) were spent" in message
    assert message.count("SystemExit(3)") == 2  # this death and the earlier one
    assert sum(issubclass(w.category, WorkerRestartedWarning) for w in caught) == 1


@pytest.fixture
def hangs_at_17() -> Iterator[HangsOnceAt]:
    dataset = HangsOnceAt(24, 17)
    yield dataset
    dataset.release.set()
    for thread in dataset.waiting:
        thread.join(60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restarts", [0, 1])
def test_a_stuck_worker_thread_fails_the_loader_with_its_stack_even_with_restarts_left(
    hangs_at_17: HangsOnceAt, restarts: int
) -> None:
    loader = threaded(hangs_at_17, batch_size=None, worker_timeout=2, worker_restarts=restarts)
    got: list[int] = []
    with pytest.raises(WorkerHungError) as raised:
        for item in loader:
            got.append(int(item))
    assert got == list(range(17))
    message = str(raised.value)
    assert raised.value.worker == 1 and raised.value.pid is None
    assert "a thread cannot be killed" in message
    assert f"{__file__}" in message
    assert "self.release.wait()  # the stuck line" in message
    assert message.rstrip().endswith(raised.value.stack.rstrip())  # type: ignore[union-attr]
    # The loader shut down without waiting for the stuck thread: it is still there, waiting.
    assert hangs_at_17.waiting[0].is_alive()


@pytest.mark.timeout(120)
def test_a_worker_thread_still_in_its_start_up_reports_itself_starting() -> None:
    # The driver watches such a worker again rather than declare it stuck: its start-up
    # (worker_init_fn here) is not its task's time.
    release = threading.Event()

    def waits(worker_id: int) -> None:
        if worker_id == 1:
            release.wait()

    plain = launch(list(range(4)), 2)
    executor = ThreadExecutor(
        attrs.evolve(plain, setup=attrs.evolve(plain.setup, worker_init_fn=waits))
    )
    executor.start()
    try:
        starting = executor.report(1)
        assert starting.starting and starting.pid is None
        release.set()
        executor.dispatch(SendTask(1, 0, [1]))
        assert isinstance(executor.poll(60), TaskCompleted)
        executor.confirm()
        assert not executor.report(1).starting
    finally:
        release.set()
        executor.shutdown()
