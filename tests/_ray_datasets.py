"""The datasets and callbacks of the Ray executor's tests (tests/test_ray_executor.py).

Every actor imports the module that defines its dataset to unpickle it, so they live here, in a
module that imports only torch and statecore, and not in the test module: that one imports
pytest, Hypothesis and statecore's models, about 0.4 s more of every actor's start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data
from torch.utils.data import Dataset, IterableDataset

import statecore

__all__ = ["SKEW", "Drawn", "Pids", "Sharded", "StuckAt", "mark_initialised", "skew_the_clock"]


class Pids(Dataset[tuple[int, int, float]]):
    """(index, pid of the process loading it, a draw from torch's seeded generator)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int, float]:
        return index, os.getpid(), float(torch.rand(()))


class Drawn(Dataset[dict[str, Any]]):
    """Items from the worker's seeded generators and its WorkerInfo (torch's and ours)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        ours = statecore.executors.get_worker_info()
        assert info is not None and ours is info
        return {
            "index": index,
            "image": torch.rand(3, 4, 4),
            "worker": info.id,
            "seed": info.seed,
            "initialised": getattr(info.dataset, "initialised", -1),
        }


def mark_initialised(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.initialised = worker_id * 10


class Sharded(IterableDataset[torch.Tensor]):
    """Shards itself by torch's get_worker_info(), as many iterable datasets do."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(worker, 23, workers):
            yield torch.tensor([index, worker]) + torch.rand(2)


class StuckAt(Dataset[int]):
    """Item `stuck` never comes (its worker waits far longer than any test's timeout)."""

    def __init__(self, stuck: int) -> None:
        self.stuck = stuck

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        if index == self.stuck:
            time.sleep(3600)
        return index


SKEW = 1000.0
"""Seconds an actor's clock is set ahead by, as another machine's clock would be."""


def skew_the_clock(worker_id: int) -> None:
    """worker_init_fn: this actor's `time.perf_counter` reads SKEW seconds ahead, as the clock
    of a node booted earlier would (CLOCK_MONOTONIC counts from a machine's boot)."""
    if not getattr(time, "statecore_skewed", False):
        real = time.perf_counter
        time.perf_counter = lambda: real() + SKEW
        time.statecore_skewed = True  # type: ignore[attr-defined]
