"""An interrupted wait (Ctrl-C, a signal handler raising) loses nothing and leaves a known state."""

from __future__ import annotations

import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    Deliver,
    DrawIndex,
    Interrupted,
    MisuseError,
    NextRequested,
    Phase,
    RaiseError,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    State,
    TaskCompleted,
    TimedOut,
    Timeout,
    WorkerResumed,
    WorkerStatus,
    violations,
)


def _waiting_for_task_zero() -> State:
    """Two workers hold two tasks each; the consumer waits for task 0."""
    state, _ = fill(start(config(2, prefetch_factor=2, persistent_workers=True))[0])
    state, _ = feed(state, NextRequested())
    assert state.waiting
    return state


def _resetting() -> State:
    """Epoch 1 finished; iter() waits for both workers to acknowledge epoch 2."""
    cfg = config(2, prefetch_factor=1, persistent_workers=True)
    state, _ = start(cfg, SamplerExhausted(), NextRequested())
    state, _ = feed(state, ResetRequested(seed=3))
    assert state.life.resetting
    return state


def test_an_interrupted_next_stops_waiting_and_emits_nothing() -> None:
    state, commands = feed(_waiting_for_task_zero(), Interrupted())
    assert not state.waiting
    assert commands == []
    assert state.outstanding == 4


def test_a_batch_that_arrives_after_an_interrupt_goes_to_the_next_request() -> None:
    state, _ = feed(_waiting_for_task_zero(), Interrupted())
    state, commands = feed(state, TaskCompleted(task=0, worker=0, payload="zero"))
    assert commands == []  # nobody waits: it is kept
    assert state.buffered == 1
    state, commands = feed(state, NextRequested())
    assert only(commands, Deliver) == [Deliver(task=0, worker=0)]


def test_a_request_after_an_interrupt_waits_for_the_same_task() -> None:
    state, _ = feed(_waiting_for_task_zero(), Interrupted(), NextRequested())
    assert state.waiting
    _, commands = feed(state, TaskCompleted(task=0, worker=0, payload="zero"))
    assert only(commands, Deliver) == [Deliver(task=0, worker=0)]


def test_an_interrupt_with_nobody_waiting_changes_nothing() -> None:
    # Ctrl-C lands wherever the program is: outside a wait it cuts nothing the scheduler owes.
    state, _ = fill(start(config(2))[0])
    after, commands = feed(state, Interrupted())
    assert (after, commands) == (state, [])


def test_an_interrupt_during_a_draw_abandons_the_draw() -> None:
    state, _ = start(config(2))  # iter() draws the first indices
    assert state.drawing_for is not None
    state, commands = feed(state, Interrupted())
    assert commands == []
    assert state.drawing_for is None
    assert not state.life.resetting
    # The next request draws again.
    _, commands = feed(state, NextRequested())
    assert commands == [DrawIndex()]


def test_an_interrupt_during_a_lazy_draw_leaves_no_draw_behind() -> None:
    state, _ = start(config(1, prefetch_factor=1, lazy=True), NextRequested())
    assert state.drawing_for is not None
    state, _ = feed(state, Interrupted())
    assert violations(state) == []


def test_a_reset_waits_in_iter_until_every_worker_resumed() -> None:
    state = _resetting()
    state, _ = feed(state, WorkerResumed(0, epoch=2))
    assert state.life.resetting
    state, _ = feed(state, WorkerResumed(1, epoch=2))
    assert state.phase is Phase.RUNNING
    assert state.life.resetting  # and then until the first tasks went out
    state, _ = fill(state)
    assert not state.life.resetting


def test_a_request_while_iter_waits_for_workers_is_misuse() -> None:
    with pytest.raises(MisuseError, match="iter\\(\\) has not returned"):
        feed(_resetting(), NextRequested())


def test_an_interrupted_reset_stays_resuming_and_is_not_waited_for() -> None:
    state, commands = feed(_resetting(), Interrupted())
    assert commands == []
    assert state.phase is Phase.RESUMING
    assert not state.life.resetting
    assert state.life.workers == (WorkerStatus.RESUMING,) * 2


def test_a_reset_after_an_interrupted_reset_starts_it_over_for_every_worker() -> None:
    state, _ = feed(_resetting(), WorkerResumed(0, epoch=2), Interrupted())
    state, commands = feed(state, ResetRequested(seed=9))
    assert commands == [ResumeWorker(0, 3, 9), ResumeWorker(1, 3, 9)]
    assert state.life.epoch == 3
    assert state.life.resetting
    assert state.life.workers == (WorkerStatus.RESUMING,) * 2


def test_acknowledgements_of_an_abandoned_reset_are_dropped() -> None:
    state, _ = feed(_resetting(), Interrupted(), ResetRequested(seed=9))
    # Worker 1 had not answered the abandoned reset: its answer to it comes first.
    state, commands = feed(state, WorkerResumed(1, epoch=2), WorkerResumed(0, epoch=3))
    assert commands == []
    assert state.phase is Phase.RESUMING
    state, _ = feed(state, WorkerResumed(1, epoch=3))
    assert state.phase is Phase.RUNNING
    assert violations(state) == []


def test_an_acknowledgement_for_an_epoch_not_started_is_refused() -> None:
    with pytest.raises(Exception, match="epoch 5"):
        feed(_resetting(), WorkerResumed(0, epoch=5))


def test_a_timeout_while_iter_waits_raises_it_from_iter() -> None:
    state, commands = feed(_resetting(), TimedOut(2.0))
    assert state.phase is Phase.FAILED
    assert commands[-1] == RaiseError(Timeout(2.0))


def test_a_request_after_an_interrupted_reset_is_served_once_workers_resume() -> None:
    state, _ = feed(_resetting(), Interrupted(), NextRequested())
    assert state.waiting
    state, _ = feed(state, WorkerResumed(0, epoch=2), WorkerResumed(1, epoch=2))
    assert state.phase is Phase.RUNNING
    assert state.drawing_for is not None  # drawing the first index of epoch 2 for the request
