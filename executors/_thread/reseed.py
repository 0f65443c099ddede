"""The reseed watch: a worker thread that reseeds a process-wide generator is seen doing so.

Run in the main process. The process-wide generators (`random`, torch's default generator,
numpy's global state) are shared by every thread, so a seed set in one worker thread moves the
numbers all of them draw. The seeding functions tell the calling worker thread's executor
(`per_thread.on_reseed`) that they ran, and the executor warns, with a `ThreadReseedWarning`
once per dataset (`first_warning_for`), from its polling thread. Only the seeding functions
are watched: a dataset that does not call them pays nothing per sample.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch.random

from statecore.executors._thread.hooks import INSTALLED, per_thread

__all__ = ["ThreadReseedWarning", "first_warning_for", "install_reseed_watch"]


class ThreadReseedWarning(RuntimeWarning):
    """A worker thread reseeded a random generator that every thread of the process shares."""


def _reseeding(label: str) -> None:
    """Called by every watched seeding function before it seeds, in whatever thread."""
    report = getattr(per_thread, "on_reseed", None)
    if report is not None:
        report(label)


def install_reseed_watch() -> None:
    """Have the process-wide seeding functions tell a worker thread's executor they ran, once
    per process.

    torch's `manual_seed` and `seed` keep their identity (their code is replaced, as for
    get_worker_info): torch._dynamo and others recognise them by it. `random.seed` and
    `numpy.random.seed` are bound or compiled functions, replaced by a wrapper in their module;
    references taken before that are not watched.
    """
    with INSTALLED:
        namespace = torch.random.__dict__
        if namespace.get("_statecore_reseeding") is _reseeding:
            return
        namespace["_statecore_reseeding"] = _reseeding
        for name, parameters in (("manual_seed", "seed"), ("seed", "")):
            function = namespace[name]
            namespace[f"_statecore_{name}"] = types.FunctionType(
                function.__code__, function.__globals__, name, function.__defaults__
            )
            source = (
                f"def {name}({parameters}):\n"
                f"    _statecore_reseeding('torch.{name}')\n"
                f"    return _statecore_{name}({parameters})\n"
            )
            compiled: dict[str, Any] = {}
            exec(compile(source, "<statecore reseed watch>", "exec"), namespace, compiled)
            function.__code__ = compiled[name].__code__
        random.seed = _watching(random.seed, "random.seed")
        with contextlib.suppress(ImportError):
            import numpy.random

            numpy.random.seed = _watching(numpy.random.seed, "numpy.random.seed")


def _watching(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def seed(*args: Any, **kwargs: Any) -> Any:
        _reseeding(label)
        return function(*args, **kwargs)

    return seed


_warned: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Datasets already warned about, by id; an entry goes when its dataset does."""
_warned_lock = threading.Lock()


def first_warning_for(dataset: Any) -> bool:
    """Whether `dataset` is not warned about yet; from now on it is."""
    with _warned_lock:
        if _warned.get(id(dataset)) is dataset:
            return False
        with contextlib.suppress(TypeError):  # not weakly referenceable: warned per iterator
            _warned[id(dataset)] = dataset
        return True
