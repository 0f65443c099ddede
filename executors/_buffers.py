"""Reused shared-memory buffers: how the large tensors of a batch reach the main process.

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
The decisions go in a table pickled ahead of the batch (see `_Framed`).

Unlike torch's, those tensors are not `is_shared()`: their memory is the worker's to reuse,
so it must not be handed to a third process. A consumer that sends such a tensor on (a
torch.multiprocessing queue, `share_memory_()`) makes torch move it to a segment of its own,
as it does for any tensor, and that move gives the buffer back.

A buffer is never overwritten while anyone can still read it:

- A buffer a message refers to is *lent* from the moment the worker places a storage in it
  until the main process gives it back. There the storages built on it hold a *lease*, a view
  of the buffer's mapping, for as long as their memory is in use: the lease goes only when the
  storages are freed (no tensor, view or numpy array on them is left) or moved. The main
  process gives a buffer back, with the next task it sends that worker, once its lease is gone.
- In the worker, a storage carved from a buffer holds the worker's own view of the buffer, so
  a batch that user code kept in the worker keeps its buffers too.
- A worker writes into a buffer only when it is not lent and its own view is gone.

Every message names the buffers it refers to in its header, so that the main process gives
them back even when the message fails to unpickle. Buffers are anonymous memory: nothing of
them appears in /dev/shm, and their pages go back to the system once no process maps them.
Like torch's segments, they can be opened by their owner only (mode 0600).

File descriptors: a worker keeps one per buffer. Under torch's default sharing strategy,
`file_descriptor`, the main process keeps one per buffer it maps too, as it does for every
tensor torch shares; under `file_system` it maps each buffer and closes the descriptor at once,
so the buffers hold none there. A process that runs out of descriptors gets an error saying
so, with the limit, what holds them and what to do (`_out_of_descriptors`), rather than the
symptom deep in the resource sharer ("received 0 items of ancdata").
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import copyreg
import ctypes
import errno
import functools
import io
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import attrs
import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

__all__ = [
    "AVAILABLE",
    "BUFFERS_PER_WORKER",
    "Batch",
    "BYTES_PER_WORKER",
    "buffers_per_worker",
    "MIN_BUFFER_BYTES",
    "BufferClosed",
    "BufferOpened",
    "BufferReceiver",
    "BufferSender",
    "explain_exhaustion",
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


# --- the wire ----------------------------------------------------------------------------------


@attrs.frozen
class BufferOpened:
    """A worker made buffer `ident`; `handle` fetches its file descriptor from the worker."""

    ident: int
    capacity: int
    handle: Any = attrs.field(eq=False, repr=False)


@attrs.frozen
class BufferClosed:
    """A worker closed buffer `ident`, which was not lent: the main process may forget it."""

    ident: int


class _Shared:
    """Bytes of a buffer, from `start`: one storage, or one window of a storage."""

    __slots__ = ("buffer", "nbytes", "start")

    def __init__(self, buffer: int, start: int, nbytes: int) -> None:
        self.buffer, self.start, self.nbytes = buffer, start, nbytes

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[int, int, int]]:
        return (_shared_storage, (self.buffer, self.start, self.nbytes))


class _Inline:
    """A small storage's bytes, or a small window's, carried in the message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[bytes]]:
        return (_inline_storage, (self.data,))


class _TorchWay:
    """A large storage that no buffer could take: it travels whole, as torch sends it."""

    __slots__ = ("storage",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[torch.Tensor]]:
        # Pickled outside any batch, so the tensor goes through torch's reductions.
        whole = torch.empty((0,), dtype=torch.uint8).set_(self.storage)
        return (_storage_of, (whole,))


_Windows = tuple[tuple[int, "_Shared | _Inline | _TorchWay"], ...]
"""Where one large storage of a batch went: (start in the storage, where those bytes went),
by start; the windows do not overlap."""


class _Framed:
    """A batch whose large storages were placed after it was pickled: the table of where each
    went, then the batch's own pickle, whose tensors refer to the table by number."""

    __slots__ = ("batch", "table")

    def __init__(self, table: tuple[_Windows, ...], batch: bytes) -> None:
        self.table, self.batch = table, batch

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[tuple[_Windows, ...], bytes]]:
        return (_unframe, (self.table, self.batch))


def _receipt(what: str) -> _Receipt:
    receipt = _RECEIVING.get()
    if receipt is None:
        raise pickle.UnpicklingError(
            f"{what} can only be unpickled by the executor receiving it from its worker"
        )
    return receipt


