"""Memory a process keeps for a while after the workers that used it are gone.

Both executors that collate into memory of their own keep it from one set of workers to the
next: worker processes their shared buffers (`_mp.leases.Kept`), worker threads their
storages (`_thread.storages.Shelf`). The next workers (a non-persistent loader's next epoch, a
later loader) take from what is kept before they make new memory, whose pages would cost
their first batches a fault each. What the two share is here: the bounds, a lock any thread
may take, the expiry once nothing was taken for a while, and what a forked child does with
its copies. What may be kept, and what is taken, stays with each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["KEPT_BYTES", "KEPT_IDLE", "KEPT_ITEMS", "Keeping"]

T = TypeVar("T")

KEPT_ITEMS = 32
KEPT_BYTES = 1 << 30
KEPT_IDLE = 30.0


class Keeping(Generic[T]):
    """What one process keeps: at most `most` items and `most_bytes` bytes, all let go once
    nothing was taken for `idle` seconds. Every method may be called from any thread."""

    def __init__(self, size: Callable[[T], int], timer_name: str) -> None:
        self.lock = threading.Lock()
        self.items: list[T] = []
        """Least recently kept first."""
        self.timer: threading.Timer | None = None
        self.most = KEPT_ITEMS
        self.most_bytes = KEPT_BYTES
        self.idle = KEPT_IDLE
        self._size = size
        self._timer_name = timer_name

    def __len__(self) -> int:
        with self.lock:
            return len(self.items)

    def held(self) -> int:
        """Bytes of what is kept."""
        with self.lock:
            return self._held()

    def release(self) -> None:
        """Let go of everything kept, now."""
        with self.lock:
            released, self.items = self.items, []
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
        del released  # outside the lock: finalizers (an unmapping) run here

    def forget_in_child(self) -> None:
        """In a process just forked from this one: let go of its copies of what is kept, which
        it would otherwise hold for as long as it lives, after this process let them go. What a
        worker adopts was taken out before the fork, and stays. The parent's lock may have been
        held by another of its threads as it forked: the child takes a fresh one rather than
        wait for it."""
        self.lock = threading.Lock()
        self.timer = None  # the parent's timer thread is not the child's
        released, self.items = self.items, []
        del released

    def _held(self) -> int:
        return sum(self._size(item) for item in self.items)

    def _fits(self, item: T, held: int) -> bool:
        """Whether `item` may join what is kept, `held` bytes of it. With the lock held."""
        return len(self.items) < self.most and held + self._size(item) <= self.most_bytes

    def _rearm(self) -> None:
        """Let go of everything `idle` seconds from now, unless some is taken first. With the
        lock held."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.items:
            self.timer = threading.Timer(self.idle, self._expire)
            self.timer.name = self._timer_name
            self.timer.daemon = True
            self.timer.start()

    def _expire(self) -> None:
        with self.lock:
            if threading.current_thread() is not self.timer:
                return  # re-armed meanwhile: the newer timer decides
            released, self.items, self.timer = self.items, [], None
        del released
