"""A tuner changing how many workers load: a retired worker is given no new task, finishes
those it holds and is then stopped; a retired slot is started again as its next incarnation,
spending no restart."""

from __future__ import annotations

import pickle

import attrs
import pytest
from _drive import feed, only, start

from statecore import (
    AddRequested,
    Config,
    Deliver,
    DrawIndex,
    ExecutorError,
    IndexDrawn,
    NextRequested,
    Phase,
    ProtocolError,
    RaiseError,
    ReplaceWorker,
    ResetRequested,
    ResumeWorker,
    RetireRequested,
    SamplerExhausted,
    SendTask,
    State,
    StopWorker,
    TaskCompleted,
    WorkerDied,
    WorkerResumed,
    WorkerStarted,
    WorkerStatus,
    WorkerStuck,
    step,
)
from statecore._events import Event

RETIRING = WorkerStatus.RETIRING
STOPPED = WorkerStatus.STOPPED
STARTING = WorkerStatus.STARTING
ACTIVE = WorkerStatus.ACTIVE


def _config(restarts: int = 0, **flags: bool) -> Config:
    return Config(num_workers=3, prefetch_factor=1, restarts=restarts, **flags)


def _full(restarts: int = 0, **flags: bool) -> State:
    """Tasks 0-2 out, one on each of workers 0, 1 and 2 (indices "i0".."i2")."""
    state, _ = start(_config(restarts, **flags))
    for task in range(3):
        state, _ = feed(state, IndexDrawn(f"i{task}"))
    assert state.send_idx == 3 and state.drawing_for is None
    return state


def _retired(restarts: int = 0, **flags: bool) -> State:
    """`_full` with worker 1 retired and stopped once task 1 was handed over; task 3 on worker 0."""
    state, _ = feed(
        _full(restarts, **flags),
        RetireRequested(worker=1),
        TaskCompleted(task=0, worker=0),
        NextRequested(),
        IndexDrawn("i3"),
        TaskCompleted(task=1, worker=1),
        NextRequested(),
    )
    assert state.life.workers[1] is STOPPED
    return state


def _refused(state: State, event: Event) -> ProtocolError:
    with pytest.raises(ExecutorError) as caught:
        step(state, event)
    return caught.value


def test_a_retired_worker_keeps_its_tasks_and_is_marked_retiring() -> None:
    state, commands = feed(_full(), RetireRequested(worker=1))
    assert commands == []
    assert state.life.workers == (ACTIVE, RETIRING, ACTIVE)
    assert state.loads == (1, 1, 1)


def test_a_retiring_worker_is_given_no_new_task() -> None:
    state, _ = feed(_full(), RetireRequested(worker=1))
    state, commands = feed(
        state, TaskCompleted(task=0, worker=0), NextRequested(), IndexDrawn("i3")
    )
    assert only(commands, SendTask) == [SendTask(0, 3, "i3")]
    # Worker 1's turn came next, in order: it is passed by, and worker 2 is full.
    assert state.drawing_for is None


def test_a_retiring_worker_is_stopped_once_it_holds_no_task() -> None:
    state, _ = feed(_full(), RetireRequested(worker=1))
    state, commands = feed(state, TaskCompleted(task=0, worker=0), NextRequested())
    assert state.life.workers[1] is RETIRING
    state, commands = feed(state, IndexDrawn("i3"), TaskCompleted(task=1, worker=1))
    assert StopWorker(1) not in commands  # answered, but the answer is not handed over yet
    state, commands = feed(state, NextRequested())
    assert commands[:2] == [Deliver(1, 1, None), StopWorker(1)]
    assert state.life.workers[1] is STOPPED


def test_a_worker_retired_holding_nothing_is_stopped_at_once() -> None:
    state, _ = start(_config())  # an index is drawn for worker 0; workers 1 and 2 hold nothing
    state, commands = feed(state, RetireRequested(worker=2))
    assert commands == [StopWorker(2)]
    assert state.life.workers[2] is STOPPED


