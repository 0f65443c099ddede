"""Page-locking the workers' buffers in place, for the stage's copies to the GPU.

With `pinned("mp", device="cuda")` each buffer of a worker's pool is registered with CUDA as it
is announced, so its batches arrive pinned and are copied to the device straight from the
buffer (executors/_mp/leases.py, executors/_pinned.py). A registration must be undone before
its mapping goes, and the mapping may go only after the last tensor on it (the stage's copy
holds its batch until the copy has run: tests/test_pinned_lifetime.py).

On a machine without CUDA the tests hand the stage a stand-in copy whose `register` only
records; the last test needs CUDA.
"""

from __future__ import annotations

import gc
import mmap
import os
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from _side_by_side import WORKERS

import statecore
from statecore.executors import PinnedExecutor, pinned
from statecore.executors._mp import leases
from statecore.executors._pinned import LendsBuffers, PageLocking, Pinned

Log = list[tuple[str, int]]

SAMPLE = 1 << 18  # float32 values: 1 MB a sample, well above what travels inside the message


class RecordingCopy:
    """A device copy that copies nothing: `register` records what it would page-lock."""

    def __init__(self) -> None:
        self.log: Log = []

    def register(self, address: int, length: int) -> Callable[[], None]:
        self.log.append(("registered", address))
        return lambda: self.log.append(("unregistered", address))

    def launch(self, batch: Any) -> Any:
        return batch

    def claim(self, ticket: Any) -> Any:
        return ticket


@attrs.frozen
class RecordingPinned(Pinned):
    """The pin stage with `RecordingCopy` as its device copy, on a machine without a GPU."""

    copy: RecordingCopy = attrs.field(factory=RecordingCopy, kw_only=True)

    def _device_copy(self) -> RecordingCopy:
        return self.copy


def registered(log: Log) -> list[int]:
    return [address for kind, address in log if kind == "registered"]


def test_a_page_locked_buffer_is_unregistered_just_before_it_is_unmapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: Log = []
    libc = leases._libc()

    class Unmapping:
        def __getattr__(self, name: str) -> Any:
            return getattr(libc, name)

        def munmap(self, address: int, length: int) -> int:
            log.append(("unmapped", address))
            return int(libc.munmap(address, length))

    monkeypatch.setattr(leases, "_libc", Unmapping)
    fd = os.memfd_create("buffer")
    os.ftruncate(fd, 2 * mmap.PAGESIZE)
    try:
        memory = leases._map(fd, 2 * mmap.PAGESIZE, lambda address, length: (
            log.append(("registered", address)) or (lambda: log.append(("unregistered", address)))
        ))  # fmt: skip
    finally:
        os.close(fd)
    lease = memoryview(memory)
    address = registered(log)[0]
    del memory
    gc.collect()
    assert log == [("registered", address)]  # a lease still reads it
    del lease
    gc.collect()
    assert log == [("registered", address), ("unregistered", address), ("unmapped", address)]


def test_a_refused_registration_leaves_the_buffer_mapped_as_any_other() -> None:
    fd = os.memfd_create("buffer")
    os.ftruncate(fd, mmap.PAGESIZE)
    try:
        memory = leases._map(fd, mmap.PAGESIZE, lambda address, length: None)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)  # as the batches are built on it
    tensor[:5] = torch.tensor(list(b"hello"), dtype=torch.uint8)
    assert bytes(tensor[:5].tolist()) == b"hello" and len(tensor) == mmap.PAGESIZE


class Lender:
    """An inner executor that lends buffers: it only records who asked to page-lock them."""

    def __init__(self) -> None:
        self.register: Callable[[int, int], Any] | None = None

    def register_buffers(self, register: Callable[[int, int], Any]) -> None:
        self.register = register

    def start(self) -> None: ...
    def dispatch(self, command: Any) -> None: ...
    def resume(self, command: Any) -> None: ...
    def poll(self, timeout: float | None) -> None: ...
    def stop_worker(self, worker: int) -> None: ...
    def shutdown(self) -> None: ...


def test_the_stage_page_locks_the_inner_buffers_only_when_it_copies_to_a_device() -> None:
    assert isinstance(Lender(), LendsBuffers) and isinstance(RecordingCopy(), PageLocking)
    copying, pinning_only = Lender(), Lender()
    device_copy = RecordingCopy()
    PinnedExecutor(copying, lambda batch: batch, threaded=False, copy=device_copy)
    PinnedExecutor(pinning_only, lambda batch: batch, threaded=False)
    assert copying.register == device_copy.register
    assert pinning_only.register is None  # the consumer's own copies may outlive its hold


@WORKERS
def test_every_buffer_page_locked_under_mp_is_unregistered_once_the_loader_is_gone() -> None:
    stage = RecordingPinned("mp", pin=lambda batch: batch)
    loader = statecore.DataLoader(
        range(24), batch_size=2, num_workers=2, executor=stage,
        collate_fn=lambda items: torch.stack([torch.full((SAMPLE,), float(i)) for i in items]),
    )  # fmt: skip
    got = [batch[:, 0].tolist() for batch in loader]
    assert got == [[float(2 * n), float(2 * n + 1)] for n in range(12)]
    log = stage.copy.log
    assert registered(log), "no buffer of the workers was page-locked"
    del loader
    gc.collect()
    unregistered = sorted(address for kind, address in log if kind == "unregistered")
    assert unregistered == sorted(registered(log))


# --- on a GPU machine ----------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@WORKERS
def test_on_cuda_batches_arrive_page_locked_and_reach_the_device_intact() -> None:
    arrived_pinned: list[bool] = []

    def pin(batch: torch.Tensor) -> torch.Tensor:
        arrived_pinned.append(batch.is_pinned())
        pinned_batch = batch.pin_memory()
        if arrived_pinned[-1]:
            assert pinned_batch.data_ptr() == batch.data_ptr()  # pinned where it lay: no copy
        return pinned_batch

    loader = statecore.DataLoader(
        range(64), batch_size=4, num_workers=2, executor=pinned("mp", device="cuda", pin=pin),
        collate_fn=lambda items: torch.stack([torch.full((SAMPLE,), float(i)) for i in items]),
    )  # fmt: skip
    for number, batch in enumerate(loader):
        assert batch.device.type == "cuda"
        expected = torch.arange(4 * number, 4 * number + 4, dtype=torch.float32, device="cuda")
        assert torch.equal(batch.mean(dim=1), expected)
    assert sum(arrived_pinned) >= len(arrived_pinned) // 2, arrived_pinned
