"""The body of a worker process, and the thread that sends its answers.

Run by each worker process of the mp executor (`executor` starts it with `worker_main` as
its target; spawn and forkserver workers find that function, and `Home`, by their names in
this module). Under forkserver the server preloads this module, and so torch, before it forks
any worker (`executor.preload_in_forkserver`).

A worker reads tasks from its task pipe and answers them in order; a thread of its own encodes
and sends each answer (`AnswerSender`) while the worker loads the next batch. Before its first
task it makes itself at home: it takes the loader's authkey (the resource sharer checks it),
puts its sockets in the executor's directory, lets go of the fork server, fixes glibc's
allocator thresholds, and starts a watchdog that ends it the moment the loader's process is
gone, however that process was killed and whatever the worker is doing (`watch_loader`).
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import ctypes
import gc
import multiprocessing as stdlib_multiprocessing
import multiprocessing.util as stdlib_util
import os
import pickle
import select
import shutil
import signal
import sys
import threading
import time
from typing import Any, Final, Literal, NoReturn

import attrs
import multiprocess
import torch
from torch.utils.data._utils import HAS_NUMPY

from statecore import Event, SendTask, WorkerStarted
from statecore.executors._incarnation import Standing, restored
from statecore.executors._mp import stacks
from statecore.executors._mp.pool import Batch, BufferSender
from statecore.executors._mp.wire import (
    NO_TASK,
    encode_answer,
    encode_failure,
    encode_notice,
    read_setup,
)
from statecore.executors._remote import RemoteError
from statecore.executors._signals import restore_in_child
from statecore.executors._startup import Seat, start_worker
from statecore.executors._worker import WorkerRuntime, WorkerSetup


def _freeze_what_a_spawned_worker_inherits() -> None:
    """In a spawned worker that is still importing, exempt every object so far from collection.

    A spawned worker imports torch, the user's `__main__` and this module before its first
    task, and the objects of those imports live as long as it does. Python's garbage collector
    runs a full collection once enough new objects pile up on top of what the last one saw:
    our imports tip a spawned worker over into one more of them than torch's, and it walks
    every object of torch's, about 90 ms on this machine. Frozen (`gc.freeze`), they are never
    walked again, and later collections look at what the worker makes itself. Only a spawned
    child unpickling its process object is `_inheriting`: the main process, forked workers and
    the fork server are left as they are.
    """
    if getattr(multiprocess.current_process(), "_inheriting", False):
        gc.freeze()


_freeze_what_a_spawned_worker_inherits()

if HAS_NUMPY:
    # Every worker seeds numpy's global generator, as torch's workers do, and a forked worker
    # that must import numpy.random first spends over 10 ms on it before its first batch.
    # Imported here, once, every worker forked from the main process (which imports this
    # module to start workers) or from the fork server (which preloads it) starts with it.
    import numpy.random  # noqa: F401

__all__ = ["AnswerSender", "Home", "Restart", "worker_main"]

# How often a worker checks that its loader's process is still there, on systems without
# process descriptors (elsewhere it is woken the moment that process ends).
WATCHDOG_INTERVAL = 1.0
# How often an idle worker checks whether shutdown has begun. The stop message normally wakes
# it at once, but a loader reclaimed by the garbage collector may have lost its pipes first.
STOP_CHECK_INTERVAL = 0.1
# glibc's mallopt parameters (malloc.h), and the values its own adaptive thresholds end at on
# 64-bit machines.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 64 << 20
# Put on the sending thread's queue: send the pool's notices, with no answer behind them.
_NOTICES: Final = "notices"


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


@attrs.frozen
class Home:
    """What a worker is told of the process that runs its loader."""

    pid: int
    authkey: bytes
    """The loader process's key, which the standard library's resource sharer checks."""
    tempdir: str
    """Where the worker's sockets go (see `_adopt_tempdir`); removed at shutdown."""


@attrs.frozen
class Restart:
    """How a replacement differs from the worker it replaces (`ReplaceWorker`): set up as that
    one was, at the epoch it was lost in, its dataset restored to its last answer recorded."""

    incarnation: int
    shared_seed: int | None
    """The epoch's shared seed: the last `ResumeWorker`'s, or the setup's for its first epoch."""
    mark: Standing = attrs.field(eq=False)
    """Where the lost worker's dataset stood after its last answer the main process recorded
    (None: where it stood as the epoch began; `Carried`: what it carried into a later epoch)."""
    later_epoch: bool
    """The epoch is not the setup's first: the checkpoint positions in the setup are past."""

    def setup_for(self, setup: WorkerSetup, worker_id: int) -> WorkerSetup:
        """`setup` as the lost worker's was at the moment it was lost: the mark goes where a
        checkpoint's per-worker position goes, so the runtime restores it and fast-forwards
        as it resumes a checkpoint (`executors._incarnation.restored`)."""
        placed = restored(setup, worker_id, self.mark, self.later_epoch)
        return attrs.evolve(placed, shared_seed=self.shared_seed)


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


