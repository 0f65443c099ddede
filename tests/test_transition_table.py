"""The transition table is a whitelist: a (phase, event type) pair missing from it is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _drive import ONE_OF_EACH, config, feed, only, start

from statecore import (
    ECHOES,
    EDGES,
    RULES,
    TRANSITIONS,
    ClosedError,
    CloseRequested,
    Deliver,
    DrawIndex,
    EndEpoch,
    Event,
    ExecutorError,
    ExecutorFailed,
    IndexDrawn,
    Interrupted,
    MisuseError,
    NextRequested,
    Phase,
    ProtocolError,
    ResetRequested,
    Rule,
    SamplerExhausted,
    State,
    TaskCompleted,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
    WorkerStarted,
    initial_state,
    step,
)
from statecore import _events as events_module
from statecore._events import CONSUMER_EVENTS

# Persistent and iterable, so that no refusal comes from the configuration instead of the phase.
_CONFIG = config(num_workers=2, prefetch_factor=1, persistent_workers=True, iterable=True)


def _idle() -> State:
    return initial_state(_CONFIG)


def _resuming() -> State:
    return start(_CONFIG, SamplerExhausted(), NextRequested(), ResetRequested())[0]


def _running() -> State:
    return start(_CONFIG)[0]


def _draining() -> State:
    # Task 0 on worker 0 is still due when the sampler runs out.
    return start(_CONFIG, IndexDrawn(0), SamplerExhausted())[0]


def _finished() -> State:
    # The sampler had nothing; the consumer's first request finds the epoch over.
    return start(_CONFIG, SamplerExhausted(), NextRequested())[0]


def _failed() -> State:
    return start(_CONFIG, WorkerDied(worker=0))[0]


def _closed() -> State:
    return start(_CONFIG, CloseRequested())[0]


BUILDERS: dict[Phase, Callable[[], State]] = {
    Phase.IDLE: _idle,
    Phase.RESUMING: _resuming,
    Phase.RUNNING: _running,
    Phase.DRAINING: _draining,
    Phase.FINISHED: _finished,
    Phase.FAILED: _failed,
    Phase.CLOSED: _closed,
}

MISSING = [
    (phase, event)
    for phase in Phase
    for event in ONE_OF_EACH
    if type(event) not in TRANSITIONS[phase]
]


def test_every_phase_has_a_representative_state() -> None:
    assert set(BUILDERS) == set(Phase)
    for phase, build in BUILDERS.items():
        assert build().phase is phase


def test_representative_states_are_hashable_values() -> None:
    # The models de-duplicate states, so equal states must hash equal, across rebuilds too.
    states = [build() for build in BUILDERS.values()]
    assert len(set(states)) == len(Phase)
    for build in BUILDERS.values():
        assert build() == build()
        assert hash(build()) == hash(build())
    running = _running()
    changed = running._replace(waiting=True)
    assert changed != running
    assert (changed.waiting, running.waiting) == (True, False)


def test_every_event_type_has_a_representative_event() -> None:
    public = {getattr(events_module, name) for name in events_module.__all__}
    assert {type(event) for event in ONE_OF_EACH} == public - {Event}


def test_the_table_names_every_phase_and_only_known_event_types() -> None:
    assert set(TRANSITIONS) == set(Phase)
    known = {type(event) for event in ONE_OF_EACH}
    for events in TRANSITIONS.values():
        assert set(events) <= known


def test_some_pairs_are_missing_from_the_table() -> None:
    assert MISSING  # otherwise the test below checks nothing


@pytest.mark.parametrize(
    ("phase", "event"),
    MISSING,
    ids=[f"{phase.name}-{type(event).__name__}" for phase, event in MISSING],
)
def test_an_event_missing_from_the_table_is_refused(phase: Phase, event: Event) -> None:
    state = BUILDERS[phase]()
    with pytest.raises(ProtocolError) as caught:
        step(state, event)
    error = caught.value
    # The error blames the event's source: the consumer (ClosedError once closed, MisuseError
    # before), or the executor and driver (ExecutorError, even after close).
    if type(event) not in CONSUMER_EVENTS:
        assert type(error) is ExecutorError
    elif phase is Phase.CLOSED:
        assert type(error) is ClosedError
    else:
        assert type(error) is MisuseError
    assert error.phase is phase
    assert error.event == event
    assert error.__context__ is None  # the table's lookup failing is not part of the story
    assert state == BUILDERS[phase]()


def test_the_sticky_phases_accept_only_the_events_that_can_still_come() -> None:
    # A close, a worker's exit, a replacement's start, an interrupt, the executor failing while it
    # stops the workers, and, while failed, a request (answered with the failure).
    late = {CloseRequested, WorkerDied, WorkerStarted, Interrupted, ExecutorFailed}
    assert set(TRANSITIONS[Phase.CLOSED]) == late
    assert set(TRANSITIONS[Phase.FAILED]) == late | {NextRequested}


@pytest.mark.parametrize("phase", list(Phase), ids=lambda phase: phase.name)
def test_close_is_accepted_in_every_phase(phase: Phase) -> None:
    state, _ = feed(BUILDERS[phase](), CloseRequested())
    assert state.phase is Phase.CLOSED


@pytest.mark.parametrize("phase", list(Phase), ids=lambda phase: phase.name)
def test_a_worker_death_is_accepted_in_every_phase(phase: Phase) -> None:
    assert WorkerDied in TRANSITIONS[phase]
    state, _ = feed(BUILDERS[phase](), WorkerDied(worker=1))
    assert state.phase in (Phase.FAILED, Phase.CLOSED)


@pytest.mark.parametrize("phase", [Phase.FAILED, Phase.CLOSED], ids=lambda phase: phase.name)
def test_a_worker_death_after_failure_or_close_changes_nothing(phase: Phase) -> None:
    assert TRANSITIONS[phase][WorkerDied] is phase
    state = BUILDERS[phase]()
    after, commands = feed(state, WorkerDied(worker=1, pid=5, exitcode=-9))
    assert commands == []
    assert after == state


def test_answers_while_resuming_are_accepted_only_for_stale_tasks() -> None:
    # _resuming() abandoned no task: nothing is stale, so no answer can be accepted.
    with pytest.raises(ExecutorError):
        step(_resuming(), TaskCompleted(task=5, worker=0))
    # Tasks 0 and 1 went to workers 0 and 1 before the reset: only those exact pairs are stale.
    state = start(_CONFIG, IndexDrawn(0), IndexDrawn(1), ResetRequested())[0]
    assert state.phase is Phase.RESUMING
    for wrong in (TaskCompleted(task=0, worker=1), TaskCompleted(task=1, worker=0)):
        with pytest.raises(ExecutorError):
            step(state, wrong)
    after, commands = feed(state, TaskCompleted(task=0, worker=0))
    assert (after.phase, commands) == (Phase.RESUMING, [])


# --- one phase per move, and the rules after it --------------------------------------------------


def test_the_table_names_one_phase_per_move() -> None:
    for moves in TRANSITIONS.values():
        assert all(isinstance(target, Phase) for target in moves.values())


def _rule(name: str) -> Rule:
    (found,) = [rule for rule in RULES if rule.name == name]
    return found


def test_every_acknowledgement_in_takes_resuming_on_to_running() -> None:
    rule = _rule("every acknowledgement in")
    state = start(_CONFIG, SamplerExhausted(), NextRequested(), ResetRequested())[0]
    state, _ = feed(state, WorkerResumed(worker=0, epoch=2))
    assert state.phase is Phase.RESUMING  # the move's phase, while worker 1 has not answered
    state, commands = feed(state, WorkerResumed(worker=1, epoch=2))
    assert TRANSITIONS[Phase.RESUMING][WorkerResumed] is rule.source
    assert state.phase is rule.target
    assert commands == [DrawIndex()]


def test_no_active_worker_left_takes_running_on_to_draining() -> None:
    rule = _rule("no active worker left")
    state = start(_CONFIG, IndexDrawn(0), IndexDrawn(1))[0]
    state, _ = feed(state, WorkerExhausted(task=0, worker=0))
    assert state.phase is Phase.RUNNING  # the move's phase, while worker 1 is active
    state, _ = feed(state, WorkerExhausted(task=1, worker=1))
    assert TRANSITIONS[Phase.RUNNING][WorkerExhausted] is rule.source
    assert state.phase is rule.target


def test_the_epoch_over_takes_draining_on_to_finished_only_for_a_request() -> None:
    rule = _rule("the epoch over")
    state, _ = feed(_draining(), TaskCompleted(task=0, worker=0, payload="batch"))
    assert state.phase is Phase.DRAINING  # every task resolved, but nobody asked
    state, commands = feed(state, NextRequested())
    assert state.phase is Phase.DRAINING  # handed the last batch
    assert only(commands, Deliver) == [Deliver(0, 0, "batch")]
    state, commands = feed(state, NextRequested())
    assert TRANSITIONS[Phase.DRAINING][NextRequested] is rule.source
    assert state.phase is rule.target
    assert commands == [EndEpoch()]


def test_the_edges_are_the_move_the_rules_after_it_and_an_echo() -> None:
    assert EDGES[Phase.RUNNING][WorkerExhausted] == {
        Phase.RUNNING,
        Phase.DRAINING,
        Phase.FINISHED,
    }
    assert EDGES[Phase.IDLE][ResetRequested] == {Phase.RUNNING, Phase.DRAINING}
    assert EDGES[Phase.RESUMING][NextRequested] == {Phase.RESUMING}
    # A worker told to stop exits as told: an echo, dropped without a move.
    assert EDGES[Phase.FINISHED][WorkerDied] == {Phase.FAILED, Phase.FINISHED}
    assert WorkerDied in ECHOES[Phase.FINISHED]
