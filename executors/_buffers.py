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
there. The message carries only the buffer's number and the storage's size, and the main
process builds the storage on its own mapping of the buffer, so the consumer gets the
worker's dtypes, offsets and strides, and views that still share their storage. What the pool
cannot take (no buffer free, the pool full, autograd, subclasses, other devices or layouts)
travels as torch sends it, so nothing ever waits for a buffer. Small storages (under
`MIN_BUFFER_BYTES`) travel in the message itself, in every batch: a few kilobytes through the
pipe cost far less than a segment of their own, whose descriptor torch fetches through a socket
connection of its own; for a batch of small tensors that fetch is most of the per-batch cost.

Unlike torch's, those tensors are not `is_shared()`: their memory is the worker's to reuse,
so it must not be handed to a third process. A consumer that sends such a tensor on (a
torch.multiprocessing queue, `share_memory_()`) makes torch move it to a segment of its own,
as it does for any tensor, and that move gives the buffer back.

A buffer is never overwritten while anyone can still read it:

- A buffer a message refers to is *lent* from the moment the worker places a storage in it
  until the main process gives it back. There the storage holds a *lease*, a view of the
  buffer's mapping, for as long as its memory is in use: the lease goes only when the storage
  is freed (no tensor, view or numpy array on it is left) or moved. The main process gives a
  buffer back, with the next task it sends that worker, once its lease is gone.
- In the worker, a storage carved from a buffer holds the worker's own view of the buffer, so
  a batch that user code kept in the worker keeps its buffers too.
- A worker writes into a buffer only when it is not lent and its own view is gone.

Every message names the buffers it refers to in its header, so that the main process gives
them back even when the message fails to unpickle. Buffers are anonymous memory: nothing of
them appears in /dev/shm, and their pages go back to the system once no process maps them.
"""

from __future__ import annotations

import contextlib
import contextvars
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

import attrs
import torch
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
]

# Storages this large go in a buffer. A smaller one costs little whichever way it goes, and
# would keep a whole buffer busy for as long as the consumer keeps it.
MIN_BUFFER_BYTES = 64 << 10
# A worker's pool holds at most this many buffers, and this many bytes. A worker has
# prefetch_factor batches in flight, the consumer usually holds one more, and a buffer given
# back reaches the worker only with its next task; a batch may hold several large storages.
BUFFERS_PER_WORKER = 16
# The main process keeps one file descriptor open per buffer it maps (Python's mmap holds a
# duplicate). Buffers of all workers together may use at most this share of the process's
# descriptor limit, so that many workers cannot exhaust it.
_FD_SHARE = 4
BYTES_PER_WORKER = 4 << 30
# Buffer sizes: eight classes per power of two, so that batches varying a little in size
# reuse the same buffers, and at most an eighth of a buffer goes unused.
_CLASSES_PER_DOUBLING_LOG2 = 3
# Free buffers a pool keeps at least, whatever the last batch took.
_MIN_SPARE = 2
_PAGE = 4096

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
    """A storage placed in a buffer. One object per storage, so that pickling shares it."""

    __slots__ = ("buffer", "nbytes")

    def __init__(self, buffer: int, nbytes: int) -> None:
        self.buffer, self.nbytes = buffer, nbytes

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[int, int]]:
        return (_shared_storage, (self.buffer, self.nbytes))


class _Inline:
    """A small storage's bytes, carried in the message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[bytes]]:
        return (_inline_storage, (self.data,))


def _shared_storage(buffer: int, nbytes: int) -> torch.UntypedStorage:
    receipt = _RECEIVING.get()
    if receipt is None:
        raise pickle.UnpicklingError(
            "a tensor in a worker's buffer can only be unpickled by the executor receiving it"
        )
    return receipt.storage(buffer, nbytes)


def _inline_storage(data: bytes) -> torch.UntypedStorage:
    return torch.UntypedStorage.from_buffer(data, dtype=torch.uint8)


def _tensor(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)


# --- the worker's side -------------------------------------------------------------------------


class _Buffer:
    """One buffer as its worker sees it."""

    def __init__(self, ident: int, capacity: int) -> None:
        self.ident = ident
        self.capacity = capacity
        # Named for the worker and the buffer, as /proc/<pid>/fd shows it, for those debugging.
        fd = os.memfd_create(f"statecore-buffer-{os.getpid()}-{ident}")
        try:
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


