"""Worker processes live as long as torch's do, and run torch as torch's workers run it.

Compared with torch's DataLoader as tests/_side_by_side.py says.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.utils.data
from _datasets import ThreadCounts, WorkerPids
from _processes import alive, state
from _side_by_side import LOADERS, QUIET, WORKERS, close, kw, run

import statecore

pytestmark = QUIET

# --- worker lifetime -----------------------------------------------------------------------------
# Torch stops a loader's workers as soon as its iterator is dropped (by reference counting), so
# `next(iter(loader))` or breaking out of a loop leaves no process behind.


@pytest.mark.parametrize("loader_class", LOADERS)
@pytest.mark.parametrize("persistent_workers", [False, True], ids=["fresh", "persistent"])
@WORKERS
def test_dropping_a_loader_stops_its_workers_at_once(
    loader_class: type, persistent_workers: bool
) -> None:
    loader = loader_class(
        WorkerPids(), batch_size=None, num_workers=2, persistent_workers=persistent_workers
    )
    iterator = iter(loader)
    pids = {next(iterator), next(iterator)}
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    dropped = weakref.ref(iterator)
    del iterator, loader
    try:
        assert dropped() is None
        assert all(state(pid) is None for pid in pids)  # gone and reaped: not even a zombie
    finally:
        # Clean up without the garbage collector, which would wait 5 s for the workers.
        leftover = dropped()
        if leftover is not None:
            close(leftover)
            del leftover


# --- what workers run on -----------------------------------------------------------------------


@WORKERS
def test_workers_run_torch_on_one_thread_like_torchs() -> None:
    expected = run(torch.utils.data.DataLoader, ThreadCounts(), kw(num_workers=2))
    assert expected == [[[1], [1], [1], [1]]]
    assert run(statecore.DataLoader, ThreadCounts(), kw(num_workers=2)) == expected
