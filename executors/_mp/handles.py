"""A worker process as torch's iterator lists it, for code written against torch's.

torch's multi-process iterator keeps its worker processes in `_workers`, and code outside torch
(its own tests among it) reads them there: `w.pid`, `w.is_alive()`, `w.join(timeout)`,
`w.exitcode`, typically after the iterator was dropped, to check that no worker outlived it.
The mp executor closes its process objects as it shuts down (their file descriptors go), and a
closed `Process` raises `ValueError` from all of those but `pid`. `WorkerProcess` answers them
after the close too: an ended process, with the exit code the executor read as it closed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["WorkerProcess"]


class WorkerProcess:
    """One worker process of the mp executor, as an item of `iter(loader)._workers`."""

    __slots__ = ("_closed", "_process", "pid")

    def __init__(self, process: Any, closed: Mapping[int, int | None]) -> None:
        """Of an open `process` (a closed one raises `ValueError`: its pid is gone)."""
        self._process = process
        self._closed = closed
        """The executor's exit codes of the processes it closed, by pid."""
        self.pid: int | None = process.pid
        """The process's id, kept once the process object is closed."""

    def of(self, process: Any) -> bool:
        """Whether this is the handle of `process`."""
        return self._process is process

    def is_alive(self) -> bool:
        try:
            alive: bool = self._process.is_alive()
        except ValueError:  # closed by the executor's shutdown, which ended it first
            return False
        return alive

    def join(self, timeout: float | None = None) -> None:
        try:
            self._process.join(timeout)
        except ValueError:
            return  # closed: joined already

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: the signal that ended it); None while it runs."""
        try:
            code: int | None = self._process.exitcode
        except ValueError:
            return None if self.pid is None else self._closed.get(self.pid)
        return code

    def __repr__(self) -> str:
        return f"<WorkerProcess pid={self.pid} alive={self.is_alive()}>"
