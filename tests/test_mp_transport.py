"""How the multiprocess executor carries tensors: large ones in shared-memory buffers it reuses.

A worker places the large storages of a batch in buffers of its pool, which the main process
keeps mapped. What the tests check: a batch is what torch's DataLoader gives; a buffer is never
written while anyone can still read what it holds (whatever the consumer kept: a batch, a
view, a numpy array; a batch kept in the worker; a batch sent on to another process); buffers
come back and are reused; when the consumer keeps more batches than the pool holds, batches
travel torch's way and nothing waits; nothing is left behind.

Where a tensor's memory lives is read from /proc/self/maps: a worker's buffer shows as
`/memfd:statecore-buffer-<worker pid>-<n>`, a segment of torch's own as `/dev/shm/torch_...`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import multiprocess
import pytest
import torch
import torch.utils.data
from _processes import Snapshot, wait_gone, wait_no_leaks, wait_until
from _wire import NUMEL, Filled, in_buffer, origin
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import statecore
from statecore.executors._mp import (
    BUFFERS_PER_WORKER,
    AnswerSender,
    BufferReceiver,
    BufferSender,
)

# Most tests here start worker processes; none may hang the suite.
pytestmark = pytest.mark.timeout(120)

GONE_WITHIN = 20.0
# A float32 sample this long is 1 MiB: large enough for a buffer.
# Buffers a worker has lent at most when the consumer keeps no batch: prefetch_factor (2)
# batches in flight, the one the consumer holds, and the one it dropped last, whose buffer goes
# back with the next task. One more for slack.
IN_USE_PER_WORKER = 5


def loader(dataset: Any, **options: Any) -> statecore.DataLoader:
    options.setdefault("num_workers", 2)
    options.setdefault("batch_size", 2)
    options.setdefault("multiprocessing_context", "fork")
    return statecore.DataLoader(dataset, **options)


def assert_same(ours: Any, theirs: Any, where: str = "batch") -> None:
    """The same structure, types, values, dtypes and tensor geometry."""
    assert type(ours) is type(theirs), where
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, where
        assert ours.shape == theirs.shape, where
        assert ours.stride() == theirs.stride(), where
        assert ours.storage_offset() == theirs.storage_offset(), where
        assert ours.requires_grad == theirs.requires_grad, where
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), where
        for index, (mine, its) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(mine, its, f"{where}[{index}]")
    else:
        assert ours == theirs, where


# --- datasets ----------------------------------------------------------------------------------


def expected(first: int, size: int = 2) -> torch.Tensor:
    """The batch of `Filled` that starts at item `first`. Made afresh each call (2 MiB of new
    pages): a test that checks kept batches at every step makes each one's once and keeps it."""
    return torch.stack([torch.full((NUMEL,), float(first + k)) for k in range(size)])


class Point(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class Mixed(Dataset):  # type: ignore[type-arg]
    """Nested samples: large and small tensors of several dtypes among plain values."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = torch.arange(3 * 128 * 256, dtype=torch.float32).reshape(3, 128, 256) + index
        return {
            "image": image,
            "transposed": image[0].t(),  # not contiguous
            "mask": image > 2 * index,
            "half": torch.full((NUMEL,), index / 4, dtype=torch.float16),
            "label": torch.tensor(index),
            "name": f"item-{index}",
            "pair": (torch.arange(5) * index, index / 2),
            "point": Point(torch.full((NUMEL,), index, dtype=torch.int64), torch.tensor(-index)),
            "list": [torch.zeros(NUMEL, dtype=torch.complex64) + index, index],
        }


class Views(Dataset):  # type: ignore[type-arg]
    """Unbatched samples: views that share one storage, with offsets and odd strides."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> dict[str, Any]:
        base = torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) * (index + 1)
        return {
            "base": base,
            "transposed": base.t(),
            "strided": base[::2, 1::3],
            "offset": base[100:],
            "other": torch.full((NUMEL,), float(index)),
            "small": torch.arange(10) + index,
        }


class Unusual(Dataset):  # type: ignore[type-arg]
    """Unbatched samples holding tensors no buffer carries, next to one it does."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "grad": torch.full((NUMEL,), float(index), requires_grad=True),
            "parameter": torch.nn.Parameter(torch.full((NUMEL,), float(-index))),
            "empty": torch.empty((0, 3)),
            "plain": torch.full((NUMEL,), float(index)),
        }


class Stream(IterableDataset):  # type: ignore[type-arg]
    """Large tensors filled with 0..n-1, split between workers as torch documents."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, self.n, step):
            yield torch.full((NUMEL,), float(index))


