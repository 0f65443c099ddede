"""A persistent loader whose workers failed runs its next epoch on fresh workers.

torch's persistent iterator cannot start another epoch once a worker has died; ours replaces
a scheduler that failed (or was closed) at the next `iter(loader)`, as a loader without
persistent workers does every epoch.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, Sampler

from statecore import DataLoader, WorkerDiedError


class DiesOnce(Dataset[tuple[int, int]]):
    """(index, pid) for range(n); the worker loading `index` first dies of SIGKILL."""

    def __init__(self, n: int, index: int, marker: Path) -> None:
        self.n, self.index, self.marker = n, index, marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == self.index and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return i, os.getpid()


@pytest.mark.timeout(120)
def test_a_persistent_loader_runs_the_epoch_after_a_worker_death(tmp_path: Path) -> None:
    loader = DataLoader(
        DiesOnce(6, 2, tmp_path / "died"), batch_size=None, num_workers=2, persistent_workers=True
    )
    with pytest.raises(WorkerDiedError):
        list(loader)
    again = list(loader)
    assert [int(index) for index, _ in again] == list(range(6))
    assert len({int(pid) for _, pid in again}) == 2
    # ...and the epochs after it run on those same workers again.
    assert {int(pid) for _, pid in loader} == {int(pid) for _, pid in again}


class FailsOnce(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n, self.failed = n, False

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == 6 and not self.failed:  # after iter() has returned: its prefetch draws 4
                self.failed = True
                raise ValueError("the sampler broke")
            yield i


@pytest.mark.timeout(120)
def test_a_persistent_loader_runs_the_epoch_after_its_sampler_failed() -> None:
    loader = DataLoader(
        torch.arange(8),
        sampler=FailsOnce(8),
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
    )
    with pytest.raises(ValueError, match="the sampler broke"):
        list(loader)
    assert [int(x) for x in loader] == list(range(8))


def test_a_fractional_num_workers_is_refused_at_iter_like_torch() -> None:
    for loader_type in (torch.utils.data.DataLoader, DataLoader):
        loader = loader_type(torch.arange(4), num_workers=2.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
            iter(loader)
