"""The Ray executor where no local Ray instance runs in this process: an unreachable cluster,
and naming the executor without importing Ray. Each runs a fresh interpreter.

Apart from tests/test_ray_executor.py, whose tests all share the local instance
(tests/_ray_local.py): these two ask for none, so between the Ray tests they would shut it
down, and the next Ray test would start another. Named to run after the other Ray modules.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("ray")


@pytest.mark.timeout(120)
def test_an_unreachable_cluster_gets_a_clear_error_not_a_hang() -> None:
    # A fresh interpreter, not connected to the tests' local instance. Nothing listens on the port
    # (bound, then closed): Ray alone would retry connecting to it for two minutes.
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
    script = (
        "import torch, statecore\n"
        "from statecore.executors import RayUnavailableError\n"
        "loader = statecore.DataLoader(list(range(4)), num_workers=1, executor='ray')\n"
        "try:\n"
        "    next(iter(loader))\n"
        "except RayUnavailableError as error:\n"
        "    print('REFUSED', error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert "REFUSED" in result.stdout, result.stderr[-2000:]
    assert f"127.0.0.1:{port}" in result.stdout
    assert "ray start --head" in result.stdout


@pytest.mark.timeout(60)
def test_importing_statecore_and_naming_the_executor_does_not_import_ray() -> None:
    script = (
        "import sys, statecore, statecore.executors\n"
        "from statecore.executors._registry import lookup\n"
        "lookup('ray'); statecore.executors.ray(num_cpus=1)\n"
        "assert 'ray' in statecore.executors.available()\n"
        "print('ray' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.strip() == "False"