def test_in_order_the_retired_slots_turn_goes_to_the_next_worker() -> None:
    state, commands = feed(_retired(), TaskCompleted(task=2, worker=2), NextRequested())
    assert commands[-1] == DrawIndex()
    assert state.drawing_for == 2


def test_out_of_order_a_retiring_worker_is_given_no_new_task() -> None:
    state, _ = feed(_full(in_order=False), RetireRequested(worker=1))
    state, commands = feed(state, TaskCompleted(task=1, worker=1), NextRequested())
    assert StopWorker(1) in commands
    assert state.drawing_for is None  # workers 0 and 2 are full, and 1 retired


def test_the_epoch_ends_with_every_batch_when_a_worker_retired() -> None:
    state, first = feed(_retired(), TaskCompleted(task=2, worker=2), NextRequested())
    state, last = feed(state, SamplerExhausted(), TaskCompleted(task=3, worker=0), NextRequested())
    assert [c.task for c in only(first + last, Deliver)] == [2, 3]
    state, _ = feed(state, NextRequested())
    assert state.phase is Phase.FINISHED


def test_an_iterable_datasets_worker_cannot_be_retired() -> None:
    error = _refused(_full(iterable=True), RetireRequested(worker=1))
    assert "iterable dataset" in error.reason and "worker 1" in error.reason


def test_a_worker_already_retiring_cannot_be_retired_again() -> None:
    state, _ = feed(_full(), RetireRequested(worker=1))
    assert "worker 1 is retiring, not running" in _refused(state, RetireRequested(1)).reason


def test_a_retired_slot_cannot_be_retired() -> None:
    assert "worker 1 is stopped, not running" in _refused(_retired(), RetireRequested(1)).reason


def test_the_last_worker_that_can_take_a_task_cannot_be_retired() -> None:
    state, _ = feed(_full(), RetireRequested(worker=1), RetireRequested(worker=2))
    error = _refused(state, RetireRequested(worker=0))
    assert "worker 0 is the last worker that can take a task" in error.reason


def test_a_worker_an_index_is_drawn_for_cannot_be_retired() -> None:
    state, _ = start(_config())
    error = _refused(state, RetireRequested(worker=0))
    assert "an index is being drawn for worker 0" in error.reason


def test_a_worker_that_does_not_exist_cannot_be_retired() -> None:
    assert "there is no worker 3" in _refused(_full(), RetireRequested(worker=3)).reason


def test_no_worker_is_retired_before_an_epoch_runs() -> None:
    from statecore import initial_state

    error = _refused(initial_state(_config()), RetireRequested(worker=1))
    assert "only while an epoch runs" in error.reason


def test_a_retired_slot_is_started_again_as_its_next_incarnation() -> None:
    state, commands = feed(_retired(), AddRequested(worker=1))
    assert commands[0] == ReplaceWorker(worker=1, incarnation=1, epoch=1)
    assert state.life.workers[1] is STARTING
    assert state.life.incarnations == (0, 1, 0)


def test_adding_a_slot_spends_no_restart() -> None:
    state, _ = feed(_retired(), AddRequested(worker=1))
    assert (state.life.replaced, state.life.added) == ((), 1)
    # Still no restart to spend: a death fails the loader as before.
    state, _ = feed(state, WorkerDied(worker=0))
    assert state.phase is Phase.FAILED


def test_an_added_slot_takes_no_turn_until_it_has_started() -> None:
    # Worker 1's turn comes while it starts: passed over, as a retired slot is, so that no
    # batch waits for a process still starting; worker 2 takes the task.
    state, _ = feed(_retired(), AddRequested(worker=1), TaskCompleted(task=2, worker=2))
    state, commands = feed(state, NextRequested(), IndexDrawn("i4"))
    assert only(commands, SendTask) == [SendTask(2, 4, "i4")]
    assert state.life.joining == frozenset({1})


