"""A worker's pool of shared-memory buffers, and the pickler that places batches in it.

Run by a worker process (the main process's side is `leases`; what the pickle holds is
`wire`'s).

Torch gives every tensor of a batch a shared-memory segment of its own: the worker creates it
and faults in every page, and the main process fetches its file descriptor through the
resource sharer (a socket connection per tensor), maps it, and faults in every page it reads.
For batches of tens of megabytes that costs several times what making the batch costs.

Here each worker keeps a pool of *buffers*: anonymous shared memory (memfd) that both the
worker and the main process keep mapped. A buffer's file descriptor crosses once, in a notice
sent before the first message that uses it. A large storage of a batch is placed in a free
buffer: `default_collate` writes its output there directly (while the worker fetches, torch's
shared-memory allocator hands out buffers), and a large storage made any other way is copied
there. The message carries only the buffer's number and where the storage lies in it, and the
main process builds the storage on its own mapping of the buffer, so the consumer gets the
worker's dtypes, offsets and strides, and views that still share their storage. What the pool
cannot take (no buffer free, the pool full, autograd, subclasses, other devices or layouts)
travels as torch sends it, so nothing ever waits for a buffer. Small storages (under
`MIN_BUFFER_BYTES`) travel in the message itself, in every batch: a few kilobytes through the
pipe cost far less than a segment of their own, whose descriptor torch fetches through a socket
connection of its own; for a batch of small tensors that fetch is most of the per-batch cost.

A batch may be a view of a storage far larger than itself: an in-memory dataset that hands out
slices of one big tensor makes batches whose storage is the whole dataset. So where a large
storage goes is decided once the whole batch has been pickled, from every byte range its
tensors reach: a storage whose tensors reach at least half of it travels whole, and otherwise
only *windows* travel, the ranges its tensors reach (tensors that overlap share one window, so
they still share their storage on arrival), packed together in one buffer, or in the message
when they are small. The tensors then arrive with their offsets counted from their window.
The decisions go in a table pickled ahead of the batch (`wire.Framed`).

A buffer is never overwritten while anyone can still read it. A buffer a message refers to is
*lent* from the moment the worker places a storage in it until the main process gives it back
(with a later task, once nothing there uses it: see `leases`). In the worker, a storage carved
from a buffer holds the worker's own view of the buffer, so a batch that user code kept in the
worker keeps its buffers too. A worker writes into a buffer only when it is not lent and its
own view is gone.

Buffers are anonymous memory: nothing of them appears in /dev/shm. Like torch's segments, they
can be opened by their owner only (mode 0600). A worker keeps one file descriptor per buffer.

The pool gives memory back: a pool grown while the consumer kept many batches shrinks once it
lets go. Whenever buffers come back (with a task, or on their own when the consumer let go of
them while no task came: see `executor`), the free buffers beyond what the next batches need
are closed (`trim`). A buffer's pages go back to the system the moment the worker closes it
(punched out of the memory, not merely unmapped), although the main process still maps it until
it reads the notice: nobody reads a buffer that is free, in either process.

A forked worker may start with buffers of workers gone before it, which the main process kept
(`leases.Kept`): it adopts them as its first buffers (`adopt`), mapped with their pages
present, and keeps them until its own batches say how many it needs.
"""

from __future__ import annotations

import contextlib
import copyreg
import ctypes
import io
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

from statecore.executors._mp.wire import (
    BufferClosed,
    BufferOpened,
    Framed,
    Inline,
    Shared,
    TorchWay,
    Windows,
    tensor_at,
    tensor_on,
)

__all__ = [
    "AVAILABLE",
    "BUFFERS_PER_WORKER",
    "BYTES_PER_WORKER",
    "MIN_BUFFER_BYTES",
    "Batch",
    "BufferSender",
    "buffers_per_worker",
]