class Hoarding:
    """A collate_fn that keeps every batch it makes in the worker, and checks them each time.

    Fails (in the worker, so the consumer sees it) as soon as a kept batch has changed.
    """

    def __init__(self) -> None:
        self.kept: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        """(first item, the batch kept, what it must still hold: made once, see `expected`)."""

    def __call__(self, samples: list[torch.Tensor]) -> torch.Tensor:
        batch = torch.utils.data.default_collate(samples)
        for first, earlier, wanted in self.kept:
            if not torch.equal(earlier, wanted):
                raise AssertionError(f"the batch from item {first} kept in the worker changed")
        first = int(batch[0, 0])
        self.kept.append((first, batch, expected(first)))
        return batch


# --- buffers -----------------------------------------------------------------------------------


def test_large_batches_arrive_in_shared_memory_buffers_of_the_workers():
    batches = 0
    for index, batch in enumerate(loader(Filled(16))):
        assert torch.equal(batch, expected(2 * index))
        assert in_buffer(batch), origin(batch)
        batches += 1
    assert batches == 8


def test_dropped_batches_give_their_buffers_back_for_reuse():
    seen: set[str] = set()
    for index, batch in enumerate(loader(Filled(120))):
        assert torch.equal(batch, expected(2 * index))
        seen.add(origin(batch))
    assert all(name.startswith("/memfd:statecore-buffer-") for name in seen), seen
    assert len(seen) <= 2 * IN_USE_PER_WORKER, sorted(seen)


def test_batches_the_consumer_keeps_are_never_overwritten():
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    seen: set[str] = set()
    for index, batch in enumerate(loader(Filled(120))):
        seen.add(origin(batch))
        if index % 6 == 0:
            # Ten batches in all, kept while the rest go by, each beside what it must hold.
            kept[2 * index] = (batch, expected(2 * index))
        for first, (held, wanted) in kept.items():
            assert torch.equal(held, wanted), f"the batch from item {first} changed"
    assert len(kept) == 10
    assert len(seen) < 60, "no buffer was reused: the test proves nothing"


def unchanged(batch: Any) -> Any:
    return batch


def test_batches_received_by_a_pin_stage_thread_are_never_overwritten():
    # The stage's thread receives the batches while the driver's thread sends the tasks that
    # carry buffers back.
    staged = loader(Filled(120), executor=statecore.executors.pinned("mp", pin=unchanged))
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    seen: set[str] = set()
    for index, batch in enumerate(staged):
        assert in_buffer(batch)
        seen.add(origin(batch))
        if index % 6 == 0:
            kept[2 * index] = (batch, expected(2 * index))
        for first, (held, wanted) in kept.items():
            assert torch.equal(held, wanted), f"the batch from item {first} changed"
    assert len(seen) < 60, "no buffer was reused: the test proves nothing"


def keep_and_check(batches: Any, results: Any) -> None:
    """In another process: keep the batches sent, then say whether they are still intact."""
    # As in a DataLoader worker: a forked child entering the parent's thread pool may hang.
    torch.set_num_threads(1)
    kept = [batches.get(timeout=60) for _ in range(4)]
    results.put("kept")
    results.put(
        batches.get(timeout=60) == "check"
        and all(torch.equal(batch, expected(8 * index)) for index, batch in enumerate(kept))
    )


def test_a_batch_sent_on_to_another_process_is_moved_out_of_its_buffer_first():
    context = torch.multiprocessing.get_context("fork")
    batches, results = context.Queue(), context.Queue()
    other = context.Process(target=keep_and_check, args=(batches, results), daemon=True)
    other.start()
    try:
        for index, batch in enumerate(loader(Filled(120))):
            if index < 16 and index % 4 == 0:
                assert in_buffer(batch) and not batch.is_shared()
                # Pickling it for the queue makes torch move it to a segment of its own.
                batches.put(batch)
            if index == 16:
                assert results.get(timeout=60) == "kept"
        batches.put("check")
        assert results.get(timeout=60) is True
    finally:
        other.join(GONE_WITHIN)
        if other.is_alive():
            other.kill()
            other.join()


