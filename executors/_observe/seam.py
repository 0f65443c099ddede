"""The seam where observers watch a driver: one call per transition, for all of them.

A driver (`executors._driver.Driver`) is given its observers (the loader attaches them: the
flight recorder unless it loads in the calling thread, the tracer when traced) and calls
`step` through `observed`, which tells each observer of every transition once, with the
state before it, the event and what `step` answered (the state after, the commands), or
that `step` refused the event. The driver also tells them of an error it is about to raise
(`Observer.raising`), which the flight recorder names its file in. Observers decide nothing
and change nothing: the driver carries out the commands as `step` gave them.

The shell classifies an event once: each observer names a hook per event type it cares about
(`Observer.on`) and one for the rest (`Observer.transition`), and the seam keeps, per event
type, the one call that tells every observer that wants it (`Routes`). A transition costs one
lookup by type whatever the number of observers, and none of them looks at the type again.
Where two observers want an event (the flight recorder and the tracer, on every batch of a
traced loader), the later one may take the earlier one's hook into its own (`Observer.joined`):
one call a transition, where a call joining the two would be a Python frame more, three a batch.
The core's own lookup of its move by type (`statecore._step`) stays the core's: it is pure and
knows nothing of the shell.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from statecore import Event, State, Transition

__all__ = ["Hook", "Observer", "Routes", "StepFunction", "observed"]

StepFunction = Callable[[State, Event], Transition]
Hook = Callable[[State, Event, Transition], None]
"""Told of one transition: the state before, the event, and what `step` answered."""


def _ignore(*_: object, **__: object) -> None:
    return None


@attrs.frozen
class Observer:
    """One observer's hooks at a driver's seam."""

    transition: Hook | None
    """Told of each transition whose event's type `on` does not name; None: of none of them."""
    refused: Callable[[State, Event, BaseException], None] = _ignore
    """Told that `step` raised on this state and event (the driver keeps the state it had)."""
    raising: Callable[..., None] = _ignore
    """Told of an error the driver is about to raise, with its state now: `raising(error,
    state, key=None, as_note=False)` (see `FlightRecorder.attach`)."""
    owner: object = None
    """Whose hooks these are (the tracer, the flight recorder), for those who look."""
    on: Mapping[type[Event], Hook | None] = attrs.field(factory=dict, eq=False)
    """Per event type (the exact type, as `type(event)` gives it), the hook told of its
    transitions instead of `transition`; None: not told of them."""
    joined: Callable[[type[Event], Hook], Hook | None] | None = attrs.field(default=None, eq=False)
    """`joined(kind, before)`: this observer's hook for events of type `kind` that first calls
    `before` (the hook of the observer given before this one) itself, as the first thing it
    does: one call for both, with no frame between them. None (or None answered for a type):
    the seam joins the two hooks in a call of its own."""

    def hook(self, kind: type[Event]) -> Hook | None:
        """What tells this observer of a transition on an event of type `kind`, if anything."""
        return self.on.get(kind, self.transition)


class Routes:
    """Per event type, the one call that tells every observer that wants it, in the order the
    observers were given (None: no observer wants it), in `calls`: a plain dictionary, built
    for every event type the core defines, so that a transition costs one lookup of the
    fastest kind. A type met later (a test's own) is added the first time it comes (`add`)."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = tuple(observers)
        self.calls: dict[type, Hook | None] = {}
        for kind in _event_types(Event):
            self.add(kind)

    def add(self, kind: type) -> Hook | None:
        """The call for events of type `kind`, made and kept."""
        wanting = [(o, hook) for o in self.observers if (hook := o.hook(kind)) is not None]
        call: Hook | None = None
        if len(wanting) == 2 and wanting[1][0].joined is not None:
            call = wanting[1][0].joined(kind, wanting[0][1])
        if call is None:
            call = _joined([hook for _, hook in wanting])
        self.calls[kind] = call
        return call


def _event_types(base: type) -> list[type]:
    found: list[type] = []
    kind: type
    for kind in base.__subclasses__():
        found.append(kind)
        found.extend(_event_types(kind))
    return found


def _joined(hooks: Sequence[Hook]) -> Hook | None:
    if not hooks:
        return None
    if len(hooks) == 1:
        return hooks[0]  # the common case (one observer wants the type) without a loop
    if len(hooks) == 2:
        first, second = hooks

        def both(state: State, event: Event, transition: Transition) -> None:
            first(state, event, transition)
            second(state, event, transition)

        return both

    def every(state: State, event: Event, transition: Transition) -> None:
        for hook in hooks:
            hook(state, event, transition)

    return every


def observed(step: StepFunction, observers: Sequence[Observer]) -> StepFunction:
    """`step`, with each transition told once to every observer that wants its event's type;
    `step` itself if there is no observer."""
    if not observers:
        return step
    routes = Routes(observers)
    calls = routes.calls
    refusals = tuple(observer.refused for observer in observers if observer.refused is not _ignore)

    def watched(state: State, event: Event) -> Transition:
        try:
            transition = step(state, event)
        except BaseException as error:
            for refused in refusals:
                refused(state, event, error)
            raise
        try:
            hook = calls[type(event)]
        except KeyError:
            hook = routes.add(type(event))
        if hook is not None:
            hook(state, event, transition)
        return transition

    return watched
