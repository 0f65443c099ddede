"""Executors whose optional package is missing: the registry knows, programs skip them by name.

"Not installed" is played by `sys.modules[name] = None`, which makes both `import ray` and
`importlib.util.find_spec("ray")` answer as they do where Ray was never installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import statecore
from statecore.executors import RayUnavailableError, available, runnable
from statecore.executors import _registry as registry
from statecore.executors._registry import Missing, missing
from statecore.tools.demo import skipped_line


def test_an_executor_whose_package_is_missing_is_not_runnable_and_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    ready, skipped = runnable()
    assert "ray" not in ready
    assert skipped == [Missing("ray", "ray", "pip install -e '.[ray]'")]
    assert str(skipped[0]) == "ray: skipped, pip install -e '.[ray]'"


def test_every_executor_is_still_named_as_available_when_its_package_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    assert "ray" in available()


def test_the_executors_without_optional_packages_are_always_runnable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    assert {"inline", "mp", "thread", "pinned"} <= set(runnable()[0])


def test_a_folder_named_like_the_package_is_not_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Ray leaves a session folder /tmp/ray: a program run from /tmp without Ray installed found
    # it as a namespace package, and the demo then failed in Ray's turn.
    (tmp_path / "statecore_absent_engine").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.NEEDS, "engine", ("statecore_absent_engine", "pip install it"))
    found = registry.missing("engine")
    assert found is not None and found.package == "statecore_absent_engine"


def test_ray_is_runnable_where_it_is_installed() -> None:
    pytest.importorskip("ray")
    assert missing("ray") is None
    assert "ray" in runnable()[0]


def test_asking_whether_ray_can_run_does_not_import_it() -> None:
    script = (
        "import sys\n"
        "from statecore.executors import runnable\n"
        "runnable()\n"
        "print('ray' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"


def test_choosing_ray_without_ray_installed_keeps_its_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    loader = statecore.DataLoader(list(range(4)), num_workers=1, executor="ray")
    with pytest.raises(RayUnavailableError, match=r"pip install -e '\.\[ray\]'"):
        next(iter(loader))


def test_the_demo_names_the_skipped_executors_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    # The demo run where Ray is missing prints it: tests/test_demo.py.
    assert skipped_line() == "ray: skipped, pip install -e '.[ray]'"
