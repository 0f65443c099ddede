"""The multiprocessing executor: worker processes from the `multiprocess` package.

Each worker has its own task pipe and its own result pipe. The parent waits on every result
pipe and every worker's process sentinel at once (`multiprocess.connection.wait`), so a worker
that dies is noticed the moment it dies, not after a polling interval.

What crosses process boundaries, and how:

- *User code* (dataset, collate_fn, worker_init_fn) goes to spawn and forkserver workers pickled
  with dill, so lambdas, closures and classes defined in functions work: pickled once for all
  workers, except for tensors (and pipes), whose pickle is a handle only one process can fetch,
  pickled for each worker as it starts (see `_Shipment`). Under fork nothing is pickled, as in
  torch. Under forkserver the server preloads this module, and so torch, before it forks any
  worker.
- *Tasks* go through a pipe per worker, pickled by the C pickler (dill only as a fallback).
  The main thread writes them itself, and what the pipe has no room for is left to a flusher
  thread (see `_channel`), so sending a task never blocks the main process.
- *Results* come back pickled with the standard library's C pickler. Large tensors travel in
  shared-memory buffers that each worker reuses (see `_buffers`): default_collate writes the
  batch straight into one, and the message says which. Other tensors travel as torch sends
  them, each in a shared-memory segment of its own whose file descriptor crosses through the
  resource sharer. Only a batch the C pickler refuses falls back to dill (with torch's
  reductions).
- *Buffers* cross once each: a notice carrying the file descriptor precedes the first message
  that uses one. The main process gives a buffer back, once the consumer has freed the storage
  built on it, with the next task it sends that worker.

Each worker is started when the scheduler first gives it something to do (or the main
process first waits for answers), so the first worker loads its first batch while the others
are still being started, instead of every worker waiting for the last one to be started.

Both picklers share tensors through the standard library's resource sharer, which
authenticates with `multiprocessing.current_process().authkey`. In a worker started by
`multiprocess` that key is not the parent's, so each worker takes the parent's key before it
unpickles anything. The sharer's sockets go in a directory of the executor's, which shutdown
removes (see `_adopt_tempdir`).

A worker exits on its own the moment its loader's process ends, however that process was
killed and whatever the worker is doing (see `_watch_loader`).
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import ctypes
import functools
import io
import multiprocessing as stdlib_multiprocessing
import multiprocessing.util as stdlib_util
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import types
from multiprocessing.reduction import ForkingPickler as StdlibPickler
from typing import Any, NoReturn

import attrs
import multiprocess
import multiprocess.connection
import multiprocess.context
import multiprocess.reduction
import multiprocess.util
import torch.multiprocessing  # registers torch's reductions with the stdlib pickler
from torch.utils.data._utils import HAS_NUMPY

from statecore import (
    Event,
    ResumeWorker,
    SendTask,
    TaskCompleted,
    TaskFailed,
    WorkerDied,
)
from statecore.executors._buffers import (
    Batch,
    BufferClosed,
    BufferOpened,
    BufferReceiver,
    BufferSender,
    explain_exhaustion,
)
from statecore.executors._channel import TaskWriter
from statecore.executors._launch import Launch
from statecore.executors._remote import RemoteError
from statecore.executors._signals import HeldSignals, restore_in_child
from statecore.executors._worker import WorkerRuntime, WorkerSetup

if HAS_NUMPY:
    # Every worker seeds numpy's global generator, as torch's workers do, and a forked worker
    # that must import numpy.random first spends over 10 ms on it before its first batch.
    # Imported here, once, every worker forked from this process (or from the fork server,
    # which imports this module) starts with it.
    import numpy.random  # noqa: F401

__all__ = ["MultiprocessExecutor", "resolve_context"]

# How often a worker checks that its loader's process is still there, on systems without
# process descriptors (elsewhere it is woken the moment that process ends).
WATCHDOG_INTERVAL = 1.0
# How often an idle worker checks whether shutdown has begun. The stop message normally wakes
# it at once, but a loader reclaimed by the garbage collector may have lost its pipes first.
STOP_CHECK_INTERVAL = 0.1
# How long shutdown lets workers exit by themselves before terminating them. An idle worker
# exits at once; one still busy with a batch nobody will read is simply terminated.
SHUTDOWN_GRACE = 1.0
# How long to wait for a process that has ended, or was terminated, to be reaped.
JOIN_TIMEOUT = 5.0
# Every result message starts with the task it answers, how many buffers it refers to and
# what its pickle holds, followed by the buffers' numbers (int32 each).
_HEADER = struct.Struct("<qiB")
# What a message's pickle holds: an event, or only the batch of a completed task (the header
# and the pipe it came by say the rest, and pickling the event object costs every batch).
_EVENT = 0
_BATCH = 1
# Answers to resumes carry no task number; this marks them on the wire.
_NO_TASK = -1
# A buffer notice is no answer at all.
_NOTICE = -2
# glibc's mallopt parameters (malloc.h), and the values its own adaptive thresholds end at on
# 64-bit machines.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 64 << 20


def _share_torch_reductions() -> None:
    """Teach multiprocess's dill pickler to send tensors through shared memory too."""
    for kind, reducer in StdlibPickler._extra_reducers.items():  # type: ignore[attr-defined]
        multiprocess.reduction.ForkingPickler.register(kind, reducer)