# Storages this large go in a buffer. A smaller one costs little whichever way it goes, and
# would keep a whole buffer busy for as long as the consumer keeps it.
MIN_BUFFER_BYTES = 64 << 10
# A worker's pool holds at most this many buffers, and this many bytes. A worker has
# prefetch_factor batches in flight, the consumer usually holds one more, and a buffer given
# back reaches the worker only with its next task; a batch may hold several large storages.
BUFFERS_PER_WORKER = 16
# Under the file_descriptor strategy the main process keeps one file descriptor open per buffer
# it maps (Python's mmap holds a duplicate). Buffers of all workers together may use at most
# this share of the process's descriptor limit, so that many workers cannot exhaust it.
_FD_SHARE = 4
BYTES_PER_WORKER = 4 << 30
# Buffer sizes: eight classes per power of two, so that batches varying a little in size
# reuse the same buffers, and at most an eighth of a buffer goes unused.
_CLASSES_PER_DOUBLING_LOG2 = 3
# Free buffers a pool keeps at least, whatever the last batch took.
_MIN_SPARE = 2
_PAGE = 4096
# A storage whose tensors reach at least 1/_WHOLE of it travels whole: its tensors then keep
# their offsets and share one storage on arrival, as torch's do, for at most twice the bytes.
_WHOLE = 2
# Windows start at a multiple of this, and lie at such multiples in a buffer: a tensor's offset
# from its window's start is then a whole number of elements, and its data keeps the
# alignment it had in the worker.
_ALIGNMENT = 64
# Buffers are for their owner alone, as torch's segments are: the main process and a worker
# run as the same user.
_MODE = 0o600

# Frees a range of a shared mapping's pages, in every process that maps them (Linux).
_MADV_REMOVE: int | None = getattr(mmap, "MADV_REMOVE", None)
# Maps an adopted buffer's pages, present already, in one call rather than a fault apiece.
_MAP_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)

AVAILABLE = hasattr(os, "memfd_create")
"""Buffers need anonymous shared memory (Linux); elsewhere every tensor goes torch's way."""


# torch's own way to send a tensor, typed for this module.
_torch_reduce_tensor: Callable[[torch.Tensor], Any] = reductions.reduce_tensor


