"""The imperative shell: the DataLoader facade, the driver loop and the executors.

Installed as `statecore.executors`. Executors carry out the scheduler's commands and report
what their workers did; they decide nothing.

The names below load on first use: a worker process imports only the modules it runs (for a
spawned worker, every module imported is start-up time), not the loader facade around them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statecore.executors._lazy import lazy_names

if TYPE_CHECKING:
    from statecore.executors._confirm import Confirming
    from statecore.executors._driver import Driver, failure_exception
    from statecore.executors._elastic import merge_state_dicts
    from statecore.executors._loader import DataLoader
    from statecore.executors._observe.trace import LoaderCounters, LoaderStats, Trace
    from statecore.executors._permutation import PermutationSampler
    from statecore.executors._pinned import Pinned, PinnedExecutor, pinned
    from statecore.executors._protocol import (
        Capabilities,
        Declared,
        Executor,
        ExecutorFactory,
        Launch,
        capabilities_of,
    )
    from statecore.executors._ray import RayOptions, RayUnavailableError, ray
    from statecore.executors._registry import ENTRY_POINT_GROUP, available, runnable
    from statecore.executors._remote import RemoteError
    from statecore.executors._shared_sequence import SharedSequence
    from statecore.executors._startup import as_worker, get_worker_info
    from statecore.executors._worker import WorkerRuntime, WorkerSetup

_WHERE = {
    "ENTRY_POINT_GROUP": "_registry",
    "Capabilities": "_protocol",
    "Confirming": "_confirm",
    "DataLoader": "_loader",
    "Declared": "_protocol",
    "Driver": "_driver",
    "Executor": "_protocol",
    "ExecutorFactory": "_protocol",
    "Launch": "_protocol",
    "LoaderCounters": "_observe.trace",
    "LoaderStats": "_observe.trace",
    "PermutationSampler": "_permutation",
    "Pinned": "_pinned",
    "PinnedExecutor": "_pinned",
    "RayOptions": "_ray",
    "RayUnavailableError": "_ray",
    "RemoteError": "_remote",
    "SharedSequence": "_shared_sequence",
    "Trace": "_observe.trace",
    "WorkerRuntime": "_worker",
    "WorkerSetup": "_worker",
    "as_worker": "_startup",
    "available": "_registry",
    "capabilities_of": "_protocol",
    "failure_exception": "_driver",
    "get_worker_info": "_startup",
    "merge_state_dicts": "_elastic",
    "pinned": "_pinned",
    "ray": "_ray",
    "runnable": "_registry",
    # Not public: statecore's import hook calls it once accelerate is imported (frameworks.py).
    "keep_statecore_under_accelerate": "frameworks",
}

__all__ = [
    "ENTRY_POINT_GROUP",
    "Capabilities",
    "Confirming",
    "DataLoader",
    "Declared",
    "Driver",
    "Executor",
    "ExecutorFactory",
    "Launch",
    "LoaderCounters",
    "LoaderStats",
    "PermutationSampler",
    "Pinned",
    "PinnedExecutor",
    "RayOptions",
    "RayUnavailableError",
    "RemoteError",
    "SharedSequence",
    "Trace",
    "WorkerRuntime",
    "WorkerSetup",
    "as_worker",
    "available",
    "capabilities_of",
    "failure_exception",
    "get_worker_info",
    "merge_state_dicts",
    "pinned",
    "ray",
    "runnable",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
