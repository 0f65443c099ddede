"""What a spawned worker imports: only the modules a worker runs, since each costs start-up time.

Checked from inside a real spawned worker: the dataset's items are the names of the modules
that worker has loaded. This module imports nothing of statecore but its core, so that what it
brings into the worker (the worker imports it to unpickle the dataset) is no more than a
user's dataset module would bring.
"""

from __future__ import annotations

import sys

import pytest
from torch.utils.data import Dataset

import statecore

WORKER_SIDE = {
    "statecore.executors",
    "statecore.executors._incarnation",
    "statecore.executors._lazy",
    "statecore.executors._mp",
    "statecore.executors._mp.pool",
    "statecore.executors._mp.stacks",
    "statecore.executors._mp.wire",
    "statecore.executors._mp.worker",
    "statecore.executors._remote",
    "statecore.executors._seeding",
    "statecore.executors._signals",
    "statecore.executors._startup",
    "statecore.executors._timing",
    "statecore.executors._worker",
}
"""The executors' modules a worker process runs (`_incarnation`: a replacement sets itself up
as the worker it replaces; `_seeding`: a batch seeded per batch is seeded there). Not among
them: the main process's side of the mp executor (`executor`, `leases`, `taskpipe`,
`descriptors`), the loader facade, the driver, the registry, the other executors."""

NEVER = ("statecore.models", "statecore.tools", "hypothesis")
"""Packages no worker runs any of."""


class LoadedModules(Dataset[list[str]]):
    """Item: the names of the modules loaded in the worker process that loads it."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> list[str]:
        return sorted(sys.modules)


@pytest.fixture(scope="module")
def in_a_spawned_worker() -> set[str]:
    loader = statecore.DataLoader(
        LoadedModules(),
        batch_size=None,
        num_workers=1,
        executor="mp",
        multiprocessing_context="spawn",
    )
    (loaded,) = list(loader)
    return set(loaded)


@pytest.mark.timeout(180)
def test_a_spawned_worker_imports_of_the_executors_only_what_a_worker_runs(
    in_a_spawned_worker: set[str],
) -> None:
    executors = {name for name in in_a_spawned_worker if name.startswith("statecore.executors")}
    assert "statecore.executors._mp.worker" in executors
    assert executors <= WORKER_SIDE, sorted(executors - WORKER_SIDE)


@pytest.mark.timeout(180)
def test_a_spawned_worker_imports_no_model_tool_or_hypothesis(
    in_a_spawned_worker: set[str],
) -> None:
    unneeded = sorted(name for name in in_a_spawned_worker if name.startswith(NEVER))
    assert unneeded == []


def test_the_parents_side_of_the_mp_executor_is_still_reachable_from_its_package() -> None:
    # The package's names load on first use, from the module that defines each.
    from statecore.executors import _mp

    assert _mp.MultiprocessExecutor.__module__ == "statecore.executors._mp.executor"
    assert _mp.BufferReceiver.__module__ == "statecore.executors._mp.leases"
    assert set(_mp.__all__) <= set(dir(_mp))
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _mp.Nothing  # noqa: B018
