"""Batches that are views of a storage much larger than themselves.

An in-memory dataset that hands out slices of one big tensor (with `batch_size=None`, or a
collate_fn that returns the samples as they are) makes batches whose storage is the whole
dataset. What the tests check: only what the batch's tensors reach crosses into shared memory,
not the storage under them; views that overlap still share one storage when they arrive;
a view that reaches most of its storage keeps its storage and offsets as torch's do; and the
batches equal torch's whichever way they travel.

How many bytes went into shared memory is read from the buffer API itself (the notices that
announce each buffer, and the storages built on arrival), not from timings.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data
from _wire import in_buffer
from torch.utils.data import Dataset

import statecore
from statecore.executors._mp import (
    BUFFERS_PER_WORKER,
    MIN_BUFFER_BYTES,
    BufferOpened,
    BufferReceiver,
    BufferSender,
)

# Every test here but the in-process ones starts worker processes; none may hang the suite.
pytestmark = pytest.mark.timeout(180)

# The dataset's storage: 8M float32 values, 32 MiB.
ROWS, COLUMNS = 512, 1 << 14
# A sample: four rows, 256 KiB.
ROWS_PER_SAMPLE = 4
SAMPLE_BYTES = ROWS_PER_SAMPLE * COLUMNS * 4
# Where a window of a storage may start before the first byte a tensor reaches.
ALIGNMENT = 64


class Slices(Dataset):  # type: ignore[type-arg]
    """Sample i: four consecutive rows of one 32 MiB tensor, a view of its whole storage."""

    def __init__(self) -> None:
        self.data = torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS)

    def __len__(self) -> int:
        return ROWS // ROWS_PER_SAMPLE

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * ROWS_PER_SAMPLE
        return self.data[start : start + ROWS_PER_SAMPLE]


def as_they_are(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """A collate_fn that keeps the samples, views of the dataset's storage, as they are."""
    return samples


def loader_arguments(**options: Any) -> dict[str, Any]:
    options.setdefault("num_workers", 2)
    options.setdefault("batch_size", None)
    options.setdefault("shuffle", True)
    options.setdefault("generator", torch.Generator().manual_seed(7))
    return options


def ours(**options: Any) -> statecore.DataLoader:
    return statecore.DataLoader(
        Slices(), multiprocessing_context="fork", **loader_arguments(**options)
    )


def theirs(**options: Any) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(Slices(), **loader_arguments(**options))


def assert_equal_values(mine: torch.Tensor, its: torch.Tensor) -> None:
    """The same values, dtype and geometry; the offset into the storage may differ."""
    assert mine.dtype == its.dtype
    assert mine.shape == its.shape
    assert mine.stride() == its.stride()
    assert torch.equal(mine, its)


# --- through the loader ------------------------------------------------------------------------


def test_a_batch_that_views_a_large_storage_brings_only_what_it_reaches():
    # Side by side, each batch dropped before the next: the pools are never spent.
    for mine, its in zip(ours(), theirs(), strict=True):
        assert_equal_values(mine, its)
        assert in_buffer(mine)
        # torch's batch is a view of the whole 32 MiB storage; ours holds the view alone.
        assert its.untyped_storage().nbytes() == ROWS * COLUMNS * 4
        assert mine.untyped_storage().nbytes() <= SAMPLE_BYTES + ALIGNMENT


def test_samples_collated_as_they_are_each_bring_only_what_they_reach():
    batches = ours(batch_size=4, collate_fn=as_they_are)
    expected = theirs(batch_size=4, collate_fn=as_they_are)
    for mine, its in zip(batches, expected, strict=True):
        assert len(mine) == len(its) == 4
        for view, other in zip(mine, its, strict=True):
            assert_equal_values(view, other)
            assert in_buffer(view)
        storages = {view.untyped_storage().data_ptr(): view.untyped_storage() for view in mine}
        reached = sum(view.nbytes for view in mine)
        assert sum(storage.nbytes() for storage in storages.values()) <= reached + 4 * ALIGNMENT


