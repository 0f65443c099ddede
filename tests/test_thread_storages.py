"""Worker threads collate into storages the consumer has let go of, and never into one it holds.

A batch is a large new allocation; writing it into fresh pages makes the kernel fault and zero
each of them. The thread executor's pool (`executors/_thread/storages.py`) gives torch's
collate, in a worker thread, an ordinary storage that no tensor uses any more, of exactly the
batch's size, and keeps a bounded number of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import statecore
from statecore.executors._thread import storages
from statecore.executors._thread.executor import ThreadExecutor
from statecore.executors._thread.storages import MIN_BYTES, StoragePool

pytestmark = pytest.mark.skipif(
    not storages.AVAILABLE, reason="this torch does not count references to a storage"
)

FLOATS = 64 << 10
"""Values per sample: 256 KB, above the pool's lower bound."""


class Filled(Dataset[torch.Tensor]):
    """Sample i is FLOATS float32 values, all equal to i."""

    def __init__(self, size: int = 64) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((FLOATS,), float(index))


def loader(dataset: Dataset[Any], **options: Any) -> statecore.DataLoader:
    arguments: dict[str, Any] = dict(batch_size=2, num_workers=2, executor="thread")
    return statecore.DataLoader(dataset, **(arguments | options))


def executor_of(iterator: Any) -> ThreadExecutor:
    executor = iterator._driver.executor
    assert isinstance(executor, ThreadExecutor)
    return executor


def pointer(batch: torch.Tensor) -> int:
    return batch.untyped_storage().data_ptr()


# --- the loader ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_batches_the_consumer_lets_go_of_lend_their_storages_to_later_batches() -> None:
    iterator = iter(loader(Filled()))
    pool = executor_of(iterator).storages
    for batch in iterator:
        del batch
    # 32 batches; at most 2 workers x 2 prefetched, 1 in hand and the spare ones made
    assert pool.made <= 2 * 2 + 1 + pool.spare


@pytest.mark.timeout(60)
def test_batches_the_consumer_keeps_are_never_written_over() -> None:
    kept = list(loader(Filled()))
    assert [batch[:, 0].tolist() for batch in kept] == [[2.0 * n, 2.0 * n + 1] for n in range(32)]
    assert all(bool((batch == batch[:, :1]).all()) for batch in kept)
    assert len({pointer(batch) for batch in kept}) == 32


@pytest.mark.timeout(60)
def test_a_view_the_consumer_keeps_holds_its_batchs_storage() -> None:
    rows = [batch[1] for batch in loader(Filled())]
    assert [float(row[0]) for row in rows] == [2.0 * n + 1 for n in range(32)]
    assert all(bool((row == row[0]).all()) for row in rows)


@pytest.mark.timeout(60)
def test_pooled_batches_are_ordinary_memory_of_exactly_their_size() -> None:
    for batch in loader(Filled(8)):
        assert not batch.is_shared()
        assert batch.untyped_storage().nbytes() == batch.nbytes == 2 * FLOATS * 4


class SharesItself(Dataset[bool]):
    """Each sample asks torch for shared memory itself: whether it got it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> bool:
        return bool(torch.UntypedStorage._new_shared(MIN_BYTES * 2).is_shared())


@pytest.mark.timeout(60)
def test_shared_memory_a_dataset_asks_for_itself_is_still_shared() -> None:
    assert [batch.tolist() for batch in loader(SharesItself())] == [[True, True], [True, True]]


@pytest.mark.timeout(120)
def test_a_consumer_keeping_50_batches_then_dropping_them_leaves_the_pool_small() -> None:
    batch_bytes = 2 * FLOATS * 4
    iterator = iter(loader(Filled(2 * 80)))
    pool = executor_of(iterator).storages
    kept = [next(iterator) for _ in range(50)]
    assert pool.held() <= pool.most * batch_bytes
    del kept
    for _ in range(10):
        next(iterator)
    assert pool.held() <= (pool.spare + 2 * 2 + 1) * batch_bytes  # spare, in flight, in hand
    list(iterator)
    assert pool.held() == 0  # the epoch's end shut the workers down


@pytest.mark.timeout(60)
def test_persistent_workers_keep_a_few_storages_between_epochs_and_none_after_shutdown() -> None:
    persistent = loader(Filled(16), persistent_workers=True)
    for _ in range(2):
        for batch in persistent:
            del batch
    iterator = persistent._iterator
    assert iterator is not None
    pool = executor_of(iterator).storages
    assert 0 < pool.held() <= pool.most * 2 * FLOATS * 4
    iterator._shutdown()
    assert pool.held() == 0


# --- the pool -----------------------------------------------------------------------------------


def test_the_pool_hands_back_a_free_storage_of_exactly_the_size_asked_for() -> None:
    pool = StoragePool(spare=2, most=4)
    first = pool.claim(MIN_BYTES)
    address = first.data_ptr()
    del first
    assert pool.claim(MIN_BYTES).data_ptr() == address and pool.made == 1
    assert pool.claim(2 * MIN_BYTES).nbytes() == 2 * MIN_BYTES and pool.made == 2


def test_the_pool_never_hands_out_a_storage_a_tensor_still_uses() -> None:
    pool = StoragePool(spare=2, most=4)
    tensor = torch.empty(0, dtype=torch.uint8).set_(pool.claim(MIN_BYTES))
    assert pool.claim(MIN_BYTES).data_ptr() != tensor.data_ptr() and pool.made == 2


def test_small_storages_are_not_pooled() -> None:
    pool = StoragePool(spare=2, most=4)
    pool.claim(MIN_BYTES - 1)
    assert pool.held() == 0


def test_free_storages_beyond_spare_are_let_go_at_the_next_claim() -> None:
    pool = StoragePool(spare=1, most=8)
    for _ in range(3):
        pool.claim(MIN_BYTES)
    assert pool.held() == MIN_BYTES  # each claim reused the one free storage
    held = [pool.claim(MIN_BYTES * 2) for _ in range(4)]
    del held
    pool.claim(MIN_BYTES * 3)
    assert pool.held() == MIN_BYTES * 3 + MIN_BYTES * 2  # one free one kept, and the new one


def test_storages_in_use_beyond_most_are_forgotten_by_the_pool_not_freed() -> None:
    pool = StoragePool(spare=0, most=2)
    kept = [torch.empty(0, dtype=torch.uint8).set_(pool.claim(MIN_BYTES)) for _ in range(5)]
    assert pool.held() == 2 * MIN_BYTES
    kept[0].fill_(7)
    assert int(kept[0][0]) == 7


def test_a_pool_needs_room_for_one_and_no_more_spare_than_room() -> None:
    with pytest.raises(ValueError, match="spare <= most"):
        StoragePool(spare=3, most=2)
    with pytest.raises(ValueError, match="most >= 1"):
        StoragePool(spare=0, most=0)


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(end, 16) for end in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping of this process holds {address:#x}")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="no transparent huge pages here (Linux only)",
)
def test_a_new_large_storage_is_advised_as_huge_pages() -> None:
    pool = StoragePool(spare=2, most=4)
    storage = pool.claim(5 * storages.HUGE_BYTES)
    whole_page = -(-storage.data_ptr() // (2 << 20)) * (2 << 20)
    assert "hg" in _vm_flags(whole_page)
