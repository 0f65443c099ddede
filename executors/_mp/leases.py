"""The main process's side of the workers' buffer pools: the mapped buffers, and leases.

Run by the main process (the loader's; a worker's side is `pool`).

The main process maps each buffer a worker announces (`wire.BufferOpened`), and builds the
large storages of each batch on its mapping. Those storages are not `is_shared()`, unlike
torch's: their memory is the worker's to reuse, so it must not be handed to a third process. A
consumer that sends such a tensor on (a torch.multiprocessing queue, `share_memory_()`) makes
torch move it to a segment of its own, as it does for any tensor, and that move gives the
buffer back.

A buffer a message refers to is *lent* to this process until it gives it back. The storages
built on it hold a *lease*, a view of the buffer's mapping, for as long as their memory is in
use: the lease goes only when the storages are freed (no tensor, view or numpy array on them
is left) or moved. A buffer goes back, with the next task sent to its worker, once its lease
is gone. Every message names the buffers it refers to in its header, so that they go back
even when the message fails to unpickle. The end of a lease is also posted (`let_go`), so that
the executor gives back on their own the buffers that no task carries back soon: a worker that
is sent no more tasks would otherwise keep its pool, and this process its mappings, as large
as the consumer made them.

Page-locked buffers: a pin stage that copies each batch to the GPU itself (`pinned(device=...)`)
hands this side a `register` function (`register_with`). Every buffer is then mapped and
page-locked for the device once, as it is announced, so the batches built on it are pinned
already: the stage neither copies them into pinned memory nor allocates any, and the device
copy reads the worker's buffer directly. Registration is undone just before the mapping goes,
which is after the last lease on it: the stage's copy holds its batch, and so the buffer's
lease, until the copy has run (`_pinned.CudaCopy`). Only that stage asks for it: a batch handed
to the consumer in host memory could be let go of while the consumer's own asynchronous copy
still reads it, and the buffer would go back to its worker under that copy.

File descriptors: under torch's default sharing strategy, `file_descriptor`, this process
keeps one per buffer it maps, as it does for every tensor torch shares; under `file_system` it
maps each buffer and closes the descriptor at once, so the buffers hold none there (nor do
page-locked buffers, which are mapped the same way). Running out of descriptors is reported as
such (`descriptors`).

Buffers that outlive their workers: when a fork executor shuts down, the buffers of its
workers that nothing uses any more (no lease on them, not page-locked) are not unmapped but
*kept* by this process (`KEPT`), and the next worker forked in this process, of the same loader
(a loader without persistent workers starts fresh ones every epoch) or of a later one, adopts
them: its first batches are collated into pages that were faulted in already, rather than
into fresh memory (a page's first write costs the kernel a fault, about 9,400 of them for a
batch of 64 images). What is kept is bounded (32 buffers and 1 GiB, `_keeping`'s
bounds: a batch of 64 images of 224x224 takes a buffer of 38.5 MB, and two workers cycle six
of them; beyond that a buffer is unmapped as before) and released once no worker has taken
any for 30 seconds. Only under torch's default sharing strategy (the descriptor each buffer
holds here is what a forked worker inherits and maps) and only for fork workers (spawn and
forkserver workers inherit no descriptor): elsewhere nothing is kept. Any process forked while
buffers are kept unmaps its copies of those it did not adopt at once (`Kept.forget_in_child`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import pickle
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from statecore.executors._keeping import Keeping
from statecore.executors._mp.descriptors import (
    explain_exhaustion,
    sharing_strategy,
    unreceived,
)
from statecore.executors._mp.wire import RECEIVING, BufferClosed, BufferOpened

__all__ = [
    "KEPT",
    "Adopted",
    "BufferReceiver",
    "HostRegister",
    "Kept",
]

HostRegister = Callable[[int, int], Callable[[], None] | None]
"""Page-locks `length` bytes at `address` for a device's copies; returns what undoes it, or
None where the memory could not be page-locked (the batches on it are then pinned by copying,
as any others)."""


class _Receipt:
    """The leases made while one message is unpickled, one per buffer it refers to."""

    def __init__(self, receiver: BufferReceiver, worker: int) -> None:
        self.receiver = receiver
        self.worker = worker
        self.leases: dict[int, weakref.ref[memoryview]] = {}
        self.table: tuple[tuple[tuple[int, ...], tuple[torch.UntypedStorage, ...]], ...] | None
        self.table = None
        """Per large storage of the batch, its windows: their starts, and their storages."""

    def storage(self, buffer: int, start: int, nbytes: int) -> torch.UntypedStorage:
        known = self.leases.get(buffer)
        lease = None if known is None else known()
        if lease is None:
            receiver = self.receiver
            with receiver.lock:
                memory = receiver.mapped.get((self.worker, buffer))
                if memory is None:
                    raise RuntimeError(
                        receiver.missing.get(
                            (self.worker, buffer),
                            f"buffer {buffer} of worker {self.worker} is unknown: "
                            "it was never announced",
                        )
                    )
                # The lease: a view of the mapping that the storages built on the buffer keep
                # for as long as their memory is in use, and release when they are freed or
                # moved (by share_memory_(), say).
                lease = memoryview(memory)
            self.leases[buffer] = weakref.ref(lease, receiver.ended(self.worker))
        return torch.frombuffer(
            lease, dtype=torch.uint8, count=nbytes, offset=start
        ).untyped_storage()


_Mapping = mmap.mmap | ctypes.Array[ctypes.c_char]

Adopted = tuple[tuple[int, int, int], ...]
"""Buffers a worker adopts as it starts: per buffer, its number, its capacity and the file
descriptor (this process's, which a forked worker inherits) that maps it."""


class _Keeping:
    """A buffer kept for the next workers: its mapping here, and the descriptor behind it."""

    __slots__ = ("fd", "memory")

    def __init__(self, memory: ctypes.Array[ctypes.c_char], fd: int) -> None:
        self.memory = memory
        self.fd = fd
        """Closed with the mapping, by its finalizer (`_map`): valid while `memory` lives."""


class Kept(Keeping[_Keeping]):
    """The buffers of workers that are gone, kept by this process for the next ones (see the
    docstring): a forked child unmaps its copies and closes its descriptors of them, so that it
    does not hold the kept memory (`Keeping.forget_in_child`). One per process (`KEPT`)."""

    def __init__(self) -> None:
        super().__init__(lambda kept: len(kept.memory), "statecore-kept-buffers")

    def keep(self, buffers: list[_Keeping]) -> None:
        """Keep `buffers`, as far as the bounds allow; the rest are unmapped as they go."""
        with self.lock:
            for buffer in buffers:
                if self._fits(buffer, self._held()):
                    self.items.append(buffer)
            self._rearm()

    def take(self, most: int) -> list[_Keeping]:
        """Up to `most` kept buffers, largest first, for a worker about to start."""
        with self.lock:
            self.items.sort(key=lambda kept: len(kept.memory), reverse=True)
            taken, self.items = self.items[:most], self.items[most:]
            self._rearm()
            return taken


KEPT = Kept()
"""This process's kept buffers."""

os.register_at_fork(after_in_child=KEPT.forget_in_child)


class BufferReceiver:
    """The main process's side of every worker's pool: its mappings, and what is lent."""

    def __init__(self) -> None:
        self.mapped: dict[tuple[int, int], _Mapping] = {}
        self.descriptors: dict[tuple[int, int], int] = {}
        """The descriptor behind each mapping that keeps one (`_map`), which shutdown may keep
        for the next workers (`close`); popped with its mapping."""
        self.missing: dict[tuple[int, int], str] = {}
        """Why a buffer announced could not be mapped, as the error to raise when used."""
        self.lent: dict[int, dict[int, weakref.ref[memoryview] | None]] = {}
        """Per worker, the buffers lent to this process, each with the lease of its storages."""
        self.let_go: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        """The worker of each lease that ended, posted as it ends: its buffers may go back."""
        self._ended: dict[int, Callable[[weakref.ref[memoryview]], None]] = {}
        # Messages may be received on one thread (a pin stage's) while tasks are sent and the
        # executor shut down on another (the driver's).
        self.lock = threading.Lock()
        self.register: HostRegister | None = None
        """Set by `register_with`: every buffer mapped from then on is page-locked."""

    def register_with(self, register: HostRegister) -> None:
        """Page-lock every buffer announced from now on with `register` (see the docstring)."""
        self.register = register

    def ended(self, worker: int) -> Callable[[weakref.ref[memoryview]], None]:
        """The callback of `worker`'s leases, which posts the worker to `let_go` as one ends.

        It runs wherever the consumer frees the last tensor on a buffer, any thread, even inside
        a garbage collection, so it only posts: `SimpleQueue.put` is safe there.
        """
        callback = self._ended.get(worker)
        if callback is None:
            callback = self._ended[worker] = functools.partial(_post, self.let_go, worker)
        return callback

    def notice(self, worker: int, notice: BufferOpened | BufferClosed) -> None:
        key = (worker, notice.ident)
        if isinstance(notice, BufferClosed):
            with self.lock:
                self.mapped.pop(key, None)  # not lent, so nothing on it is left to read
                self.descriptors.pop(key, None)
            return
        which = f"buffer {notice.ident} of worker {worker}"
        try:
            fd = notice.handle.detach()
        except Exception as error:  # the worker died, most likely; its death is reported
            self.missing[key] = unreceived(error, which, "its descriptor could not be fetched")
            return
        # Under torch's default strategy the mapping keeps the descriptor, for the next
        # workers (`Kept`); under file_system, or page-locked, it keeps none.
        keep = self.register is None and sharing_strategy() != "file_system"
        try:
            memory = _map(fd, notice.capacity, self.register, keep=keep)
        except OSError as error:
            os.close(fd)
            self.missing[key] = unreceived(error, which, "it could not be mapped")
            return
        if not keep:
            os.close(fd)  # the mapping keeps a duplicate of its own, or (file_system) none
        with self.lock:
            self.mapped[key] = memory
            if keep:
                self.descriptors[key] = fd

    def adopt(self, worker: int, most: int) -> Adopted:
        """Up to `most` kept buffers (`KEPT`) for `worker`, about to be forked: mapped here as
        its buffers 0, 1, ...; what the worker is to adopt. None for a receiver that
        page-locks its buffers (a kept one is not page-locked), nor under the file_system
        strategy (a kept one holds a descriptor here)."""
        if self.register is not None or most <= 0 or sharing_strategy() == "file_system":
            return ()
        adopted = []
        with self.lock:
            for ident, kept in enumerate(KEPT.take(most)):
                key = (worker, ident)
                self.mapped[key] = kept.memory
                self.descriptors[key] = kept.fd
                adopted.append((ident, len(kept.memory), kept.fd))
        return tuple(adopted)

    def loads(self, worker: int, lent: tuple[int, ...], payload: bytes | memoryview) -> Any:
        """Unpickle a message from `worker` that refers to the buffers `lent`."""
        receipt = _Receipt(self, worker)
        token = RECEIVING.set(receipt)
        try:
            return pickle.loads(payload)
        except Exception as error:
            # Fetching a tensor torch's way is where a process short of descriptors fails.
            clear = explain_exhaustion(error)
            if clear is error:
                raise
            raise clear from error
        finally:
            RECEIVING.reset(token)
            receipt.table = None  # the storages are the batch's now, or garbage
            with self.lock:
                held = self.lent.setdefault(worker, {})
                for ident in lent:
                    # None where nothing was built on it (the message failed): give it back.
                    held[ident] = receipt.leases.get(ident)

    def returns_for(self, worker: int) -> tuple[int, ...]:
        """The buffers to give back to `worker` with the next message it is sent."""
        with self.lock:
            held = self.lent.get(worker)
            if not held:
                return ()
            back = tuple(ident for ident, lease in held.items() if lease is None or not lease())
            for ident in back:
                del held[ident]
            return back

    def forget(self, worker: int) -> None:
        """`worker` was replaced: forget its buffers, none of which goes back to it, since the
        replacement numbers its own from 0. A batch the consumer still holds keeps its mapping
        of them until it is freed, as after `close`."""
        with self.lock:
            for key in [key for key in (*self.mapped, *self.missing) if key[0] == worker]:
                self.mapped.pop(key, None)
                self.descriptors.pop(key, None)
                self.missing.pop(key, None)
            self.lent.pop(worker, None)

    def close(self, keep: bool = False) -> None:
        """Forget every mapping; one that a kept batch still uses goes when the batch goes.

        With `keep` (every worker is gone, and they were forked), the buffers nothing uses any
        more are kept for the next workers (`KEPT`), as far as its bounds allow.
        """
        kept: list[_Keeping] = []
        with self.lock:
            # Under file_system a kept buffer would hold a descriptor, which that strategy avoids.
            if keep and self.register is None and sharing_strategy() != "file_system":
                for key, fd in self.descriptors.items():
                    memory = self.mapped.get(key)
                    lease = self.lent.get(key[0], {}).get(key[1])
                    # A buffer goes to another worker only once its last lease has ended.
                    if isinstance(memory, ctypes.Array) and (lease is None or lease() is None):
                        kept.append(_Keeping(memory, fd))
            self.mapped.clear()
            self.descriptors.clear()
            self.missing.clear()
            self.lent.clear()
        if kept:
            KEPT.keep(kept)


def _post(let_go: queue.SimpleQueue[int | None], worker: int, _: object) -> None:
    let_go.put(worker)


def _map(
    fd: int, length: int, register: HostRegister | None = None, *, keep: bool = False
) -> _Mapping:
    """Map a buffer's descriptor in the main process; the caller closes `fd`, unless `keep`.

    With `keep` (the receiver asks for it under torch's default sharing strategy,
    file_descriptor) the mapping owns `fd`, as torch keeps one descriptor per segment it maps,
    and closes it as it is unmapped: a buffer kept for the next workers is handed to them by it
    (`Kept`). Otherwise, under file_descriptor, Python's mmap keeps a duplicate of its own;
    under file_system the mapping is made through libc, which keeps none: the buffers then
    cost this process no descriptors. A buffer to page-lock (`register`) is mapped through
    libc too, so that its registration is undone before it is unmapped, never after.
    """
    if register is None and not keep and sharing_strategy() != "file_system":
        return mmap.mmap(fd, length)
    libc = _libc()
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap: {os.strerror(code)}")
    memory = (ctypes.c_char * length).from_address(address)
    unregister = None if register is None else register(address, length)
    # Unmapped once nothing uses it: the array goes with the last lease on it (or with the
    # kept buffers, `Kept`). Not at exit, while a tensor still on it might yet be read.
    owned = fd if keep else None
    finalizer = weakref.finalize(memory, _unmap, libc, address, length, unregister, owned)
    finalizer.atexit = False
    return memory


def _unmap(
    libc: ctypes.CDLL,
    address: int,
    length: int,
    unregister: Callable[[], None] | None,
    fd: int | None = None,
) -> None:
    if unregister is not None:
        unregister()  # while the pages are still mapped: the device may not keep them locked
    libc.munmap(address, length)
    if fd is not None:
        os.close(fd)


_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc
