"""Executors by name: `DataLoader(executor="mp")`.

The built-in names are "inline", "mp", "thread" and "pinned" (the pin-memory stage over the
executor num_workers would choose: "inline" or "mp"). Other packages add executors through the
entry-point group `statecore.executors`: each entry point names an executor factory, a callable
taking a `Launch` and returning an `Executor`. A factory with a true `in_process` attribute loads
in the calling thread and takes `num_workers=0`; any other takes `num_workers > 0`.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

import attrs

from statecore.executors._launch import ExecutorFactory, Launch
from statecore.executors._pinned import Pinned
from statecore.executors._protocol import Executor

__all__ = [
    "BUILT_IN",
    "ENTRY_POINT_GROUP",
    "PINNED",
    "available",
    "loads_in_process",
    "lookup",
    "resolve_executor",
]

ENTRY_POINT_GROUP = "statecore.executors"
# Not in BUILT_IN: whether it loads in the calling thread depends on what it wraps.
PINNED = "pinned"


def _inline(launch: Launch) -> Executor:
    from statecore.executors._inline import InlineExecutor

    return InlineExecutor(launch)


def _mp(launch: Launch) -> Executor:
    from statecore.executors._mp import MultiprocessExecutor

    return MultiprocessExecutor(launch)


def _thread(launch: Launch) -> Executor:
    from statecore.executors._thread import ThreadExecutor

    return ThreadExecutor(launch)


# Their poll only reads pipes or a queue, safe beside dispatch from another thread: the pin
# stage may poll them from a thread of its own.
_mp.poll_from_any_thread = True  # type: ignore[attr-defined]
_thread.poll_from_any_thread = True  # type: ignore[attr-defined]


# name -> (factory, loads in the calling thread?)
BUILT_IN: dict[str, tuple[ExecutorFactory, bool]] = {
    "inline": (_inline, True),
    "mp": (_mp, False),
    "thread": (_thread, False),
}


def _plugins() -> dict[str, EntryPoint]:
    return {
        point.name: point
        for point in entry_points(group=ENTRY_POINT_GROUP)
        # a plug-in cannot shadow a built-in name
        if point.name not in BUILT_IN and point.name != PINNED
    }


def available() -> list[str]:
    """Every executor name: the built-ins and those other packages registered."""
    return sorted({*BUILT_IN, PINNED, *_plugins()})


def lookup(name: str) -> tuple[ExecutorFactory, bool]:
    """The factory registered as `name`, and whether it loads in the calling thread.

    "pinned" is not looked up here: it takes its inner executor from num_workers, so only
    `resolve_executor` can resolve it.
    """
    if name in BUILT_IN:
        return BUILT_IN[name]
    point = _plugins().get(name)
    if point is None:
        raise ValueError(
            f"unknown executor {name!r}; available executors: {', '.join(available())}"
        )
    factory = point.load()
    if not callable(factory):
        raise TypeError(
            f"the executor {name!r} registered by {point.value!r} is not a callable factory"
        )
    return factory, bool(getattr(factory, "in_process", False))


def loads_in_process(executor: str | ExecutorFactory | None) -> bool:
    """Whether `executor` loads in the calling thread, so takes num_workers=0.

    A name asks the registry ("pinned" wraps "mp" unless told otherwise); a factory answers with
    its `in_process` attribute, and one without it starts workers.
    """
    if isinstance(executor, Pinned):
        return executor.in_process or (
            executor.inner is not None and loads_in_process(executor.inner)
        )
    if executor is None or executor == PINNED:
        return False
    if isinstance(executor, str):
        return lookup(executor)[1]
    return bool(getattr(executor, "in_process", False))


def resolve_executor(
    executor: str | Callable[..., Executor] | None, num_workers: int
) -> tuple[ExecutorFactory, bool]:
    """The factory for `executor`, and whether it loads in-process; errors say what to do."""
    if executor is None:
        executor = "inline" if num_workers == 0 else "mp"
    if executor == PINNED:
        executor = Pinned()
    if isinstance(executor, Pinned):
        if isinstance(executor.inner, Pinned) or executor.inner == PINNED:
            raise ValueError("the pinned executor cannot wrap another pinned executor")
        inner, in_process = resolve_executor(executor.inner, num_workers)
        return attrs.evolve(executor, inner=inner, in_process=in_process), in_process
    if callable(executor):
        return executor, bool(getattr(executor, "in_process", num_workers == 0))
    if not isinstance(executor, str):
        raise TypeError(
            f"executor must be a name ({', '.join(available())}) or an executor factory, "
            f"but got {executor!r}"
        )
    factory, in_process = lookup(executor)
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
