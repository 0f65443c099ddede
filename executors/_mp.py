"""The multiprocessing executor: worker processes from the `multiprocess` package.

Each worker has its own task queue and its own result pipe. The parent waits on every result
pipe and every worker's process sentinel at once (`multiprocess.connection.wait`), so a worker
that dies is noticed the moment it dies, not after a polling interval.

What crosses process boundaries, and how:

- *User code* (dataset, collate_fn, worker_init_fn) goes to spawn and forkserver workers pickled
  with dill, so lambdas, closures and classes defined in functions work. Under fork nothing
  is pickled, as in torch.
- *Tasks* go through a `multiprocess` queue, whose feeder thread never blocks the parent.
- *Results* come back pickled with the standard library's C pickler, into which torch registers
  its reductions: tensors travel as shared-memory file descriptors, not as bytes through the
  pipe. Only a batch the C pickler refuses falls back to dill (with torch's reductions too).

Both picklers share tensors through the standard library's resource sharer, which
authenticates with `multiprocessing.current_process().authkey`. In a worker started by
`multiprocess` that key is not the parent's, so each worker takes the parent's key before it
unpickles anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as stdlib_multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from multiprocessing.reduction import ForkingPickler as StdlibPickler
from typing import Any

import multiprocess
import multiprocess.connection
import multiprocess.context
import multiprocess.reduction
import torch.multiprocessing  # registers torch's reductions with the stdlib pickler

from statecore import (
    Event,
    ResumeWorker,
    SendTask,
    TaskFailed,
    WorkerDied,
)
from statecore.executors._launch import Launch
from statecore.executors._remote import RemoteError
from statecore.executors._worker import WorkerRuntime, WorkerSetup

__all__ = ["MultiprocessExecutor", "resolve_context"]

# How often an idle worker checks that its parent is still there.
WATCHDOG_INTERVAL = 1.0
# How often an idle worker checks whether shutdown has begun. The stop message normally wakes
# it at once, but a loader reclaimed by the garbage collector may have lost its queues first.
STOP_CHECK_INTERVAL = 0.1
# How long shutdown lets workers exit by themselves before terminating them. An idle worker
# exits at once; one still busy with a batch nobody will read is simply terminated.
SHUTDOWN_GRACE = 1.0
# How long to wait for a process that has ended, or was terminated, to be reaped.
JOIN_TIMEOUT = 5.0
# Answers to resumes carry no task number; this marks them on the wire.
_NO_TASK = -1
_HEADER = 8


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


def _encode(task: int, event: Event) -> bytes:
    header = task.to_bytes(_HEADER, "little", signed=True)
    try:
        return header + bytes(StdlibPickler.dumps(event))
    except Exception:
        return header + bytes(multiprocess.reduction.ForkingPickler.dumps(event))


def _watch_parent(parent: int) -> None:
    """Exit this worker once its parent is gone, even while user code blocks the main thread."""
    while True:
        time.sleep(WATCHDOG_INTERVAL)
        if os.getppid() != parent:
            os._exit(0)


def _worker_main(
    shipped: WorkerSetup | bytes,
    worker_id: int,
    tasks: Any,
    results: Any,
    authkey: bytes,
    stopping: Any,
) -> None:
    """The body of a worker process."""
    # Ctrl-C reaches the whole process group; the main process decides what happens next and
    # stops the workers itself, so a worker neither dies of it nor prints a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdlib_multiprocessing.current_process().authkey = authkey
    torch.set_num_threads(1)
    threading.Thread(
        target=_watch_parent, args=(os.getppid(),), name="statecore-watchdog", daemon=True
    ).start()
    setup = pickle.loads(shipped) if isinstance(shipped, bytes) else shipped
    runtime = WorkerRuntime.in_worker(setup, worker_id, os.getpid())
    while True:
        try:
            command = tasks.get(timeout=STOP_CHECK_INTERVAL)
        except queue.Empty:
            if stopping.value:
                return
            continue
        if command is None:
            return
        event = runtime.answer(command)
        task = command.task if isinstance(command, SendTask) else _NO_TASK
        try:
            message = _encode(task, event)
        except Exception as error:
            failure = RemoteError.capture(
                error,
                worker=worker_id,
                pid=os.getpid(),
                index=getattr(command, "index", None),
                where="while sending the batch back",
            )
            message = _encode(task, TaskFailed(task, worker_id, failure))
        del event
        try:
            results.send_bytes(message)
        except (BrokenPipeError, OSError):
            return  # the parent closed our pipe: it is shutting down


class MultiprocessExecutor:
    """Runs each worker in its own process; see the module docstring for the wire."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.context = resolve_context(launch.multiprocessing_context)
        self.processes: list[Any] = []
        self.tasks: list[Any] = []
        self.readers: list[Any] = []
        self.ready: list[Event] = []
        self.stopping: set[int] = set()
        self.shutting_down: Any = None
        self.gone: set[int] = set()
        self.closed = False

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        ctx = self.context
        setup = self.launch.setup
        shipped: WorkerSetup | bytes = setup
        if ctx.get_start_method() != "fork":
            shipped = bytes(multiprocess.reduction.ForkingPickler.dumps(setup))
        authkey = bytes(stdlib_multiprocessing.current_process().authkey)
        # A raw shared flag, not an Event: an Event's lock would stay held for ever by a worker
        # killed while checking it, and shutdown would then block on it.
        self.shutting_down = ctx.RawValue(ctypes.c_bool, False)
        try:
            for worker in range(self.launch.num_workers):
                tasks = ctx.Queue()
                reader, writer = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=_worker_main,
                    args=(shipped, worker, tasks, writer, authkey, self.shutting_down),
                    name=f"statecore-worker-{worker}",
                    daemon=True,
                )
                self.tasks.append(tasks)
                self.readers.append(reader)
                self.processes.append(process)
                process.start()
                writer.close()  # the worker holds the only writing end: EOF means it is gone
        except BaseException:
            self.shutdown()
            raise

    def dispatch(self, command: SendTask) -> None:
        self.tasks[command.worker].put(command)

    def resume(self, command: ResumeWorker) -> None:
        self.tasks[command.worker].put(command)

    def stop_worker(self, worker: int) -> None:
        if worker not in self.stopping:
            self.stopping.add(worker)
            if worker not in self.gone:
                # At interpreter exit the queue may already be finalized; shutdown then
                # terminates the worker instead.
                with contextlib.suppress(ValueError, OSError):
                    self.tasks[worker].put(None)

    # --- answers -----------------------------------------------------------------------------

    def poll(self, timeout: float | None) -> Event | None:
        """The next answer from any worker, a death, or None once `timeout` seconds pass."""
        if self.ready:
            return self.ready.pop(0)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ready:
            watched = self._watched()
            if not watched:
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            fired = multiprocess.connection.wait(list(watched), left)
            if not fired:
                return None
            for handle in fired:
                self._collect(*watched[handle])
        return self.ready.pop(0)

    def _watched(self) -> dict[Any, tuple[str, int]]:
        watched: dict[Any, tuple[str, int]] = {}
        for worker, process in enumerate(self.processes):
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
                self.ready.append(self._decode(worker, message))
            return
        # The process ended: first take whatever it sent before ending.
        try:
            while reader.poll(0):
                self.ready.append(self._decode(worker, reader.recv_bytes()))
        except (EOFError, OSError):
            pass
        self._exited(worker)

    def _exited(self, worker: int) -> None:
        if worker in self.gone:
            return
        self.gone.add(worker)
        process = self.processes[worker]
        process.join(JOIN_TIMEOUT)
        if worker not in self.stopping:
            self.ready.append(WorkerDied(worker, process.pid, process.exitcode))

    def _decode(self, worker: int, message: bytes) -> Event:
        task = int.from_bytes(message[:_HEADER], "little", signed=True)
        try:
            event = pickle.loads(message[_HEADER:])
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
        assert isinstance(event, Event)
        return event

    # --- shutdown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker, terminate the ones that do not stop, release every handle."""
        if self.closed:
            return
        self.closed = True
        if self.shutting_down is not None:
            self.shutting_down.value = True
        for worker in range(len(self.processes)):
            self.stop_worker(worker)
        deadline = time.monotonic() + SHUTDOWN_GRACE
        running = {w for w, p in enumerate(self.processes) if p.is_alive()}
        while running and time.monotonic() < deadline:
            # A worker blocked on sending a batch nobody will read exits once we drain it.
            handles = {self.readers[w]: w for w in running}
            handles.update({self.processes[w].sentinel: w for w in running})
            for handle in multiprocess.connection.wait(
                list(handles), max(0.0, deadline - time.monotonic())
            ):
                worker = handles[handle]
                try:
                    while self.readers[worker].poll(0):
                        self.readers[worker].recv_bytes()
                except (EOFError, OSError):
                    pass
            running = {w for w in running if self.processes[w].is_alive()}
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT)
            if process.is_alive():
                process.kill()
            process.join()
            process.close()
        for tasks in self.tasks:
            # Task messages are small and the pipe has room for them, so the feeder thread
            # flushes and ends even though nobody reads them any more.
            tasks.close()
            tasks.join_thread()
        for reader in self.readers:
            reader.close()
        self.ready.clear()
