"""Worker threads hand over batches in ordinary memory, and still tell datasets their worker.

torch's `default_collate` builds a batch in shared memory when `get_worker_info()` says it runs
in a worker, so that the batch can cross to the main process cheaply. A thread's batch needs no
crossing, and each shared batch holds an open file while it lives.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _side_by_side import threaded
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils.collate import default_collate


class WorkerIds(Dataset):  # type: ignore[type-arg]
    """Each sample is the id of the worker that loads it, as a tensor."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        assert info is not None, "a worker thread's dataset must see its WorkerInfo"
        return torch.tensor(info.id)


@pytest.mark.timeout(60)
def test_batches_from_worker_threads_are_not_in_shared_memory() -> None:
    batches = list(threaded(WorkerIds(), batch_size=2))
    assert len(batches) == 4
    assert [batch.is_shared() for batch in batches] == [False] * 4


@pytest.mark.timeout(60)
def test_the_dataset_still_sees_the_worker_thread_it_runs_in() -> None:
    batches = list(threaded(WorkerIds(), batch_size=2))
    assert [batch.tolist() for batch in batches] == [[0, 0], [1, 1], [0, 0], [1, 1]]


def worker_id_and_default_collate(samples: list[torch.Tensor]) -> tuple[int, torch.Tensor]:
    info = get_worker_info()
    assert info is not None, "a custom collate_fn must see its WorkerInfo"
    return info.id, default_collate(samples)


@pytest.mark.timeout(60)
def test_a_custom_collate_fn_sees_its_worker_and_torchs_collate_inside_it_shares_nothing() -> None:
    batches = list(threaded(WorkerIds(), batch_size=4, collate_fn=worker_id_and_default_collate))
    assert [worker for worker, _ in batches] == [0, 1]
    assert [batch.is_shared() for _, batch in batches] == [False, False]


KEEP_MANY_BATCHES = textwrap.dedent(
    """
    import resource
    import torch
    import statecore

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
    data = torch.arange(400.0).reshape(200, 2)
    loader = statecore.DataLoader(data, batch_size=1, num_workers=2, executor="thread")
    kept = list(loader)
    print(len(kept), sum(batch.is_shared() for batch in kept))
    """
)


@pytest.mark.timeout(120)
def test_keeping_200_batches_needs_no_open_file_per_batch() -> None:
    # In shared memory each batch kept one file descriptor open: with at most 100 open files the
    # loader failed after 93 batches.
    done = subprocess.run(
        [sys.executable, "-c", KEEP_MANY_BATCHES],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["200", "0"]
