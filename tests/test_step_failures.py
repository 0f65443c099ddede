"""Fatal failures and closing: the ordered shutdown, and what the consumer is told."""

from __future__ import annotations

import pytest
from _drive import config, feed, fill, start

from statecore import (
    Cancelled,
    CloseRequested,
    EndEpoch,
    Event,
    ExecutorError,
    ExecutorFailed,
    ExecutorFailure,
    IndexDrawn,
    Interrupted,
    NextRequested,
    Phase,
    RaiseError,
    ResetRequested,
    SamplerExhausted,
    SamplerFailed,
    SamplerFailure,
    Shutdown,
    State,
    StopWorker,
    TaskCompleted,
    TaskFailure,
    TimedOut,
    Timeout,
    WorkerDeath,
    WorkerDied,
    WorkerResumed,
    WorkerStatus,
    can_restart,
    initial_state,
)

SHUTDOWN_OF_TWO = [StopWorker(0), StopWorker(1), Shutdown()]


def _busy(**flags: bool) -> State:
    """A first epoch with two workers holding two tasks each."""
    state, _ = fill(start(config(num_workers=2, prefetch_factor=2, **flags))[0])
    return state


# --- worker death --------------------------------------------------------------------------------


def test_a_worker_death_fails_the_loader_and_shuts_every_worker_down_in_order() -> None:
    state, commands = feed(_busy(), WorkerDied(worker=1, pid=4242, exitcode=-9))
    assert state.phase is Phase.FAILED
    assert commands == SHUTDOWN_OF_TWO
    assert state.life.failure == WorkerDeath(worker=1, pid=4242, exitcode=-9)
    assert state.life.workers == (WorkerStatus.STOPPED,) * 2


def test_the_executors_account_of_a_death_is_kept_in_the_failure() -> None:
    account = "The actor died unexpectedly before finishing this task."
    state, _ = feed(_busy(), WorkerDied(worker=1, pid=4242, reason=account))
    assert state.life.failure == WorkerDeath(worker=1, pid=4242, reason=account)
    assert WorkerDied(worker=1).reason is None


def test_a_worker_death_is_raised_to_a_waiting_consumer_after_the_shutdown() -> None:
    state, _ = feed(_busy(), NextRequested())
    state, commands = feed(state, WorkerDied(worker=0, pid=7, exitcode=1))
    assert commands == [*SHUTDOWN_OF_TWO, RaiseError(WorkerDeath(worker=0, pid=7, exitcode=1))]
    assert not state.waiting


def test_without_a_waiting_consumer_the_next_request_gets_the_death() -> None:
    state, _ = feed(_busy(), WorkerDied(worker=0, pid=7, exitcode=-11))
    state, commands = feed(state, NextRequested())
    assert commands == [RaiseError(WorkerDeath(worker=0, pid=7, exitcode=-11))]


def test_a_failed_loader_raises_its_failure_on_every_request() -> None:
    state, _ = feed(_busy(), WorkerDied(worker=0))
    once, first = feed(state, NextRequested())
    twice, second = feed(once, NextRequested())
    assert first == second == [RaiseError(WorkerDeath(worker=0))]
    assert twice == once


def test_a_failed_loader_lets_go_of_every_task_and_answer() -> None:
    state, _ = feed(_busy(), TaskCompleted(task=0, worker=0), WorkerDied(worker=1))
    assert state.window == ()
    assert state.loads == (0, 0)
    assert state.drawing_for is None


def test_a_worker_death_while_idle_fails_the_loader() -> None:
    state, commands = feed(initial_state(config()), WorkerDied(worker=0))
    assert state.phase is Phase.FAILED
    assert commands == SHUTDOWN_OF_TWO


def test_a_worker_death_while_resuming_fails_the_loader() -> None:
    cfg = config(num_workers=2, prefetch_factor=1, persistent_workers=True)
    finished, _ = start(cfg, SamplerExhausted(), NextRequested())
    state, _ = feed(finished, ResetRequested(), WorkerResumed(0, 2))
    state, commands = feed(state, WorkerDied(worker=1))
    assert state.phase is Phase.FAILED
    assert commands == [*SHUTDOWN_OF_TWO, RaiseError(WorkerDeath(worker=1))]


