"""Deliberately broken executors, to show that the conformance checks can fail."""

from __future__ import annotations

import attrs

from statecore import Event, ReplaceWorker, TaskCompleted, WorkerStarted
from statecore.executors._inline import InlineExecutor
from statecore.executors._thread.executor import ThreadExecutor
from statecore.executors._worker import Mark


class Blanking(InlineExecutor):
    """A broken executor: every batch it loads arrives as None."""

    def poll(self, timeout: float | None) -> Event | None:
        event = super().poll(timeout)
        if isinstance(event, TaskCompleted):
            return attrs.evolve(event, payload=None)
        return event


class Misnumbering(ThreadExecutor):
    """A broken replacer: each replacement starts under the number after the one it was given."""

    def replace(self, command: ReplaceWorker, mark: Mark | None) -> None:
        super().replace(attrs.evolve(command, incarnation=command.incarnation + 1), mark)


class Unstamped(ThreadExecutor):
    """A broken replacer: a replacement's answers say incarnation 0, as the first worker's do."""

    def _answer(self, event: Event) -> None:
        if type(event) is not WorkerStarted and getattr(event, "incarnation", 0):
            event = attrs.evolve(event, incarnation=0)
        super()._answer(event)
