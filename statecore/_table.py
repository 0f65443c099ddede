"""The legal moves, as data: everything about *where* a step may lead lives in this file.

`TRANSITIONS` names the one phase each move leads to; `RULES` are the state-triggered moves
that `step` applies after it, in one place (`statecore._step._settle`); `ECHOES` are the events
a phase drops without a move. `EDGES` joins them: every phase a step may end in, which the models
check each step against and docs/state-machine.md draws (`python -m statecore diagram`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from statecore._events import (
    AddRequested,
    CloseRequested,
    Event,
    ExecutorFailed,
    IndexDrawn,
    Interrupted,
    NextRequested,
    PrefetchChangeRequested,
    ResetRequested,
    RetireRequested,
    SamplerExhausted,
    SamplerFailed,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
    WorkerStarted,
    WorkerStuck,
)
from statecore._state import Phase

__all__ = ["ECHOES", "EDGES", "RULES", "TRANSITIONS", "Rule"]

IDLE = Phase.IDLE
RESUMING = Phase.RESUMING
RUNNING = Phase.RUNNING
DRAINING = Phase.DRAINING
FINISHED = Phase.FINISHED
FAILED = Phase.FAILED
CLOSED = Phase.CLOSED

_ANSWERS = (TaskCompleted, TaskFailed, WorkerExhausted)
_FAILURES = (TimedOut, ExecutorFailed)
_LIVE = (IDLE, RESUMING, RUNNING, DRAINING, FINISHED)

# --- the table -----------------------------------------------------------------------------------
# The legal moves: phase -> event type -> the phase the move leads to. Where the state after the
# move decides more (every acknowledgement in, no active worker left, the epoch over, a lost
# worker with no restart left), a rule takes it on from there (`RULES`).
#
# A worker retired (`RetireRequested`, map-style datasets only) is given no new task and is
# stopped by the rule "retired" once it holds none; `AddRequested` starts a retired slot again.
# Neither changes the phase, nor does `PrefetchChangeRequested`, which changes how many tasks
# each worker may hold from now on (lowering it cancels nothing: it only holds back new sends).
#
# A worker lost (`WorkerDied`, `WorkerStuck`) in a live phase is replaced in its slot, and the
# phase stays; the rule "restarts spent" fails the loader instead when none is left, which with
# torch's default of no restarts is every time.
TRANSITIONS: Mapping[Phase, Mapping[type[Event], Phase]] = {
    IDLE: {
        ResetRequested: RUNNING,
        WorkerDied: IDLE,
        WorkerStarted: IDLE,
        Interrupted: IDLE,
        CloseRequested: CLOSED,
    },
    RESUMING: {
        # Only after an interrupted iter(): a batch is asked for, or the reset starts over.
        NextRequested: RESUMING,
        ResetRequested: RESUMING,
        Interrupted: RESUMING,
        WorkerResumed: RESUMING,
        **{answer: RESUMING for answer in _ANSWERS},  # echoes only
        WorkerDied: RESUMING,
        WorkerStarted: RESUMING,
        **{failure: FAILED for failure in _FAILURES},
        CloseRequested: CLOSED,
    },
    RUNNING: {
        NextRequested: RUNNING,
        IndexDrawn: RUNNING,
        SamplerExhausted: DRAINING,
        SamplerFailed: FAILED,
        **{answer: RUNNING for answer in _ANSWERS},
        WorkerResumed: RUNNING,  # echoes only: a lost incarnation's
        WorkerDied: RUNNING,
        WorkerStuck: RUNNING,
        WorkerStarted: RUNNING,
        RetireRequested: RUNNING,
        AddRequested: RUNNING,
        PrefetchChangeRequested: RUNNING,
        **{failure: FAILED for failure in _FAILURES},
        Interrupted: RUNNING,
        ResetRequested: RESUMING,
        CloseRequested: CLOSED,
    },
    DRAINING: {
        NextRequested: DRAINING,
        # Drawn while every worker ran dry: the index has nowhere to go, and is dropped.
        IndexDrawn: DRAINING,
        SamplerExhausted: DRAINING,
        SamplerFailed: FAILED,
        **{answer: DRAINING for answer in _ANSWERS},
        WorkerResumed: DRAINING,  # echoes only: a lost incarnation's
        WorkerDied: DRAINING,
        WorkerStuck: DRAINING,
        WorkerStarted: DRAINING,
        RetireRequested: DRAINING,
        AddRequested: DRAINING,
        PrefetchChangeRequested: DRAINING,
        **{failure: FAILED for failure in _FAILURES},
        Interrupted: DRAINING,
        ResetRequested: RESUMING,
        CloseRequested: CLOSED,
    },
    FINISHED: {
        NextRequested: FINISHED,
        **{answer: FINISHED for answer in _ANSWERS},  # echoes only
        WorkerResumed: FINISHED,  # echoes only: a lost incarnation's
        WorkerDied: FINISHED,  # a persistent worker's; the exit of one told to stop is an echo
        WorkerStarted: FINISHED,
        ExecutorFailed: FAILED,  # stopping the workers at the end of the epoch failed
        Interrupted: FINISHED,
        ResetRequested: RESUMING,
        CloseRequested: CLOSED,
    },
    FAILED: {
        NextRequested: FAILED,
        WorkerDied: FAILED,  # every worker was stopped: only echoes come
        WorkerStarted: FAILED,  # a replacement that started as everything stopped: an echo
        ExecutorFailed: FAILED,  # stopping the workers after the failure failed too
        Interrupted: FAILED,
        CloseRequested: CLOSED,
    },
    CLOSED: {
        WorkerDied: CLOSED,  # echoes only
        WorkerStarted: CLOSED,  # echoes only
        ExecutorFailed: CLOSED,  # stopping the workers on close failed: the close call raises it
        Interrupted: CLOSED,
        CloseRequested: CLOSED,
    },
}


@attrs.frozen
class Rule:
    """A state-triggered transition: after any move, a state in `source` that meets `condition`
    goes on to `target`. `_settle` applies the rules, in the order of `RULES`, after every move
    that leaves a live phase.

    `after` names the event types whose moves can meet the condition; the checkers and the
    diagram read it, `_settle` does not.
    """

    name: str
    source: Phase
    target: Phase
    condition: str
    after: frozenset[type[Event]]


RULES: tuple[Rule, ...] = (
    Rule(
        "every acknowledgement in",
        RESUMING,
        RUNNING,
        "every persistent worker acknowledged the new epoch (or was lost, and its replacement is "
        "set up for it): tasks may flow",
        frozenset({WorkerResumed, WorkerDied}),
    ),
    Rule(
        "no active worker left",
        RUNNING,
        DRAINING,
        "every worker ran dry (or a checkpoint resumed them all dry): nothing more is sent",
        frozenset({WorkerExhausted, ResetRequested}),
    ),
    *(
        Rule(
            "retired",
            phase,
            phase,
            "a retiring worker holds no unresolved task: it is told to stop (StopWorker) and its "
            "slot is retired (STOPPED) until AddRequested starts it again",
            frozenset({RetireRequested, NextRequested, TaskCompleted, TaskFailed}),
        )
        for phase in (RUNNING, DRAINING)
    ),
    Rule(
        "the epoch over",
        DRAINING,
        FINISHED,
        "a consumer waits, every task is resolved and no index is on its way",
        frozenset({NextRequested, IndexDrawn, SamplerExhausted, WorkerExhausted}),
    ),
    *(
        Rule(
            "restarts spent",
            phase,
            FAILED,
            "a worker was lost (died, or stuck) and no restart is left to replace it, or it is "
            "a stuck thread, which cannot be killed: the loss is fatal, naming every earlier one",
            frozenset({WorkerDied, WorkerStuck}),
        )
        for phase in _LIVE
        if WorkerDied in TRANSITIONS[phase]
    ),
)

ECHOES: Mapping[Phase, frozenset[type[Event]]] = {
    IDLE: frozenset({WorkerDied}),
    RESUMING: frozenset({*_ANSWERS, WorkerResumed, WorkerDied, WorkerStarted}),
    RUNNING: frozenset({*_ANSWERS, WorkerResumed, WorkerDied}),
    DRAINING: frozenset({*_ANSWERS, WorkerResumed, WorkerDied}),
    FINISHED: frozenset({*_ANSWERS, WorkerResumed, WorkerDied, WorkerStarted}),
    FAILED: frozenset({WorkerDied, WorkerStarted}),
    CLOSED: frozenset({WorkerDied, WorkerStarted}),
}
"""Per phase, the event types that may answer what the scheduler no longer waits for: a task of
an earlier epoch, the resume of an abandoned reset, a worker told to stop, anything from an
incarnation already lost, a replacement that started after a new epoch's reset or after
everything stopped. They are dropped, and the phase stays whatever the table says the move
would do."""


def _edges() -> dict[Phase, dict[type[Event], frozenset[Phase]]]:
    edges: dict[Phase, dict[type[Event], frozenset[Phase]]] = {}
    for phase, moves in TRANSITIONS.items():
        edges[phase] = {}
        for event, target in moves.items():
            reached = {target}
            for rule in RULES:  # in chain order: each may take on from the one before
                if rule.source in reached and event in rule.after:
                    reached.add(rule.target)
            if event in ECHOES[phase]:
                reached.add(phase)
            edges[phase][event] = frozenset(reached)
    return edges


EDGES: Mapping[Phase, Mapping[type[Event], frozenset[Phase]]] = _edges()
"""Derived, never edited: phase -> event type -> every phase a step may end in (the move's, the
rules' after it, and the phase itself for an echo). The models check each step they see
against it, and docs/state-machine.md's diagram draws it."""
