"""Executors by name: `DataLoader(executor="mp")`."""

from __future__ import annotations

from collections.abc import Callable

from statecore.executors._launch import ExecutorFactory, Launch
from statecore.executors._protocol import Executor

__all__ = ["BUILT_IN", "available", "resolve_executor"]


def _inline(launch: Launch) -> Executor:
    from statecore.executors._inline import InlineExecutor

    return InlineExecutor(launch)


def _mp(launch: Launch) -> Executor:
    from statecore.executors._mp import MultiprocessExecutor

    return MultiprocessExecutor(launch)


def _thread(launch: Launch) -> Executor:
    from statecore.executors._thread import ThreadExecutor

    return ThreadExecutor(launch)


# name -> (factory, loads in the calling thread?)
BUILT_IN: dict[str, tuple[ExecutorFactory, bool]] = {
    "inline": (_inline, True),
    "mp": (_mp, False),
    "thread": (_thread, False),
}


def available() -> list[str]:
    return sorted(BUILT_IN)


def resolve_executor(
    executor: str | Callable[..., Executor] | None, num_workers: int
) -> tuple[ExecutorFactory, bool]:
    """The factory for `executor`, and whether it loads in-process; errors say what to do."""
    if executor is None:
        executor = "inline" if num_workers == 0 else "mp"
    if callable(executor):
        return executor, num_workers == 0
    if not isinstance(executor, str):
        raise TypeError(
            f"executor must be a name ({', '.join(available())}) or an executor factory, "
            f"but got {executor!r}"
        )
    if executor not in BUILT_IN:
        raise ValueError(
            f"unknown executor {executor!r}; available executors: {', '.join(available())}"
        )
    factory, in_process = BUILT_IN[executor]
    if in_process and num_workers > 0:
        raise ValueError(
            f"executor={executor!r} loads in the calling thread and needs num_workers=0, but "
            f"got num_workers={num_workers}; leave executor out (or use executor='mp') to load "
            "in worker processes"
        )
    if not in_process and num_workers == 0:
        raise ValueError(
            f"executor={executor!r} loads in workers and needs num_workers > 0, but got "
            "num_workers=0; set num_workers, or use executor='inline'"
        )
    return factory, in_process
