"""Stamping a worker's answers with the incarnation that made them.

A worker's runtime (`executors._worker.WorkerRuntime`) knows nothing of replacements: its
events say incarnation 0. An executor that replaced the worker (`Replacing`) stamps each event
of the replacement with the replacement's number before handing it out, so that the scheduler
can tell late news of a lost incarnation from the answers of the one now in its slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statecore import (
    Event,
    TaskCompleted,
    TaskFailed,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
)

__all__ = ["stamped"]

_SLOTS: dict[type[Event], Callable[[Any, int], None]] = {
    kind: kind.__dict__["incarnation"].__set__
    for kind in (TaskCompleted, TaskFailed, WorkerExhausted, WorkerResumed, WorkerDied)
}
"""Each worker event's `incarnation` slot setter: the frozen value is filled in place, as
`TaskCompleted.fast` fills it, rather than copied (`attrs.evolve`) once per batch."""


def stamped(event: Event, incarnation: int) -> Event:
    """`event`, just made by a worker's runtime and held by nobody else yet, stamped with
    `incarnation` in place. Incarnation 0 is every event's default: nothing to do."""
    if incarnation:
        _SLOTS[type(event)](event, incarnation)
    return event
