"""A third-party executor, registered the way a user's package would register it."""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import statecore
from statecore import SendTask
from statecore.executors import ENTRY_POINT_GROUP, available
from statecore.executors._thread import ThreadExecutor
from statecore.models.kit import check_executor, matrix

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "executors.md"


@pytest.fixture
def acme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Install docs/executors.md's worked example as the package `acme_loading`."""
    code = re.search(r"```python\n(\"\"\"acme_loading.*?)```", GUIDE.read_text(), re.S)
    assert code is not None, "the guide's worked example is missing"
    (tmp_path / "acme_loading.py").write_text(code.group(1))
    info = tmp_path / "acme_loading-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-loading\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nacme = acme_loading:make_executor\n"
        "inline = acme_loading:make_executor\n"  # may not shadow a built-in
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "acme"
    sys.modules.pop("acme_loading", None)


def test_a_registered_executor_is_listed_by_name(acme: str) -> None:
    assert acme in available()
    assert {"inline", "mp", "thread"} <= set(available())


def test_a_registered_executor_loads_torchs_batches(acme: str) -> None:
    data = torch.arange(23)
    ours = [
        b.tolist() for b in statecore.DataLoader(data, batch_size=4, num_workers=3, executor=acme)
    ]
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(data, batch_size=4, num_workers=0)]
    assert ours == theirs


def test_a_plugin_cannot_take_a_built_in_name(acme: str) -> None:
    loader = statecore.DataLoader(torch.arange(4), executor="inline")
    assert loader.executor_factory.__module__ == "statecore.executors._registry"


def test_a_misspelt_name_lists_the_registered_executors_too(acme: str) -> None:
    with pytest.raises(ValueError, match="acme, inline, mp, pinned, thread"):
        statecore.DataLoader(torch.arange(4), num_workers=2, executor="acmee")


@pytest.mark.timeout(300)
def test_the_conformance_kit_passes_a_registered_executor(acme: str) -> None:
    report = check_executor(acme)
    assert len(report.cases) == len(matrix(in_process=False))


class FailsToDispatch(ThreadExecutor):
    """The thread executor, except that it cannot give out a second task (a worker that cannot
    be started, say)."""

    shutdowns = 0

    def dispatch(self, command: SendTask) -> None:
        if command.task == 1:
            raise OSError("worker 1 could not be started")
        super().dispatch(command)

    def shutdown(self) -> None:
        FailsToDispatch.shutdowns += 1
        super().shutdown()


@pytest.mark.timeout(60)
def test_an_executor_that_cannot_carry_out_a_command_fails_the_loader_cleanly() -> None:
    FailsToDispatch.shutdowns = 0
    loader = statecore.DataLoader(range(8), num_workers=2, executor=FailsToDispatch)
    with pytest.raises(OSError, match="worker 1 could not be started"):
        iter(loader)
    # What was already running was stopped, and nothing the scheduler asked after the failure
    # (the next draw, the next task) was carried out: closing later finds nothing to do.
    assert FailsToDispatch.shutdowns == 1
    gc.collect()
    assert FailsToDispatch.shutdowns == 1
