"""The thread executor: workers are threads of the main process.

No start-up cost, no pickling, and batches are shared for free. This is the right choice when
loading releases the GIL (file and network I/O, decoding in native code) and on free-threaded
Python.

What torch does per worker process applies here per thread where it can:

- `get_worker_info()`, ours and torch's, returns the calling thread's own WorkerInfo (id,
  num_workers, seed = base_seed + id, dataset), so IterableDatasets shard themselves as they
  do in worker processes. In the main thread it stays None.
- The process-wide random generators (`random`, torch, numpy) are shared by every thread, so
  they cannot be seeded per worker; code that needs per-worker randomness should build its own
  generator from `get_worker_info().seed`, as torch's documentation recommends.
- `worker_init_fn(worker_id)` runs in the worker's thread before its first task.

A thread cannot be killed. Shutdown asks each thread to stop and waits a bounded time; a
thread stuck inside user code is a daemon and does not keep the interpreter alive.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch.utils.data._utils.worker as torch_worker

from statecore import Event, ResumeWorker, SendTask, WorkerDied
from statecore.executors._launch import Launch
from statecore.executors._worker import WorkerRuntime

__all__ = ["ThreadExecutor"]

JOIN_TIMEOUT = 5.0

_threads = threading.local()
_installed = threading.Lock()


def _install_thread_worker_info() -> None:
    """Make torch's get_worker_info() answer per thread, once per process.

    torch keeps the worker's info in a module global, one per process. We give the function a
    body that first looks at this thread's info; everyone holding a reference to it, such as
    `torch.utils.data.get_worker_info`, sees the change. Outside our worker threads it returns
    exactly what it returned before.
    """
    with _installed:
        namespace = torch_worker.__dict__
        if namespace.get("_statecore_threads") is _threads:
            return
        namespace["_statecore_threads"] = _threads
        source = (
            "def get_worker_info():\n"
            "    info = getattr(_statecore_threads, 'info', None)\n"
            "    return _worker_info if info is None else info\n"
        )
        compiled: dict[str, Any] = {}
        exec(compile(source, "<statecore thread worker info>", "exec"), namespace, compiled)
        torch_worker.get_worker_info.__code__ = compiled["get_worker_info"].__code__


class ThreadExecutor:
    """Runs each worker in its own thread of this process."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.results: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.inboxes: list[queue.SimpleQueue[SendTask | ResumeWorker | None]] = []
        self.threads: list[threading.Thread] = []
        self.stopped: set[int] = set()
        self.closed = False

    def start(self) -> None:
        _install_thread_worker_info()
        for worker in range(self.launch.num_workers):
            inbox: queue.SimpleQueue[SendTask | ResumeWorker | None] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._run,
                args=(worker, inbox),
                name=f"statecore-worker-{worker}",
                daemon=True,
            )
            self.inboxes.append(inbox)
            self.threads.append(thread)
            thread.start()

    def _run(self, worker: int, inbox: queue.SimpleQueue[SendTask | ResumeWorker | None]) -> None:
        setup = self.launch.setup
        _threads.info = torch_worker.WorkerInfo(
            id=worker,
            num_workers=setup.num_workers,
            seed=setup.base_seed + worker,
            dataset=setup.dataset,
        )
        note = f"Raised in statecore worker thread {worker}"
        init_error = None
        try:
            if setup.worker_init_fn is not None:
                setup.worker_init_fn(worker)
        except Exception as error:
            error.add_note(f"{note} in worker_init_fn")
            init_error = error
        runtime = WorkerRuntime(setup, worker, None, init_error=init_error, note=note)
        try:
            while True:
                command = inbox.get()
                if command is None:
                    return
                self.results.put(runtime.answer(command))
        except BaseException:
            # Only something like SystemExit gets here (answer() catches Exception): the
            # thread is gone, and the scheduler must hear of it.
            self.results.put(WorkerDied(worker, None, None))
        finally:
            _threads.info = None

    def dispatch(self, command: SendTask) -> None:
        self.inboxes[command.worker].put(command)

    def resume(self, command: ResumeWorker) -> None:
        self.inboxes[command.worker].put(command)

    def poll(self, timeout: float | None) -> Event | None:
        if not any(thread.is_alive() for thread in self.threads) and self.results.empty():
            return None
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop_worker(self, worker: int) -> None:
        if worker not in self.stopped:
            self.stopped.add(worker)
            self.inboxes[worker].put(None)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for worker in range(len(self.threads)):
            self.stop_worker(worker)
        for thread in self.threads:
            thread.join(JOIN_TIMEOUT)