def _shared_storage(buffer: int, start: int, nbytes: int) -> torch.UntypedStorage:
    return _receipt("a tensor in a worker's buffer").storage(buffer, start, nbytes)


def _inline_storage(data: bytes) -> torch.UntypedStorage:
    return torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage:
    return tensor.untyped_storage()


def _unframe(table: tuple[tuple[tuple[int, torch.UntypedStorage], ...], ...], batch: bytes) -> Any:
    # By now the table's storages are built (the pickle builds arguments before the call).
    receipt = _receipt("a batch placed in a worker's buffers")
    receipt.table = tuple(
        (tuple(start for start, _ in windows), tuple(storage for _, storage in windows))
        for windows in table
    )
    # Should the batch fail to unpickle, its traceback keeps this frame: it must not keep the
    # storages too, or their buffers would stay lent for as long as the error is kept.
    del table
    return pickle.loads(batch)


def _tensor(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)


def _tensor_at(
    ref: int,
    dtype: torch.dtype,
    start: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    """The tensor whose data starts `start` bytes into large storage `ref` of the batch."""
    table = _receipt("a tensor in a worker's buffer").table
    if table is None:
        raise pickle.UnpicklingError("a tensor refers to a batch's table, but none came first")
    starts, storages = table[ref]
    # Its window is the last one to start at or before its data: the windows do not overlap.
    window = bisect.bisect_right(starts, start) - 1
    offset = (start - starts[window]) // dtype.itemsize
    return _tensor(storages[window], dtype, offset, size, stride)


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


# --- the worker's side -------------------------------------------------------------------------


class _Buffer:
    """One buffer as its worker sees it."""

    def __init__(self, ident: int, capacity: int) -> None:
        self.ident = ident
        self.capacity = capacity
        # Named for the worker and the buffer, as /proc/<pid>/fd shows it, for those debugging.
        fd = os.memfd_create(f"statecore-buffer-{os.getpid()}-{ident}")
        try:
            # A memfd is made with mode 0777, and another user's process that can reach this
            # one's descriptors (through /proc/<pid>/fd) could open it.
            os.fchmod(fd, _MODE)
            os.ftruncate(fd, capacity)
            self.memory = mmap.mmap(fd, capacity)
            # Registers a duplicate with the resource sharer, from which the main process
            # fetches it once; the mapping keeps a descriptor of its own.
            self.handle: Any = DupFd(fd)
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
        self.placed: dict[tuple[int, int], _Inline | None] = {}
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
    the `notices`, then the message; `end(batch)`. From `dumps` on, a batch may be handled on
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

    def returned(self, idents: tuple[int, ...]) -> None:
        """The main process has let go of these buffers."""
        with self.lock:
            for ident in idents:
                buffer = self.buffers.get(ident)
                if buffer is not None:
                    buffer.lent = False

    def begin(self) -> Batch:
        """A new batch, about to be fetched."""
        with self.lock:
            # Free buffers beyond what the next batches need are closed, least recently used
            # first, so that a pool grown while the consumer kept many batches shrinks once it
            # lets go.
            free = self._free()
            for buffer in free[: max(0, len(free) - self.spare)]:
                self._close(buffer)
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
            payload = self._pickle(_Framed(table, payload))
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
            return (_tensor_at, (batch.defer(storage, reach), tensor.dtype, reach[0], size, stride))
        place = self._inline(batch, storage)
        if place is None:
            return _torch_reduce_tensor(tensor)
        return (_tensor, (place, tensor.dtype, tensor.storage_offset(), size, stride))

    @staticmethod
    def _inline(batch: Batch, storage: torch.UntypedStorage) -> _Inline | None:
        """A small storage's bytes, once per batch; None for an empty one (torch's way)."""
        address, nbytes = storage.data_ptr(), storage.nbytes()
        key = (address, nbytes)
        if key not in batch.placed:
            batch.placed[key] = _Inline(ctypes.string_at(address, nbytes)) if nbytes else None
        return batch.placed[key]

    def _place(self, batch: Batch) -> tuple[_Windows, ...]:
        """Where each large storage of `batch` goes, now that all its tensors are known.

        With the lock held.
        """
        table: list[_Windows] = [()] * len(batch.deferred)
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
                table[deferred.ref] = ((0, _TorchWay(storage)),)
                continue
            if buffer is not carved:
                buffer.writable(nbytes).copy_(_bytes_of(storage))
            self._lend(batch, buffer)
            table[deferred.ref] = ((0, _Shared(buffer.ident, 0, nbytes)),)
        if partial:
            self._pack(batch, partial, table)
        return tuple(table)

    def _pack(
        self,
        batch: Batch,
        partial: list[tuple[_Deferred, list[tuple[int, int]]]],
        table: list[_Windows],
    ) -> None:
        """Place the windows of storages that travel in part: together in one buffer, or in the
        message when they are small. With the lock held."""
        total = sum(_align(end - start) for _, windows in partial for start, end in windows)
        if total < MIN_BUFFER_BYTES:
            for deferred, windows in partial:
                address = deferred.storage.data_ptr()
                table[deferred.ref] = tuple(
                    (start, _Inline(ctypes.string_at(address + start, end - start)))
                    for start, end in windows
                )
            return
        buffer = self._acquire(batch, total)
        if buffer is None:
            # The pool is spent: these storages go whole, as torch sends them.
            for deferred, _ in partial:
                table[deferred.ref] = ((0, _TorchWay(deferred.storage)),)
            return
        target = buffer.writable(total)
        at = 0
        for deferred, windows in partial:
            source = _bytes_of(deferred.storage)
            places: list[tuple[int, _Shared | _Inline | _TorchWay]] = []
            for start, end in windows:
                if end == start:  # an empty tensor's: no bytes to hold
                    places.append((start, _Inline(b"")))
                    continue
                target[at : at + end - start].copy_(source[start:end])
                places.append((start, _Shared(buffer.ident, at, end - start)))
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


# --- the main process's side -------------------------------------------------------------------


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
            self.leases[buffer] = weakref.ref(lease)
        return torch.frombuffer(
            lease, dtype=torch.uint8, count=nbytes, offset=start
        ).untyped_storage()


_RECEIVING: contextvars.ContextVar[_Receipt | None] = contextvars.ContextVar(
    "statecore_buffer_receipt", default=None
)

_Mapping = mmap.mmap | ctypes.Array[ctypes.c_char]


class BufferReceiver:
    """The main process's side of every worker's pool: its mappings, and what is lent."""

    def __init__(self) -> None:
        self.mapped: dict[tuple[int, int], _Mapping] = {}
        self.missing: dict[tuple[int, int], str] = {}
        """Why a buffer announced could not be mapped, as the error to raise when used."""
        self.lent: dict[int, dict[int, weakref.ref[memoryview] | None]] = {}
        """Per worker, the buffers lent to this process, each with the lease of its storages."""
        # Messages may be received on one thread (a pin stage's) while tasks are sent and the
        # executor shut down on another (the driver's).
        self.lock = threading.Lock()

    def notice(self, worker: int, notice: BufferOpened | BufferClosed) -> None:
        key = (worker, notice.ident)
        if isinstance(notice, BufferClosed):
            with self.lock:
                self.mapped.pop(key, None)  # not lent, so nothing on it is left to read
            return
        which = f"buffer {notice.ident} of worker {worker}"
        try:
            fd = notice.handle.detach()
        except Exception as error:  # the worker died, most likely; its death is reported
            self.missing[key] = _failure(error, which, "its descriptor could not be fetched")
            return
        try:
            memory = _map(fd, notice.capacity)
        except OSError as error:
            self.missing[key] = _failure(error, which, "it could not be mapped")
            return
        finally:
            os.close(fd)  # the mapping keeps a duplicate of its own, or (file_system) none
        with self.lock:
            self.mapped[key] = memory

    def loads(self, worker: int, lent: tuple[int, ...], payload: bytes | memoryview) -> Any:
        """Unpickle a message from `worker` that refers to the buffers `lent`."""
        receipt = _Receipt(self, worker)
        token = _RECEIVING.set(receipt)
        try:
            return pickle.loads(payload)
        except Exception as error:
            # Fetching a tensor torch's way is where a process short of descriptors fails.
            clear = explain_exhaustion(error)
            if clear is error:
                raise
            raise clear from error
        finally:
            _RECEIVING.reset(token)
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

    def close(self) -> None:
        """Forget every mapping; one that a kept batch still uses goes when the batch goes."""
        with self.lock:
            self.mapped.clear()
            self.missing.clear()
            self.lent.clear()


def _map(fd: int, length: int) -> _Mapping:
    """Map a buffer's descriptor in the main process; the caller closes `fd`.

    Under torch's default sharing strategy (file_descriptor) Python's mmap keeps a duplicate of
    the descriptor, as torch keeps one per segment it maps. Under file_system the mapping is
    made through libc, which keeps none: the buffers then cost this process no descriptors.
    """
    if _sharing_strategy() != "file_system":
        return mmap.mmap(fd, length)
    libc = _libc()
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap: {os.strerror(code)}")
    memory = (ctypes.c_char * length).from_address(address)
    # Unmapped once nothing uses it: the array goes with the last lease on it. Not at exit,
    # while a tensor still on it might yet be read.
    finalizer = weakref.finalize(memory, libc.munmap, address, length)
    finalizer.atexit = False
    return memory


_MAP_FAILED = ctypes.c_void_p(-1).value


def _sharing_strategy() -> str:
    """torch.multiprocessing's sharing strategy, as set_sharing_strategy() last set it."""
    strategy: str = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    return strategy


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


# --- running out of descriptors ----------------------------------------------------------------

# A descriptor sent over a socket to a process with no room for it is dropped by the kernel, and
# the standard library reports "received 0 items of ancdata". That is taken for exhaustion when
# the process holds at least its limit less this many.
_NEAR_LIMIT = 8


def explain_exhaustion(error: BaseException) -> BaseException:
    """`error`, or where it comes from this process running out of file descriptors, an error
    that says so: the limit, what holds the descriptors, and what to do (`error` its cause)."""
    explained = _out_of_descriptors(error)
    if explained is None:
        return error
    clear = RuntimeError(explained)
    clear.__cause__ = error
    return clear


def _failure(error: BaseException, which: str, what: str) -> str:
    """The error to raise when a message uses buffer `which`, which failed to arrive."""
    explained = _out_of_descriptors(error)
    if explained is not None:
        return f"{explained} ({which} could not be received)"
    return f"{which} is unknown: {what}: {error!r}"


def _out_of_descriptors(error: BaseException) -> str | None:
    """What to tell the user if `error` (or what caused it) is this process out of descriptors."""
    limit = _descriptor_limit()
    held: dict[str, int] | None = None
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.EMFILE:
            break
        if isinstance(cause, RuntimeError) and "ancdata" in str(cause) and limit is not None:
            held = _held_descriptors()
            if sum(held.values()) + _NEAR_LIMIT >= limit:
                break
        cause = cause.__cause__ or cause.__context__
    else:
        return None
    if held is None:
        held = _held_descriptors()
    kinds = ", ".join(f"{count} {kind}" for kind, count in held.items() if count) or "none listed"
    if _sharing_strategy() == "file_system":
        holders = ""
        remedies = ""
    else:
        holders = (
            " Under torch's sharing strategy 'file_descriptor' (its default), every tensor "
            "torch shares with this process holds one for as long as it lives (a batch kept "
            "beyond what the workers' buffers hold travels that way), and so does each buffer "
            "of the workers that this process maps."
        )
        remedies = (
            ", or call torch.multiprocessing.set_sharing_strategy('file_system') at the start "
            "of the program, so that neither holds one"
        )
    return (
        f"this process (pid {os.getpid()}) ran out of file descriptors: its limit "
        f"(RLIMIT_NOFILE) is {'unlimited' if limit is None else limit}, and it has "
        f"{sum(held.values())} open ({kinds}). Each DataLoader worker process holds a few "
        f"here (its task and result pipes, and its sentinel).{holders} Raise the limit "
        "(`ulimit -n` in the shell that starts Python, or "
        "resource.setrlimit(resource.RLIMIT_NOFILE, ...) before the loader starts)"
        f"{remedies}, or keep fewer batches alive at once."
    )


def _descriptor_limit() -> int | None:
    """This process's limit on open descriptors (the soft RLIMIT_NOFILE); None if there is none."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if limit == resource.RLIM_INFINITY else limit


# What a descriptor's target starts with, in /proc/self/fd, and what to call it.
_KINDS = (
    (("/dev/shm/", "/memfd:"), "shared-memory segments"),
    (("pipe:",), "pipes"),
    (("socket:",), "sockets"),
    (("",), "other files"),
)


def _held_descriptors() -> dict[str, int]:
    """This process's open descriptors, counted by kind; empty where /proc cannot tell."""
    try:
        numbers = [int(entry) for entry in os.listdir("/proc/self/fd")]
    except OSError as error:
        # Listing the directory takes a descriptor itself; at the limit, try every number.
        limit = _descriptor_limit()
        if error.errno != errno.EMFILE or limit is None or limit > 1 << 16:
            return {}
        numbers = list(range(limit))
    held = dict.fromkeys((name for _, name in _KINDS), 0)
    for number in numbers:
        try:
            target = os.readlink(f"/proc/self/fd/{number}")
        except OSError:
            continue  # not open, or the directory's own descriptor, closed since
        kind = next(name for prefixes, name in _KINDS if target.startswith(prefixes))
        held[kind] += 1
    return held
