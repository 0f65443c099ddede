"""The thread executor: workers are threads of the main process.

Run in the main process: `start`, `dispatch`, `resume`, `stop_worker` and `shutdown` from the
driver's thread, `poll` from the driver's thread or the pin stage's
(`Capabilities.poll_from_any_thread`), and each worker's body (`_run`) in a thread of its own,
which starts as every worker does (`executors._startup.start_worker`), seated as a thread.

No start-up cost, no pickling, and batches are handed over by reference. This is the right
choice when loading releases the GIL (file and network I/O, decoding in native code) and on
free-threaded Python.

What torch gives each worker process, each thread gets where it can:

- Its own dataset object. When the loader's iterator is made, each worker gets a shallow copy
  (`copy.copy`) of the dataset: what the worker or `worker_init_fn` sets on it stays that
  worker's, and what the main process rebinds on the dataset afterwards is not seen, even by
  persistent workers. The copy is shallow: the tensors, arrays and lists the dataset points to
  are the same objects in every worker and in the main process, so a change made *inside* one
  of them (a tensor written in place, an item appended) is seen everywhere. A datapipe is
  copied deeply (`copy.deepcopy`), as a worker process unpickles its own: its iterator and its
  sharding live all through its graph. Tensors, arrays and plain containers used directly as
  the dataset are not copied; they hold nothing a worker sets. A dataset that cannot be copied
  is shared by every worker, with a warning.
- `get_worker_info()`, ours and torch's, returns the calling thread's own WorkerInfo (id,
  num_workers, seed = base_seed + id, and that worker's copy of the dataset), so
  IterableDatasets shard themselves as they do in worker processes; datapipes are reseeded and
  sharded as torch's workers do it. In the main thread it stays None. As torch's own thread
  workers will, it also says `worker_method="thread"` and carries the worker's own generators in
  `rng`, seeded from its seed (see `executors._startup.worker_info`), so
  `torch.thread_safe_generator()` returns that worker's torch generator.
- `worker_init_fn(worker_id)` runs in the worker's thread before its first task.

What differs from worker processes:

- Batches are ordinary tensors, not in shared memory. torch's collate functions allocate a
  batch with `UntypedStorage._new_shared` when `get_worker_info()` says they run in a worker,
  so that it can cross to the main process; a thread's batch needs no crossing, and each
  shared batch would hold an open file while it lives. So in a worker thread that call, made
  by torch's collate (called by the loader or from a custom `collate_fn`), gets an ordinary
  storage from the executor's pool (`storages`): one the consumer has let go of, or a new
  one. Everything else, the dataset, `worker_init_fn` and a custom `collate_fn` itself, sees
  the thread's WorkerInfo as usual. The cost is a look at the caller's frame in each
  `get_worker_info()` call made in a worker thread.
- The process-wide random generators (`random`, torch's default generator, numpy's global
  state) are shared by every thread, so they cannot be seeded per worker, and a dataset that
  reseeds one per sample (torchvision's FakeData calls `torch.manual_seed` in `__getitem__`)
  draws numbers that depend on how the threads interleave. A worker thread calling
  `torch.manual_seed`, `torch.seed`, `random.seed` or `numpy.random.seed` is therefore
  reported with a `ThreadReseedWarning`, once per dataset. The remedy is the worker's own
  generators, `torch.thread_safe_generator()` and `get_worker_info().rng`, which draw in a
  thread what the process-wide ones draw in a worker process; or a generator of the sample's
  own (`torch.Generator().manual_seed(...)`, seeded from the index); or `executor="mp"`. Only
  the seeding functions are watched: a dataset that does not call them pays nothing per
  sample.
- A thread cannot be killed. A worker ended by an exception that is not an `Exception`
  (`SystemExit` from `sys.exit()`, a `KeyboardInterrupt` raised by hand) runs none of the
  dataset's code after it: the task it had in hand, and every later one of that worker, fails
  with a `WorkerDiedError` naming the thread and the exception (its cause), raised in the
  task's turn. The other workers go on.

Shutdown asks each thread to stop and waits a bounded time; a thread stuck inside user code is
a daemon and does not keep the interpreter alive.
"""

