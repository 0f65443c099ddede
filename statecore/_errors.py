"""The error family. Each class says who caused the trouble.

- `MisuseError`: the consumer used the loader in a way its state does not allow.
- `ClosedError`: the consumer used the loader after closing it (a kind of misuse).
- `ExecutorError`: an executor or driver reported something impossible, such as an answer to a
  task that was never sent. This is a bug in that executor, not in the user's code.
- `WorkerDiedError`, `LoaderTimeoutError`, `LoaderCancelledError`: the loader failed for a
  reason outside anybody's control flow; they are RuntimeErrors, as in torch.
- `InternalError`: a bug in statecore itself.

Every class survives a pickle round trip, because errors cross process boundaries.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClosedError",
    "ExecutorError",
    "InternalError",
    "LoaderCancelledError",
    "LoaderTimeoutError",
    "MisuseError",
    "ProtocolError",
    "StatecoreError",
    "WorkerDiedError",
]


class StatecoreError(Exception):
    """Base of every error statecore raises."""


class ProtocolError(StatecoreError):
    """An event that the scheduler cannot accept in its current state.

    The scheduler's state is left as it was: the caller still holds the old state.
    """

    def __init__(self, phase: object, event: object, reason: str) -> None:
        self.phase = phase
        self.event = event
        self.reason = reason
        super().__init__(f"{event!r} is not allowed in phase {phase!r}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.phase, self.event, self.reason))


class MisuseError(ProtocolError):
    """The consumer asked for something the loader's state does not allow."""


class ClosedError(MisuseError):
    """The loader was used after it was closed."""


class ExecutorError(ProtocolError):
    """An executor or driver reported something impossible; a bug in that executor."""


class InternalError(StatecoreError):
    """statecore broke one of its own rules. Please report it with the message."""


class WorkerDiedError(StatecoreError, RuntimeError):
    """A worker ended without being told to."""

    def __init__(
        self,
        message: str,
        worker: int | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
    ) -> None:
        self.worker = worker
        self.pid = pid
        self.exitcode = exitcode
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.worker, self.pid, self.exitcode))


class WorkerHungError(StatecoreError, RuntimeError):
    """A worker gave no answer within the loader's `worker_timeout` while the consumer waited,
    and could not be replaced. The message shows where its Python stack was stuck."""

    def __init__(
        self,
        message: str,
        worker: int | None = None,
        pid: int | None = None,
        stack: str | None = None,
    ) -> None:
        self.worker = worker
        self.pid = pid
        self.stack = stack
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.worker, self.pid, self.stack))


class LoaderTimeoutError(StatecoreError, RuntimeError):
    """No batch came within the loader's timeout."""


class LoaderCancelledError(StatecoreError, RuntimeError):
    """The loader was closed while a consumer waited for a batch."""


class WorkerRestartedWarning(UserWarning):
    """A lost worker (dead, or stuck) was replaced and its batches sent again: the epoch goes
    on, nothing lost or repeated (`DataLoader(worker_restarts=N)`)."""
