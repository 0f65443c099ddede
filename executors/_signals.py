"""Holding back signal handlers for the few microseconds a message is half received.

Python runs a signal handler between two bytecodes of the main thread. An exception it raises
(Ctrl-C's KeyboardInterrupt) in the middle of reading a message from a pipe leaves half the
message read, and one raised just after a read drops the bytes that read returned: either way
an answer is lost and the loader waits for it in vain. While the main thread receives, the
handlers of the asynchronous signals are replaced by one that notes the signal; once the
message is stored they are put back and called for what was noted, so the exception is raised
there, where nothing is lost. Elsewhere (the waits above all) signals act at once.

The same holds for work that must not stop half done: starting a worker process (a fork whose
child nobody recorded would be left running) and shutting the workers down. A child forked
while handlers are held calls `restore_in_child` first, to get the program's own back.
"""

from __future__ import annotations

import _thread
import importlib
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

__all__ = ["HeldSignals", "is_interrupt", "restore_in_child"]

_MAIN = threading.main_thread().ident
# Every hold in force, innermost last: what a forked child must put back.
_HOLDS: list[HeldSignals] = []
# The signal module's getsignal and signal convert each handler to its Handlers enum, which
# for a Python handler means raising and catching a ValueError: 3 to 4 us a call, 18 us a
# hold. The C functions underneath take and return the same handlers (SIG_DFL and SIG_IGN as
# plain ints, which are not callable either) in well under a microsecond.
_C_SIGNAL: Any = importlib.import_module("_signal")
_getsignal: Callable[[int], Any] = _C_SIGNAL.getsignal
_setsignal: Callable[[int, Any], Any] = _C_SIGNAL.signal

# The signals that arrive at any moment and that programs commonly give Python handlers to:
# Ctrl-C, time limits, termination and job-control requests.
_ASYNCHRONOUS = tuple(
    getattr(signal, name)
    for name in (
        "SIGINT",
        "SIGTERM",
        "SIGALRM",
        "SIGVTALRM",
        "SIGPROF",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
    )
    if hasattr(signal, name)
)
# Every signal a handler may be set for, as plain ints: fixed for the life of the process.
_VALID = tuple(int(number) for number in signal.valid_signals())


class HeldSignals:
    """A context in which the asynchronous signals' Python handlers run only at its end.

    Re-entrant use is not supported. Outside the main thread no Python handler runs anyway,
    and the context does nothing.
    """

    def __init__(self) -> None:
        self.saved: dict[int, Any] = {}
        self.noted: list[tuple[int, FrameType | None]] = []

    def __enter__(self) -> HeldSignals:
        if _thread.get_ident() == _MAIN:
            for number in _ASYNCHRONOUS:
                handler = _getsignal(number)
                if callable(handler):
                    self.saved[number] = handler
                    _setsignal(number, self._note)
            _HOLDS.append(self)
        return self

    def _note(self, number: int, frame: FrameType | None) -> None:
        self.noted.append((number, frame))

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self in _HOLDS:
            _HOLDS.remove(self)
        saved, self.saved = self.saved, {}
        for number, handler in saved.items():
            _setsignal(number, handler)
        noted, self.noted = self.noted, []
        for number, frame in noted:
            handler = saved.get(number)
            if callable(handler):
                handler(number, frame)


def restore_in_child() -> None:
    """In a process just forked from a main thread that held signals: the program's handlers.

    Without this a forked worker would keep noting signals for a hold that ended only in its
    parent, and never act on SIGTERM, say.
    """
    while _HOLDS:
        hold = _HOLDS.pop()
        for number, handler in hold.saved.items():
            _setsignal(number, handler)
        hold.saved.clear()
        hold.noted.clear()


def is_interrupt(error: BaseException) -> bool:
    """Whether `error` interrupted the program rather than reporting a failure.

    KeyboardInterrupt (and any other exception that is not an `Exception`) is one; so is any
    exception raised by a Python signal handler, such as a SIGALRM-based time limit raising
    TimeoutError, which the handler's frame in the traceback gives away. Looked at only when
    something was raised, so it costs nothing per batch.
    """
    if not isinstance(error, Exception):
        return True
    # The C getsignal over plain ints (see `_getsignal`): the models' simulated executors
    # raise at every wait, so this runs thousands of times a second there. The traceback's
    # few frames first, then only handlers that are Python functions (most signals have
    # SIG_DFL, a plain int) are looked into.
    codes = set()
    trace = error.__traceback__
    while trace is not None:
        codes.add(trace.tb_frame.f_code)
        trace = trace.tb_next
    if not codes:
        return False
    for number in _VALID:
        try:
            handler = _getsignal(number)
        except (OSError, ValueError):
            continue
        if handler is None or handler.__class__ is int:
            continue
        if getattr(getattr(handler, "__func__", handler), "__code__", None) in codes:
            return True
    return False
