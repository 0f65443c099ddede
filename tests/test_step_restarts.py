"""Workers that come and go: a lost worker (dead, or stuck) is replaced in its slot while the
scheduler has restarts left, its tasks sent again under their own numbers once the replacement
has started, and everything a lost incarnation says afterwards dropped."""

from __future__ import annotations

import pytest
from _drive import feed, fill, only, start

from statecore import (
    Config,
    Deliver,
    ExecutorError,
    IndexDrawn,
    NextRequested,
    Phase,
    ProtocolError,
    RaiseError,
    ReplaceWorker,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    SendTask,
    State,
    StopWorker,
    TaskCompleted,
    WorkerDeath,
    WorkerDied,
    WorkerExhausted,
    WorkerHang,
    WorkerResumed,
    WorkerStarted,
    WorkerStatus,
    WorkerStuck,
    step,
)


def _config(restarts: int = 1, **flags: bool) -> Config:
    return Config(num_workers=2, prefetch_factor=2, restarts=restarts, **flags)


def _full(restarts: int = 1, **flags: bool) -> State:
    """Tasks 0-3 out, indices "i0".."i3": tasks 0 and 2 on worker 0, 1 and 3 on worker 1."""
    state, _ = start(_config(restarts, **flags))
    for task in range(4):
        state, _ = feed(state, IndexDrawn(f"i{task}"))
    assert state.send_idx == 4 and state.drawing_for is None
    return state


def _refused(state: State, event: object) -> ProtocolError:
    with pytest.raises(ExecutorError) as caught:
        step(state, event)  # type: ignore[arg-type]
    return caught.value


def test_a_dead_worker_is_replaced_in_its_slot_while_restarts_are_left() -> None:
    state, commands = feed(_full(), WorkerDied(worker=0, pid=7, exitcode=-9))
    assert commands == [ReplaceWorker(worker=0, incarnation=1, epoch=1)]
    assert state.phase is Phase.RUNNING
    assert state.life.workers[0] is WorkerStatus.STARTING
    assert state.life.incarnations == (1, 0)
    assert state.life.replaced == (WorkerDeath(0, pid=7, exitcode=-9),)


def test_nothing_is_sent_to_a_replacement_before_it_has_started() -> None:
    state, _ = feed(_full(), WorkerDied(worker=0))
    # Worker 1 answers, making room; in order, worker 0's turn comes and its task is held.
    state, commands = feed(state, TaskCompleted(task=1, worker=1), NextRequested())
    assert all(command.worker != 0 for command in only(commands, SendTask))


def test_the_lost_tasks_are_sent_again_in_order_under_their_own_numbers() -> None:
    state, _ = feed(_full(), WorkerDied(worker=0))
    state, commands = feed(state, WorkerStarted(worker=0, incarnation=1))
    assert commands == [SendTask(0, 0, "i0"), SendTask(0, 2, "i2")]
    assert [c.index for c in commands] == ["i0", "i2"]  # type: ignore[attr-defined]
    assert state.life.workers[0] is WorkerStatus.ACTIVE


def test_a_task_given_to_a_starting_replacement_waits_and_goes_out_when_it_starts() -> None:
    state, _ = feed(_full(), TaskCompleted(task=0, worker=0), NextRequested(), WorkerDied(worker=0))
    # Task 0 was delivered; task 2 is owed by worker 0, which has room for one more: its turn
    # comes with task 4, drawn now and held.
    state, _ = feed(state, IndexDrawn("i4"))
    assert state.send_idx == 5
    state, commands = feed(state, WorkerStarted(worker=0, incarnation=1))
    assert only(commands, SendTask) == [SendTask(0, 2, "i2"), SendTask(0, 4, "i4")]


def test_the_batches_come_in_the_order_of_an_uninterrupted_run() -> None:
    state, _ = feed(_full(), WorkerDied(worker=0), NextRequested())
    state, _ = feed(state, TaskCompleted(task=1, worker=1, payload="b1"))
    state, _ = feed(state, WorkerStarted(worker=0, incarnation=1))
    state, commands = feed(state, TaskCompleted(task=0, worker=0, payload="b0", incarnation=1))
    assert [d.payload for d in only(commands, Deliver)] == ["b0"]
    state, commands = feed(state, NextRequested())
    assert [d.payload for d in only(commands, Deliver)] == ["b1"]