def test_a_numpy_array_alone_keeps_its_buffer():
    arrays: dict[int, tuple[Any, torch.Tensor]] = {}
    seen: set[str] = set()
    for index, batch in enumerate(loader(Filled(60))):
        seen.add(origin(batch))
        if index % 5 == 0:
            # The tensor itself goes at the next step; what the array must hold is kept beside.
            arrays[2 * index] = (batch.numpy(), expected(2 * index))
        for first, (array, wanted) in arrays.items():
            assert torch.equal(torch.from_numpy(array), wanted), f"item {first}'s array changed"
    assert len(seen) < 30, "no buffer was reused: the test proves nothing"


def test_a_consumer_keeping_more_batches_than_the_pool_holds_gets_torchs_segments():
    count = 2 * (BUFFERS_PER_WORKER + 4)
    batches = list(loader(Filled(2 * count)))
    for index, batch in enumerate(batches):
        assert torch.equal(batch, expected(2 * index))
    origins = [origin(batch) for batch in batches]
    buffers = {name for name in origins if name.startswith("/memfd:statecore-buffer-")}
    assert len(buffers) == 2 * BUFFERS_PER_WORKER
    assert sum(name.startswith("/dev/shm/torch_") for name in origins) == count - len(buffers)


def test_a_batch_collate_keeps_in_the_worker_is_never_overwritten():
    # Every batch stays in its worker, so each buffer stays busy: once the pool is spent, the
    # batches travel torch's way, and the kept ones never change.
    batches = loader(Filled(2 * 2 * (BUFFERS_PER_WORKER + 4)), collate_fn=Hoarding())
    for index, batch in enumerate(batches):
        assert torch.equal(batch, expected(2 * index))


def buffers_of(pid: int) -> int:
    """How many buffers worker `pid` has open: each mapping keeps a descriptor."""
    names = []
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            names.append(os.readlink(f"/proc/{pid}/fd/{entry}"))
        except OSError:
            continue
    return sum(name.startswith("/memfd:statecore-buffer-") for name in names)


def test_a_pool_grown_for_a_hoarding_consumer_shrinks_once_it_lets_go():
    persistent = loader(Filled(4 * (BUFFERS_PER_WORKER + 4)), persistent_workers=True)
    hoard = list(persistent)
    workers = pids_of(hoard[:2])
    assert [buffers_of(pid) for pid in workers] == [BUFFERS_PER_WORKER] * 2
    del hoard
    for index, batch in enumerate(persistent):
        assert torch.equal(batch, expected(2 * index))
    assert all(buffers_of(pid) <= IN_USE_PER_WORKER for pid in workers)


# --- what the consumer gets --------------------------------------------------------------------


def test_nested_batches_equal_torchs():
    ours = list(loader(Mixed(), batch_size=3))
    theirs = list(torch.utils.data.DataLoader(Mixed(), batch_size=3, num_workers=2))
    assert_same(ours, theirs)
    assert in_buffer(ours[-1]["image"]) and in_buffer(ours[-1]["point"].x)


def test_small_tensors_of_a_large_batch_travel_in_the_message():
    batches = list(loader(Mixed(), batch_size=3))
    # From its second batch on, a worker expects small tensors to come with large ones.
    for index, batch in enumerate(batches[2:], start=2):
        assert not batch["label"].is_shared()
        assert not in_buffer(batch["label"])
        assert torch.equal(batch["label"], torch.arange(3 * index, 3 * index + 3))


def test_views_strides_offsets_and_shared_storage_equal_torchs():
    ours = list(loader(Views(), batch_size=None))
    theirs = list(torch.utils.data.DataLoader(Views(), batch_size=None, num_workers=2))
    assert_same(ours, theirs)
    for sample in ours:
        base = sample["base"].untyped_storage().data_ptr()
        for name in ("transposed", "strided", "offset"):
            assert sample[name].untyped_storage().data_ptr() == base, name
        assert in_buffer(sample["base"])


def test_tensors_no_buffer_carries_travel_torchs_way_and_equal_torchs():
    ours = list(loader(Unusual(), batch_size=None))
    theirs = list(torch.utils.data.DataLoader(Unusual(), batch_size=None, num_workers=2))
    assert_same(ours, theirs)
    for sample in ours:
        assert origin(sample["grad"]).startswith("/dev/shm/torch_")
        assert origin(sample["parameter"]).startswith("/dev/shm/torch_")
        assert in_buffer(sample["plain"])