def watch_loader(loader: int, parent: int, tempdir: str) -> None:
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


def worker_main(
    shipped: WorkerSetup | None,
    worker_id: int,
    tasks: Any,
    results: Any,
    home: Home,
    stopping: Any,
    restart: Restart | None = None,
    adopted: tuple[tuple[int, int, int], ...] = (),
) -> None:
    """The body of a worker process; `restart` for one that replaces a lost one.

    `shipped`: the setup, for a forked worker; None for a spawn or forkserver worker, whose
    first message says where its pickle is (`executor._setup_message`). `adopted`: buffers the
    main process kept from workers gone before this one, for a forked worker to adopt
    (`leases.Kept`), each with the descriptor it inherited.
    """
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
    _thread.start_new_thread(watch_loader, (home.pid, os.getppid(), home.tempdir))
    _adopt_tempdir(home.tempdir)
    incarnation = 0 if restart is None else restart.incarnation
    stacks.listen(stacks.stack_file(home.tempdir, worker_id, incarnation))
    stdlib_multiprocessing.current_process().authkey = home.authkey
    torch.set_num_threads(1)
    _reuse_freed_memory()  # before worker_init_fn, which may tune the allocator its own way
    if shipped is None:
        message = _receive_task(tasks)
        if not message:
            return  # stopped before its setup came: the loader failed to pickle it, say
        setup = read_setup(*pickle.loads(message))
    else:
        setup = shipped
    if restart is not None:
        setup = restart.setup_for(setup, worker_id)
    buffers = BufferSender(workers=setup.num_workers)
    if buffers.enabled:
        buffers.adopt(adopted)
    else:
        for _, _, fd in adopted:
            os.close(fd)
    buffers.install()
    runtime = start_worker(setup, worker_id, Seat.process(os.getpid()))
    answers = AnswerSender(worker_id, results, buffers)
    if restart is not None:
        # Its first word: set up, and ready for the tasks its slot holds.
        answers.put(NO_TASK, None, WorkerStarted(worker_id, incarnation), None)
    try:
        _serve(tasks, stopping, runtime, buffers, answers)
    finally:
        answers.close()
    if answers.failed is not None:
        # The sending thread itself broke: end this worker with its error (exit code 1), so
        # that the main process reports the death instead of waiting for answers for ever.
        raise answers.failed


def _serve(
    tasks: Any, stopping: Any, runtime: WorkerRuntime, buffers: BufferSender, answers: AnswerSender
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
        if command is None:
            # Buffers the consumer let go of while no task came (`wire.encode_returns`): the
            # pool shrinks now, not at the next task, which may be long in coming.
            if buffers.trim():
                answers.put_notices()
            message = None
            continue
        task, batch = NO_TASK, None
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


class AnswerSender:
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
        self.queue: collections.deque[
            tuple[int, object, Event, Batch | None] | Literal["notices"] | None
        ] = collections.deque()
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

    def put_notices(self) -> None:
        """Send the pool's notices, behind the answers put so far, with no answer of their own."""
        with self.more:
            self.queue.append(_NOTICES)
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
                if isinstance(item, str):  # _NOTICES
                    if not self._send_notices():
                        return
                    continue
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
            answer = encode_answer(task, event, buffers, batch)
        except Exception as error:
            buffers.abandon(batch)
            failure = RemoteError.capture(
                error,
                worker=self.worker,
                pid=os.getpid(),
                index=index,
                where="while sending the batch back",
            )
            answer = encode_failure(
                task, self.worker, failure, buffers, getattr(event, "mark", None)
            )
        if not self._send_notices():
            return False
        try:
            self.results.send_bytes(answer)
        except (BrokenPipeError, OSError):
            return False
        buffers.end(batch)
        return True

    def _send_notices(self) -> bool:
        """Send what the main process must learn about the pool; False once the pipe is closed."""
        try:
            for notice in self.buffers.notices():
                self.results.send_bytes(encode_notice(notice))
        except (BrokenPipeError, OSError):
            return False
        return True
