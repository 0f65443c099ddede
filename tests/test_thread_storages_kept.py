"""Storages that outlive their executor: kept by the process, taken by the next worker threads.

When a thread executor shuts down, the free storages of its pool stay with the process
(`storages.SHELF`), and the next executor's pool (the next epoch's, or a later loader's) takes
them before it makes new ones, so that its first batches go into pages already faulted in. What
the tests check: the next workers do take them and their batches are right; a storage a batch
still uses is kept but never written over, and taken once let go; what is kept stays within
its bounds, goes once unused for `idle` seconds, and a process forked meanwhile holds none of
it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from _processes import thread_names, true_in_a_fork, wait_until
from _wire import NUMEL, Filled

import statecore
from statecore.executors._thread import storages
from statecore.executors._thread.executor import ThreadExecutor
from statecore.executors._thread.storages import SHELF, Shelf, StoragePool

pytestmark = pytest.mark.skipif(
    not storages.AVAILABLE, reason="this torch does not count references to a storage"
)

TIMEOUT = 60
WITHIN = 30.0
BATCH = 2
"""Items per batch: 2 MiB of float32 a batch, well above the pool's lower bound."""
ITEMS = 16 * BATCH
BATCH_BYTES = BATCH * NUMEL * 4


@pytest.fixture(autouse=True)
def empty_shelf() -> Iterator[None]:
    """Each test starts with nothing kept, and leaves nothing kept behind."""
    SHELF.release()
    yield
    SHELF.release()


def loader(**options: Any) -> statecore.DataLoader[torch.Tensor]:
    options = {"num_workers": 2, "executor": "thread", **options}
    return statecore.DataLoader(Filled(ITEMS), batch_size=BATCH, **options)


def right_batch(number: int) -> torch.Tensor:
    expected = torch.arange(number * BATCH, (number + 1) * BATCH, dtype=torch.float32)
    return expected[:, None].expand(BATCH, NUMEL).contiguous()


def check(batches: Iterable[torch.Tensor]) -> None:
    """Every batch of an epoch is right; each is let go of before the next comes."""
    count = 0
    for number, batch in enumerate(batches):
        assert torch.equal(batch, right_batch(number)), f"batch {number} is wrong"
        count += 1
    assert count == ITEMS // BATCH


def pool_of(iterator: Any) -> StoragePool:
    executor = iterator._driver.executor
    assert isinstance(executor, ThreadExecutor)
    return executor.storages


def kept_addresses() -> set[int]:
    with SHELF.lock:
        return {storage.data_ptr() for storage in SHELF.items}


@pytest.mark.timeout(TIMEOUT)
def test_a_later_loader_s_worker_threads_take_the_storages_the_last_one_left() -> None:
    check(loader())
    left = kept_addresses()
    assert left, "nothing was kept of the last loader's storages"
    iterator = iter(loader())
    pool = pool_of(iterator)
    check(iterator)
    # It made a storage only once it had taken every one kept.
    assert pool.adopted > 0 and (pool.made == 0 or pool.adopted == len(left))


@pytest.mark.timeout(TIMEOUT)
def test_the_next_epoch_of_a_loader_without_persistent_workers_takes_them_too() -> None:
    made = loader(persistent_workers=False)
    check(made)
    assert len(SHELF) > 0
    iterator = iter(made)
    pool = pool_of(iterator)
    check(iterator)
    assert pool.adopted > 0


@pytest.mark.timeout(TIMEOUT)
def test_a_storage_a_batch_still_uses_is_kept_but_never_written_over() -> None:
    iterator = iter(loader())
    for batch in iterator:  # each batch let go of as the next comes, but the last
        last = batch
    del batch
    held = last.untyped_storage().data_ptr()
    assert held in kept_addresses()
    check(loader())  # writes into every storage it took
    assert torch.equal(last, right_batch(ITEMS // BATCH - 1))
    assert held in kept_addresses()


@pytest.mark.timeout(TIMEOUT)
def test_the_consumer_s_last_batch_lends_its_storage_to_the_next_epoch_once_let_go() -> None:
    made = loader(persistent_workers=False)
    for batch in made:  # as in a training loop, `batch` holds the last one after the epoch
        held = batch.untyped_storage().data_ptr()
    iterator = iter(made)
    # The consumer keeps every batch of this epoch, so its workers need a storage for each.
    kept = [next(iterator)]
    del batch  # let go of as the next epoch's first batch takes its name
    kept += list(iterator)
    check(kept)
    assert held in {batch.untyped_storage().data_ptr() for batch in kept}


@pytest.mark.timeout(TIMEOUT)
def test_what_is_kept_stays_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storages.SHELF, "most", 2)
    check(loader())
    assert len(SHELF) == 2
    SHELF.release()
    monkeypatch.setattr(storages.SHELF, "most", 32)
    monkeypatch.setattr(storages.SHELF, "most_bytes", BATCH_BYTES)  # one storage's worth
    check(loader())
    assert len(SHELF) == 1 and SHELF.held() == BATCH_BYTES


@pytest.mark.timeout(TIMEOUT)
def test_kept_storages_are_let_go_once_no_pool_took_any_for_the_idle_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storages.SHELF, "idle", 0.2)
    check(loader())
    assert wait_until(lambda: len(SHELF) == 0, WITHIN)
    assert wait_until(lambda: "statecore-kept-storages" not in thread_names(), WITHIN)


@pytest.mark.timeout(TIMEOUT)
def test_a_process_forked_while_storages_are_kept_holds_none_of_them() -> None:
    check(loader())
    kept = len(SHELF)
    assert kept
    assert true_in_a_fork(lambda: len(SHELF) == 0), "a forked child holds the kept storages on"
    assert len(SHELF) == kept  # and this process keeps them still


# --- the shelf and the pool ---------------------------------------------------------------------


def test_a_pool_takes_a_kept_storage_of_exactly_its_size_before_making_one() -> None:
    shelf = Shelf()
    first = StoragePool(spare=2, most=4, shelf=shelf)
    address = first.claim(storages.MIN_BYTES).data_ptr()
    other = torch.empty(0, dtype=torch.uint8).set_(first.claim(2 * storages.MIN_BYTES))
    first.clear()
    assert len(shelf) == 2  # the other one, still in use, too
    second = StoragePool(spare=2, most=4, shelf=shelf)
    assert second.claim(2 * storages.MIN_BYTES).data_ptr() != other.data_ptr()
    assert second.claim(storages.MIN_BYTES).data_ptr() == address
    assert (second.adopted, second.made, len(shelf)) == (1, 1, 1)
    shelf.release()


def test_the_free_storages_are_kept_before_those_in_use() -> None:
    shelf = Shelf()
    shelf.most = 1
    pool = StoragePool(spare=2, most=4, shelf=shelf)
    used = torch.empty(0, dtype=torch.uint8).set_(pool.claim(storages.MIN_BYTES))
    free = pool.claim(storages.MIN_BYTES).data_ptr()
    pool.clear()
    assert [storage.data_ptr() for storage in shelf.items] == [free]
    assert used.data_ptr() != free
    shelf.release()


def test_a_pool_without_a_shelf_keeps_nothing_at_its_end() -> None:
    pool = StoragePool(spare=2, most=4)
    pool.claim(storages.MIN_BYTES)
    pool.clear()
    assert pool.held() == 0 and len(SHELF) == 0