def test_iterable_dataset_batches_equal_torchs():
    ours = list(loader(Stream(20), batch_size=3))
    theirs = list(torch.utils.data.DataLoader(Stream(20), batch_size=3, num_workers=2))
    assert_same(ours, theirs)
    assert in_buffer(ours[-3])


def test_persistent_workers_reuse_their_buffers_across_epochs():
    persistent = loader(Filled(40), persistent_workers=True)
    seen: set[str] = set()
    for _ in range(3):
        for index, batch in enumerate(persistent):
            assert torch.equal(batch, expected(2 * index))
            seen.add(origin(batch))
    assert len(seen) <= 2 * IN_USE_PER_WORKER, sorted(seen)


@pytest.mark.parametrize(
    "method", ["spawn", pytest.param("forkserver", marks=pytest.mark.exhaustive)]
)
def test_each_start_method_sends_large_batches_through_buffers(method: str):
    batches = list(loader(Filled(12), multiprocessing_context=method))
    for index, batch in enumerate(batches):
        assert torch.equal(batch, expected(2 * index))
    assert all(in_buffer(batch) for batch in batches)


# --- shutdown ----------------------------------------------------------------------------------


def pids_of(tensors: list[torch.Tensor]) -> set[int]:
    """The workers whose buffers hold these tensors, from the buffers' names."""
    return {int(origin(tensor).split("-")[2]) for tensor in tensors}


def test_large_batches_leave_no_process_descriptor_or_shared_memory_behind():
    before = Snapshot.take()
    iterator = iter(loader(Filled(60)))
    kept = [next(iterator) for _ in range(10)]
    workers = pids_of(kept)
    assert len(workers) == 2
    del iterator, kept
    assert not wait_gone(workers, GONE_WITHIN)
    assert wait_no_leaks(before, GONE_WITHIN, workers) == []


def test_a_batch_kept_after_its_loader_is_gone_stays_readable_and_is_then_released():
    before = Snapshot.take()
    iterator = iter(loader(Filled(60)))
    kept = [next(iterator) for _ in range(4)]
    workers = pids_of(kept)
    del iterator
    assert not wait_gone(workers, GONE_WITHIN)
    for index, batch in enumerate(kept):
        assert torch.equal(batch, expected(2 * index))
    del kept, batch
    assert wait_no_leaks(before, GONE_WITHIN, workers) == []


# --- the wire, in one process ------------------------------------------------------------------


def send(sender: BufferSender, receiver: BufferReceiver, batch: Any) -> tuple[bytes, Any]:
    """Place `batch` as a worker does; announce its buffers to the receiver."""
    placing = sender.begin()
    payload, lent = sender.dumps(batch, placing)
    for notice in sender.notices():
        receiver.notice(0, notice)
    sender.end(placing)
    return payload, lent


def explode() -> None:
    raise ValueError("cannot be rebuilt here")


