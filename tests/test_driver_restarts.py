"""The driver carries out a replacement and reports a stuck worker (executors/_driver.py), over a
scripted executor: it decides nothing, so what the core asks is what the executor is told."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from statecore import (
    Config,
    Event,
    ReplaceWorker,
    ResumeWorker,
    SendTask,
    TaskCompleted,
    WorkerDied,
    WorkerHungError,
    WorkerStarted,
    WorkerStuck,
)
from statecore.executors import Driver
from statecore.executors._observe.seam import Observer
from statecore.executors._protocol import Capabilities, WorkerReport


class _Scripted:
    """Two workers that answer each task with its index, except that the first task sent to
    `stuck_worker` is never answered (its incarnation 0 hangs). A replacement answers
    WorkerStarted first. Records every command."""

    def __init__(self, stuck_worker: int | None = None, dies_at: int | None = None) -> None:
        self.stuck_worker = stuck_worker
        self.dies_at = dies_at
        self.incarnations = [0, 0]
        self.events: deque[Event] = deque()
        self.told: list[object] = []
        self.reported: list[int] = []

    def start(self) -> None:
        pass

    def dispatch(self, command: SendTask) -> None:
        self.told.append(command)
        w = command.worker
        incarnation = self.incarnations[w]
        if w == self.stuck_worker and incarnation == 0:
            return  # hangs
        if command.index == self.dies_at and incarnation == 0:
            self.events.append(WorkerDied(w, pid=100 + w, exitcode=-9))
            return
        answer = TaskCompleted(command.task, w, command.index, incarnation=incarnation)
        self.events.append(answer)

    def resume(self, command: ResumeWorker) -> None:
        self.told.append(command)

    def poll(self, timeout: float | None) -> Event | None:
        return self.events.popleft() if self.events else None

    def stop_worker(self, worker: int) -> None:
        self.told.append(("stop", worker))

    def shutdown(self) -> None:
        self.told.append("shutdown")

    def replace(self, command: ReplaceWorker, mark: Any) -> None:
        self.told.append(command)
        self.incarnations[command.worker] = command.incarnation
        self.events.append(WorkerStarted(command.worker, command.incarnation))

    def report(self, worker: int) -> WorkerReport:
        self.reported.append(worker)
        return WorkerReport(pid=100 + worker, stack='  File "ds.py", line 17, in __getitem__')


class _Killable(_Scripted):
    capabilities = Capabilities(replaces_workers=True, kills_stuck_workers=True)


class _Unkillable(_Scripted):
    capabilities = Capabilities(replaces_workers=True, kills_stuck_workers=False)


def _driver(executor: _Scripted, restarts: int, worker_timeout: float = 0) -> Driver:
    indices = iter(range(6))

    def draw(state: object) -> int:
        return next(indices)

    config = Config(num_workers=2, prefetch_factor=2, restarts=restarts)
    return Driver(config, executor, draw, timeout=0, worker_timeout=worker_timeout)


def _epoch(driver: Driver) -> list[int]:
    driver.start_epoch()
    got = []
    while True:
        try:
            got.append(driver.next())
        except StopIteration:
            return got


@pytest.mark.timeout(60)
def test_a_dead_worker_is_replaced_and_the_epoch_comes_out_whole_and_in_order() -> None:
    executor = _Killable(dies_at=2)
    assert _epoch(_driver(executor, restarts=1)) == [0, 1, 2, 3, 4, 5]
    replaced = [c for c in executor.told if isinstance(c, ReplaceWorker)]
    assert replaced == [ReplaceWorker(0, 1, 1)]
    # The replacement is sent task 2 again, under its own number, only after it started.
    after = executor.told[executor.told.index(replaced[0]) + 1 :]
    assert SendTask(0, 2, 2) in after


@pytest.mark.timeout(60)
def test_a_stuck_worker_is_reported_with_its_stack_and_replaced() -> None:
    executor = _Killable(stuck_worker=0)
    assert _epoch(_driver(executor, restarts=1, worker_timeout=0.01)) == [0, 1, 2, 3, 4, 5]
    assert executor.reported == [0]
    assert [c for c in executor.told if isinstance(c, ReplaceWorker)] == [ReplaceWorker(0, 1, 1)]


@pytest.mark.timeout(60)
def test_a_stuck_thread_fails_the_loader_showing_where_it_hangs() -> None:
    executor = _Unkillable(stuck_worker=0)
    driver = _driver(executor, restarts=1, worker_timeout=0.01)
    driver.start_epoch()
    with pytest.raises(WorkerHungError) as raised:
        driver.next()
    assert "ds.py" in str(raised.value) and "line 17" in str(raised.value)
    assert "cannot be killed" in str(raised.value)
    assert raised.value.worker == 0 and raised.value.pid == 100
    assert "shutdown" in executor.told


@pytest.mark.timeout(60)
def test_a_worker_timeout_without_restarts_raises_with_the_stack() -> None:
    executor = _Killable(stuck_worker=0)
    driver = _driver(executor, restarts=0, worker_timeout=0.01)
    driver.start_epoch()
    with pytest.raises(WorkerHungError, match="line 17"):
        driver.next()


@pytest.mark.timeout(60)
def test_the_stuck_event_names_the_task_the_consumer_waits_for() -> None:
    executor = _Killable(stuck_worker=1)
    fed: list[Event] = []
    indices = iter(range(6))
    driver = Driver(
        Config(num_workers=2, prefetch_factor=2, restarts=1),
        executor,
        lambda state: next(indices),
        timeout=0,
        worker_timeout=0.01,
        observers=[Observer(lambda state, event, transition: fed.append(event))],
    )
    driver.start_epoch()
    assert [driver.next(), driver.next()] == [0, 1]
    (stuck,) = [event for event in fed if isinstance(event, WorkerStuck)]
    assert (stuck.worker, stuck.task, stuck.incarnation, stuck.pid) == (1, 1, 0, 101)


class _SlowToStart(_Killable):
    """Worker 0 reports itself starting the first two times it is asked, then answers."""

    def __init__(self) -> None:
        super().__init__(stuck_worker=None)
        self.asked = 0
        self.held: list[SendTask] = []

    def dispatch(self, command: SendTask) -> None:
        if command.worker == 0 and not self.asked:
            self.told.append(command)
            self.held.append(command)
            return
        super().dispatch(command)

    def report(self, worker: int) -> WorkerReport:
        self.asked += 1
        if self.asked < 3:
            return WorkerReport(pid=100, starting=True)
        for command in self.held:
            self.events.append(TaskCompleted(command.task, 0, command.index))
        self.held.clear()
        return WorkerReport(pid=100, starting=True)


@pytest.mark.timeout(60)
def test_a_worker_still_starting_is_not_stuck() -> None:
    executor = _SlowToStart()
    assert _epoch(_driver(executor, restarts=1, worker_timeout=0.01)) == [0, 1, 2, 3, 4, 5]
    assert not [c for c in executor.told if isinstance(c, ReplaceWorker)]
    assert executor.asked >= 3


@pytest.mark.timeout(60)
def test_a_tuner_retires_a_worker_and_adds_it_back_between_calls() -> None:
    executor = _Killable()
    driver = _driver(executor, restarts=0)
    driver.start_epoch()
    got = [driver.next()]
    driver.retire(1)
    while ("stop", 1) not in executor.told:
        got.append(driver.next())
    driver.add(1)
    while True:
        try:
            got.append(driver.next())
        except StopIteration:
            break
    assert got == [0, 1, 2, 3, 4, 5]
    assert ReplaceWorker(1, 1, 1) in executor.told
    assert driver.state.life.added == 1


@pytest.mark.timeout(60)
def test_adding_a_worker_on_an_executor_that_cannot_start_one_says_so() -> None:
    class _Plain(_Scripted):
        replace = None  # type: ignore[assignment]

    driver = _driver(_Plain(), restarts=0)
    driver.start_epoch()
    before = driver.state
    with pytest.raises(TypeError, match="cannot start worker 1 again"):
        driver.add(1)
    assert driver.state is before