class Batch:
    """What the worker has placed so far for the batch it is making."""

    def __init__(self, inline: bool, number: int = 0) -> None:
        self.number = number
        """The sender's count of batches when this one began."""
        self.inline = inline
        """Small storages travel in the message (False where there are no buffers at all)."""
        self.collating = False
        self.carved: dict[int, _Buffer] = {}
        self.placed: dict[tuple[int, int], _Shared | _Inline | None] = {}
        self.lent: list[_Buffer] = []
        self.buffered = 0
        """How many buffers this batch took."""


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
        stream = io.BytesIO()
        pickler = pickle.Pickler(stream, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = self._dispatch_table()
        # Only placing a storage takes the pool's lock: the rest of pickling (user reducers
        # included) must not hold up the next batch, which may be fetched meanwhile.
        self.encoding = batch
        try:
            pickler.dump(obj)
        finally:
            self.encoding = None
        lent = () if batch is None else tuple(b.ident for b in batch.lent)
        return stream.getvalue(), lent

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
            if batch.placed:  # a batch without tensors teaches nothing
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
        if batch is None or not _plain(tensor):
            return _torch_reduce_tensor(tensor)
        with self.lock:
            place = self._place(batch, tensor.untyped_storage())
        if place is None:
            return _torch_reduce_tensor(tensor)
        geometry = (tensor.storage_offset(), tuple(tensor.size()), tensor.stride())
        return (_tensor, (place, tensor.dtype, *geometry))

    def _place(self, batch: Batch, storage: torch.UntypedStorage) -> _Shared | _Inline | None:
        """Where `storage` travels: in a buffer, in the message, or (None) torch's way."""
        address, nbytes = storage.data_ptr(), storage.nbytes()
        key = (address, nbytes)
        if key in batch.placed:
            return batch.placed[key]
        place: _Shared | _Inline | None = None
        if nbytes >= MIN_BUFFER_BYTES:
            buffer = self._buffer_for(batch, storage, address, nbytes)
            if buffer is not None:
                buffer.lent = True
                batch.lent.append(buffer)
                place = _Shared(buffer.ident, nbytes)
        elif nbytes > 0 and batch.inline:
            place = _Inline(ctypes.string_at(address, nbytes))
        batch.placed[key] = place
        return place

    def _buffer_for(
        self, batch: Batch, storage: torch.UntypedStorage, address: int, nbytes: int
    ) -> _Buffer | None:
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
        buffer = self._acquire(batch, nbytes)
        if buffer is not None:
            source = torch.empty((0,), dtype=torch.uint8).set_(storage)
            buffer.writable(nbytes).copy_(source)
        return buffer

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

    def storage(self, buffer: int, nbytes: int) -> torch.UntypedStorage:
        receiver = self.receiver
        with receiver.lock:
            memory = receiver.mapped.get((self.worker, buffer))
            if memory is None:
                why = receiver.missing.get((self.worker, buffer), "it was never announced")
                raise RuntimeError(f"buffer {buffer} of worker {self.worker} is unknown: {why}")
            # The lease: a view of the mapping that the storage keeps for as long as its memory
            # is in use, and releases when it is freed or moved (by share_memory_(), say).
            lease = memoryview(memory)
        self.leases[buffer] = weakref.ref(lease)
        return torch.frombuffer(lease, dtype=torch.uint8, count=nbytes).untyped_storage()


_RECEIVING: contextvars.ContextVar[_Receipt | None] = contextvars.ContextVar(
    "statecore_buffer_receipt", default=None
)


class BufferReceiver:
    """The main process's side of every worker's pool: its mappings, and what is lent."""

    def __init__(self) -> None:
        self.mapped: dict[tuple[int, int], mmap.mmap] = {}
        self.missing: dict[tuple[int, int], str] = {}
        self.lent: dict[int, dict[int, weakref.ref[memoryview] | None]] = {}
        """Per worker, the buffers lent to this process, each with the lease of its storage."""
        # Messages may be received on one thread (a pin stage's) while tasks are sent and the
        # executor shut down on another (the driver's).
        self.lock = threading.Lock()

    def notice(self, worker: int, notice: BufferOpened | BufferClosed) -> None:
        key = (worker, notice.ident)
        if isinstance(notice, BufferClosed):
            with self.lock:
                self.mapped.pop(key, None)  # not lent, so nothing on it is left to read
            return
        try:
            fd = notice.handle.detach()
        except Exception as error:  # the worker died, most likely; its death is reported
            self.missing[key] = f"its descriptor could not be fetched: {error!r}"
            return
        try:
            memory = mmap.mmap(fd, notice.capacity)
        except OSError as error:
            self.missing[key] = f"it could not be mapped: {error!r}"
            return
        finally:
            os.close(fd)  # the mapping keeps a descriptor of its own
        with self.lock:
            self.mapped[key] = memory

    def loads(self, worker: int, lent: tuple[int, ...], payload: bytes | memoryview) -> Any:
        """Unpickle a message from `worker` that refers to the buffers `lent`."""
        receipt = _Receipt(self, worker)
        token = _RECEIVING.set(receipt)
        try:
            return pickle.loads(payload)
        finally:
            _RECEIVING.reset(token)
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
