"""What crosses between the main process and a worker, and how it is encoded: both sides.

Run by both processes: the main process encodes tasks and the worker setup and decodes
answers; a worker decodes them and encodes its answers.

- *The worker setup* (`Shipment`) goes to spawn and forkserver workers pickled once for all
  workers (by the C pickler, dill where it must), except what can be fetched only once (see
  `Shipment`); the executor writes it to a file that every worker reads (`read_setup`).
- *A task* is `(command, buffers given back)`, pickled by the C pickler (dill only for an
  index the C pickler refuses). Its framing is the pipe's (`taskpipe.frame`). Buffers the
  consumer let go of while no task went to their worker go back on their own, as
  `(None, buffers given back)` (`encode_returns`).
- *An answer* (and a buffer notice) is a header, the numbers of the buffers it refers to, then
  a pickle (`HEADER`): for a completed task only its batch, since the header and the pipe it
  came by say the rest, and pickling the event object would cost every batch; for anything
  else the event. The header names the buffers, so that the main process gives them back even
  when the pickle fails to load.
- *A batch's large storages* are pickled as records of where the worker placed them (`Shared`,
  `Inline`, `TorchWay`, in a `Framed` table ahead of the batch): the worker's pool places them
  (`pool`), and unpickling them in the main process builds each storage on the receipt of the
  message being received (`RECEIVING`, set by `leases`).
"""

from __future__ import annotations

import bisect
import contextvars
import copyreg
import functools
import io
import pickle
import struct
import sys
import types
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler as StdlibPickler
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import multiprocess.reduction
import torch
import torch.multiprocessing  # registers torch's reductions with the stdlib pickler

from statecore import Event, ResumeWorker, SendTask, TaskCompleted, TaskFailed
from statecore.executors._remote import RemoteError
from statecore.executors._worker import DATAPIPE_GRAPH, WorkerSetup

if TYPE_CHECKING:
    from statecore.executors._mp.pool import Batch, BufferSender

__all__ = [
    "BATCH",
    "EVENT",
    "HEADER",
    "MARKED",
    "TIMED",
    "NOTICE",
    "NO_TASK",
    "RECEIVING",
    "BufferClosed",
    "BufferOpened",
    "Framed",
    "Inline",
    "Receiving",
    "Shared",
    "Shipment",
    "TorchWay",
    "Windows",
    "decode",
    "encode_answer",
    "encode_failure",
    "encode_notice",
    "encode_returns",
    "encode_task",
    "tensor_at",
    "tensor_on",
    "read_setup",
    "unpack_setup",
]


def _share_torch_reductions() -> None:
    """Teach multiprocess's dill pickler to send tensors through shared memory too."""
    for kind, reducer in StdlibPickler._extra_reducers.items():  # type: ignore[attr-defined]
        multiprocess.reduction.ForkingPickler.register(kind, reducer)


_share_torch_reductions()


# --- answers and notices -----------------------------------------------------------------------

HEADER = struct.Struct("<qiB")
"""Every answer starts with the task it answers, how many buffers it refers to and what its
pickle holds, followed by the buffers' numbers (int32 each)."""
# What a message's pickle holds: an event, only the batch of a completed task, the batch and
# its worker's mark (an iterable dataset's: see `WorkerRuntime`), or the batch, the mark and the
# task's timing (a traced loader's: see `executors._timing`).
EVENT = 0
BATCH = 1
MARKED = 2
TIMED = 3
NO_TASK = -1
"""Answers to resumes carry no task number; this marks them on the wire."""
NOTICE = -2
"""A buffer notice is no answer at all."""


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


def encode_answer(
    task: int, event: Event, buffers: BufferSender, batch: Batch | None = None
) -> bytes:
    """In a worker: the message answering `task` with `event`, its tensors placed by `buffers`."""
    content: object
    if type(event) is not TaskCompleted:
        kind, content = EVENT, event
    elif event.timing is not None:
        kind, content = TIMED, (event.payload, event.mark, event.timing)
    elif event.mark is None:
        kind, content = BATCH, event.payload
    else:
        kind, content = MARKED, (event.payload, event.mark)
    try:
        payload, lent = buffers.dumps(content, batch)
    except Exception:
        buffers.abandon(batch)
        payload, lent = bytes(multiprocess.reduction.ForkingPickler.dumps(content)), ()
    return HEADER.pack(task, len(lent), kind) + struct.pack(f"<{len(lent)}i", *lent) + payload


