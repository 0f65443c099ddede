"""The seam where observers watch a driver: one call per transition, for all of them.

A driver (`executors._driver.Driver`) is given its observers (the loader attaches them: the
flight recorder unless it loads in the calling thread, the tracer when traced) and calls
`step` through `observed`, which tells each observer of every transition once, with the
state before it, the event and what `step` answered (the state after, the commands), or
that `step` refused the event. The driver also tells them of an error it is about to raise
(`Observer.raising`), which the flight recorder names its file in. Observers decide nothing
and change nothing: the driver carries out the commands as `step` gave them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from statecore import Event, State, Transition

__all__ = ["Observer", "StepFunction", "observed"]

StepFunction = Callable[[State, Event], Transition]


def _ignore(*_: object, **__: object) -> None:
    return None


@attrs.frozen
class Observer:
    """One observer's hooks at a driver's seam."""

    transition: Callable[[State, Event, Transition], None]
    """Told of each transition: the state before, the event, and what `step` answered."""
    refused: Callable[[State, Event, BaseException], None] = _ignore
    """Told that `step` raised on this state and event (the driver keeps the state it had)."""
    raising: Callable[..., None] = _ignore
    """Told of an error the driver is about to raise, with its state now: `raising(error,
    state, key=None, as_note=False)` (see `FlightRecorder.attach`)."""
    owner: object = None
    """Whose hooks these are (the tracer, the flight recorder), for those who look."""


def observed(step: StepFunction, observers: Sequence[Observer]) -> StepFunction:
    """`step`, with each transition told to every observer once; `step` itself if none."""
    if not observers:
        return step
    hooks = tuple(observer.transition for observer in observers)
    refusals = tuple(observer.refused for observer in observers)
    if len(observers) == 1:
        # The common case (a loader's flight recorder alone) without the loop.
        (hook,), (refused,) = hooks, refusals

        def one(state: State, event: Event) -> Transition:
            try:
                transition = step(state, event)
            except BaseException as error:
                refused(state, event, error)
                raise
            hook(state, event, transition)
            return transition

        return one

    def every(state: State, event: Event) -> Transition:
        try:
            transition = step(state, event)
        except BaseException as error:
            for refused in refusals:
                refused(state, event, error)
            raise
        for hook in hooks:
            hook(state, event, transition)
        return transition

    return every