def test_the_death_of_a_stopped_worker_is_ignored() -> None:
    state, _ = start(config(), SamplerExhausted(), NextRequested())
    assert state.life.workers == (WorkerStatus.STOPPED,) * 2
    after, commands = feed(state, WorkerDied(worker=1, pid=3, exitcode=0))
    assert commands == []
    assert after == state
    assert after.phase is Phase.FINISHED


def test_the_death_of_a_persistent_worker_between_epochs_fails_the_loader() -> None:
    state, _ = start(config(persistent_workers=True), SamplerExhausted(), NextRequested())
    state, commands = feed(state, WorkerDied(worker=0))
    assert state.phase is Phase.FAILED
    assert commands == SHUTDOWN_OF_TWO


# --- timeout -------------------------------------------------------------------------------------


def test_a_timeout_while_waiting_fails_the_loader_with_timeout() -> None:
    state, _ = feed(_busy(), NextRequested())
    state, commands = feed(state, TimedOut(seconds=5.0))
    assert state.phase is Phase.FAILED
    assert commands == [*SHUTDOWN_OF_TWO, RaiseError(Timeout(5.0))]
    assert state.life.failure == Timeout(5.0)


def test_after_a_timeout_the_next_request_gets_the_timeout_again() -> None:
    state, _ = feed(_busy(), NextRequested(), TimedOut(seconds=5.0))
    _, commands = feed(state, NextRequested())
    assert commands == [RaiseError(Timeout(5.0))]


def test_a_timeout_while_iter_waits_for_workers_to_resume_fails_the_loader() -> None:
    cfg = config(num_workers=2, prefetch_factor=1, persistent_workers=True)
    state, _ = start(cfg, SamplerExhausted(), ResetRequested())
    state, commands = feed(state, TimedOut(seconds=1.5))
    assert state.phase is Phase.FAILED
    assert commands == [*SHUTDOWN_OF_TWO, RaiseError(Timeout(1.5))]


# --- close ---------------------------------------------------------------------------------------


def test_close_mid_epoch_stops_every_worker_then_shuts_down() -> None:
    state, commands = feed(_busy(), CloseRequested())
    assert state.phase is Phase.CLOSED
    assert commands == SHUTDOWN_OF_TWO
    assert state.window == ()
    assert state.loads == (0, 0)


def test_a_second_close_emits_nothing() -> None:
    state, _ = feed(_busy(), CloseRequested())
    after, commands = feed(state, CloseRequested())
    assert commands == []
    assert after == state


def test_close_while_a_consumer_waits_raises_cancelled_after_the_shutdown() -> None:
    state, _ = feed(_busy(), NextRequested())
    state, commands = feed(state, CloseRequested())
    assert commands == [*SHUTDOWN_OF_TWO, RaiseError(Cancelled())]
    assert not state.waiting


def test_close_before_any_epoch_shuts_the_workers_down() -> None:
    state, commands = feed(initial_state(config()), CloseRequested())
    assert state.phase is Phase.CLOSED
    assert commands == SHUTDOWN_OF_TWO


def test_close_after_a_non_persistent_epoch_emits_nothing_more() -> None:
    state, _ = start(config(), SamplerExhausted(), NextRequested())
    state, commands = feed(state, CloseRequested())
    assert state.phase is Phase.CLOSED
    assert commands == []


def test_close_after_a_persistent_epoch_shuts_the_workers_down() -> None:
    state, _ = start(config(persistent_workers=True), SamplerExhausted(), NextRequested())
    _, commands = feed(state, CloseRequested())
    assert commands == SHUTDOWN_OF_TWO


def test_close_after_a_failure_emits_nothing_more() -> None:
    state, _ = feed(_busy(), WorkerDied(worker=0))
    state, commands = feed(state, CloseRequested())
    assert state.phase is Phase.CLOSED
    assert commands == []


def test_close_forgets_the_stale_tasks() -> None:
    cfg = config(num_workers=2, prefetch_factor=1, persistent_workers=True)
    state, _ = fill(start(cfg)[0])
    state, _ = feed(state, ResetRequested())
    assert state.life.stale == frozenset({(0, 0), (1, 1)})
    state, _ = feed(state, CloseRequested())
    assert state.life.stale == frozenset()
    assert state.life.dropped == 0  # stale tasks belong to an earlier epoch: none is dropped