from __future__ import annotations

import functools
import queue
import threading
import warnings
from typing import Any, ClassVar

import torch.utils.data._utils.worker as torch_worker

from statecore import Event, ResumeWorker, SendTask, WorkerDied, WorkerDiedError
from statecore.executors._confirm import Confirming
from statecore.executors._handoff import Handoff
from statecore.executors._protocol import Capabilities, Launch
from statecore.executors._startup import Seat, start_worker
from statecore.executors._thread.copies import own_copy, rebound
from statecore.executors._thread.hooks import (
    install_pooled_storages,
    install_worker_info,
    per_thread,
)
from statecore.executors._thread.reseed import (
    ThreadReseedWarning,
    first_warning_for,
    install_reseed_watch,
)
from statecore.executors._thread.storages import StoragePool
from statecore.executors._worker import WorkerRuntime, WorkerSetup

__all__ = ["ThreadExecutor", "ThreadReseedWarning"]

JOIN_TIMEOUT = 5.0


def _ended(worker: int, error: BaseException, where: str) -> WorkerDiedError:
    """The error for a worker thread that `error` (not an `Exception`) ended."""
    code = error.code if isinstance(error, SystemExit) else None
    name = threading.current_thread().name
    ended = WorkerDiedError(
        f"DataLoader worker thread {worker} ({name}) was ended by {error!r}, raised {where}. "
        f"The thread runs none of the dataset's code after it, so every later task of worker "
        f"{worker} fails with this error. Look for what raises {type(error).__name__} in the "
        "dataset or worker_init_fn (sys.exit() raises SystemExit), or load with num_workers=0 "
        "to see it raised in the main process.",
        worker=worker,
        exitcode=code if isinstance(code, int) else None,
    )
    ended.__cause__ = error
    return ended


def _tell(info: torch_worker.WorkerInfo) -> None:
    """Give this worker thread its WorkerInfo: `get_worker_info()` answers it here alone."""
    per_thread.info = info


def _now_doing(where: str) -> None:
    """What this worker thread is doing, named by the reseed warning."""
    per_thread.where = where


def _doing(setup: WorkerSetup, command: SendTask | ResumeWorker) -> str:
    if isinstance(command, ResumeWorker):
        return "while restarting the dataset for a new epoch"
    if setup.iterable:
        return "while loading from the IterableDataset"
    if isinstance(command.index, list):
        return f"while loading the batch of dataset indices {command.index!r}"
    return f"while loading dataset index {command.index!r}"