def encode_failure(
    task: int, worker: int, failure: RemoteError, buffers: BufferSender, mark: object = None
) -> bytes:
    """In a worker: a failed task's answer, which must go out whatever the failure holds."""
    try:
        return encode_answer(task, TaskFailed(task, worker, failure, mark), buffers)
    except Exception:
        # What is left is text: the index as its repr, and no type to rebuild.
        plain = attrs.evolve(failure, index=_index_text(failure.index), exc_type=None)
        return encode_answer(task, TaskFailed(task, worker, plain, mark), buffers)


def _index_text(index: object) -> str:
    try:
        return repr(index)
    except Exception:
        return f"<a {type(index).__qualname__} that cannot be shown>"


def encode_notice(notice: BufferOpened | BufferClosed) -> bytes:
    """In a worker: a notice about its pool, sent ahead of the first message it concerns."""
    return HEADER.pack(NOTICE, 0, EVENT) + bytes(StdlibPickler.dumps(notice))


def decode(message: bytes) -> tuple[int, tuple[int, ...], int, memoryview]:
    """In the main process: a message's task (or NOTICE, NO_TASK), the buffers it refers to,
    what its pickle holds (EVENT, BATCH, MARKED or TIMED), and the pickle."""
    task, count, kind = HEADER.unpack_from(message)
    lent = struct.unpack_from(f"<{count}i", message, HEADER.size)
    return task, lent, kind, memoryview(message)[HEADER.size + 4 * count :]


# --- tasks -------------------------------------------------------------------------------------


def encode_task(command: SendTask | ResumeWorker, returned: tuple[int, ...]) -> bytes:
    """In the main process: a task and the buffers given back with it, pickled by the C pickler.

    dill takes about 100 us for a task, which is GIL time taken from the main process on every
    batch. dill remains the fallback for an index the C pickler refuses.
    """
    message = (command, returned)
    try:
        return bytes(StdlibPickler.dumps(message))
    except Exception:
        return bytes(multiprocess.reduction.ForkingPickler.dumps(message))


def encode_returns(returned: tuple[int, ...]) -> bytes:
    """In the main process: a message that only gives buffers back, with no task."""
    return bytes(StdlibPickler.dumps((None, returned)))


# --- the worker setup --------------------------------------------------------------------------

# Reductions registered with the picklers that only name what they pickle. Every other one
# (torch's for tensors and storages, multiprocessing's for pipes and sockets) hands over a
# resource, typically a file descriptor that one receiving process fetches, once.
_NAMING_REDUCTIONS = frozenset(
    {types.MethodType, types.MethodDescriptorType, types.WrapperDescriptorType, functools.partial}
)


class _NotByName(Exception):
    """The C pickler met code it would pickle by a name the worker may not find."""


def _findable(obj: type | types.FunctionType) -> bool:
    """Whether a worker finds `obj` by its module and qualified name, as the C pickler names it.

    Not code of `__main__` (a spawned worker's main module is the script run again, or nothing
    at all for `python -c`, a notebook, an interpreter's stdin), nor a lambda or anything
    defined inside a function, nor anything its module does not hold under that name.
    """
    module_name = getattr(obj, "__module__", None)
    if module_name in (None, "__main__", "__mp_main__"):
        return False
    module = sys.modules.get(module_name)
    if module is None:
        return False
    found: object = module
    for part in obj.__qualname__.split("."):
        found = getattr(found, part, None)
        if found is None:
            return False
    return found is obj


