"""Executors by name, and what `num_workers` means for the one chosen: `resolve_executor`.

The built-in names are "inline", "mp", "thread", "ray" (Ray actors, see `_ray`) and "pinned"
(the pin-memory stage over the executor num_workers would choose: "inline" or "mp"). Other
packages add executors through the entry-point group `statecore.executors`: each entry point
names an executor factory, a callable taking a `Launch` and returning an `Executor`. What an
executor loads with comes from what it declares (`Capabilities`, read by `capabilities_of`):
one that declares `in_process` loads in the calling thread and takes `num_workers=0`; any other
takes `num_workers > 0`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

import attrs

from statecore.executors._pinned import Pinned
from statecore.executors._protocol import (
    Capabilities,
    Declared,
    Executor,
    ExecutorFactory,
    Launch,
    capabilities_of,
)

__all__ = [
    "BUILT_IN",
    "ENTRY_POINT_GROUP",
    "NEEDS",
    "PINNED",
    "Missing",
    "available",
    "missing",
    "runnable",
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
    from statecore.executors._thread.executor import ThreadExecutor

    return ThreadExecutor(launch)


def _ray(launch: Launch) -> Executor:
    from statecore.executors._ray import RayExecutor

    return RayExecutor(launch)


def _built_in(make: ExecutorFactory, capabilities: Capabilities) -> tuple[ExecutorFactory, bool]:
    return Declared(make, capabilities), capabilities.in_process


# Each imports its executor when it first makes one: choosing an executor imports none, and the
# mp executor's modules (which teach multiprocess's pickler torch's reductions) load only for a
# loader that starts workers. mp and thread only read pipes or a hand-off in `poll`, safe beside
# `dispatch` from another thread: the pin stage may poll them from a thread of its own. Their
# classes declare `confirms_answers` themselves; subclasses (tests, plug-ins) passed as
# factories promise nothing more than they declare.
BUILT_IN: dict[str, tuple[ExecutorFactory, bool]] = {
    "inline": _built_in(_inline, Capabilities(in_process=True)),
    "mp": _built_in(
        _mp,
        Capabilities(poll_from_any_thread=True, replaces_workers=True, kills_stuck_workers=True),
    ),
    "thread": _built_in(_thread, Capabilities(poll_from_any_thread=True, replaces_workers=True)),
    # Ray is imported when a loader starts its actors, not when the name is looked up.
    "ray": _built_in(
        _ray, Capabilities(confirms_answers=True, replaces_workers=True, kills_stuck_workers=True)
    ),
}
"""name -> (factory, whether it loads in the calling thread, as the factory declares)."""


@attrs.frozen
class Missing:
    """Why an executor cannot run here: the package it needs, and how to install it."""

    name: str
    package: str
    install: str

    def __str__(self) -> str:
        return f"{self.name}: skipped, {self.install}"


NEEDS: dict[str, tuple[str, str]] = {"ray": ("ray", "pip install -e '.[ray]'")}
"""name -> (the package a built-in executor imports when it starts, the command that installs
it: the optional extra of pyproject.toml that brings it)."""


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


def missing(name: str) -> Missing | None:
    """Why the executor `name` cannot run here (its optional package is not installed), or None.

    Asks whether the package can be found, without importing it: Ray takes seconds to import.
    A plug-in is runnable when its entry point loads.
    """
    if name in NEEDS:
        package, install = NEEDS[name]
        spec = importlib.util.find_spec(package)
        # A folder of that name is found as a namespace package when the package is not there:
        # Ray's own session folder, /tmp/ray, for a program run from /tmp. It is not the package.
        if spec is None or spec.origin in (None, "namespace"):
            return Missing(name, package, install)
        return None
    point = _plugins().get(name)
    if point is not None:
        try:
            point.load()
        except ImportError as error:
            package = error.name or point.value
            return Missing(name, package, f"its package failed to import ({error})")
    return None


def runnable() -> tuple[list[str], list[Missing]]:
    """The executors that can run here, and why each of the others cannot.

    `available()` names every executor; one whose optional package is missing still raises
    its own clear error when chosen. Programs that try every executor (`demo`) run these.
    """
    ready: list[str] = []
    skipped: list[Missing] = []
    for name in available():
        why = missing(name)
        if why is None:
            ready.append(name)
        else:
            skipped.append(why)
    return ready, skipped


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
    return factory, capabilities_of(factory).in_process


def loads_in_process(executor: str | ExecutorFactory | None) -> bool:
    """Whether `executor` declares that it loads in the calling thread, so takes num_workers=0.

    A name asks the registry ("pinned" and None choose "mp" unless told otherwise); a factory
    answers with what it declares (`Capabilities.in_process`).
    """
    if isinstance(executor, Pinned):
        return executor.in_process or (
            executor.inner is not None and loads_in_process(executor.inner)
        )
    if executor is None or executor == PINNED:
        return False
    if isinstance(executor, str):
        return lookup(executor)[1]
    return capabilities_of(executor).in_process


def resolve_executor(
    executor: str | Callable[..., Executor] | None, num_workers: int
) -> tuple[ExecutorFactory, bool]:
    """The factory for `executor`, and whether it loads in-process; errors say what to do.

    The one place that decides what `num_workers` means for an executor:

    - left out, `num_workers=0` chooses "inline" and any other "mp", as torch does;
    - an executor that declares `in_process` takes `num_workers=0` only, and loads in the
      calling thread as one worker;
    - a named executor that does not takes `num_workers > 0`, one worker per `num_workers`;
    - a factory passed as it is that does not declare `in_process` follows `num_workers`: with
      0 it is given one worker and loads as in-process loading does (no timeout, each batch
      loaded when asked for), otherwise it is given `num_workers` workers;
    - the pin-memory stage resolves what it wraps by these same rules.
    """
    if executor is None:
        executor = "inline" if num_workers == 0 else "mp"
    if executor == PINNED:
        executor = Pinned()
    if isinstance(executor, Pinned):
        if isinstance(executor.inner, Pinned) or executor.inner == PINNED:
            raise ValueError("the pinned executor cannot wrap another pinned executor")
        inner, in_process = resolve_executor(executor.inner, num_workers)
        return attrs.evolve(executor, inner=inner, in_process=in_process), in_process
    if isinstance(executor, str):
        factory, in_process = lookup(executor)
        named = repr(executor)
    elif callable(executor):
        factory, in_process = executor, loads_in_process(executor)
        named = getattr(executor, "__qualname__", None) or repr(executor)
    else:
        raise TypeError(
            f"executor must be a name ({', '.join(available())}) or an executor factory, "
            f"but got {executor!r}"
        )
    if in_process and num_workers > 0:
        raise ValueError(
            f"executor={named} loads in the calling thread and needs num_workers=0, but "
            f"got num_workers={num_workers}; leave executor out (or use executor='mp') to load "
            "in worker processes"
        )
    if num_workers == 0 and not in_process:
        if not isinstance(executor, str):
            return factory, True  # it follows num_workers: one worker, loading in-process
        raise ValueError(
            f"executor={named} loads in workers and needs num_workers > 0, but got "
            "num_workers=0; set num_workers, or use executor='inline'"
        )
    return factory, in_process
