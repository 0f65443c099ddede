"""Errors raised in a worker, carried to the main process as plain data and raised there again.

Torch sends a worker's exception as text and rebuilds it by calling the type with a message.
We keep more: the exception itself when it pickles, and the worker id, pid, dataset index and
the worker's traceback. When the consumer's turn comes, the driver raises an exception of the
original type (when it can be built from a message) whose message says where it came from.
"""

from __future__ import annotations

import pickle
import traceback

import attrs

__all__ = ["RemoteError"]


@attrs.frozen
class RemoteError:
    """A worker's exception, as data."""

    type_name: str
    message: str
    traceback: str
    worker: int | None
    pid: int | None
    index: object = attrs.field(default=None, hash=False)
    where: str = "while loading"
    exc_type: type[BaseException] | None = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def capture(
        cls,
        error: BaseException,
        *,
        worker: int | None,
        pid: int | None,
        index: object,
        where: str = "while loading",
    ) -> RemoteError:
        """Record `error`, which is being handled now, with where it happened."""
        exc_type: type[BaseException] | None = type(error)
        try:
            # A class defined in user code may not exist in the main process; keep only a type
            # that survives the trip.
            pickle.loads(pickle.dumps(exc_type))
        except Exception:
            exc_type = None
        return cls(
            type_name=type(error).__qualname__,
            message=str(error),
            traceback="".join(traceback.format_exception(error)),
            worker=worker,
            pid=pid,
            index=index,
            where=where,
            exc_type=exc_type,
        )

    def describe(self) -> str:
        place = (
            "in the main process" if self.worker is None else f"in DataLoader worker {self.worker}"
        )
        if self.pid is not None and self.worker is not None:
            place += f" (pid {self.pid})"
        at = "" if self.index is None else f" at dataset index {self.index!r}"
        return (
            f"Caught {self.type_name} {place} {self.where}{at}.\n"
            f"Original traceback:\n{self.traceback}"
        )

    def exception(self) -> BaseException:
        """An exception of the original type where possible, carrying the whole story."""
        text = self.describe()
        if self.exc_type is not None:
            if issubclass(self.exc_type, KeyError):
                # KeyError quotes its message; this keeps the traceback readable (as torch does).
                text = _KeyErrorMessage(text)
            try:
                error = self.exc_type(text)
            except Exception:
                error = None
            if isinstance(error, BaseException):
                return error
        return RuntimeError(text)


class _KeyErrorMessage(str):
    """A string whose repr is itself, so KeyError prints the message as written."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)
