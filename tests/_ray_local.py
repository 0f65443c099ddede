"""A local Ray instance for the Ray executor's tests, and what they ask of Ray's bookkeeping.

One Ray instance serves a whole test module (its fixture `cluster`, from `local_cluster`),
started by the first test that needs it and shut down when the module ends: see
tests/test_ray_executor.py's docstring for why it is shut down. The actors' processes import
the test modules to unpickle their datasets, so the fixture puts the tests' folder on their
PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

TESTS = Path(__file__).resolve().parent
WORKER = "_Worker"
"""The class name of statecore's actors, as Ray's state lists it."""
SETTLED_WITHIN = 30.0
"""Bounded wait for Ray's own bookkeeping (the GCS's actor table) to reach a state."""


def local_cluster() -> Iterator[Any]:
    """A local Ray instance with 2 CPUs, shut down when the generator ends; a module's
    fixture: `cluster = pytest.fixture(scope="module", name="cluster")(local_cluster)`."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def live_actors() -> list[dict[str, Any]]:
    """statecore's actors that Ray's control store does not list as dead.

    `ray.util.state.list_actors` needs Ray's dashboard, which this instance runs without; the
    control store's actor table (`ray._private.state.actors`) is what it reads underneath.
    """
    table = ray._private.state.actors()
    return [
        actor
        for actor in table.values()
        if actor["ActorClassName"] == WORKER and actor["State"] != "DEAD"
    ]


def owned_references() -> set[Any]:
    """The object references this process holds or owns, as Ray's reference table has them."""
    worker = ray._private.worker.global_worker
    return set(worker.core_worker.get_all_reference_counts())


def settles(condition: Any) -> bool:
    """Whether `condition()` holds within SETTLED_WITHIN, looking again every 20 ms: Ray
    records deaths asynchronously, so this bounds a wait, it does not guess one."""
    deadline = time.monotonic() + SETTLED_WITHIN
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
