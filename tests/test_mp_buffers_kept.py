"""Buffers that outlive their workers: kept by the main process, adopted by the next workers.

When forked workers end, the buffers of theirs that nothing uses any more stay mapped in the
main process (`leases.KEPT`), and the next forked workers (the next epoch's, or a later
loader's) start with them, so their first batches go into pages already faulted in. What the
tests check: the next workers do adopt them and their batches are right; a buffer a batch still
uses is never handed on; what is kept stays within its bounds, goes once unused for
`idle` seconds, and is never kept where it cannot be handed on (page-locked buffers, spawned
workers). Which buffers a process holds is read from /proc, by the name each buffer was made
with (`statecore-buffer-<pid of the worker that made it>-<number>`).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from _processes import true_in_a_fork, wait_until
from _wire import NUMEL, Filled

import statecore
from statecore.executors._mp import BufferReceiver, BufferSender, leases
from statecore.executors._mp import executor as executor_module

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="buffers need memfd")

TIMEOUT = 120
WITHIN = 30.0
BUFFER = "/memfd:statecore-buffer-"
BATCH = 2
"""Items per batch: 2 MiB of float32, one buffer a batch."""
ITEMS = 16 * BATCH


def loader(**options: Any) -> statecore.DataLoader[torch.Tensor]:
    options = {"multiprocessing_context": "fork", "num_workers": 2, **options}
    return statecore.DataLoader(Filled(ITEMS), batch_size=BATCH, **options)


def right(number: int, batch: torch.Tensor) -> bool:
    return torch.equal(batch, right_batch(number))


def check(batches: Iterable[torch.Tensor]) -> None:
    """Every batch of an epoch is right; each is let go of before the next comes."""
    count = 0
    for number, batch in enumerate(batches):
        assert right(number, batch), f"batch {number} is wrong"
        count += 1
    assert count == ITEMS // BATCH


def right_batch(number: int) -> torch.Tensor:
    """What batch `number` holds."""
    expected = torch.arange(number * BATCH, (number + 1) * BATCH, dtype=torch.float32)
    return expected[:, None].expand(BATCH, NUMEL).contiguous()


def buffer_mappings(pid: int) -> set[tuple[int, int]]:
    """The buffers process `pid` maps: per buffer, the pid of the worker that made it and its
    inode number."""
    found = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(BUFFER):
                maker = int(fields[5][len(BUFFER) :].split("-")[0])
                found.add((maker, int(fields[4])))
    return found


def makers(pid: int) -> set[int]:
    """The pids of the workers that made the buffers process `pid` maps."""
    return {maker for maker, _ in buffer_mappings(pid)}


def mapped_here() -> int:
    """How many distinct buffers this process maps."""
    return len({inode for _, inode in buffer_mappings(os.getpid())})


def buffer_fds_here() -> int:
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{entry}").startswith(BUFFER)
        except OSError:
            continue
    return count


@pytest.mark.timeout(TIMEOUT)
def test_a_later_loader_s_workers_adopt_the_buffers_the_last_one_s_workers_left() -> None:
    check(loader())
    gc.collect()
    # The first loader's workers are gone; the buffers they made are still mapped here.
    earlier = makers(os.getpid())
    assert earlier
    iterator = iter(loader())
    batch = next(iterator)
    assert right(0, batch)
    workers = [p.pid for p in iterator._driver.executor.processes.values()]  # type: ignore[attr-defined]
    assert workers and not earlier & set(workers)
    adopted = set().union(*(makers(pid) for pid in workers))
    assert adopted & earlier, "the new workers map none of the buffers the last ones made"
    del batch
    check([right_batch(0), *iterator])


@pytest.mark.timeout(TIMEOUT)
def test_the_next_epoch_of_a_loader_without_persistent_workers_adopts_them_too() -> None:
    made = loader(persistent_workers=False)
    check(made)
    earlier = makers(os.getpid())
    iterator = iter(made)
    batch = next(iterator)
    assert right(0, batch)
    workers = [p.pid for p in iterator._driver.executor.processes.values()]  # type: ignore[attr-defined]
    assert set().union(*(makers(pid) for pid in workers)) & earlier
    del batch
    check([right_batch(0), *iterator])


@pytest.mark.timeout(TIMEOUT)
def test_a_buffer_a_batch_still_uses_is_not_handed_to_the_next_workers() -> None:
    iterator = iter(loader())
    for batch in iterator:  # each batch let go of as the next comes, but the last
        last = batch
    del batch
    held = last.untyped_storage().data_ptr()
    # The loader ends with the last batch held: its buffer stays this batch's alone.
    del iterator
    gc.collect()
    kept = leases.KEPT.take(len(leases.KEPT))
    assert kept, "nothing was kept of the buffers no batch uses"
    for buffer in kept:
        start = leases.ctypes.addressof(buffer.memory)
        assert not start <= held < start + len(buffer.memory)
    leases.KEPT.keep(kept)
    # The next loader's workers overwrite every buffer they adopted; the batch is untouched.
    check(loader())
    assert right(ITEMS // BATCH - 1, last)


def held_by(pid: int) -> set[int]:
    """The buffers (their inode numbers) process `pid` maps or holds a descriptor of."""
    found = {inode for _, inode in buffer_mappings(pid)}
    for entry in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{entry}").startswith(BUFFER):
                found.add(os.stat(f"/proc/{pid}/fd/{entry}").st_ino)
    return found


def kept_here() -> set[int]:
    return {os.fstat(buffer.fd).st_ino for buffer in leases.KEPT.items}


@pytest.mark.timeout(TIMEOUT)
def test_a_worker_holds_none_of_the_kept_buffers_it_did_not_adopt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check(loader())
    gc.collect()
    assert len(leases.KEPT) >= 2
    monkeypatch.setattr(executor_module, "BUFFERS_PER_WORKER", 1)  # each worker adopts one
    iterator = iter(loader(num_workers=1))
    batch = next(iterator)
    left = kept_here()
    assert left, "the worker adopted every kept buffer: nothing left to check"
    (worker,) = [p.pid for p in iterator._driver.executor.processes.values()]  # type: ignore[attr-defined]
    assert not held_by(worker) & left, "the worker still holds kept buffers it did not adopt"
    del batch
    check([right_batch(0), *iterator])


@pytest.mark.timeout(TIMEOUT)
def test_a_process_forked_while_buffers_are_kept_holds_none_of_them() -> None:
    check(loader())
    gc.collect()
    left = kept_here()
    assert left
    holds_none = true_in_a_fork(lambda: not held_by(os.getpid()) & left)
    assert holds_none, "a forked child holds the kept buffers on"
    assert kept_here() == left  # and this process keeps them still


@pytest.mark.timeout(TIMEOUT)
def test_what_is_kept_stays_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases.KEPT, "most", 2)
    check(loader())
    gc.collect()
    assert len(leases.KEPT) == 2
    # The buffers beyond the bound are unmapped, their descriptors closed.
    assert mapped_here() == 2 and buffer_fds_here() == 2
    monkeypatch.setattr(leases.KEPT, "most", 32)
    monkeypatch.setattr(leases.KEPT, "most_bytes", 4 * NUMEL * BATCH)  # one buffer's worth
    leases.KEPT.release()
    check(loader())
    gc.collect()
    assert len(leases.KEPT) == 1 and mapped_here() == 1


@pytest.mark.timeout(TIMEOUT)
def test_kept_buffers_are_released_once_no_worker_took_any_for_the_idle_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(leases.KEPT, "idle", 0.2)
    check(loader())
    gc.collect()
    assert wait_until(lambda: len(leases.KEPT) == 0, WITHIN)
    assert wait_until(lambda: mapped_here() == 0 and buffer_fds_here() == 0, WITHIN)
    assert wait_until(
        lambda: "statecore-kept-buffers" not in [t.name for t in leases.threading.enumerate()],
        WITHIN,
    )


@pytest.mark.timeout(TIMEOUT)
def test_spawned_workers_keep_nothing_for_the_next_ones() -> None:
    check(loader(multiprocessing_context="spawn"))
    gc.collect()
    assert len(leases.KEPT) == 0 and mapped_here() == 0


def test_page_locked_buffers_are_never_kept_nor_adopted(
    pair: tuple[BufferSender, BufferReceiver],
) -> None:
    sender, receiver = pair
    receiver.register_with(lambda address, length: None)
    batch = sender.begin()
    payload, lent = sender.dumps(torch.ones(NUMEL), batch)
    for notice in sender.notices():
        receiver.notice(0, notice)
    sender.end(batch)
    receiver.loads(0, lent, payload)
    receiver.close(keep=True)
    assert len(leases.KEPT) == 0
    # And a receiver that page-locks takes none that another left.
    other = BufferReceiver()
    other_sender = BufferSender()
    batch = other_sender.begin()
    payload, lent = other_sender.dumps(torch.ones(NUMEL), batch)
    for notice in other_sender.notices():
        other.notice(0, notice)
    other.loads(0, lent, payload)
    other.close(keep=True)
    assert len(leases.KEPT) == 1
    assert receiver.adopt(1, 4) == ()
    assert len(leases.KEPT) == 1
