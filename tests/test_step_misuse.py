"""Refusals: an impossible event raises the error that blames its source and changes nothing."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
from _drive import ONE_OF_EACH, config, feed, fill, only, start

from statecore import (
    ClosedError,
    CloseRequested,
    Deliver,
    Event,
    ExecutorError,
    ExecutorFailed,
    IndexDrawn,
    InternalError,
    Interrupted,
    LoaderCancelledError,
    LoaderTimeoutError,
    MisuseError,
    NextRequested,
    Phase,
    ProtocolError,
    ResetRequested,
    SamplerExhausted,
    State,
    StatecoreError,
    TaskCompleted,
    TimedOut,
    WorkerDied,
    WorkerDiedError,
    WorkerResumed,
    WorkerStarted,
    initial_state,
)
from statecore import _errors as errors
from statecore._events import CONSUMER_EVENTS


def _refused(
    build: Callable[[], State], event: Event, kind: type[ProtocolError]
) -> tuple[State, ProtocolError]:
    """Check that `event` is refused in the state `build` makes, with exactly `kind`.

    The message must name the phase and the event, and the state must be left as it was (equal
    to a freshly built one). Returns the state, to show it is still usable, and the error.
    """
    state = build()
    with pytest.raises(ProtocolError) as caught:
        feed(state, event)
    error = caught.value
    assert type(error) is kind
    assert error.phase is state.phase
    assert error.event == event
    assert repr(state.phase) in str(error)
    assert type(event).__name__ in str(error)
    assert state == build()
    return state, error


def _idle() -> State:
    return initial_state(config())


def _waiting() -> State:
    """Running, both workers holding two tasks each, a consumer waiting for task 0."""
    return feed(fill(start(config(persistent_workers=True))[0])[0], NextRequested())[0]


def _full() -> State:
    """Running, both workers holding two tasks each (0 and 2 on worker 0, 1 and 3 on worker 1)."""
    return fill(start(config())[0])[0]


def _resuming() -> State:
    cfg = config(persistent_workers=True)
    return start(cfg, SamplerExhausted(), ResetRequested(), WorkerResumed(0, epoch=2))[0]


def _closed() -> State:
    return feed(_full(), CloseRequested())[0]


# --- the consumer --------------------------------------------------------------------------------


def test_next_requested_before_any_epoch_is_misuse() -> None:
    state, error = _refused(_idle, NextRequested(), MisuseError)
    assert "no epoch has started" in error.reason
    assert feed(state, ResetRequested())[0].phase is Phase.RUNNING


def test_next_requested_twice_while_waiting_is_misuse() -> None:
    state, error = _refused(_waiting, NextRequested(), MisuseError)
    assert "already awaited" in error.reason
    assert only(feed(state, TaskCompleted(task=0, worker=0))[1], Deliver)


def test_reset_while_a_consumer_waits_is_misuse() -> None:
    state, error = _refused(_waiting, ResetRequested(), MisuseError)
    assert "awaited" in error.reason
    assert feed(state, TaskCompleted(task=1, worker=1))[0].waiting


def test_reset_after_a_failure_is_misuse_that_names_the_failure() -> None:
    state, error = _refused(
        lambda: feed(_full(), WorkerDied(worker=1, pid=99))[0], ResetRequested(), MisuseError
    )
    assert "worker 1 (pid 99)" in error.reason
    assert feed(state, CloseRequested())[0].phase is Phase.CLOSED


# --- the executor and the driver -----------------------------------------------------------------


def test_an_answer_for_an_unknown_task_is_an_executor_error() -> None:
    state, error = _refused(_full, TaskCompleted(task=99, worker=0), ExecutorError)
    assert "task 99" in error.reason
    assert feed(state, TaskCompleted(task=0, worker=0))[0].buffered == 1


def test_an_answer_naming_the_wrong_worker_is_an_executor_error() -> None:
    state, error = _refused(_full, TaskCompleted(task=0, worker=1), ExecutorError)
    assert "task 0 was sent to worker 0, not 1" in error.reason
    assert feed(state, TaskCompleted(task=0, worker=0))[0].buffered == 1


def test_a_second_answer_for_the_same_task_is_an_executor_error() -> None:
    answered = lambda: feed(_full(), TaskCompleted(task=1, worker=1))[0]  # noqa: E731
    state, _ = _refused(answered, TaskCompleted(task=1, worker=1), ExecutorError)
    assert feed(state, TaskCompleted(task=0, worker=0))[0].buffered == 2


def test_an_answer_for_a_task_already_delivered_out_of_order_is_an_executor_error() -> None:
    def delivered() -> State:
        cfg = config(in_order=False)
        return feed(fill(start(cfg)[0])[0], NextRequested(), TaskCompleted(task=1, worker=1))[0]

    state, _ = _refused(delivered, TaskCompleted(task=1, worker=1), ExecutorError)
    assert feed(state, IndexDrawn("a"))[0].send_idx == 5


def test_an_index_drawn_without_draw_index_is_an_executor_error() -> None:
    state, error = _refused(_full, IndexDrawn("a"), ExecutorError)
    assert "no index was asked" in error.reason
    assert feed(state, TaskCompleted(task=0, worker=0))[0].buffered == 1


def test_an_index_drawn_before_any_epoch_is_an_executor_error() -> None:
    state, _ = _refused(_idle, IndexDrawn("a"), ExecutorError)
    assert feed(state, ResetRequested())[0].phase is Phase.RUNNING


def test_sampler_exhausted_without_draw_index_is_an_executor_error() -> None:
    state, _ = _refused(_full, SamplerExhausted(), ExecutorError)
    assert feed(state, TaskCompleted(task=0, worker=0))[0].buffered == 1


def test_worker_resumed_when_not_resuming_is_an_executor_error() -> None:
    state, error = _refused(_full, WorkerResumed(worker=0, epoch=1), ExecutorError)
    assert "worker 0 was not asked to resume for epoch 1" in error.reason
    assert feed(state, TaskCompleted(task=0, worker=0))[0].buffered == 1


def test_worker_resumed_twice_by_one_worker_is_an_executor_error() -> None:
    state, error = _refused(_resuming, WorkerResumed(worker=0, epoch=2), ExecutorError)
    assert "worker 0" in error.reason
    assert feed(state, WorkerResumed(worker=1, epoch=2))[0].phase is Phase.RUNNING


def test_worker_resumed_by_a_worker_that_does_not_exist_is_an_executor_error() -> None:
    state, _ = _refused(_resuming, WorkerResumed(worker=5, epoch=2), ExecutorError)
    assert feed(state, WorkerResumed(worker=1, epoch=2))[0].phase is Phase.RUNNING


def test_timed_out_with_nobody_waiting_is_an_executor_error() -> None:
    state, error = _refused(_full, TimedOut(seconds=3.0), ExecutorError)
    assert "no consumer is waiting" in error.reason
    assert feed(state, NextRequested())[0].waiting


def test_the_death_of_a_worker_that_does_not_exist_is_an_executor_error() -> None:
    state, _ = _refused(_full, WorkerDied(worker=2), ExecutorError)
    assert feed(state, WorkerDied(worker=1))[0].phase is Phase.FAILED


# --- after close ---------------------------------------------------------------------------------


# What may still come after a close or a failure, and is accepted: another close, a worker's
# exit, a replacement's start, an interrupt (it lands anywhere), and the executor failing as it
# stops the workers.
_LATE = (CloseRequested, WorkerDied, WorkerStarted, Interrupted, ExecutorFailed)
_CONSUMER_AFTER_CLOSE = [
    e for e in ONE_OF_EACH if type(e) in CONSUMER_EVENTS and not isinstance(e, _LATE)
]
_EXECUTOR_AFTER_CLOSE = [
    e for e in ONE_OF_EACH if type(e) not in CONSUMER_EVENTS and not isinstance(e, _LATE)
]


def test_the_after_close_lists_cover_every_event_type_but_the_late_ones() -> None:
    covered = {type(e) for e in _CONSUMER_AFTER_CLOSE + _EXECUTOR_AFTER_CLOSE}
    assert covered == {type(e) for e in ONE_OF_EACH} - set(_LATE)
    assert {type(e) for e in _CONSUMER_AFTER_CLOSE} == {ResetRequested, NextRequested}


@pytest.mark.parametrize("event", _CONSUMER_AFTER_CLOSE, ids=lambda e: type(e).__name__)
def test_a_consumer_event_after_close_is_a_closed_error(event: Event) -> None:
    state, error = _refused(_closed, event, ClosedError)
    assert "closed" in error.reason
    assert feed(state, CloseRequested()) == (state, [])


@pytest.mark.parametrize("event", _EXECUTOR_AFTER_CLOSE, ids=lambda e: type(e).__name__)
def test_an_executor_or_driver_event_after_close_is_an_executor_error(event: Event) -> None:
    # The executor was told to stop: a report after that is its bug, not the consumer's misuse.
    state, error = _refused(_closed, event, ExecutorError)
    assert not isinstance(error, MisuseError)
    assert "closed" in error.reason
    assert feed(state, CloseRequested()) == (state, [])


@pytest.mark.parametrize("worker", [0, 1])
def test_a_worker_death_after_close_is_ignored(worker: int) -> None:
    state = _closed()
    after, commands = feed(state, WorkerDied(worker=worker, pid=3, exitcode=-15))
    assert commands == []
    assert after == state


def test_the_death_of_a_worker_that_does_not_exist_after_close_is_an_executor_error() -> None:
    state, error = _refused(_closed, WorkerDied(worker=2), ExecutorError)
    assert "no worker 2" in error.reason
    assert feed(state, CloseRequested()) == (state, [])


@pytest.mark.parametrize("event", _EXECUTOR_AFTER_CLOSE, ids=lambda e: type(e).__name__)
def test_an_executor_or_driver_event_after_a_failure_is_an_executor_error(event: Event) -> None:
    state, error = _refused(lambda: feed(_full(), WorkerDied(worker=1))[0], event, ExecutorError)
    assert "failed earlier" in error.reason
    assert feed(state, CloseRequested())[0].phase is Phase.CLOSED


def test_a_closed_error_is_a_misuse_error() -> None:
    assert issubclass(ClosedError, MisuseError)


# --- errors cross process boundaries -------------------------------------------------------------

_ERRORS: list[StatecoreError] = [
    StatecoreError("base"),
    ProtocolError(Phase.RUNNING, NextRequested(), "a reason"),
    MisuseError(Phase.IDLE, NextRequested(), "no epoch has started"),
    ClosedError(Phase.CLOSED, IndexDrawn([1, 2]), "the loader was closed"),
    ExecutorError(Phase.DRAINING, TaskCompleted(task=3, worker=1, payload="x"), "unknown"),
    InternalError("a rule was broken"),
    WorkerDiedError("worker 1 died", worker=1, pid=4242, exitcode=-9),
    LoaderTimeoutError("timed out after 5 seconds"),
    LoaderCancelledError("closed while waiting"),
]


def test_every_error_class_has_a_pickling_example() -> None:
    assert {type(error).__name__ for error in _ERRORS} == set(errors.__all__)


@pytest.mark.parametrize("error", _ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_survives_a_pickle_round_trip(error: StatecoreError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.args == error.args
    for name in ("phase", "event", "reason", "worker", "pid", "exitcode"):
        if hasattr(error, name):
            assert getattr(copy, name) == getattr(error, name)


def test_a_refusal_raised_by_step_survives_a_pickle_round_trip() -> None:
    _, error = _refused(_full, TaskCompleted(task=0, worker=1), ExecutorError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ExecutorError
    assert str(copy) == str(error)
    assert (copy.phase, copy.event, copy.reason) == (error.phase, error.event, error.reason)