class Unloadable:
    """Pickles, but fails to unpickle."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (explode, ())


@pytest.mark.parametrize("failing", ["before the tensor", "after the tensor"])
def test_a_message_that_fails_to_unpickle_gives_its_buffer_back(
    pair: tuple[BufferSender, BufferReceiver], failing: str
):
    sender, receiver = pair
    large = torch.full((NUMEL,), 1.0)
    batch = [Unloadable(), large] if failing == "before the tensor" else [large, Unloadable()]
    payload, lent = send(sender, receiver, batch)
    assert len(lent) == 1
    with pytest.raises(ValueError, match="cannot be rebuilt here"):
        receiver.loads(0, lent, payload)
    assert receiver.returns_for(0) == lent


def test_a_buffer_goes_back_only_once_every_view_of_its_storage_is_gone(
    pair: tuple[BufferSender, BufferReceiver],
):
    sender, receiver = pair
    payload, lent = send(sender, receiver, torch.full((NUMEL,), 2.0))
    tensor = receiver.loads(0, lent, payload)
    view = tensor[10:20]
    del tensor
    assert receiver.returns_for(0) == ()
    del view
    assert receiver.returns_for(0) == lent
    assert receiver.returns_for(0) == ()  # given back once


def test_a_storage_moved_to_torchs_shared_memory_gives_its_buffer_back(
    pair: tuple[BufferSender, BufferReceiver],
):
    sender, receiver = pair
    payload, lent = send(sender, receiver, torch.full((NUMEL,), 6.0))
    tensor = receiver.loads(0, lent, payload)
    assert receiver.returns_for(0) == ()
    tensor.share_memory_()
    assert receiver.returns_for(0) == lent
    assert torch.equal(tensor, torch.full((NUMEL,), 6.0))


def test_a_lent_buffer_is_not_written_until_given_back(
    pair: tuple[BufferSender, BufferReceiver],
):
    sender, receiver = pair
    payload, lent = send(sender, receiver, torch.full((NUMEL,), 3.0))
    first = receiver.loads(0, lent, payload)
    payload, again = send(sender, receiver, torch.full((NUMEL,), 4.0))
    assert again != lent
    assert torch.equal(first, torch.full((NUMEL,), 3.0))
    del first
    sender.returned(receiver.returns_for(0))
    payload, reused = send(sender, receiver, torch.full((NUMEL,), 5.0))
    assert reused == lent
    assert torch.equal(receiver.loads(0, reused, payload), torch.full((NUMEL,), 5.0))


@pytest.mark.parametrize(
    ("limit", "workers", "expected"),
    [(1 << 20, 4, 16), (1024, 8, 16), (1024, 64, 4), (256, 64, 1), (64, 64, 0)],
)
def test_the_pools_of_all_workers_use_at_most_a_quarter_of_the_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch, limit: int, workers: int, expected: int
) -> None:
    import resource

    from statecore.executors._mp import buffers_per_worker

    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, limit))
    assert buffers_per_worker(workers) == expected


# --- sending -----------------------------------------------------------------------------------


class Gate:
    """Pickles only once `opened` is set: stands for an answer that is slow to send."""

    def __init__(self, opened: threading.Event) -> None:
        self.opened = opened

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        if not self.opened.wait(GONE_WITHIN):
            raise RuntimeError("the next batch was not loaded while this one was being sent")
        return (str, ("sent",))


class GatedFilled(Dataset):  # type: ignore[type-arg]
    """Large samples; batch 0 carries a Gate that loading item `opener` opens."""

    def __init__(self, size: int, opener: int) -> None:
        self.size = size
        self.opener = opener
        self.opened = threading.Event()  # the worker's own copy, under fork

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.opener:
            self.opened.set()
        gate = Gate(self.opened) if index == 0 else None
        return {"tensor": torch.full((NUMEL,), float(index)), "gate": gate}


def collate_gated(items: list[dict[str, Any]]) -> dict[str, Any]:
    tensors = torch.utils.data.default_collate([item["tensor"] for item in items])
    return {"tensor": tensors, "gate": items[0]["gate"]}


def test_a_worker_loads_its_next_batch_while_the_last_one_is_being_sent():
    # One worker: batch 0 can only be pickled once batch 1 is being loaded. A worker that
    # sent each batch before loading the next would wait in vain, and batch 0 would fail.
    dataset = GatedFilled(4, opener=2)
    batches = list(loader(dataset, num_workers=1, collate_fn=collate_gated, timeout=60))
    assert [batch["gate"] for batch in batches] == ["sent", None]
    # Batch 1 was collated into a buffer while batch 0 still held its own: neither was
    # written over by the other.
    assert torch.equal(batches[0]["tensor"], expected(0))
    assert torch.equal(batches[1]["tensor"], expected(2))
    assert all(in_buffer(batch["tensor"]) for batch in batches)


class Tracked:
    """A payload whose lifetime the test can see."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (str, ("tracked",))


def test_an_idle_sending_thread_holds_no_batch() -> None:
    # A batch kept alive in the worker keeps the buffers it was collated into from reuse, so
    # once its answer is sent the thread must let go of it, even with nothing more to send.
    reader, writer = multiprocess.Pipe(duplex=False)
    buffers = BufferSender(workers=1)
    answers = AnswerSender(0, writer, buffers)
    try:
        payload = Tracked()
        alive = weakref.ref(payload)
        answers.put(5, 0, statecore.TaskCompleted(5, 0, payload), buffers.begin())
        del payload
        assert reader.poll(GONE_WITHIN)
        reader.recv_bytes()
        assert wait_until(lambda: alive() is None, GONE_WITHIN)
    finally:
        answers.close()
        reader.close()
        writer.close()
