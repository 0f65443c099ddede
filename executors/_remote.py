"""Errors raised in a worker, carried to the main process as plain data and raised there again.

Torch sends a worker's exception as text and rebuilds it by calling the type with a message.
We keep more: the exception's type when the main process can import it, and the worker id,
pid, dataset index and the worker's traceback. When the consumer's turn comes, the driver raises
an exception of the original type (when one can be built from a message and says it) whose
message says where it came from. Capturing an exception never fails, however broken it is: a
worker must answer every task, and a worker that died of describing an error would take the
rest of the epoch with it.
"""

from __future__ import annotations

import pickle
import traceback

import attrs

__all__ = ["RemoteError"]


@attrs.frozen
class RemoteError:
    """A worker's exception, as data.

    Capturing never fails, whatever the exception does: an exception whose `__str__` raises,
    that cannot be pickled, or whose type the main process cannot import still arrives, as
    its type's name, the text that could be rendered and the worker's traceback.
    """

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
        message, printable = _message(error)
        story = _traceback(error)
        if not printable:
            story += f"({message})\n"  # the traceback's last line only says that str() failed
        return cls(
            type_name=_type_name(type(error)),
            message=message,
            traceback=story,
            worker=worker,
            pid=pid,
            index=index,
            where=where,
            exc_type=type(error) if _travels(type(error)) else None,
        )

    def __reduce__(self) -> tuple[object, ...]:
        # The type travels as a pickle of its own, loaded apart: a type that the worker could
        # pickle (by name) but the main process cannot import must not lose the whole error.
        kept = None
        if self.exc_type is not None and _travels(self.exc_type):
            kept = pickle.dumps(self.exc_type)
        fields = (self.type_name, self.message, self.traceback, self.worker, self.pid)
        return _rebuild, (*fields, self.index, self.where, kept)

    def describe(self) -> str:
        place = (
            "in the main process" if self.worker is None else f"in DataLoader worker {self.worker}"
        )
        if self.pid is not None and self.worker is not None:
            place += f" (pid {self.pid})"
        at = "" if self.index is None else f" at dataset index {_safe_repr(self.index)}"
        return (
            f"Caught {self.type_name} {place} {self.where}{at}.\n"
            f"Original traceback:\n{self.traceback}"
        )

    def exception(self) -> BaseException:
        """An exception of the original type where possible, carrying the whole story.

        The original type is used when an instance of it can be built from a message and says
        that message; otherwise (a type that needs other arguments, that prints something else
        or cannot print at all, or did not survive the trip) a RuntimeError names the type.
        """
        text = self.describe()
        if self.exc_type is not None:
            if issubclass(self.exc_type, KeyError):
                # KeyError quotes its message; this keeps the traceback readable (as torch does).
                text = _KeyErrorMessage(text)
            try:
                error = self.exc_type(text)
                says = str(error)
            except Exception:
                pass
            else:
                if isinstance(error, BaseException) and text in says:
                    return error
        return RuntimeError(text)


def _rebuild(
    type_name: str,
    message: str,
    traceback: str,
    worker: int | None,
    pid: int | None,
    index: object,
    where: str,
    kept: bytes | None,
) -> RemoteError:
    exc_type = None
    if kept is not None:
        try:
            loaded = pickle.loads(kept)
        except Exception:
            loaded = None  # not importable here: the type's name and the text still tell
        if isinstance(loaded, type) and issubclass(loaded, BaseException):
            exc_type = loaded
    return RemoteError(type_name, message, traceback, worker, pid, index, where, exc_type)


def _type_name(kind: type) -> str:
    try:
        return str(kind.__qualname__)
    except Exception:
        return object.__repr__(kind)


def _message(error: BaseException) -> tuple[str, bool]:
    """The exception's text, and whether it had one: its `__str__` may raise."""
    try:
        return str(error), True
    except Exception as failure:
        return f"str() of the {_type_name(type(error))} raised {_failure(failure)}", False


def _traceback(error: BaseException) -> str:
    """The worker's traceback as text, as much of it as can be rendered."""
    try:
        return "".join(traceback.format_exception(error))
    except Exception as failure:
        reason = f"(the rest of the traceback could not be rendered: {_failure(failure)})"
    try:
        frames = "".join(traceback.format_tb(error.__traceback__))
    except Exception:
        frames = ""
    return (
        f"Traceback (most recent call last):\n{frames}"
        f"{_type_name(type(error))}: {_message(error)[0]}\n{reason}\n"
    )


def _failure(failure: BaseException) -> str:
    """What went wrong while describing an exception, told without trusting `failure` either."""
    try:
        return f"{_type_name(type(failure))}: {failure}"
    except Exception:
        return _type_name(type(failure))


def _safe_repr(value: object) -> str:
    try:
        return repr(value)
    except Exception as failure:
        return f"<repr() of a {_type_name(type(value))} raised {_failure(failure)}>"


def _travels(kind: type) -> bool:
    """Whether the type pickles by reference: a type defined in a function, or made by dill
    from its definition, does not exist in the main process."""
    try:
        return pickle.loads(pickle.dumps(kind)) is kind
    except Exception:
        return False


class _KeyErrorMessage(str):
    """A string whose repr is itself, so KeyError prints the message as written."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)
