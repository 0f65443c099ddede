"""A dataset holding tensors reaches every spawn and forkserver worker, shared, not copied.

Under spawn and forkserver the worker setup (dataset, collate_fn, worker_init_fn) is pickled.
Torch's reductions move a tensor's storage into shared memory and pickle a handle that a
receiving process fetches once; every worker must get a handle of its own, and every worker
must map the same shared storage rather than a copy. Under fork nothing is pickled.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _processes import Snapshot, wait_gone, wait_no_leaks
from torch.utils.data import Dataset, TensorDataset

import statecore

pytestmark = pytest.mark.timeout(300)

GONE_WITHIN = 20.0

SPAWNED = [
    pytest.param("forkserver", 2),
    pytest.param("forkserver", 4, marks=pytest.mark.exhaustive),
    pytest.param("spawn", 2, marks=pytest.mark.exhaustive),
    pytest.param("spawn", 4, marks=pytest.mark.exhaustive),
]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # more workers than cores
@pytest.mark.parametrize(("method", "workers"), SPAWNED)
def test_a_tensor_dataset_loads_in_every_worker(method: str, workers: int) -> None:
    loader = statecore.DataLoader(
        TensorDataset(torch.arange(100)),
        batch_size=5,
        num_workers=workers,
        multiprocessing_context=method,
    )
    batches = [batch.tolist() for (batch,) in loader]
    assert batches == [list(range(k, k + 5)) for k in range(0, 100, 5)]


class Nested(Dataset):  # type: ignore[type-arg]
    """Tensors in dicts, lists and tuples; one tensor held twice; two views of one storage.

    Item i: the sum of every tensor's element i, whether the tensor held twice is one object
    in the worker, whether the two views still share their storage, and the worker's pid.
    """

    def __init__(self, n: int) -> None:
        base = torch.arange(2 * n)
        twice = torch.full((n,), 5)
        self.n = n
        self.tree = {"a": [torch.arange(n), {"b": torch.ones(n)}], "c": (twice,), "d": twice}
        self.views = (base[:n], base[n:])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[float, bool, bool, int]:
        (first, inner), (twice,) = self.tree["a"], self.tree["c"]
        total = float(first[index] + inner["b"][index] + twice[index] + self.tree["d"][index])
        total += float(self.views[0][index] + self.views[1][index])
        low, high = self.views
        shared = low.untyped_storage().data_ptr() == high.untyped_storage().data_ptr()
        return total, twice is self.tree["d"], shared, os.getpid()


@pytest.mark.parametrize(
    "method", ["forkserver", pytest.param("spawn", marks=pytest.mark.exhaustive)]
)
def test_tensors_nested_in_a_dataset_reach_every_worker_intact(method: str) -> None:
    n = 12
    loader = statecore.DataLoader(
        Nested(n), batch_size=None, num_workers=2, multiprocessing_context=method
    )
    items = list(loader)
    # arange(n)[i] + 1 + 5 + 5 + i + (n + i)
    assert [item[0] for item in items] == [float(3 * i + 11 + n) for i in range(n)]
    assert all(item[1] for item in items), "a tensor held twice became two tensors"
    assert all(item[2] for item in items), "two views of one storage became two storages"
    workers = {item[3] for item in items}
    assert len(workers) == 2
    assert not wait_gone(workers, GONE_WITHIN)


def backing(pointer: int) -> tuple[str, int, str]:
    """The device, inode and path of the mapping of this process that holds `pointer`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(end, 16) for end in fields[0].split("-"))
            if low <= pointer < high:
                path = fields[5].strip() if len(fields) > 5 else ""
                return fields[3], int(fields[4]), path
    raise AssertionError(f"address {pointer:#x} is not mapped")


class Large(Dataset):  # type: ignore[type-arg]
    """Holds one 32 MiB tensor; item i: what backs that tensor's memory in the worker."""

    def __init__(self) -> None:
        self.data = torch.zeros(8 * 2**20, dtype=torch.float32)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[tuple[str, int, str], int]:
        return backing(self.data.data_ptr()), os.getpid()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")
@pytest.mark.parametrize(
    "method", ["forkserver", pytest.param("spawn", marks=pytest.mark.exhaustive)]
)
def test_a_large_dataset_tensor_is_shared_by_every_worker_not_copied(method: str) -> None:
    dataset = Large()
    loader = statecore.DataLoader(
        dataset, batch_size=None, num_workers=2, multiprocessing_context=method
    )
    items: list[Any] = list(loader)
    assert len({pid for _, pid in items}) == 2
    # Sending the dataset moved its storage into shared memory, once, in this process...
    assert dataset.data.is_shared()
    ours = backing(dataset.data.data_ptr())
    assert ours[1] != 0, f"not file-backed shared memory: {ours}"
    # ...and every worker maps that same file: none holds a copy of its own.
    assert {tuple(mapping) for mapping, _ in items} == {ours}


class NonLeaf(Dataset):  # type: ignore[type-arg]
    """Holds a tensor that autograd refuses to send to another process."""

    def __init__(self) -> None:
        self.data = torch.ones(3, requires_grad=True) * 2

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


def test_a_dataset_tensor_that_cannot_be_shared_fails_the_loader_with_torchs_error() -> None:
    # A loader first, so that what any loader opens once per process is not counted as a leak.
    assert list(statecore.DataLoader(range(2), num_workers=1, multiprocessing_context="fork"))
    before = Snapshot.take()
    loader = statecore.DataLoader(NonLeaf(), num_workers=2, multiprocessing_context="forkserver")
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        list(loader)
    del loader
    assert wait_no_leaks(before, GONE_WITHIN) == []
