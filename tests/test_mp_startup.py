"""What worker processes import and inherit at start-up: start-up time is mostly imports."""

from __future__ import annotations

import subprocess
import sys

import multiprocess.forkserver
import pytest
import torch

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


@pytest.mark.timeout(120)
def test_forkserver_workers_are_forked_from_a_server_that_preloaded_the_worker_module() -> None:
    loader = statecore.DataLoader(
        torch.arange(4), batch_size=2, num_workers=1, multiprocessing_context="forkserver"
    )
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    preload = multiprocess.forkserver._forkserver._preload_modules
    assert "statecore.executors._mp" in preload
    assert "__main__" in preload  # what the server preloaded by default is kept