class ThreadExecutor(Confirming):
    """Runs each worker in its own thread of this process."""

    capabilities: ClassVar[Capabilities] = Capabilities(confirms_answers=True)

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.results: Handoff[Event] = Handoff()
        self.inboxes: list[queue.SimpleQueue[SendTask | ResumeWorker | None]] = []
        self.threads: list[threading.Thread] = []
        self.stopped: set[int] = set()
        self.closed = False
        workers = launch.num_workers
        self.storages = StoragePool(spare=workers + 1, most=4 * workers + 4)
        """Where torch's collate takes the batches' storages from (see `storages`)."""
        self.reseeded: tuple[int, str, str] | None = None
        """(worker, seeding function, where) of the first reseeding seen; set by a worker."""
        self.reseed_warned = False

    def start(self) -> None:
        install_worker_info()
        install_reseed_watch()
        install_pooled_storages()
        # Copied here, in the consumer's iter(): what the main process changes afterwards is
        # not seen, as with worker processes.
        dataset = self.launch.setup.dataset
        copies = [self._copy_for(worker, dataset) for worker in range(self.launch.num_workers)]
        for worker, own in enumerate(copies):
            inbox: queue.SimpleQueue[SendTask | ResumeWorker | None] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._run,
                args=(worker, inbox, *own),
                name=f"statecore-worker-{worker}",
                daemon=True,
            )
            self.inboxes.append(inbox)
            self.threads.append(thread)
            thread.start()

    def _copy_for(self, worker: int, dataset: Any) -> tuple[Any, BaseException | None]:
        try:
            return own_copy(dataset), None
        except Exception as error:
            error.add_note(
                f"Raised while copying the datapipe for DataLoader worker thread {worker}: each "
                'worker thread needs its own. Make it copyable, or use executor="mp".'
            )
            return dataset, error

    def _run(
        self,
        worker: int,
        inbox: queue.SimpleQueue[SendTask | ResumeWorker | None],
        dataset: Any,
        init_error: BaseException | None,
    ) -> None:
        setup = self.launch.setup
        try:
            runtime = self._prepare(worker, dataset, init_error)
            while True:
                command = inbox.get()
                if command is None:
                    return
                try:
                    event = runtime.answer(command)
                except BaseException as error:
                    # answer() catches every Exception: this is SystemExit or the like, which
                    # ends the worker (see the module docstring).
                    runtime.fail_every_task(_ended(worker, error, _doing(setup, command)))
                    event = runtime.answer(command)
                self._answer(event)
        except BaseException:
            # Only a fault of our own gets here: the thread is gone, and the scheduler must hear
            # of it, or it would wait for the thread's answers forever.
            self._answer(WorkerDied(worker, None, None))
            raise
        finally:
            per_thread.__dict__.clear()

    def _prepare(
        self, worker: int, dataset: Any, init_error: BaseException | None
    ) -> WorkerRuntime:
        """Make this thread worker `worker`, loading from its own copy `dataset`, through the
        start-up every worker takes, seated as a thread (which cannot seed the process-wide
        generators, and whose WorkerInfo only it sees)."""
        per_thread.on_reseed = functools.partial(self._saw_reseed, worker)
        per_thread.pool = self.storages
        seat = Seat.thread(
            note=f"Raised in DataLoader worker thread {worker}",
            tell=_tell,
            doing=_now_doing,
            ended=_ended,
        )
        setup = rebound(self.launch.setup, dataset)
        return start_worker(setup, worker, seat, dataset=dataset, init_error=init_error)

    def _saw_reseed(self, worker: int, label: str) -> None:
        # In the worker's thread. Two workers racing here both find None: either report will do.
        if self.reseeded is None:
            self.reseeded = (worker, label, getattr(per_thread, "where", "while loading"))

    def _warn_reseeded(self, worker: int, label: str, where: str) -> None:
        self.reseed_warned = True
        dataset = self.launch.setup.dataset
        if not first_warning_for(dataset):
            return
        warnings.warn(
            f"DataLoader worker thread {worker} reseeded a process-wide random generator "
            f"({label}) {where}, for a dataset {type(dataset).__name__}. Worker threads share "
            "the process's generators (random, torch's default generator, numpy's global "
            "state): a seed set in one thread moves the numbers every thread draws, so samples "
            "depend on how the threads interleave and differ from those of torch's worker "
            "processes. Draw from the worker's own generators instead: "
            "torch.thread_safe_generator() (as generator= of torch.rand and the like; None "
            "outside worker threads, meaning torch's default generator) and "
            "get_worker_info().rng.random_generator, seeded per worker as worker processes "
            "seed theirs; or from a generator of the sample's own, such as "
            "torch.Generator().manual_seed(index); or load in worker processes with "
            'executor="mp". This warning is given once per dataset.',
            ThreadReseedWarning,
            stacklevel=2,
        )

    def _answer(self, event: Event) -> None:
        self.results.put(event)

    def _running(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)

    def dispatch(self, command: SendTask) -> None:
        self.inboxes[command.worker].put(command)

    def resume(self, command: ResumeWorker) -> None:
        self.inboxes[command.worker].put(command)

    def poll(self, timeout: float | None) -> Event | None:
        if self._unconfirmed is not None:
            return self._unconfirmed  # not confirmed yet: an interrupt cut the last poll short
        results = self.results
        if not results.wait(timeout, self._running):
            return None
        event = self._hand_out(results.items[0], results.items)
        if self.reseeded is not None and not self.reseed_warned:
            self._warn_reseeded(*self.reseeded)
        return event

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
        self.storages.clear()