def test_a_late_answer_of_a_lost_incarnation_is_dropped() -> None:
    state, _ = feed(_full(), WorkerDied(worker=0), WorkerStarted(worker=0, incarnation=1))
    after, commands = feed(state, TaskCompleted(task=0, worker=0, payload="late"))
    assert (after, commands) == (state, [])


def test_an_answer_of_the_replacement_before_it_started_is_an_executor_error() -> None:
    state, _ = feed(_full(), WorkerDied(worker=0))
    error = _refused(state, TaskCompleted(task=0, worker=0, incarnation=1))
    assert "has not started" in error.reason


def test_an_incarnation_never_started_is_an_executor_error() -> None:
    error = _refused(_full(), WorkerStarted(worker=0, incarnation=1))
    assert "never started" in error.reason


def test_a_late_death_of_a_lost_incarnation_is_dropped() -> None:
    state, _ = feed(_full(), WorkerDied(worker=0))
    after, commands = feed(state, WorkerDied(worker=0, incarnation=0))
    assert (after, commands) == (state, [])


def test_a_replacement_that_dies_starting_is_replaced_again_while_restarts_are_left() -> None:
    state, commands = feed(_full(restarts=2), WorkerDied(worker=0), WorkerDied(0, incarnation=1))
    assert only(commands, ReplaceWorker) == [ReplaceWorker(0, 1, 1), ReplaceWorker(0, 2, 1)]
    assert state.life.incarnations == (2, 0)


def test_a_loss_past_the_restarts_fails_the_loader_naming_every_loss() -> None:
    state, _ = feed(_full(), WorkerDied(worker=0, pid=7, exitcode=-9), NextRequested())
    state, commands = feed(state, WorkerDied(worker=1, pid=8, exitcode=1))
    assert state.phase is Phase.FAILED
    (raised,) = only(commands, RaiseError)
    assert raised.failure == WorkerDeath(
        1, pid=8, exitcode=1, earlier=(WorkerDeath(0, pid=7, exitcode=-9),)
    )
    text = raised.failure.describe()
    assert "pid 8" in text and "pid 7" in text and "1 worker restart" in text
    assert {c.worker for c in only(commands, StopWorker)} == {0, 1}


def test_without_restarts_a_death_fails_the_loader_as_in_torch() -> None:
    state, commands = feed(_full(restarts=0), NextRequested(), WorkerDied(worker=1))
    assert state.phase is Phase.FAILED
    assert only(commands, RaiseError)[0].failure == WorkerDeath(1)


def test_a_stuck_worker_that_can_be_killed_is_replaced() -> None:
    state, _ = feed(_full(), NextRequested())
    stuck = WorkerStuck(worker=0, task=0, seconds=2.0, pid=7, stack="  File 'ds.py', line 3")
    state, commands = feed(state, stuck)
    assert commands == [ReplaceWorker(0, 1, 1)]
    assert state.life.replaced == (WorkerHang(0, 0, 2.0, 7, "  File 'ds.py', line 3"),)


def test_a_stuck_thread_fails_the_loader_with_its_stack_even_with_restarts_left() -> None:
    state, _ = feed(_full(), NextRequested())
    stuck = WorkerStuck(worker=0, task=0, seconds=2.0, stack="line 3", killable=False)
    state, commands = feed(state, stuck)
    assert state.phase is Phase.FAILED
    (raised,) = only(commands, RaiseError)
    assert isinstance(raised.failure, WorkerHang)
    assert "cannot be killed" in raised.failure.describe()
    assert "line 3" in raised.failure.describe()


def test_a_worker_is_not_stuck_while_no_consumer_waits() -> None:
    error = _refused(_full(), WorkerStuck(worker=0, task=0, seconds=2.0))
    assert "no consumer waits" in error.reason


def test_a_worker_is_not_stuck_on_a_task_it_does_not_hold() -> None:
    state, _ = feed(_full(), NextRequested())
    error = _refused(state, WorkerStuck(worker=0, task=1, seconds=2.0))
    assert "not awaiting an answer from worker 0" in error.reason


