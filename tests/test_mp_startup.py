"""What worker processes import and inherit at start-up: start-up time is mostly imports."""

from __future__ import annotations

import os
import subprocess
import sys

import multiprocess.forkserver
import pytest
import torch
import torch.utils.data

import statecore


def test_a_worker_module_imports_the_core_but_not_the_loader_facade() -> None:
    code = (
        "import sys, statecore.executors._mp\n"
        "print(sorted(m for m in sys.modules if m.startswith('statecore.executors.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "statecore.executors._mp" in loaded
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
