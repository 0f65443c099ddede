"""Installed names: statecore and its executors, models and tools, and nothing top-level else."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _python(code: str) -> subprocess.CompletedProcess[str]:
    # From the filesystem root, so the checkout itself is not on sys.path.
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )


@pytest.mark.parametrize(
    "name", ["statecore", "statecore.executors", "statecore.models", "statecore.tools"]
)
def test_the_package_installs_under_the_statecore_name(name: str) -> None:
    result = _python(f"import {name}")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["executors", "models", "tools"])
def test_no_generic_top_level_name_is_installed(name: str) -> None:
    result = _python(
        f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is not None)"
    )
    assert result.returncode == 0, f"an installed top-level package {name!r} would shadow users'"


def test_the_command_line_is_reachable_as_a_module() -> None:
    result = _python(
        "import runpy, sys; sys.argv = ['statecore', '--help']; "
        "runpy.run_module('statecore', run_name='__main__')"
    )
    assert result.returncode == 0, result.stderr
    assert "check" in result.stdout and "diagram" in result.stdout