def test_restarts_are_spent_over_the_schedulers_life_not_per_epoch() -> None:
    state, _ = start(_config(persistent_workers=True))
    state, _ = feed(state, WorkerDied(worker=1), WorkerStarted(1, 1), SamplerExhausted())
    state, _ = feed(state, NextRequested(), ResetRequested())
    state, _ = feed(state, WorkerResumed(0, 2), WorkerResumed(1, 2, incarnation=1))
    assert state.phase is Phase.RUNNING and state.stats().restarts == 1
    state, _ = fill(state)
    state, _ = feed(state, NextRequested(), WorkerDied(worker=0))
    assert state.phase is Phase.FAILED


def test_a_worker_lost_while_resuming_is_replaced_set_up_for_the_new_epoch() -> None:
    state, _ = start(_config(persistent_workers=True), SamplerExhausted(), NextRequested())
    state, commands = feed(state, ResetRequested())
    assert len(only(commands, ResumeWorker)) == 2
    state, commands = feed(state, WorkerDied(worker=0))
    assert commands == [ReplaceWorker(0, 1, 2)]
    state, _ = feed(state, WorkerResumed(1, 2))
    # Worker 0's turn is first: the epoch waits for its replacement, whose start acknowledges it.
    assert state.phase is Phase.RUNNING
    state, _ = feed(state, WorkerStarted(0, 1))
    assert state.life.workers == (WorkerStatus.ACTIVE, WorkerStatus.ACTIVE)


def test_a_late_acknowledgement_of_a_lost_incarnation_is_dropped() -> None:
    state, _ = start(_config(persistent_workers=True), SamplerExhausted(), NextRequested())
    state, _ = feed(state, ResetRequested(), WorkerDied(worker=0))
    after, commands = feed(state, WorkerResumed(0, 2, incarnation=0))
    assert (after, commands) == (state, [])


def test_a_replacement_starting_across_a_new_epochs_reset_answers_that_reset() -> None:
    state, _ = start(_config(persistent_workers=True), SamplerExhausted(), NextRequested())
    state, _ = feed(state, WorkerDied(worker=0), ResetRequested())
    assert state.life.workers == (WorkerStatus.RESUMING, WorkerStatus.RESUMING)
    state, commands = feed(state, WorkerStarted(0, 1))
    assert commands == [] and state.life.workers[0] is WorkerStatus.RESUMING
    state, _ = feed(state, WorkerResumed(0, 2, incarnation=1), WorkerResumed(1, 2))
    assert state.phase is Phase.RUNNING


def test_a_dry_worker_lost_is_replaced_and_its_tasks_answered_by_the_replacement() -> None:
    state = _full(iterable=True)
    state, _ = feed(state, WorkerExhausted(task=0, worker=0), WorkerDied(worker=0))
    state, commands = feed(state, WorkerStarted(0, 1))
    assert only(commands, SendTask) == [SendTask(0, 2, "i2")]
    state, _ = feed(state, WorkerExhausted(task=2, worker=0, incarnation=1))
    assert state.life.skipped == 2


def test_without_restarts_the_window_keeps_no_index() -> None:
    state = _full(restarts=0)
    assert all(slot.index is None for slot in state.window)  # type: ignore[union-attr]


def test_a_worker_lost_once_the_others_resumed_lets_the_tasks_flow() -> None:
    state, _ = start(_config(persistent_workers=True), SamplerExhausted(), NextRequested())
    state, _ = feed(state, ResetRequested(), WorkerResumed(1, 2))
    # Its replacement is set up for the new epoch: no acknowledgement is owed any more (the
    # rule "every acknowledgement in", after the death; `feed` checks the table has the edge).
    state, commands = feed(state, WorkerDied(worker=0))
    assert commands[0] == ReplaceWorker(0, 1, 2)
    assert state.phase is Phase.RUNNING


def test_a_late_answer_leaves_the_replacements_answer_of_an_old_epoch_to_be_dropped() -> None:
    state = _full(persistent_workers=True)
    state, _ = feed(state, WorkerDied(worker=0), WorkerStarted(0, 1), ResetRequested())
    # Task 0 went to the replacement too before the reset: two answers of it are owed, the lost
    # incarnation's (late) and the replacement's, and both are dropped.
    state, commands = feed(state, TaskCompleted(task=0, worker=0, incarnation=0))
    assert commands == [] and (0, 0) in state.life.stale
    state, commands = feed(state, TaskCompleted(task=0, worker=0, incarnation=1))
    assert commands == [] and (0, 0) not in state.life.stale
