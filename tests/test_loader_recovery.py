"""A persistent loader whose workers failed runs its next epoch on fresh workers.

torch's persistent iterator cannot start another epoch once a worker has died; ours replaces
a scheduler that failed (or was closed) at the next `iter(loader)`, as a loader without
persistent workers does every epoch.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from _datasets import BrokenSampler, DiesAt

from statecore import DataLoader, WorkerDiedError


@pytest.mark.timeout(120)
def test_a_persistent_loader_runs_the_epoch_after_a_worker_death(tmp_path: Path) -> None:
    loader = DataLoader(
        DiesAt(6, 2, signal.SIGKILL, marker=tmp_path / "died"),
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
    )
    with pytest.raises(WorkerDiedError):
        list(loader)
    again = list(loader)
    assert [int(index) for index, _ in again] == list(range(6))
    assert len({int(pid) for _, pid in again}) == 2
    # ...and the epochs after it run on those same workers again.
    assert {int(pid) for _, pid in loader} == {int(pid) for _, pid in again}


@pytest.mark.timeout(120)
def test_a_persistent_loader_runs_the_epoch_after_its_sampler_failed() -> None:
    loader = DataLoader(
        torch.arange(8),
        sampler=BrokenSampler(8, 6, once=True),  # 6: after iter() has returned (it draws 4)
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
    )
    with pytest.raises(ValueError, match="sampler failed at 6"):
        list(loader)
    assert [int(x) for x in loader] == list(range(8))