# --- how failures read ---------------------------------------------------------------------------


def test_a_worker_death_by_signal_names_the_worker_the_pid_and_the_signal() -> None:
    text = WorkerDeath(worker=3, pid=4242, exitcode=-9).describe()
    assert "worker 3" in text
    assert "4242" in text
    assert "signal 9" in text


def test_a_worker_death_by_exit_code_names_the_code() -> None:
    text = WorkerDeath(worker=0, pid=11, exitcode=2).describe()
    assert "worker 0" in text
    assert "exit code 2" in text


def test_a_worker_death_without_pid_or_code_still_reads_well() -> None:
    assert WorkerDeath(worker=1).describe() == "DataLoader worker 1 exited unexpectedly"


def test_a_timeout_names_its_seconds() -> None:
    assert "2.5 seconds" in Timeout(2.5).describe()


def test_a_task_failure_names_the_worker_the_task_and_the_error() -> None:
    text = TaskFailure(task=8, worker=2, error=ValueError("bad")).describe()
    assert "worker 2" in text
    assert "task 8" in text
    assert "ValueError('bad')" in text


def test_cancelled_says_the_loader_was_closed() -> None:
    assert "closed" in Cancelled().describe()


@pytest.mark.parametrize("worker", [0, 1])
@pytest.mark.parametrize("end", [WorkerDied(worker=0), CloseRequested()], ids=["failed", "closed"])
def test_a_worker_death_after_a_failure_or_close_emits_nothing(end: Event, worker: int) -> None:
    # Every worker was stopped on the way to FAILED or CLOSED, so its exit is expected; this
    # holds for the worker whose death failed the loader too.
    state, _ = feed(_busy(), end)
    assert state.life.workers == (WorkerStatus.STOPPED,) * 2
    after, commands = feed(state, WorkerDied(worker=worker, pid=9, exitcode=-9))
    assert commands == []
    assert after == state
    assert after.phase is state.phase


def test_a_worker_death_after_a_failure_does_not_replace_the_failure() -> None:
    state, _ = feed(_busy(), NextRequested(), TimedOut(seconds=2.0))
    state, commands = feed(state, WorkerDied(worker=0, pid=1, exitcode=1), WorkerDied(worker=1))
    assert commands == []
    assert state.life.failure == Timeout(2.0)
    _, commands = feed(state, NextRequested())
    assert commands == [RaiseError(Timeout(2.0))]


def test_a_worker_death_while_a_consumer_waits_after_close_raises_nothing_more() -> None:
    state, _ = feed(_busy(), NextRequested())
    state, commands = feed(state, CloseRequested(), WorkerDied(worker=0), WorkerDied(worker=1))
    assert commands == [*SHUTDOWN_OF_TWO, RaiseError(Cancelled())]
    assert state.phase is Phase.CLOSED


# --- the sampler raising -------------------------------------------------------------------------

_BROKEN_SAMPLER = ValueError("bad index")


def _served_and_drawing() -> State:
    """The consumer was just handed task 0, and the index for its replacement is being drawn."""
    state, _ = feed(_busy(), NextRequested(), TaskCompleted(task=0, worker=0))
    assert state.drawing_for is not None and not state.waiting
    return state


def test_a_sampler_failure_stops_every_worker() -> None:
    state, commands = feed(_served_and_drawing(), SamplerFailed(_BROKEN_SAMPLER))
    assert commands == SHUTDOWN_OF_TWO
    assert state.phase is Phase.FAILED


def test_a_consumer_handed_a_batch_gets_the_sampler_failure_with_its_next_request() -> None:
    state, _ = feed(_served_and_drawing(), SamplerFailed(_BROKEN_SAMPLER))
    _, commands = feed(state, NextRequested())
    assert commands == [RaiseError(SamplerFailure(_BROKEN_SAMPLER))]


