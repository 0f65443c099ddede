"""Answers handed from worker threads to the polling thread, so that an interrupt loses none.

A `queue.Queue.get()` returns the item it removed; Ctrl-C landing just as it returns drops the
item with the return value. Here other threads append, and the poller only waits and reads:
the answer stays in the list until the executor has kept it until confirmed (see `_confirm`),
and removes it then, with no call in between.

The poller sleeps on a lock that the threads which append release, a signal that at most one
answer's worth of wake-up is pending. Lock and deque are the interpreter's own C code: the
hand-over costs the poller one call a batch, where an `Event` (a condition variable written in
Python) cost it some twenty, each run with caches the loading threads have just emptied, and
the appending thread one call rather than six.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["SLICE", "Handoff"]

T = TypeVar("T")

SLICE = 0.05
"""Seconds the poller sleeps at a time before it asks again whether an answer may still come:
how late a wait with nothing left to produce it notices."""


class Handoff(Generic[T]):
    """A list of answers that other threads append to and one polling thread takes from."""

    def __init__(self) -> None:
        self.items: collections.deque[T] = collections.deque()
        self.signal = threading.Lock()
        """Held while no wake-up is pending: `put` releases it, the poller takes it to sleep."""
        self.signal.acquire()

    def put(self, item: T) -> None:
        """From any thread."""
        self.items.append(item)
        signal = self.signal
        if signal.locked():
            # Not contextlib.suppress: a context manager costs the calls this module saves.
            try:  # noqa: SIM105
                signal.release()
            except RuntimeError:  # another thread released it between the test and here
                pass

    def wait(self, timeout: float | None, producing: Callable[[], bool] = lambda: True) -> bool:
        """Whether an answer is there within `timeout` seconds (None: no limit), while
        `producing()` says that one may still come (asked every `SLICE` seconds of waiting).
        Interruptible; takes nothing."""
        items = self.items
        if items:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        acquire = self.signal.acquire
        while not items:
            left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
            # A wake-up still pending from an answer taken without waiting returns at once;
            # the loop then sleeps again.
            if left > 0 and acquire(True, left):
                continue
            if items or not producing():
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
        return bool(items)

    def clear(self) -> None:
        self.items.clear()