def test_views_a_consumer_keeps_beyond_the_pool_travel_torchs_way_and_equal_torchs():
    # Every batch is kept, so the pools are soon spent: the rest go as torch sends them.
    kept = list(ours())
    expected = list(theirs())
    for mine, its in zip(kept, expected, strict=True):
        assert_equal_values(mine, its)
    assert sum(not in_buffer(batch) for batch in kept) >= len(kept) - 2 * BUFFERS_PER_WORKER


# --- the wire, in one process ------------------------------------------------------------------


def send_and_receive(
    sender: BufferSender, receiver: BufferReceiver, batch: Any
) -> tuple[Any, list[BufferOpened]]:
    """`batch` as the main process receives it, and the buffers announced for it."""
    placing = sender.begin()
    payload, lent = sender.dumps(batch, placing)
    opened = []
    for notice in sender.notices():
        receiver.notice(0, notice)
        if isinstance(notice, BufferOpened):
            opened.append(notice)
    sender.end(placing)
    return receiver.loads(0, lent, payload), opened


def large_storage() -> torch.Tensor:
    """16 MiB of float32 values, each its own index."""
    return torch.arange(1 << 22, dtype=torch.float32)


def test_the_buffers_made_for_views_of_a_large_storage_hold_only_what_they_reach(
    pair: tuple[BufferSender, BufferReceiver],
):
    data = large_storage()
    views = [data[k << 20 : (k << 20) + 40_000] for k in (3, 0, 2)]
    received, opened = send_and_receive(*pair, views)
    for mine, its in zip(received, views, strict=True):
        assert_equal_values(mine, its)
    reached = sum(view.nbytes for view in views)
    assert reached >= MIN_BUFFER_BYTES  # so that they travel in a buffer, not the message
    # A buffer is at most an eighth larger than what it holds, plus the views' alignment.
    assert 0 < sum(notice.capacity for notice in opened) <= reached * 9 // 8 + 4096


def test_small_views_of_a_large_storage_travel_in_the_message(
    pair: tuple[BufferSender, BufferReceiver],
):
    data = large_storage()
    views = [data[10:20], data[1 << 21 : (1 << 21) + 100]]
    received, opened = send_and_receive(*pair, views)
    assert opened == []
    for mine, its in zip(received, views, strict=True):
        assert_equal_values(mine, its)
        assert mine.untyped_storage().nbytes() <= its.nbytes + ALIGNMENT


def test_views_that_overlap_share_one_storage_on_arrival(
    pair: tuple[BufferSender, BufferReceiver],
):
    data = large_storage()
    first, second = data[100_000:200_000], data[150_000:250_000].view(torch.int32)
    apart = data[3_000_000:3_100_000]
    empty = data[2_000_000:2_000_000]
    received, _ = send_and_receive(*pair, [first, apart, second, empty])
    for mine, its in zip(received, [first, apart, second, empty], strict=True):
        assert_equal_values(mine, its)
    storages = [tensor.untyped_storage() for tensor in received]
    assert storages[0].data_ptr() == storages[2].data_ptr()
    assert storages[0].nbytes() <= 150_000 * 4 + ALIGNMENT
    assert storages[1].data_ptr() != storages[0].data_ptr()
    # Written through one, seen through the other, as in the worker.
    received[0][60_000] = -1.0
    assert received[2][10_000].item() == torch.tensor(-1.0).view(torch.int32).item()


def test_a_view_that_reaches_most_of_its_storage_brings_the_storage_and_its_offset(
    pair: tuple[BufferSender, BufferReceiver],
):
    data = large_storage()
    tail = data[1_000_000:]
    received, _ = send_and_receive(*pair, tail)
    assert_equal_values(received, tail)
    assert received.storage_offset() == tail.storage_offset()
    assert received.untyped_storage().nbytes() == data.untyped_storage().nbytes()