_share_torch_reductions()


def resolve_context(spec: object) -> multiprocess.context.BaseContext:
    """A multiprocess context from a start method name or a context object of either package."""
    if spec is None:
        return multiprocess.get_context()
    if isinstance(spec, str):
        return multiprocess.get_context(spec)
    if isinstance(spec, multiprocess.context.BaseContext):
        return spec
    if isinstance(spec, stdlib_multiprocessing.context.BaseContext):
        return multiprocess.get_context(spec.get_start_method())
    raise TypeError(
        "multiprocessing_context should be a start method name or a context object, "
        f"but got {spec!r}"
    )


def _encode(task: int, event: Event, buffers: BufferSender, batch: Batch | None = None) -> bytes:
    kind, content = (_BATCH, event.payload) if type(event) is TaskCompleted else (_EVENT, event)
    try:
        payload, lent = buffers.dumps(content, batch)
    except Exception:
        buffers.abandon(batch)
        payload, lent = bytes(multiprocess.reduction.ForkingPickler.dumps(content)), ()
    return _HEADER.pack(task, len(lent), kind) + struct.pack(f"<{len(lent)}i", *lent) + payload


def _encode_failure(task: int, worker: int, failure: RemoteError, buffers: BufferSender) -> bytes:
    """A failed task's answer, which must go out whatever the failure holds."""
    try:
        return _encode(task, TaskFailed(task, worker, failure), buffers)
    except Exception:
        # What is left is text: the index as its repr, and no type to rebuild.
        plain = attrs.evolve(failure, index=_index_text(failure.index), exc_type=None)
        return _encode(task, TaskFailed(task, worker, plain), buffers)


def _index_text(index: object) -> str:
    try:
        return repr(index)
    except Exception:
        return f"<a {type(index).__qualname__} that cannot be shown>"


def _task_message(command: SendTask | ResumeWorker, returned: tuple[int, ...]) -> bytes:
    """A task as bytes, pickled with the C pickler: dill takes about 100 us for a task, which is
    GIL time taken from the main process on every batch. dill remains the fallback for an index
    the C pickler refuses."""
    message = (command, returned)
    try:
        return bytes(StdlibPickler.dumps(message))
    except Exception:
        return bytes(multiprocess.reduction.ForkingPickler.dumps(message))


def _notice(notice: BufferOpened | BufferClosed) -> bytes:
    return _HEADER.pack(_NOTICE, 0, _EVENT) + bytes(StdlibPickler.dumps(notice))