def buffers_per_worker(workers: int) -> int:
    """The pool's size: BUFFERS_PER_WORKER, less where the descriptor limit is low."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return BUFFERS_PER_WORKER
    if limit == resource.RLIM_INFINITY:
        return BUFFERS_PER_WORKER
    return max(0, min(BUFFERS_PER_WORKER, limit // _FD_SHARE // max(1, workers)))


def _size_class(nbytes: int) -> int:
    step = max(_PAGE, 1 << max(0, nbytes.bit_length() - 1 - _CLASSES_PER_DOUBLING_LOG2))
    return -(-nbytes // step) * step


def _plain(tensor: torch.Tensor) -> bool:
    """Whether a buffer can carry `tensor` exactly as torch would: data, dtype and geometry."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_nested
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _reach(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor reaches: from its first element to past its last."""
    itemsize = tensor.element_size()
    start = int(tensor.storage_offset()) * itemsize
    if tensor.numel() == 0:
        return start, start
    # Strides are never negative in torch: the last element is the furthest.
    geometry = zip(tensor.size(), tensor.stride(), strict=True)
    last = sum((int(length) - 1) * int(step) for length, step in geometry)
    return start, start + (last + 1) * itemsize


def _windows(reaches: list[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges of a storage of `nbytes` to send, for tensors reaching `reaches`.

    Ranges that overlap or touch make one window, so that the tensors on them share a storage
    on arrival; a window starts at a multiple of `_ALIGNMENT`. Where the windows cover at least
    1/_WHOLE of the storage, the whole storage is the one window.
    """
    merged: list[list[int]] = []
    for start, end in sorted(reaches):
        start -= start % _ALIGNMENT
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    # An empty tensor may lie at the very end of its storage, or past it: its window is empty.
    windows = [(start, max(start, min(end, nbytes))) for start, end in merged]
    if _WHOLE * sum(end - start for start, end in windows) >= nbytes:
        return [(0, nbytes)]
    return windows


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a tensor of bytes."""
    return torch.empty((0,), dtype=torch.uint8).set_(storage)


class _Buffer:
    """One buffer as its worker sees it."""

    def __init__(self, ident: int, capacity: int, adopted: int | None = None) -> None:
        self.ident = ident
        self.capacity = capacity
        self.handle: Any = None
        if adopted is not None:
            # A kept buffer (`adopt`): the main process maps it already, so no notice goes.
            try:
                flags = mmap.MAP_SHARED | _MAP_POPULATE
                self.memory = mmap.mmap(adopted, capacity, flags=flags)
            finally:
                os.close(adopted)  # this worker's inherited copy: the mapping keeps its own
        else:
            # Named for the worker and the buffer, as /proc/<pid>/fd shows it, for those
            # debugging.
            fd = os.memfd_create(f"statecore-buffer-{os.getpid()}-{ident}")
            try:
                # A memfd is made with mode 0777, and another user's process that can reach
                # this one's descriptors (through /proc/<pid>/fd) could open it.
                os.fchmod(fd, _MODE)
                os.ftruncate(fd, capacity)
                self.memory = mmap.mmap(fd, capacity)
                # Registers a duplicate with the resource sharer, from which the main process
                # fetches it once; the mapping keeps a descriptor of its own.
                self.handle = DupFd(fd)
            finally:
                os.close(fd)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.lent = False
        """A message refers to it and the main process has not given it back."""
        self.last_used = 0
        """The batch (by the sender's count) that last placed a storage in it."""
        self.view: weakref.ref[memoryview] | None = None
        """The worker's view while it writes; storages carved from the buffer keep it alive."""

    @property
    def free(self) -> bool:
        return not self.lent and (self.view is None or self.view() is None)

    def writable(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the buffer, to write into; they keep the worker's view alive."""
        view = memoryview(self.memory)
        self.view = weakref.ref(view)
        return torch.frombuffer(view, dtype=torch.uint8, count=nbytes)

    def close(self) -> None:
        """Give the buffer's memory back to the system, and unmap it here; with it free only."""
        # The main process keeps its mapping until it reads the notice, which comes with the
        # worker's next message: perhaps long after, or never for a consumer that stopped
        # reading. Punched out, the pages go now. Nothing reads them: the buffer is free, so no
        # storage of either process is built on it, and the pool would otherwise overwrite it.
        if _MADV_REMOVE is not None:
            with contextlib.suppress(OSError, ValueError):
                self.memory.madvise(_MADV_REMOVE)
        # Nothing written through a free buffer's view is alive; should a stray export remain,
        # the mapping goes with its last reference instead.
        with contextlib.suppress(BufferError):
            self.memory.close()


class _Deferred:
    """A large storage of the batch being pickled, and the byte ranges its tensors reach."""

    __slots__ = ("reaches", "ref", "storage")

    def __init__(self, ref: int, storage: torch.UntypedStorage) -> None:
        self.ref = ref
        self.storage = storage
        self.reaches: list[tuple[int, int]] = []


class Batch:
    """What the worker has placed so far for the batch it is making."""

    def __init__(self, inline: bool, number: int = 0) -> None:
        self.number = number
        """The sender's count of batches when this one began."""
        self.inline = inline
        """Small storages travel in the message (False where there are no buffers at all)."""
        self.collating = False
        self.carved: dict[int, _Buffer] = {}
        self.placed: dict[tuple[int, int], Inline | None] = {}
        """The small storages pickled so far, by address and size."""
        self.deferred: dict[tuple[int, int], _Deferred] = {}
        """The large storages pickled so far, by address and size, placed once all are seen."""
        self.lent: list[_Buffer] = []
        self.buffered = 0
        """How many buffers this batch took."""
        self.tensors = False
        """Whether a tensor of the batch was pickled (torch's way or not)."""

    def defer(self, storage: torch.UntypedStorage, reach: tuple[int, int]) -> int:
        """Note that a tensor reaches `reach` of large `storage`; its number in the table."""
        key = (storage.data_ptr(), storage.nbytes())
        deferred = self.deferred.get(key)
        if deferred is None:
            deferred = self.deferred[key] = _Deferred(len(self.deferred), storage)
        deferred.reaches.append(reach)
        return deferred.ref


class BufferSender:
    """A worker's buffer pool, and the pickler that places batches in it.

    Per task: `returned` with the buffers the task brought back; `batch = begin()`; fetch the
    batch inside `collating(batch)`; `dumps(obj, batch)` (`abandon(batch)` if that fails); send
    the `notices`, then the message; `end(batch)`. Buffers that come back with no task:
    `returned`, then `trim`, and send the `notices`. From `dumps` on, a batch may be handled on
    another thread while the next one is fetched: the pool is shared under a lock, and each
    step names the batch it is for.
    """

    def __init__(self, enabled: bool = True, workers: int = 1) -> None:
        self.enabled = enabled and AVAILABLE
        self.buffers: dict[int, _Buffer] = {}
        self.next_ident = 0
        self.pending: list[BufferOpened | BufferClosed] = []
        self.batch: Batch | None = None
        """The batch being fetched: the one collate's allocations are for."""
        self.encoding: Batch | None = None
        """The batch being pickled, while `dumps` runs."""
        self.batches = 0
        self.spare = _MIN_SPARE
        """How many free buffers the pool keeps: twice what the last batch took."""
        self.most = buffers_per_worker(workers)
        """How many buffers the pool may hold at once."""
        self._table: dict[type, Any] | None = None
        self._table_key = (0, 0)
        self.lock = threading.RLock()

    def install(self) -> None:
        """Make torch's shared-memory allocator hand out buffers while collate runs.

        default_collate allocates its output with `UntypedStorage._new_shared` in workers, so
        it writes the batch straight into a buffer. Calls outside a fetch, from other threads,
        or that the pool cannot serve get torch's own segment.
        """
        if not self.enabled:
            return
        original: Callable[..., torch.UntypedStorage] = torch.UntypedStorage._new_shared
        # A process forked by user code inherits the pool's state but must not write into it.
        main, pid = threading.get_ident(), os.getpid()
        sender = self

        def new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
            batch = sender.batch
            if (
                batch is not None
                and batch.collating
                and cls is torch.UntypedStorage
                and threading.get_ident() == main
                and os.getpid() == pid
                and torch.device(device).type == "cpu"
            ):
                carved = sender._carve(batch, size)
                if carved is not None:
                    return carved
            return original(size, device=device)

        torch.UntypedStorage._new_shared = classmethod(new_shared)  # type: ignore[assignment,method-assign]

    def adopt(self, adopted: tuple[tuple[int, int, int], ...]) -> None:
        """Take buffers the main process kept from workers gone before this one (`leases.Kept`):
        per buffer, its number here, its capacity, and the inherited descriptor that maps it.
        The pool keeps them all free until its batches say how many it needs (`spare`)."""
        with self.lock:
            for ident, capacity, fd in adopted:
                try:
                    buffer = _Buffer(ident, capacity, adopted=fd)
                except (OSError, ValueError):
                    # Not mapped here: the main process keeps its mapping until shutdown, and
                    # this number is never used.
                    self.next_ident = max(self.next_ident, ident + 1)
                    continue
                self.buffers[ident] = buffer
                self.next_ident = max(self.next_ident, ident + 1)
            self.spare = max(_MIN_SPARE, min(len(self.buffers), self.most))

    def returned(self, idents: tuple[int, ...]) -> None:
        """The main process has let go of these buffers."""
        with self.lock:
            for ident in idents:
                buffer = self.buffers.get(ident)
                if buffer is not None:
                    buffer.lent = False

    def trim(self) -> bool:
        """Close the free buffers beyond what the next batches need (`spare`), least recently
        used first, so that a pool grown while the consumer kept many batches shrinks once it
        lets go. Whether any was closed: the main process learns it from the `notices`."""
        with self.lock:
            free = self._free()
            surplus = free[: max(0, len(free) - self.spare)]
            for buffer in surplus:
                self._close(buffer)
            return bool(surplus)

    def begin(self) -> Batch:
        """A new batch, about to be fetched."""
        with self.lock:
            self.trim()
            self.batches += 1
            self.batch = Batch(inline=self.enabled, number=self.batches)
            return self.batch

    @contextlib.contextmanager
    def collating(self, batch: Batch | None) -> Iterator[None]:
        """Within the block, collate's shared-memory allocations come from the pool."""
        if batch is not None:
            batch.collating = True
        try:
            yield
        finally:
            if batch is not None:
                batch.collating = False

    def dumps(self, obj: object, batch: Batch | None = None) -> tuple[bytes, tuple[int, ...]]:
        """`obj` pickled with the tensors of `batch` placed, and the buffers it refers to.

        Without a batch, tensors go as torch sends them (an answer that is not a batch).
        """
        # Only placing the large storages takes the pool's lock, once the whole batch is
        # pickled: the rest of pickling (user reducers included) must not hold up the next
        # batch, which may be fetched meanwhile.
        self.encoding = batch
        try:
            payload = self._pickle(obj)
        finally:
            self.encoding = None
        if batch is None:
            return payload, ()
        if batch.deferred:
            with self.lock:
                table = self._place(batch)
            payload = self._pickle(Framed(table, payload))
            # The batch object lives on until the next one begins: it must not keep the
            # storages, whose carvings would keep their buffers from reuse meanwhile.
            batch.deferred.clear()
        return payload, tuple(b.ident for b in batch.lent)

    def _pickle(self, obj: object) -> bytes:
        stream = io.BytesIO()
        pickler = pickle.Pickler(stream, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = self._dispatch_table()
        pickler.dump(obj)
        return stream.getvalue()

    def _dispatch_table(self) -> dict[type, Any]:
        # Rebuilt whenever a reducer is registered (which adds an entry) after the worker
        # started, so that user code's reducers apply here as torch's ForkingPickler would
        # apply them; rebuilding it for every batch cost more than pickling a small batch.
        extra: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
        key = (len(copyreg.dispatch_table), len(extra))
        if self._table is None or key != self._table_key:
            table: dict[type, Any] = dict(copyreg.dispatch_table)
            table.update(extra)
            table[torch.Tensor] = self._reduce_tensor
            self._table, self._table_key = table, key
        return self._table

    def abandon(self, batch: Batch | None) -> None:
        """The batch could not be pickled here: nothing placed in the pool will be sent."""
        if batch is not None:
            with self.lock:
                for buffer in batch.lent:
                    buffer.lent = False
                batch.lent.clear()
                batch.placed.clear()
                batch.deferred.clear()

    def notices(self) -> list[BufferOpened | BufferClosed]:
        """What the main process must learn about the pool before the next message."""
        with self.lock:
            pending, self.pending = self.pending, []
        return pending

    def end(self, batch: Batch | None) -> None:
        """The batch's message went out."""
        if batch is None:
            return
        with self.lock:
            if self.batch is batch:
                self.batch = None
            if batch.tensors:  # a batch without tensors teaches nothing
                self.spare = max(_MIN_SPARE, 2 * batch.buffered)

    # --- placing storages ----------------------------------------------------------------

    def _carve(self, batch: Batch, nbytes: int) -> torch.UntypedStorage | None:
        if nbytes < MIN_BUFFER_BYTES:
            # It will travel in the message, so it needs no shared memory at all.
            if batch.inline and nbytes > 0:
                return torch.empty((nbytes,), dtype=torch.uint8).untyped_storage()
            return None
        with self.lock:
            buffer = self._acquire(batch, nbytes)
            if buffer is None:
                return None
            batch.carved[buffer.address] = buffer
            return buffer.writable(nbytes).untyped_storage()

    def _reduce_tensor(self, tensor: torch.Tensor) -> Any:
        batch = self.encoding
        if batch is not None:
            batch.tensors = True
        if batch is None or not batch.inline or not _plain(tensor):
            return _torch_reduce_tensor(tensor)
        storage = tensor.untyped_storage()
        size, stride = tuple(tensor.size()), tensor.stride()
        if storage.nbytes() >= MIN_BUFFER_BYTES:
            reach = _reach(tensor)
            if _ALIGNMENT % tensor.element_size():
                # No window could start where this tensor's elements line up: it takes all.
                reach = (0, storage.nbytes())
            return (tensor_at, (batch.defer(storage, reach), tensor.dtype, reach[0], size, stride))
        place = self._inline(batch, storage)
        if place is None:
            return _torch_reduce_tensor(tensor)
        return (tensor_on, (place, tensor.dtype, tensor.storage_offset(), size, stride))

    @staticmethod
    def _inline(batch: Batch, storage: torch.UntypedStorage) -> Inline | None:
        """A small storage's bytes, once per batch; None for an empty one (torch's way)."""
        address, nbytes = storage.data_ptr(), storage.nbytes()
        key = (address, nbytes)
        if key not in batch.placed:
            batch.placed[key] = Inline(ctypes.string_at(address, nbytes)) if nbytes else None
        return batch.placed[key]

    def _place(self, batch: Batch) -> tuple[Windows, ...]:
        """Where each large storage of `batch` goes, now that all its tensors are known.

        With the lock held.
        """
        table: list[Windows] = [()] * len(batch.deferred)
        partial: list[tuple[_Deferred, list[tuple[int, int]]]] = []
        for deferred in batch.deferred.values():
            storage = deferred.storage
            nbytes = storage.nbytes()
            carved = self._carving(batch, storage.data_ptr(), nbytes)
            windows = [(0, nbytes)] if carved else _windows(deferred.reaches, nbytes)
            if windows != [(0, nbytes)]:
                partial.append((deferred, windows))
                continue
            buffer = carved or self._acquire(batch, nbytes)
            if buffer is None:
                table[deferred.ref] = ((0, TorchWay(storage)),)
                continue
            if buffer is not carved:
                buffer.writable(nbytes).copy_(_bytes_of(storage))
            self._lend(batch, buffer)
            table[deferred.ref] = ((0, Shared(buffer.ident, 0, nbytes)),)
        if partial:
            self._pack(batch, partial, table)
        return tuple(table)

    def _pack(
        self,
        batch: Batch,
        partial: list[tuple[_Deferred, list[tuple[int, int]]]],
        table: list[Windows],
    ) -> None:
        """Place the windows of storages that travel in part: together in one buffer, or in the
        message when they are small. With the lock held."""
        total = sum(_align(end - start) for _, windows in partial for start, end in windows)
        if total < MIN_BUFFER_BYTES:
            for deferred, windows in partial:
                address = deferred.storage.data_ptr()
                table[deferred.ref] = tuple(
                    (start, Inline(ctypes.string_at(address + start, end - start)))
                    for start, end in windows
                )
            return
        buffer = self._acquire(batch, total)
        if buffer is None:
            # The pool is spent: these storages go whole, as torch sends them.
            for deferred, _ in partial:
                table[deferred.ref] = ((0, TorchWay(deferred.storage)),)
            return
        target = buffer.writable(total)
        at = 0
        for deferred, windows in partial:
            source = _bytes_of(deferred.storage)
            places: list[tuple[int, Shared | Inline | TorchWay]] = []
            for start, end in windows:
                if end == start:  # an empty tensor's: no bytes to hold
                    places.append((start, Inline(b"")))
                    continue
                target[at : at + end - start].copy_(source[start:end])
                places.append((start, Shared(buffer.ident, at, end - start)))
                at += _align(end - start)
            table[deferred.ref] = tuple(places)
        self._lend(batch, buffer)

    def _lend(self, batch: Batch, buffer: _Buffer) -> None:
        buffer.lent = True
        batch.lent.append(buffer)

    def _carving(self, batch: Batch, address: int, nbytes: int) -> _Buffer | None:
        """The buffer collate carved this storage from for this batch, if it was."""
        carved = batch.carved.get(address)
        # A storage starting at a buffer carved for this batch is that carving: the buffer's
        # mapping owns those addresses, and a carving kept from an earlier batch would have
        # kept the buffer from being carved again. Unless the buffer was closed since (its
        # carving died and the pool needed room), and the address reused by other memory.
        if (
            carved is not None
            and self.buffers.get(carved.ident) is carved
            and carved.view is not None
            and carved.view() is not None
            and not carved.lent
            and nbytes <= carved.capacity
        ):
            return carved
        return None

    def _acquire(self, batch: Batch, nbytes: int) -> _Buffer | None:
        """A free buffer of at least `nbytes` for `batch`, made if need be; None if the pool is
        spent. With the lock held."""
        if not self.enabled:
            return None
        buffer = self._reuse(nbytes) or self._make(nbytes)
        if buffer is not None:
            buffer.last_used = batch.number
            batch.buffered += 1
        return buffer

    def _free(self) -> list[_Buffer]:
        """The free buffers, least recently used first."""
        return sorted((b for b in self.buffers.values() if b.free), key=lambda b: b.last_used)

    def _reuse(self, nbytes: int) -> _Buffer | None:
        # Not one much larger than needed: it would sit idle while a large storage waits.
        most = 2 * _size_class(nbytes)
        fitting = [b for b in self._free() if nbytes <= b.capacity <= most]
        return min(fitting, key=lambda b: b.capacity) if fitting else None

    def _make(self, nbytes: int) -> _Buffer | None:
        capacity = _size_class(nbytes)
        free = self._free()

        def full() -> bool:
            held = sum(b.capacity for b in self.buffers.values())
            return len(self.buffers) >= self.most or held + capacity > BYTES_PER_WORKER

        while free and full():
            self._close(free.pop(0))
        if full():
            return None  # the consumer holds them all: this storage goes torch's way
        try:
            buffer = _Buffer(self.next_ident, capacity)
        except Exception:
            return None  # out of memory or descriptors, say: torch's way may still work
        self.next_ident += 1
        self.buffers[buffer.ident] = buffer
        self.pending.append(BufferOpened(buffer.ident, capacity, buffer.handle))
        buffer.handle = None  # the notice holds it until it is sent
        return buffer

    def _close(self, buffer: _Buffer) -> None:
        del self.buffers[buffer.ident]
        buffer.close()
        self.pending.append(BufferClosed(buffer.ident))
