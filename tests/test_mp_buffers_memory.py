"""The mp executor's buffers give their memory back once the consumer lets go of its batches.

A consumer that keeps many large batches makes each worker's pool grow to its limit; what the
tests check is that the memory goes back once it lets go: while it reads on, when it stops
reading, between the epochs of persistent workers, and when the loader is gone.

Memory is measured three ways, for real:

- the main process's own account (`BufferReceiver`): the bytes of the buffers it maps, and the
  buffers lent to it whose lease is alive (a tensor on them is still in use);
- the system's: every statecore buffer that the main process or a worker holds a descriptor for
  (a mapping of a buffer keeps one, in both), counted once by its inode, with the memory the
  system has allocated to it (`st_blocks` of the memfd). A buffer its worker closed holds none,
  even while the main process still maps it;
- each process's: the buffers a worker holds open, and the buffers the main process maps, from
  `/proc/<pid>/fd` and `/proc/<pid>/maps`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch
from _processes import alive, wait_gone, wait_until
from _wire import NUMEL
from torch.utils.data import Dataset

import statecore
from statecore.executors._mp import BUFFERS_PER_WORKER, BufferReceiver, BufferSender
from statecore.executors._mp.wire import BufferClosed

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")

TIMEOUT = 180
"""For each test that starts workers: none may hang the suite."""
WITHIN = 30.0
"""How long memory may take to go back once nothing more is asked of the loader: generous, for
a busy machine; it goes back within the executor's LINGER (half a second)."""

BUFFER = "/memfd:statecore-buffer-"
TORCH_SEGMENT = "/dev/shm/torch_"
MB = 1 << 20
ELEMENTS = 1 << 20
BATCH = 4 * ELEMENTS
"""Bytes of each batch: one float32 sample of 4 MiB (batch_size=1), which fills one buffer."""
KEPT = 50
WORKERS = 2
PREFETCH = 2  # torch's default prefetch_factor
SETTLED_PER_WORKER = PREFETCH + 2 + 2
"""Buffers a worker's pool holds at most once the consumer lets go: the batches in flight
(prefetch_factor), the one the consumer holds and the one it dropped last (which goes back with
the next task), and the two free ones the pool keeps for the next batches."""
SETTLED = WORKERS * SETTLED_PER_WORKER * BATCH
"""Bytes the buffers of all workers hold at most once the consumer lets go: 12 batches' worth,
where the pools grew to hold 32 (BUFFERS_PER_WORKER each)."""
READ_ON = 2 * WORKERS * PREFETCH
"""Batches read on after letting go: by then each worker has been sent a task (which gives its
buffers back, unless they went back on their own before), and the main process has read its
answer (behind which come the notices of the buffers it closed)."""


class Large(Dataset[torch.Tensor]):
    """Item i: a 4 MiB float32 tensor filled with i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((ELEMENTS,), float(index))


def loader(n: int, **options: Any) -> statecore.DataLoader[torch.Tensor]:
    return statecore.DataLoader(
        Large(n), batch_size=1, num_workers=WORKERS, executor="mp", **options
    )


def expected(index: int) -> torch.Tensor:
    return torch.full((1, ELEMENTS), float(index))


# --- measuring -----------------------------------------------------------------------------


def _maker(name: str) -> int:
    """The worker that made a buffer, from its name: statecore-buffer-<pid>-<number>."""
    return int(name[len(BUFFER) :].split("-")[0])


def buffers_open(pid: int, makers: Iterable[int]) -> dict[int, int]:
    """The buffers made by `makers` that process `pid` holds a descriptor for: inode -> bytes
    of memory the system has allocated to it."""
    makers = set(makers)
    found: dict[int, int] = {}
    for entry in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{entry}"
        try:
            name = os.readlink(path)
            if name.startswith(BUFFER) and _maker(name) in makers:
                status = os.stat(path)
                found[status.st_ino] = status.st_blocks * 512
        except OSError:
            continue  # closed meanwhile
    return found


def buffers_mapped(pid: int, makers: Iterable[int]) -> set[int]:
    """The inodes of the buffers made by `makers` that process `pid` maps."""
    makers = set(makers)
    found = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(BUFFER) and _maker(fields[5]) in makers:
                found.add(int(fields[4]))
    return found


def torch_segments() -> int:
    """How many of torch's own shared-memory segments this process holds a descriptor for."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{entry}").startswith(TORCH_SEGMENT)
        except OSError:
            continue
    return count


def mapped_bytes(receiver: BufferReceiver) -> int:
    """Bytes of the buffers the main process maps, by its own account."""
    with receiver.lock:
        return sum(len(memory) for memory in receiver.mapped.values())


def leased(receiver: BufferReceiver) -> int:
    """How many buffers lent to the main process something still uses."""
    with receiver.lock:
        leases = [lease for held in receiver.lent.values() for lease in held.values()]
    return sum(lease is not None and lease() is not None for lease in leases)


class Run:
    """A loader's iterator, its executor's buffers, and every process that holds them."""

    def __init__(self, iterator: Iterator[torch.Tensor]) -> None:
        executor = iterator._driver.executor  # type: ignore[attr-defined]
        self.receiver: BufferReceiver = executor.buffers
        self.workers = [process.pid for process in executor.processes.values()]
        self.pids = [os.getpid(), *self.workers]

    def held(self, pid: int) -> dict[int, int]:
        return buffers_open(pid, self.workers) if alive(pid) or pid == os.getpid() else {}

    def allocated(self) -> int:
        """Bytes the system holds for the buffers, each counted once, whoever holds it."""
        held: dict[int, int] = {}
        for pid in self.pids:
            try:
                held.update(self.held(pid))
            except FileNotFoundError:
                continue  # a worker that is gone holds nothing
        return sum(held.values())

    def pool_sizes(self) -> list[int]:
        return [len(self.held(pid)) for pid in self.workers]

    def pools_settled(self) -> bool:
        return all(size <= SETTLED_PER_WORKER for size in self.pool_sizes())

    def mapped_here(self) -> set[int]:
        return buffers_mapped(os.getpid(), self.workers)


def hoard(iterator: Iterator[torch.Tensor]) -> tuple[list[torch.Tensor], Run]:
    """Keep KEPT batches; the pools have grown to their limit."""
    kept = [next(iterator) for _ in range(KEPT)]
    for index, batch in enumerate(kept):
        assert torch.equal(batch, expected(index))
    run = Run(iterator)
    assert len(run.workers) == WORKERS
    grown = [BUFFERS_PER_WORKER] * WORKERS
    assert wait_until(lambda: run.pool_sizes() == grown, WITHIN), run.pool_sizes()
    return kept, run


# --- the pools grow ------------------------------------------------------------------------


@pytest.mark.timeout(TIMEOUT)
def test_a_consumer_keeping_fifty_large_batches_grows_every_pool_to_its_limit() -> None:
    segments = torch_segments()
    iterator = iter(loader(4 * KEPT))
    kept, run = hoard(iterator)
    grown = WORKERS * BUFFERS_PER_WORKER * BATCH
    assert mapped_bytes(run.receiver) == grown
    assert len(run.mapped_here()) == WORKERS * BUFFERS_PER_WORKER
    assert leased(run.receiver) == WORKERS * BUFFERS_PER_WORKER
    assert run.allocated() == grown
    # What no buffer could take came torch's way, in segments of its own.
    assert torch_segments() >= segments + KEPT - WORKERS * BUFFERS_PER_WORKER
    del kept


# --- and shrink once the consumer lets go --------------------------------------------------


@pytest.mark.timeout(TIMEOUT)
def test_once_the_consumer_lets_go_and_reads_on_the_buffers_fall_back_to_a_few_batches() -> None:
    segments = torch_segments()
    iterator = iter(loader(4 * KEPT))
    kept, run = hoard(iterator)
    del kept
    for index in range(KEPT, KEPT + READ_ON):
        batch = next(iterator)
        assert torch.equal(batch, expected(index))
    del batch
    assert mapped_bytes(run.receiver) <= SETTLED
    assert len(run.mapped_here()) <= WORKERS * SETTLED_PER_WORKER
    assert leased(run.receiver) <= WORKERS * PREFETCH  # the batches read ahead
    assert wait_until(run.pools_settled, WITHIN), run.pool_sizes()
    assert run.allocated() <= SETTLED
    assert torch_segments() <= segments


@pytest.mark.timeout(TIMEOUT)
def test_once_the_consumer_lets_go_without_reading_on_the_workers_give_the_memory_back() -> None:
    # No task goes to the workers, so their buffers go back on their own. The pages of those
    # the workers close go at once, though the main process maps them until it reads on.
    iterator = iter(loader(4 * KEPT))
    kept, run = hoard(iterator)
    del kept
    assert leased(run.receiver) <= WORKERS * PREFETCH  # the batches read ahead
    assert wait_until(run.pools_settled, WITHIN), run.pool_sizes()
    assert wait_until(lambda: run.allocated() <= SETTLED, WITHIN), run.allocated() / MB
    # Reading on, the main process learns which buffers were closed, and unmaps them.
    for index in range(KEPT, KEPT + READ_ON):
        assert torch.equal(next(iterator), expected(index))
    assert mapped_bytes(run.receiver) <= SETTLED
    assert len(run.mapped_here()) <= WORKERS * SETTLED_PER_WORKER