# Reductions registered with the picklers that only name what they pickle. Every other one
# (torch's for tensors and storages, multiprocessing's for pipes and sockets) hands over a
# resource, typically a file descriptor that one receiving process fetches, once.
_NAMING_REDUCTIONS = frozenset(
    {types.MethodType, types.MethodDescriptorType, types.WrapperDescriptorType, functools.partial}
)


@attrs.frozen
class _Shipment:
    """The worker setup for spawn and forkserver workers, pickled with dill once for them all.

    Except for the objects whose pickle hands over a resource (a tensor shared through torch's
    reductions, a pipe): their pickle is a handle that a single process can fetch, so the same
    bytes cannot go to two workers. They are set aside and pickled for each worker as it
    starts, as torch pickles the whole dataset for each. A tensor's storage moves to shared
    memory the first time, and every worker maps that same memory: nothing is copied per worker.
    """

    setup: bytes
    set_aside: tuple[object, ...]

    @classmethod
    def pack(cls, setup: WorkerSetup) -> _Shipment:
        handing = frozenset(multiprocess.reduction.ForkingPickler._extra_reducers)
        handing -= _NAMING_REDUCTIONS
        set_aside: list[object] = []
        keys: dict[int, int] = {}  # by id(): an object held twice stays one object

        def persistent_id(obj: object) -> int | None:
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
        pickler.dump(setup)
        return cls(stream.getvalue(), tuple(set_aside))

    def for_worker(self) -> tuple[bytes, bytes]:
        """What one worker unpacks with `_unpack`: handles of its own for what was set aside."""
        if not self.set_aside:
            return self.setup, b""
        return self.setup, bytes(multiprocess.reduction.ForkingPickler.dumps(self.set_aside))


def _unpack(setup: bytes, set_aside: bytes) -> WorkerSetup:
    objects = pickle.loads(set_aside) if set_aside else ()
    unpickler = pickle.Unpickler(io.BytesIO(setup))
    unpickler.persistent_load = objects.__getitem__  # type: ignore[method-assign]
    unpacked = unpickler.load()
    assert isinstance(unpacked, WorkerSetup)
    return unpacked


def _reuse_freed_memory() -> None:
    """Make the worker's malloc reuse freed blocks of up to 32 MiB, not map fresh pages.

    glibc maps every allocation above a threshold afresh, and each page of a fresh mapping
    faults when first written: for samples of a few megabytes, that costs more than moving the
    batch. The threshold adapts to what the process has freed, so a forked worker inherits
    whatever its parent's history left, and the same dataset ran at half speed or full speed
    from one loader to the next. Fixed where glibc's adaptation would end (32 MiB; up to 64 MiB
    kept free at the top of the heap), samples reuse memory in every worker.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except Exception:
        return  # not glibc: its allocator has its own ways
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def _preload_in_forkserver() -> None:
    """Have the fork server import this module (and so torch) before it forks any worker.

    A worker forked from the server then starts with torch already imported, rather than each
    worker importing it anew: seconds per worker, and on few cores the workers queue for them.
    The server imports once, when it starts, and stays single-threaded, which is what makes
    forking from it safe. Only a server not yet started takes the hint; what its preload list
    already holds (by default `__main__`) stays.
    """
    from multiprocess import forkserver

    server = forkserver._forkserver
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    if __name__ not in preload:
        forkserver.set_forkserver_preload([*preload, __name__])


@attrs.frozen
class _Home:
    """What a worker is told of the process that runs its loader."""

    pid: int
    authkey: bytes
    """The loader process's key, which the standard library's resource sharer checks."""
    tempdir: str
    """Where the worker's sockets go (see `_adopt_tempdir`); removed at shutdown."""


def _adopt_tempdir(tempdir: str) -> None:
    """Make the worker's sockets go in the executor's directory rather than one of its own.

    Sharing a file descriptor (a buffer, or a tensor sent torch's way) starts the resource
    sharer, which listens on a unix socket in a temporary directory that the standard library
    creates and removes at exit. `multiprocess` workers skip the standard library's exit, and
    a terminated worker skips any exit, so each such directory (`/tmp/pymp-*`) would stay, one
    per worker per epoch. The executor's directory is removed by the main process instead.
    """
    stdlib_multiprocessing.current_process()._config["tempdir"] = tempdir  # type: ignore[attr-defined]
    multiprocess.current_process()._config["tempdir"] = tempdir