class _SetupPickler(pickle.Pickler):
    """The C pickler, for the worker setup: pickles data hundreds of times faster than dill.

    What it cannot send by name (see `_findable`) makes it give up, and dill pickles the whole
    setup instead (`Shipment.pack`). Objects that hand over a resource go to `set_aside`.
    """

    def __init__(self, stream: io.BytesIO, handing: frozenset[type]) -> None:
        super().__init__(stream, pickle.HIGHEST_PROTOCOL)
        table: dict[type, Any] = dict(copyreg.dispatch_table)
        table.update(StdlibPickler._extra_reducers)  # type: ignore[attr-defined]
        self.dispatch_table = table
        self.handing = handing
        self.set_aside: list[object] = []
        self.keys: dict[int, int] = {}

    def reducer_override(self, obj: object) -> Any:
        # Called for every object but exact ints, floats, strs, bytes, lists, tuples, dicts and
        # sets: a dataset's index of millions of plain entries costs no Python call each.
        kind = type(obj)
        if kind in self.handing:
            key = self.keys.get(id(obj))
            if key is None:
                key = self.keys[id(obj)] = len(self.set_aside)
                self.set_aside.append(obj)
            return (_set_aside, (key,))
        if isinstance(obj, (type, types.FunctionType)) and not _findable(obj):
            raise _NotByName(obj)
        return NotImplemented


_UNPACKING: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar(
    "statecore_set_aside", default=()
)
"""The objects set aside from the setup being unpacked in this thread (`unpack_setup`)."""


def _set_aside(key: int) -> object:
    return _UNPACKING.get()[key]


@attrs.frozen
class Shipment:
    """The worker setup for spawn and forkserver workers, pickled once for them all.

    By the C pickler, and by dill where the setup holds code the C pickler would send by a name
    that a worker may not find (a lambda, a local class, code of `__main__`: see `_findable`),
    or anything else the C pickler refuses. dill, a pure-Python pickler, takes seconds for a
    dataset with an index of a few hundred thousand entries, the C pickler a tenth of that.

    Except for the objects whose pickle hands over a resource (a tensor shared through torch's
    reductions, a pipe): their pickle is a handle that a single process can fetch, so the same
    bytes cannot go to two workers. They are set aside and pickled for each worker as it
    starts, as torch pickles the whole dataset for each. A tensor's storage moves to shared
    memory the first time, and every worker maps that same memory: nothing is copied per worker.
    """

    setup: bytes
    set_aside: tuple[object, ...]
    by_name: bool = True
    """Pickled by the C pickler: False when dill had to."""

    @classmethod
    def pack(cls, setup: WorkerSetup) -> Shipment:
        # A datapipe pickled while another thread walks a datapipe's graph is pickled as
        # torch's stub (see DATAPIPE_GRAPH): a thread executor's workers may be walking theirs.
        with DATAPIPE_GRAPH:
            return cls._pack(setup)

    @classmethod
    def _pack(cls, setup: WorkerSetup) -> Shipment:
        handing = frozenset(multiprocess.reduction.ForkingPickler._extra_reducers)
        handing -= _NAMING_REDUCTIONS
        stream = io.BytesIO()
        fast = _SetupPickler(stream, handing)
        try:
            fast.dump(setup)
        except Exception:
            pass
        else:
            return cls(stream.getvalue(), tuple(fast.set_aside))
        return cls._pack_with_dill(setup, handing)

    @classmethod
    def _pack_with_dill(cls, setup: WorkerSetup, handing: frozenset[type]) -> Shipment:
        set_aside: list[object] = []
        keys: dict[int, int] = {}  # by id(): an object held twice stays one object

        mended: list[type] = []

        def persistent_id(obj: object) -> int | None:
            if isinstance(obj, type):
                _give_own_bases(obj, mended)
                return None
            if type(obj) not in handing:
                return None
            key = keys.get(id(obj))
            if key is None:
                key = keys[id(obj)] = len(set_aside)
                set_aside.append(obj)
            return key

        stream = io.BytesIO()
        pickler = multiprocess.reduction.ForkingPickler(stream)
        pickler.persistent_id = persistent_id
        try:
            pickler.dump(setup)
        finally:
            for mended_class in mended:
                delattr(mended_class, "__orig_bases__")
        return cls(stream.getvalue(), tuple(set_aside), by_name=False)

    def for_worker(self) -> tuple[bytes, bytes]:
        """What one worker unpacks with `unpack_setup`: handles of its own for what was set
        aside."""
        if not self.set_aside:
            return self.setup, b""
        return self.setup, bytes(multiprocess.reduction.ForkingPickler.dumps(self.set_aside))


