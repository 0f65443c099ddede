"""Interrupting the main process while it waits, and only then: shared by the interrupt tests.

A worker sends the signal once the executor's `poll` is blocked (a flag that the `watched`
executor wrapper raises around it), so that the interrupt lands in a wait, not in the test.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import multiprocess
from _processes import wait_until

from statecore import Event
from statecore.executors import Executor, Launch
from statecore.executors._registry import lookup
from statecore.models.loader import Forwarding

__all__ = [
    "WAIT",
    "TimeLimit",
    "collector_off",
    "interrupt_main_once",
    "shared_flag",
    "time_limit",
    "watched",
]

# Long enough for a loaded two-core machine; the waits end as soon as their condition holds.
WAIT = 30.0


class _Watched(Forwarding):
    """An executor whose waits the workers can see, so that they interrupt a wait only."""

    def __init__(self, inner: Executor, polling: Any) -> None:
        super().__init__(inner)
        self.polling = polling

    def poll(self, timeout: float | None) -> Event | None:
        self.polling[0] = 1
        try:
            return self.inner.poll(timeout)
        finally:
            self.polling[0] = 0


def watched(name: str, polling: Any) -> Callable[[Launch], Executor]:
    inner, _ = lookup(name)

    def factory(launch: Launch) -> Executor:
        return _Watched(inner(launch), polling)

    return factory


def interrupt_main_once(main: int, polling: Any, marker: Path, signum: int) -> None:
    """From a worker: signal the main process once it waits, the first time only.

    The worker then answers at once, so its answer may arrive in the very instant the signal
    lands: the executors' hand-off (`confirm`, see executors/_confirm.py) must lose nothing.
    """
    if marker.exists():
        return
    marker.touch()
    assert wait_until(lambda: bool(polling[0]), WAIT), "the main process never waited"
    os.kill(main, signum)


@contextmanager
def collector_off() -> Iterator[None]:
    """No automatic garbage collection while a signal may land in the main thread.

    Python runs a signal's handler wherever the main thread is, a collector's callback included
    (Hypothesis installs one to time collections), and an exception raised there, such as
    Ctrl-C's KeyboardInterrupt, is only reported as unraisable and then dropped: the test would
    see no interrupt at all. That is Python's behaviour, not the loader's, so these tests keep
    the collector off while they wait for their interrupt.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def shared_flag() -> Any:
    """[whether the main process waits in poll], shared with the workers."""
    return multiprocess.Array("q", 1, lock=False)


class TimeLimit(Exception):
    """What a SIGALRM-based time limit raises in the main thread."""


def time_limit(signum: int, frame: FrameType | None) -> None:
    """A SIGALRM handler of the kind users write: it raises TimeLimit wherever the thread is."""
    raise TimeLimit("the step took too long")