def _let_go_of_fork_server() -> None:
    """Close this worker's end of the fork server's "alive" pipe.

    The server exits once every holder of that pipe's writing end has closed it, and it gives
    one to every process it forks, so that they could start processes through it too. A worker
    that kept it would keep the server (and the resource tracker, which the server holds) alive
    after the main process died, for as long as the worker itself lives.
    """
    forkserver = sys.modules.get("multiprocess.forkserver")
    if forkserver is None:
        return
    server = forkserver._forkserver
    if server.get_inherited_fds() is None or server._forkserver_alive_fd is None:
        return  # not forked by a fork server
    with contextlib.suppress(OSError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None


def _watch_loader(loader: int, parent: int, tempdir: str) -> None:
    """Exit this worker once the loader's process is gone, even while user code blocks the
    main thread.

    The loader's process, not this worker's parent: under forkserver the parent is the fork
    server. Where the system has process descriptors, this waits on one and wakes the moment
    the process ends; elsewhere it looks every WATCHDOG_INTERVAL.
    """
    try:
        descriptor = os.pidfd_open(loader)
    except ProcessLookupError:
        _orphaned(tempdir)
    except (AttributeError, OSError):
        descriptor = None  # not Linux 5.3 or later: poll instead
    if parent == loader and os.getppid() != parent:
        _orphaned(tempdir)  # it ended before the descriptor was open (its pid may be reused)
    if descriptor is not None:
        waiting = select.poll()
        waiting.register(descriptor, select.POLLIN)
        waiting.poll()  # readable once the process has ended
        _orphaned(tempdir)
    while True:
        time.sleep(WATCHDOG_INTERVAL)
        if (parent == loader and os.getppid() != parent) or not _exists(loader):
            _orphaned(tempdir)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _orphaned(tempdir: str) -> NoReturn:
    """End this worker at once: nobody is left to read what it would send."""
    shutil.rmtree(tempdir, ignore_errors=True)  # the loader's process cannot remove it now
    os._exit(0)


def _worker_main(
    shipped: WorkerSetup | tuple[bytes, bytes],
    worker_id: int,
    tasks: Any,
    results: Any,
    home: _Home,
    stopping: Any,
) -> None:
    """The body of a worker process."""
    restore_in_child()  # forked while the main thread held signals back
    # Ctrl-C reaches the whole process group; the main process decides what happens next and
    # stops the workers itself, so a worker neither dies of it nor prints a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if isinstance(shipped, WorkerSetup):
        # Forked by multiprocess, which runs its own after-fork hooks but not the standard
        # library's: without them this worker would share tensors through its parent's
        # resource sharer (whose listener is the parent's) and inherit torch's locks as held.
        stdlib_util._run_after_forkers()  # type: ignore[attr-defined]
    else:
        _let_go_of_fork_server()
    # A bare thread: `threading.Thread.start` waits until the new thread has run, which costs
    # a starting worker milliseconds on a busy machine.
    _thread.start_new_thread(_watch_loader, (home.pid, os.getppid(), home.tempdir))
    _adopt_tempdir(home.tempdir)
    stdlib_multiprocessing.current_process().authkey = home.authkey
    torch.set_num_threads(1)
    _reuse_freed_memory()  # before worker_init_fn, which may tune the allocator its own way
    setup = shipped if isinstance(shipped, WorkerSetup) else _unpack(*shipped)
    buffers = BufferSender(workers=setup.num_workers)
    buffers.install()
    runtime = WorkerRuntime.in_worker(setup, worker_id, os.getpid())
    answers = _Answers(worker_id, results, buffers)
    try:
        _serve(tasks, stopping, runtime, buffers, answers)
    finally:
        answers.close()
    if answers.failed is not None:
        # The sending thread itself broke: end this worker with its error (exit code 1), so
        # that the main process reports the death instead of waiting for answers for ever.
        raise answers.failed


def _serve(
    tasks: Any, stopping: Any, runtime: WorkerRuntime, buffers: BufferSender, answers: _Answers
) -> None:
    """Answer tasks until the stop message, shutdown, or the parent closing a pipe."""
    message: bytes | None = None
    while not answers.broken:
        if message is None:
            if not tasks.poll(STOP_CHECK_INTERVAL):
                if stopping.value:
                    return
                continue
            message = _receive_task(tasks)
        if not message:
            return  # the stop message, or the parent closed our pipe
        command, returned = pickle.loads(message)
        buffers.returned(returned)
        task, batch = _NO_TASK, None
        if isinstance(command, SendTask):
            task, batch = command.task, buffers.begin()
        with buffers.collating(batch):
            event = runtime.answer(command)
        # The next task, if it is here already, is read before this answer is handed on, so
        # that the sending thread wakes while this one loads, not while it reads the pipe.
        message = _receive_task(tasks) if tasks.poll(0) else None
        answers.put(task, getattr(command, "index", None), event, batch)
        del event  # the sending thread holds the batch (and what it holds of the buffers)


def _receive_task(tasks: Any) -> bytes:
    try:
        return bytes(tasks.recv_bytes())
    except (EOFError, OSError):
        return b""  # the parent closed our pipe: it is shutting down


class _Answers:
    """A worker's answers on their way to the main process, encoded and sent by a thread.

    Right after a sample that waited (I/O, a sleep) the worker's caches are cold, and encoding
    and writing a batch of small tensors then takes it a few hundred microseconds. On this
    thread that overlaps the next batch's loading whenever the dataset releases the GIL, as
    torch's queue feeder thread does; on CPU-bound samples the GIL serializes them as before.
    Answers go out in the order they were put.
    """

    def __init__(self, worker: int, results: Any, buffers: BufferSender) -> None:
        self.worker = worker
        self.results = results
        self.buffers = buffers
        self.queue: collections.deque[tuple[int, object, Event, Batch | None] | None] = (
            collections.deque()
        )
        self.more = threading.Condition(threading.Lock())
        self.done = threading.Event()
        self.broken = False
        """Nothing more will be sent: the main process closed the result pipe (it is shutting
        down), or the thread failed."""
        self.failed: BaseException | None = None
        """What ended the thread, if it was not the main process closing the pipe."""
        # A bare thread, as for the watchdog: starting it costs no wait.
        _thread.start_new_thread(self._run, ())

    def put(self, task: int, index: object, event: Event, batch: Batch | None) -> None:
        with self.more:
            self.queue.append((task, index, event, batch))
            self.more.notify()

    def close(self) -> None:
        """Send every answer put so far (unless the pipe is closed), then stop the thread."""
        with self.more:
            self.queue.append(None)
            self.more.notify()
        self.done.wait()

    def _run(self) -> None:
        try:
            while True:
                with self.more:
                    while not self.queue:
                        self.more.wait()
                    item = self.queue.popleft()
                if item is None:
                    return
                task, index, event, batch = item
                del item  # while idle, hold no batch: it would keep its buffers from reuse
                if not self._send(task, index, event, batch):
                    return
                del event
        except BaseException as error:
            self.failed = error
        finally:
            self.broken = True
            self.done.set()

    def _send(self, task: int, index: object, event: Event, batch: Batch | None) -> bool:
        buffers = self.buffers
        try:
            answer = _encode(task, event, buffers, batch)
        except Exception as error:
            buffers.abandon(batch)
            failure = RemoteError.capture(
                error,
                worker=self.worker,
                pid=os.getpid(),
                index=index,
                where="while sending the batch back",
            )
            answer = _encode_failure(task, self.worker, failure, buffers)
        try:
            for notice in buffers.notices():
                self.results.send_bytes(_notice(notice))
            self.results.send_bytes(answer)
        except (BrokenPipeError, OSError):
            return False
        buffers.end(batch)
        return True


class MultiprocessExecutor:
    """Runs each worker in its own process; see the module docstring for the wire."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.context = resolve_context(launch.multiprocessing_context)
        # Keyed by worker, for the workers started so far.
        self.processes: dict[int, Any] = {}
        self.tasks: dict[int, TaskWriter] = {}
        self.readers: dict[int, Any] = {}
        self.task_readers: dict[int, Any] = {}
        self.held: dict[int, list[bytes]] = {}
        """Task messages for workers not started yet, written once each starts."""
        # The pin stage polls from its own thread while the driver's thread dispatches.
        self.launching = threading.Lock()
        self.shipped: WorkerSetup | _Shipment | None = None
        self.authkey = b""
        self.home: _Home | None = None
        """Made when the first worker starts: a loader that starts none leaves no directory."""
        self.remove_tempdir: Any = None
        self.ready: list[Event] = []
        self.unconfirmed: Event | None = None
        """The answer `poll` returned last, until the driver has recorded it (see _protocol)."""
        self.signals_held = HeldSignals()
        self.stopping: set[int] = set()
        self.shutting_down: Any = None
        self.gone: set[int] = set()
        self.buffers = BufferReceiver()
        self.closed = False

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Get ready to start the workers: the first starts with its first task (`_send`)."""
        ctx = self.context
        if ctx.get_start_method() == "forkserver":
            _preload_in_forkserver()
        setup = self.launch.setup
        self.shipped = setup if ctx.get_start_method() == "fork" else _Shipment.pack(setup)
        self.authkey = bytes(stdlib_multiprocessing.current_process().authkey)
        # A raw shared flag, not an Event: an Event's lock would stay held for ever by a worker
        # killed while checking it, and shutdown would then block on it.
        self.shutting_down = ctx.RawValue(ctypes.c_bool, False)
        if self.launch.start_all_at_once:
            for worker in range(self.launch.num_workers):
                self._launch(worker)

    def _launch(self, worker: int) -> None:
        """Start `worker`'s process, unless it runs, was stopped, or shutdown has begun."""
        failure: BaseException | None = None
        # A fork cut short would leave a child nobody recorded: an interrupt is raised once the
        # worker is started and recorded, from the end of this block (see _signals).
        with self.signals_held, self.launching:
            if worker in self.processes or worker in self.stopping or self.closed:
                return
            try:
                self._start_process(worker)
            except BaseException as error:
                failure = explain_exhaustion(error)  # while the descriptors are still held
        if failure is not None:
            self.shutdown()
            raise failure

    def _start_process(self, worker: int) -> None:
        # Each worker's pipes are made just before it starts, and the writing end of its
        # result pipe is closed here just after: a worker started earlier does not hold it, so
        # EOF on a result pipe means that its worker is gone. (A worker forked later does
        # inherit this process's ends of earlier workers' pipes, and never uses them.)
        ctx = self.context
        # Before any pipe is made, so that a setup that fails to pickle leaves none open.
        shipped = self.shipped.for_worker() if isinstance(self.shipped, _Shipment) else self.shipped
        home = self._home()
        task_reader, task_writer = ctx.Pipe(duplex=False)
        reader, writer = ctx.Pipe(duplex=False)
        try:
            tasks = TaskWriter(os.dup(task_writer.fileno()), f"statecore-tasks-{worker}")
        finally:
            task_writer.close()
        process = ctx.Process(
            target=_worker_main,
            args=(
                shipped,
                worker,
                task_reader,
                writer,
                home,
                self.shutting_down,
            ),
            name=f"statecore-worker-{worker}",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            for end in (task_reader, writer, reader):
                end.close()
            tasks.close()
            raise
        # This process keeps its copy of the task pipe's reading end: writing to the pipe of a
        # worker that died then fills the pipe rather than raising SIGPIPE, which would kill a
        # main process that restored the signal's default. The death is reported by its
        # sentinel.
        self.task_readers[worker] = task_reader
        writer.close()
        for message in self.held.pop(worker, ()):
            tasks.put(message)
        self.readers[worker], self.processes[worker] = reader, process
        self.tasks[worker] = tasks  # last: from now on `_send` writes to it directly

    def _home(self) -> _Home:
        if self.home is None:
            tempdir = tempfile.mkdtemp(prefix="statecore-")
            # Removed at shutdown; for a loader never shut down, at interpreter exit once its
            # workers are terminated (unlike weakref.finalize, not in a forked child's exit).
            self.remove_tempdir = multiprocess.util.Finalize(
                self, shutil.rmtree, args=(tempdir, True), exitpriority=-50
            )
            self.home = _Home(pid=os.getpid(), authkey=self.authkey, tempdir=tempdir)
        return self.home

    def _next_to_launch(self) -> int | None:
        if self.closed or len(self.processes) == self.launch.num_workers:
            return None
        for worker in range(self.launch.num_workers):
            if worker not in self.processes and worker not in self.stopping:
                return worker
        return None

    def _send(self, worker: int, command: SendTask | ResumeWorker) -> None:
        message = _task_message(command, self.buffers.returns_for(worker))
        tasks = self.tasks.get(worker)
        if tasks is None:
            with self.launching:
                tasks = self.tasks.get(worker)
                if tasks is None:
                    if worker not in self.stopping and not self.closed:
                        self.held.setdefault(worker, []).append(message)
                    first = not self.processes
            if tasks is None:
                if first:
                    # The first worker given a task starts at once; the others start while
                    # the main process waits for answers (see `poll`).
                    self._launch(worker)
                return
        tasks.put(message)

    def dispatch(self, command: SendTask) -> None:
        self._send(command.worker, command)

    def resume(self, command: ResumeWorker) -> None:
        self._send(command.worker, command)

    def stop_worker(self, worker: int) -> None:
        if worker in self.stopping:
            return
        with self.launching:
            self.stopping.add(worker)  # a worker not started yet never will be
            self.held.pop(worker, None)
        if worker in self.processes and worker not in self.gone:
            # At interpreter exit the pipe may already be closed; shutdown then terminates
            # the worker instead.
            with contextlib.suppress(ValueError, OSError):
                self.tasks[worker].put(b"")  # the stop message

    # --- answers -----------------------------------------------------------------------------

    def poll(self, timeout: float | None) -> Event | None:
        """The next answer from any worker, a death, or None once `timeout` seconds pass.

        Workers not started yet are started here, one at a time, and only while no answer is
        waiting to be read: starting one takes milliseconds (fork copies the page tables of
        the whole main process), which an answer already here should not wait for.
        """
        if self.ready:
            return self._hand_over()
        deadline = None
        while not self.ready:
            watched = self._watched()
            starting = self._next_to_launch()
            if starting is not None:
                fired = multiprocess.connection.wait(list(watched), 0) if watched else []
                if not fired:
                    self._launch(starting)
                    continue
            else:
                if not watched:
                    return None
                # The timeout counts from here: starting workers is not waiting for them.
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                fired = multiprocess.connection.wait(list(watched), left)
                if not fired:
                    return None
            # Reading a message is not interruptible without losing it (see _signals).
            with self.signals_held:
                for handle in fired:
                    self._collect(*watched[handle])
        return self._hand_over()

    def _hand_over(self) -> Event:
        # Read, recorded, then removed, with no call in between: an interrupt landing as this
        # returns cannot lose the answer (see _protocol).
        event = self.ready[0]
        self.unconfirmed = event
        del self.ready[0]
        return event

    def _watched(self) -> dict[Any, tuple[str, int]]:
        watched: dict[Any, tuple[str, int]] = {}
        # A snapshot: another thread may start a worker meanwhile.
        for worker, process in tuple(self.processes.items()):
            if worker in self.gone:
                continue
            watched[self.readers[worker]] = ("answer", worker)
            watched[process.sentinel] = ("exit", worker)
        return watched

    def _collect(self, kind: str, worker: int) -> None:
        reader = self.readers[worker]
        if kind == "answer":
            try:
                message = reader.recv_bytes()
            except (EOFError, OSError):
                self._exited(worker)
            else:
                self._receive(worker, message)
            return
        # The process ended: first take whatever it sent before ending.
        try:
            while reader.poll(0):
                self._receive(worker, reader.recv_bytes())
        except (EOFError, OSError):
            pass
        self._exited(worker)

    def _receive(self, worker: int, message: bytes) -> None:
        task, count, kind = _HEADER.unpack_from(message)
        lent = struct.unpack_from(f"<{count}i", message, _HEADER.size)
        payload = memoryview(message)[_HEADER.size + 4 * count :]
        if task == _NOTICE:
            self.buffers.notice(worker, pickle.loads(payload))
        else:
            self.ready.append(self._decode(worker, task, lent, payload, kind))

    def _exited(self, worker: int) -> None:
        if worker in self.gone:
            return
        self.gone.add(worker)
        process = self.processes[worker]
        process.join(JOIN_TIMEOUT)
        if worker not in self.stopping:
            self.ready.append(WorkerDied(worker, process.pid, process.exitcode))

    def _decode(
        self, worker: int, task: int, lent: tuple[int, ...], payload: memoryview, kind: int
    ) -> Event:
        try:
            content = self.buffers.loads(worker, lent, payload)
        except Exception as error:
            process = self.processes[worker]
            process.join(JOIN_TIMEOUT / 5)
            if not process.is_alive() and worker not in self.stopping:
                # Its tensors died with it (they are fetched from the worker on unpickling):
                # the death is the error to report, not the failed fetch.
                self.gone.add(worker)
                return WorkerDied(worker, process.pid, process.exitcode)
            failure = RemoteError.capture(
                error,
                worker=worker,
                pid=self.processes[worker].pid,
                index=None,
                where="while receiving a batch in the main process",
            )
            return TaskFailed(task, worker, failure)
        if kind == _BATCH:
            return TaskCompleted(task, worker, content)
        assert isinstance(content, Event)
        return content

    # --- shutdown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker, terminate the ones that do not stop, release every handle."""
        if self.closed:
            return
        self.closed = True
        if self.shutting_down is not None:
            self.shutting_down.value = True
        with self.launching:  # no worker starts from now on: `closed` is set
            self.held.clear()
        for worker in range(self.launch.num_workers):
            self.stop_worker(worker)
        deadline = time.monotonic() + SHUTDOWN_GRACE
        running = {w for w, p in self.processes.items() if p.is_alive()}
        # A pipe at its end stays readable: watching it would spin while its worker exits.
        ended: set[int] = set()
        while running and time.monotonic() < deadline:
            # A worker blocked on sending a batch nobody will read exits once we drain it.
            handles = {self.readers[w]: w for w in running - ended}
            handles.update({self.processes[w].sentinel: w for w in running})
            for handle in multiprocess.connection.wait(
                list(handles), max(0.0, deadline - time.monotonic())
            ):
                worker = handles[handle]
                try:
                    while self.readers[worker].poll(0):
                        self.readers[worker].recv_bytes()
                except (EOFError, OSError):
                    ended.add(worker)
            running = {w for w in running if self.processes[w].is_alive()}
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT)
            if process.is_alive():
                process.kill()
            process.join()
            process.close()
        for tasks in self.tasks.values():
            tasks.close()
        for reader in (*self.readers.values(), *self.task_readers.values()):
            reader.close()
        self.ready.clear()
        self.unconfirmed = None
        self.buffers.close()
        if self.remove_tempdir is not None:
            self.remove_tempdir()  # every worker is gone: the sockets in it are dead