@pytest.mark.timeout(TIMEOUT)
def test_persistent_workers_give_back_between_epochs_what_the_consumer_let_go_of() -> None:
    persistent = loader(KEPT, persistent_workers=True)
    epoch = iter(persistent)
    kept, run = hoard(epoch)
    with pytest.raises(StopIteration):
        next(epoch)  # the epoch is over: no task goes to the workers until the next one
    del kept, epoch
    assert wait_until(run.pools_settled, WITHIN), run.pool_sizes()
    assert wait_until(lambda: run.allocated() <= SETTLED, WITHIN), run.allocated() / MB
    # The next epoch runs on the same workers, and their pools stay small.
    for index, batch in enumerate(persistent):
        assert torch.equal(batch, expected(index))
    del batch
    assert all(alive(pid) for pid in run.workers)
    assert run.allocated() <= SETTLED
    del persistent
    gc.collect()
    assert not wait_gone(run.workers, WITHIN)


@pytest.mark.timeout(TIMEOUT)
def test_once_the_loader_is_gone_and_the_consumer_lets_go_nothing_is_left() -> None:
    segments = torch_segments()
    iterator = iter(loader(4 * KEPT))
    kept, run = hoard(iterator)
    del iterator
    gc.collect()
    assert not wait_gone(run.workers, WITHIN)
    # The kept batches outlive their loader and its workers, on the buffers they use...
    assert len(run.mapped_here()) == WORKERS * BUFFERS_PER_WORKER
    for index, batch in enumerate(kept):
        assert torch.equal(batch, expected(index))
    del kept, batch
    # ...and once they go, nothing is left: no buffer mapped or open, no segment of torch's.
    assert run.mapped_here() == set()
    assert run.allocated() == 0
    assert torch_segments() <= segments


# --- the pieces, in one process ------------------------------------------------------------


def place(sender: BufferSender, receiver: BufferReceiver, value: float) -> tuple[bytes, Any]:
    """A batch placed as a worker places it; its buffers announced to the receiver."""
    batch = sender.begin()
    payload, lent = sender.dumps(torch.full((NUMEL,), value), batch)
    for notice in sender.notices():
        receiver.notice(0, notice)
    sender.end(batch)
    return payload, lent


def allocated_under(memory: mmap.mmap | ctypes.Array[ctypes.c_char]) -> int:
    """Bytes the system holds for the buffer this process maps at `memory`."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if int(fields[0].split("-")[0], 16) == address:
                inode = int(fields[4])
                break
        else:
            raise AssertionError(f"nothing is mapped at {address:#x}")
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            status = os.stat(f"/proc/self/fd/{entry}")
            if status.st_ino == inode:
                return status.st_blocks * 512
    raise AssertionError(f"no descriptor holds inode {inode}")


def test_buffers_given_back_with_no_task_shrink_the_pool_to_its_spare(
    pair: tuple[BufferSender, BufferReceiver],
) -> None:
    sender, receiver = pair
    lent = [ident for value in range(6) for ident in place(sender, receiver, value)[1]]
    assert sorted(sender.buffers) == lent == [0, 1, 2, 3, 4, 5]
    sender.returned((0, 1, 2, 3))  # the consumer still uses the last two batches
    assert sender.trim()
    # Two free ones stay for the next batches (twice what a batch took); those in use stay,
    # and the least recently used go.
    assert sorted(sender.buffers) == [2, 3, 4, 5]
    assert sender.notices() == [BufferClosed(0), BufferClosed(1)]
    assert not sender.trim()


def test_a_buffer_its_worker_closed_holds_no_memory_though_the_main_process_maps_it(
    pair: tuple[BufferSender, BufferReceiver],
) -> None:
    sender, receiver = pair
    payload, lent = place(sender, receiver, 1.0)
    (buffer,) = lent
    receiver.loads(0, lent, payload)  # the batch is dropped at once
    memory = receiver.mapped[(0, buffer)]
    assert allocated_under(memory) == 4 * NUMEL
    # Given back and closed by its worker, before the notice reaches the main process.
    sender.returned(receiver.returns_for(0))
    sender.spare = 0
    assert sender.trim()
    assert allocated_under(memory) == 0
    (notice,) = sender.notices()
    del memory
    receiver.notice(0, notice)
    assert mapped_bytes(receiver) == 0


def test_a_lease_that_ends_posts_its_worker_for_its_buffers_to_go_back(
    pair: tuple[BufferSender, BufferReceiver],
) -> None:
    sender, receiver = pair
    payload, lent = place(sender, receiver, 1.0)
    tensor = receiver.loads(0, lent, payload)
    view = tensor[:10]
    del tensor
    assert receiver.let_go.empty()  # the view still uses the buffer
    del view
    assert receiver.let_go.get_nowait() == 0
    assert receiver.let_go.empty()
    assert receiver.returns_for(0) == lent
