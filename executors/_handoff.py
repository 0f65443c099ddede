"""Answers handed from worker threads to the polling thread, so that an interrupt loses none.

A `queue.Queue.get()` returns the item it removed; Ctrl-C landing just as it returns drops the
item with the return value. Here other threads append, and the poller only waits and reads:
the answer stays in the list until the executor has kept it until confirmed (see `_confirm`),
and removes it then, with no call in between.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Handoff"]

T = TypeVar("T")


class Handoff(Generic[T]):
    """A list of answers that other threads append to and one polling thread takes from."""

    def __init__(self) -> None:
        self.items: collections.deque[T] = collections.deque()
        self.arrived = threading.Event()

    def put(self, item: T) -> None:
        """From any thread."""
        self.items.append(item)
        self.arrived.set()

    def wait(self, timeout: float | None, producing: Callable[[], bool] = lambda: True) -> bool:
        """Whether an answer is there within `timeout` seconds (None: no limit), while
        `producing()` says that one may still come. Interruptible; takes nothing."""
        items = self.items
        deadline = None if timeout is None else time.monotonic() + timeout
        while not items:
            if not producing():
                return bool(items)
            self.arrived.clear()
            if items:  # arrived between the test and the clear
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.arrived.wait(left):
                return bool(items)
        return True

    def clear(self) -> None:
        self.items.clear()