def test_after_the_sampler_failure_was_raised_the_next_request_ends_the_epoch() -> None:
    state, _ = feed(_served_and_drawing(), SamplerFailed(_BROKEN_SAMPLER), NextRequested())
    state, commands = feed(state, NextRequested())
    assert commands == [EndEpoch()]
    assert feed(state, NextRequested())[1] == [EndEpoch()]


def test_a_consumer_waiting_gets_the_sampler_failure_at_once_after_the_shutdown() -> None:
    cfg = config(num_workers=1, prefetch_factor=1, lazy=True)
    state, _ = start(cfg, NextRequested())  # lazy: the index is drawn for the waiting consumer
    _, commands = feed(state, SamplerFailed(_BROKEN_SAMPLER))
    assert commands == [StopWorker(0), Shutdown(), RaiseError(SamplerFailure(_BROKEN_SAMPLER))]


def test_a_sampler_failing_while_iter_draws_the_first_indices_fails_iter() -> None:
    state, _ = start(config(), IndexDrawn(0))
    assert state.life.resetting
    state, commands = feed(state, SamplerFailed(_BROKEN_SAMPLER))
    assert commands[-1] == RaiseError(SamplerFailure(_BROKEN_SAMPLER))
    assert not state.life.resetting


def test_a_sampler_failure_is_refused_when_no_index_was_asked_for() -> None:
    with pytest.raises(ExecutorError, match="no index was asked"):
        feed(_busy(), SamplerFailed(_BROKEN_SAMPLER))


# --- the executor itself failing -----------------------------------------------------------------

_BROKEN_EXECUTOR = OSError("pipe closed")


def test_an_executor_failure_stops_the_workers_and_is_raised_in_the_call_that_met_it() -> None:
    # Even to a consumer not waiting: the call in progress (iter(), or next() after its batch
    # was handed over) ends with it.
    state, commands = feed(_busy(), ExecutorFailed(_BROKEN_EXECUTOR))
    assert commands == [*SHUTDOWN_OF_TWO, RaiseError(ExecutorFailure(_BROKEN_EXECUTOR))]
    assert state.phase is Phase.FAILED


def test_an_executor_failure_is_raised_again_by_every_later_request() -> None:
    state, _ = feed(_busy(), ExecutorFailed(_BROKEN_EXECUTOR))
    for _ in range(2):
        state, commands = feed(state, NextRequested())
        assert commands == [RaiseError(ExecutorFailure(_BROKEN_EXECUTOR))]


def test_an_executor_failing_again_as_it_stops_the_workers_raises_with_no_second_shutdown() -> None:
    state, _ = feed(_busy(), ExecutorFailed(_BROKEN_EXECUTOR))
    again = OSError("still closed")
    state, commands = feed(state, ExecutorFailed(again))
    assert commands == [RaiseError(ExecutorFailure(again))]


def test_an_executor_failure_while_closing_is_raised_by_close_and_the_loader_stays_closed() -> None:
    state, _ = feed(_busy(), CloseRequested())
    after, commands = feed(state, ExecutorFailed(_BROKEN_EXECUTOR))
    assert commands == [RaiseError(ExecutorFailure(_BROKEN_EXECUTOR))]
    assert after == state


def test_an_interrupt_after_a_failure_changes_nothing() -> None:
    state, _ = feed(_busy(), WorkerDied(worker=0))
    assert feed(state, Interrupted()) == (state, [])


# --- whether another epoch can start on the same workers -----------------------------------------


def test_a_persistent_scheduler_can_start_another_epoch_once_one_finished() -> None:
    state, _ = start(config(persistent_workers=True), SamplerExhausted(), NextRequested())
    assert can_restart(state)


def test_a_scheduler_without_persistent_workers_runs_one_epoch() -> None:
    state, _ = start(config(), SamplerExhausted(), NextRequested())
    assert can_restart(initial_state(config()))
    assert not can_restart(state)


@pytest.mark.parametrize(
    "event",
    [WorkerDied(worker=0), ExecutorFailed(_BROKEN_EXECUTOR), CloseRequested()],
    ids=lambda event: type(event).__name__,
)
def test_a_failed_or_closed_persistent_scheduler_cannot_start_another_epoch(event: Event) -> None:
    state, _ = feed(_busy(persistent_workers=True), event)
    assert not can_restart(state)