def test_an_added_slot_takes_its_turns_once_it_has_started() -> None:
    state, _ = feed(
        _retired(),
        AddRequested(worker=1),
        WorkerStarted(worker=1, incarnation=1),
        TaskCompleted(task=2, worker=2),
    )
    assert state.life.workers[1] is ACTIVE and state.life.joining == frozenset()
    state, commands = feed(state, NextRequested(), IndexDrawn("i4"))
    assert only(commands, SendTask) == [SendTask(1, 4, "i4")]


def test_only_a_retired_slot_can_be_added() -> None:
    error = _refused(_full(), AddRequested(worker=1))
    assert "worker 1 is active, not retired" in error.reason


def test_the_exit_of_a_retired_worker_is_an_echo() -> None:
    state, commands = feed(_retired(), WorkerDied(worker=1, pid=5, exitcode=0))
    assert commands == []
    assert state.phase is Phase.RUNNING


def test_the_late_exit_of_a_retired_incarnation_is_dropped_after_its_slot_is_added() -> None:
    state, _ = feed(_retired(), AddRequested(worker=1))
    after, commands = feed(state, WorkerDied(worker=1, incarnation=0))
    assert (after, commands) == (state, [])


def test_a_retiring_worker_that_dies_is_replaced_and_its_retirement_lapses() -> None:
    state, _ = feed(_full(restarts=1), RetireRequested(worker=1))
    state, commands = feed(state, WorkerDied(worker=1))
    assert commands == [ReplaceWorker(worker=1, incarnation=1, epoch=1)]
    state, commands = feed(state, WorkerStarted(worker=1, incarnation=1))
    assert commands == [SendTask(1, 1, "i1")]
    assert state.life.workers[1] is ACTIVE


def test_a_retiring_worker_that_dies_with_no_restart_left_fails_the_loader() -> None:
    state, _ = feed(_full(), RetireRequested(worker=1), NextRequested())
    state, commands = feed(state, WorkerDied(worker=1, pid=9))
    assert state.phase is Phase.FAILED
    assert isinstance(commands[-1], RaiseError)


def test_a_stuck_retiring_worker_is_a_loss() -> None:
    state, _ = feed(_full(restarts=1), RetireRequested(worker=0), NextRequested())
    state, commands = feed(state, WorkerStuck(worker=0, task=0, seconds=1.0))
    assert commands == [ReplaceWorker(worker=0, incarnation=1, epoch=1)]


def test_a_new_epoch_resumes_only_the_slots_not_retired() -> None:
    state, commands = feed(_retired(persistent_workers=True), ResetRequested())
    assert [c.worker for c in only(commands, ResumeWorker)] == [0, 2]
    state, _ = feed(state, WorkerResumed(worker=0, epoch=2), WorkerResumed(worker=2, epoch=2))
    assert state.phase is Phase.RUNNING
    assert state.life.workers == (ACTIVE, STOPPED, ACTIVE)


def test_a_worker_still_retiring_at_a_new_epoch_is_stopped_then() -> None:
    state, _ = feed(_full(persistent_workers=True), RetireRequested(worker=1))
    state, commands = feed(state, ResetRequested())
    assert commands[0] == StopWorker(1)
    assert [c.worker for c in only(commands, ResumeWorker)] == [0, 2]
    assert state.life.workers[1] is STOPPED


def test_whether_a_worker_is_retiring_follows_the_workers_and_is_not_part_of_the_value() -> None:
    life = start(Config(num_workers=3, prefetch_factor=1))[0].life
    assert not life.retiring
    retiring = attrs.evolve(life, workers=(WorkerStatus.ACTIVE, RETIRING, WorkerStatus.ACTIVE))
    assert retiring.retiring
    assert pickle.loads(pickle.dumps(retiring)).retiring
    assert not attrs.evolve(retiring, workers=(WorkerStatus.ACTIVE, STOPPED, STOPPED)).retiring
    assert "retiring" not in repr(retiring)
    assert retiring == attrs.evolve(retiring)
    assert hash(retiring) == hash(attrs.evolve(retiring))
