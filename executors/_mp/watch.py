"""The workers' result pipes and sentinels, watched by one poll object kept across polls.

`multiprocess.connection.wait` makes a selector and registers every handle on each call: 16 to
19 us for 8 workers' 16 handles on the project's machine, against 1.5 us for a poll over a
`select.poll` object registered once. The main process polls about once a batch, so at 8 to 16
workers that is some 13 to 25 us of its CPU a batch, the consumer's CPU on a loaded machine.
`Watch` registers the handles again only when the set watched changes (a worker started,
replaced, retired or gone), which it tells by comparing the set with the one registered.
"""

from __future__ import annotations

import math
import select
from collections.abc import Hashable
from typing import Any, cast

import multiprocess.connection

__all__ = ["Watch"]

_HAS_POLL = hasattr(select, "poll")


class Watch:
    """Waits until any of the handles watched is readable (or hung up, or in error, as
    `multiprocess.connection.wait` counts them), from one thread at a time."""

    def __init__(self) -> None:
        self._watched: dict[Hashable, Any] = {}
        self._poller: Any = None
        self._by_fd: dict[int, Hashable] = {}

    def wait(self, watched: dict[Hashable, Any], timeout: float | None) -> list[Hashable]:
        """The handles of `watched` (connections or file descriptors) ready within `timeout`
        seconds (None: until one is). Equal to `multiprocess.connection.wait(list(watched),
        timeout)`, without registering the handles again while `watched` is the set it was."""
        if not _HAS_POLL:
            return list(multiprocess.connection.wait(list(watched), timeout))
        # Equal means the same handle objects (connections compare by identity) mapped to the
        # same entries (a sentinel's fd reused by a replacement comes with another process).
        if watched != self._watched:
            self._register(watched)
        if timeout is None:
            ready = self._poller.poll()
        else:
            # Rounded up, as the selectors module does: a wait never ends before its time.
            ready = self._poller.poll(math.ceil(max(0.0, timeout) * 1000))
        return [self._by_fd[fd] for fd, _ in ready]

    def _register(self, watched: dict[Hashable, Any]) -> None:
        # A fresh poll object rather than unregistering: a handle closed since the last poll
        # has no fd left to unregister by, and its number may be another's now.
        poller = select.poll()
        by_fd: dict[int, Hashable] = {}
        for handle in watched:
            fd = handle if isinstance(handle, int) else cast(Any, handle).fileno()
            poller.register(fd, select.POLLIN)
            by_fd[fd] = handle
        self._watched, self._poller, self._by_fd = dict(watched), poller, by_fd
