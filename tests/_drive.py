"""Small helpers that drive the pure scheduler core in tests.

`feed` steps a state through events and checks, after every step, the core's own invariants and
that the move is an edge of the transition table (as the models do), so every test that drives
the core also checks that the states it passes through are sound.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from statecore import (
    EDGES,
    AddRequested,
    CloseRequested,
    Command,
    Config,
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
    State,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
    WorkerStarted,
    WorkerStuck,
    initial_state,
    step,
    violations,
)

C = TypeVar("C", bound=Command)


def config(num_workers: int = 2, prefetch_factor: int = 2, **flags: bool) -> Config:
    """A configuration with small defaults: two workers, two tasks each."""
    return Config(num_workers=num_workers, prefetch_factor=prefetch_factor, **flags)


def feed(state: State, *events: Event) -> tuple[State, list[Command]]:
    """Step `state` through `events`: the final state and every command emitted, in order.

    Every step is checked against the core's invariants and the transition table.
    """
    commands: list[Command] = []
    for event in events:
        before = state.phase
        state, emitted = step(state, event)
        broken = violations(state)
        assert not broken, f"after {event!r}: {broken}"
        allowed = EDGES[before].get(type(event), frozenset())
        assert state.phase in allowed, (
            f"{event!r} moved {before!r} to {state.phase!r}, an edge the table lacks"
        )
        commands.extend(emitted)
    return state, commands


def start(cfg: Config, *events: Event) -> tuple[State, list[Command]]:
    """A scheduler for `cfg` that began its first epoch and then saw `events`."""
    return feed(initial_state(cfg), ResetRequested(), *events)


def fill(state: State) -> tuple[State, list[Command]]:
    """Answer each DrawIndex with the task number as index until no worker has room."""
    commands: list[Command] = []
    while state.drawing_for is not None:
        state, emitted = feed(state, IndexDrawn(state.send_idx))
        commands.extend(emitted)
    return state, commands


def only(commands: Iterable[Command], kind: type[C]) -> list[C]:
    """The commands of one type, in order."""
    return [command for command in commands if isinstance(command, kind)]


ONE_OF_EACH: tuple[Event, ...] = (
    ResetRequested(seed=1),
    NextRequested(),
    CloseRequested(),
    IndexDrawn(0),
    SamplerExhausted(),
    SamplerFailed(ValueError("sampler")),
    TimedOut(1.0),
    ExecutorFailed(OSError("executor")),
    TaskCompleted(task=0, worker=0),
    TaskFailed(task=0, worker=0),
    WorkerExhausted(task=0, worker=0),
    WorkerResumed(worker=0, epoch=1),
    Interrupted(),
    WorkerDied(worker=0),
    WorkerStarted(worker=0, incarnation=1),
    WorkerStuck(worker=0, task=0, seconds=1.0),
    RetireRequested(worker=0),
    AddRequested(worker=0),
    PrefetchChangeRequested(prefetch_factor=3),
)
"""One representative event of every event type."""
