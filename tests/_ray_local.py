"""A local Ray instance for the Ray executor's tests, and what they ask of Ray's bookkeeping.

One Ray instance serves every test that asks for it (a fixture named `cluster` or
`ray_cluster`, from `local_cluster`) in a row: the first starts it, and it is shut down after
the last, before a test that does not ask for it (`shut_down_unless_wanted`, called by
tests/conftest.py after each test). Starting one takes seconds (tens on a loaded two-core
machine), and the Ray tests follow one another (their files are named test_ray_*), so the
default tier starts one instance, not one per module. See tests/test_ray_executor.py's
docstring for why it is shut down before other tests. The actors' processes import the test
modules to unpickle their datasets, so the instance puts the tests' folder on their PYTHONPATH.
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


FIXTURES = frozenset({"cluster", "ray_cluster"})
"""The names of the fixtures made from `local_cluster`: a test that asks for one wants Ray."""

_started: list[Any] = []
"""The Ray instance `local_cluster` started and that still runs (Ray's module), if any."""


def local_cluster() -> Iterator[Any]:
    """A local Ray instance with 2 CPUs, started unless the one this started runs already; a
    module's fixture: `cluster = pytest.fixture(name="cluster")(local_cluster)`. It stays up
    for the next test: `shut_down_unless_wanted` ends it."""
    if not (_started and ray.is_initialized()):
        if ray.is_initialized():
            ray.shutdown()  # someone else's connection: this one needs its own settings
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}},
        )
        _started[:] = [ray]
    yield ray


def shut_down_unless_wanted(nextitem: pytest.Item | None) -> None:
    """Shut the instance down unless the next test asks for it too (see the module's
    docstring); so, too, a connection that a test's loader opened on its own."""
    if nextitem is not None and FIXTURES & set(getattr(nextitem, "fixturenames", ())):
        return
    _started.clear()
    if ray.is_initialized():
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