def _give_own_bases(cls: type, mended: list[type]) -> None:
    """Keep dill from rebuilding `cls` on the wrong parents; note it in `mended` to undo.

    dill (0.4.1; uqfoundation/dill#766) rebuilds a class it sends by value from
    `__orig_bases__` whenever the class *has* one, inherited included. Every torch dataset
    inherits one from `Dataset(Generic[T_co])`: a dataset class of a script's `__main__` that
    does not subscript its parent came back in a worker without that parent, and so without
    every method it inherits (`__getitem__` raised NotImplementedError, or the object was not
    subscriptable). For the length of the dump such a class holds its own `__orig_bases__`,
    its real bases, which is what `types.get_original_bases` says of it anyway.
    """
    if "__orig_bases__" in cls.__dict__ or not hasattr(cls, "__orig_bases__") or _findable(cls):
        return  # its own already, none at all, or sent by name, not rebuilt
    try:
        cls.__orig_bases__ = cls.__bases__
    except (AttributeError, TypeError):
        return  # a class that takes no attributes; dill rebuilds it as it would have
    mended.append(cls)


def read_setup(path: str, set_aside: bytes) -> WorkerSetup:
    """In a worker: the setup whose pickle the executor wrote to `path` (see `unpack_setup`)."""
    with open(path, "rb") as file:
        return unpack_setup(file.read(), set_aside)


def unpack_setup(setup: bytes, set_aside: bytes) -> WorkerSetup:
    """In a worker: the setup a `Shipment` packed."""
    objects = pickle.loads(set_aside) if set_aside else ()
    unpickler = pickle.Unpickler(io.BytesIO(setup))
    unpickler.persistent_load = objects.__getitem__  # type: ignore[method-assign]
    token = _UNPACKING.set(objects)
    try:
        unpacked = unpickler.load()
    finally:
        _UNPACKING.reset(token)
    assert isinstance(unpacked, WorkerSetup)
    return unpacked


# --- where a batch's storages went -------------------------------------------------------------


class Receiving(Protocol):
    """The main process's receipt for the message being unpickled (`leases`)."""

    table: tuple[tuple[tuple[int, ...], tuple[torch.UntypedStorage, ...]], ...] | None
    """Per large storage of the batch, its windows: their starts, and their storages."""

    def storage(self, buffer: int, start: int, nbytes: int) -> torch.UntypedStorage:
        """`nbytes` of the worker's buffer `buffer` from `start`, as a storage."""


RECEIVING: contextvars.ContextVar[Receiving | None] = contextvars.ContextVar(
    "statecore_buffer_receipt", default=None
)
"""The receipt of the message being unpickled in this thread; None outside `leases`' loads."""


class Shared:
    """Bytes of a buffer, from `start`: one storage, or one window of a storage."""

    __slots__ = ("buffer", "nbytes", "start")

    def __init__(self, buffer: int, start: int, nbytes: int) -> None:
        self.buffer, self.start, self.nbytes = buffer, start, nbytes

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[int, int, int]]:
        return (_shared_storage, (self.buffer, self.start, self.nbytes))


class Inline:
    """A small storage's bytes, or a small window's, carried in the message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[bytes]]:
        return (_inline_storage, (self.data,))


class TorchWay:
    """A large storage that no buffer could take: it travels whole, as torch sends it."""

    __slots__ = ("storage",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage

    def __reduce__(self) -> tuple[Callable[..., torch.UntypedStorage], tuple[torch.Tensor]]:
        # Pickled outside any batch, so the tensor goes through torch's reductions.
        whole = torch.empty((0,), dtype=torch.uint8).set_(self.storage)
        return (_storage_of, (whole,))


Windows = tuple[tuple[int, "Shared | Inline | TorchWay"], ...]
"""Where one large storage of a batch went: (start in the storage, where those bytes went),
by start; the windows do not overlap."""


class Framed:
    """A batch whose large storages were placed after it was pickled: the table of where each
    went, then the batch's own pickle, whose tensors refer to the table by number."""

    __slots__ = ("batch", "table")

    def __init__(self, table: tuple[Windows, ...], batch: bytes) -> None:
        self.table, self.batch = table, batch

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[tuple[Windows, ...], bytes]]:
        return (_unframe, (self.table, self.batch))


def _receipt(what: str) -> Receiving:
    receipt = RECEIVING.get()
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


def tensor_on(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    """The tensor on `storage` at element `offset`, with the worker's size and stride."""
    return torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)


def tensor_at(
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
    return tensor_on(storages[window], dtype, offset, size, stride)
