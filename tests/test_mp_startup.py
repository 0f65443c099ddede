"""What worker processes import and inherit at start-up: start-up time is mostly imports."""

from __future__ import annotations

import os
import subprocess
import sys

import multiprocess.forkserver
import pytest
import torch
import torch.utils.data
from _processes import children

import statecore


def test_a_worker_module_imports_the_core_but_not_the_loader_facade() -> None:
    code = (
        "import sys, statecore.executors._mp.worker\n"
        "print(sorted(m for m in sys.modules if m.startswith('statecore.executors.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "statecore.executors._mp.worker" in loaded
    for facade in ("_loader", "_driver", "_registry", "_pinned"):
        assert f"statecore.executors.{facade}'" not in loaded


class ParentHasTorch(torch.utils.data.Dataset[bool]):
    """Item: whether the process that forked this worker (the fork server) had torch loaded."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> bool:
        with open(f"/proc/{os.getppid()}/maps") as maps:
            return "libtorch" in maps.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_forkserver_workers_are_forked_from_a_server_that_preloaded_torch() -> None:
    loader = statecore.DataLoader(
        ParentHasTorch(), batch_size=None, num_workers=1, multiprocessing_context="forkserver"
    )
    assert list(loader) == [True]
    preload = multiprocess.forkserver._forkserver._preload_modules
    assert "__main__" in preload  # what the server preloaded by default is kept


class WhoLoads(torch.utils.data.Dataset[int]):
    """Item: the id of the worker that loaded it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return info.id


def test_a_worker_module_has_numpy_random_before_any_worker_seeds_it() -> None:
    # Every worker seeds numpy's generator as torch's do; a forked worker that had to import
    # numpy.random first would spend over 10 ms on it before its first batch.
    code = "import sys, statecore.executors._mp.worker\nprint('numpy.random' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert loaded.strip() == "True"


@pytest.mark.timeout(120)
def test_the_first_worker_starts_with_its_first_task_and_the_others_once_the_loader_waits() -> None:
    before = children()
    loader = statecore.DataLoader(WhoLoads(), batch_size=2, num_workers=2, executor="mp")
    iterator = iter(loader)
    try:
        # Worker 0 has its tasks and is loading while the others have not been forked yet.
        assert len(children() - before) == 1
        batches = [batch.tolist() for batch in iterator]
    finally:
        del iterator
    # In order, batch k is worker k % 2's, as in torch: every worker started and loaded.
    assert batches == [[k % 2] * 2 for k in range(6)]
