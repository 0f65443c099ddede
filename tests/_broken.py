"""Deliberately broken executors, to show that the conformance checks can fail."""

from __future__ import annotations

import attrs

from statecore import Event, TaskCompleted
from statecore.executors._inline import InlineExecutor


class Blanking(InlineExecutor):
    """A broken executor: every batch it loads arrives as None."""

    def poll(self, timeout: float | None) -> Event | None:
        event = super().poll(timeout)
        if isinstance(event, TaskCompleted):
            return attrs.evolve(event, payload=None)
        return event
