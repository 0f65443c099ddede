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

Workers that come and go (`DataLoader(worker_restarts=N)`, `Launch.worker_restarts`): a worker
thread so ended is a worker lost. Its thread ends, and it is reported with `WorkerDied` (no pid;
the executor's account names the thread and the exception), so that the scheduler replaces it
(`replace`): a new thread in the same slot, started as the first was (the same worker id and
WorkerInfo, its generators seeded from the same seed, `worker_init_fn`), from a copy of the
dataset as the loader's iterator first copied it, set up for the epoch and datapipe seed of the
slot's last `ResumeWorker`, and its dataset restored to the mark the scheduler gives through the
path a checkpoint's resume takes (`WorkerSetup.resume`). It says `WorkerStarted` first, and
stamps every answer with its incarnation. A lost thread still running (the scheduler may
replace a worker that is still there) is told to stop and abandoned; whatever it still says
carries its own incarnation, which the scheduler drops.

A stuck worker thread (`worker_timeout`) cannot be killed, so it cannot be replaced: the
executor declares `kills_stuck_workers=False`, and the loader fails with `WorkerHungError`
showing the thread's stack (`report`, from `sys._current_frames()`). Shutdown asks each thread
to stop and waits a bounded time in all (`JOIN_TIMEOUT`), and not at all for a thread reported
stuck: threads are daemons, so one stuck inside user code is abandoned and does not keep the
interpreter alive.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
import traceback
import warnings
from typing import Any, ClassVar

import torch.utils.data._utils.worker as torch_worker

from statecore import (
    Event,
    ReplaceWorker,
    ResumeWorker,
    SendTask,
    WorkerDied,
    WorkerDiedError,
    WorkerStarted,
)
from statecore.executors._confirm import Confirming
from statecore.executors._handoff import Handoff
from statecore.executors._incarnation import Standing, replacement_setup, stamped
from statecore.executors._protocol import Capabilities, Launch, WorkerReport
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
from statecore.executors._thread.storages import SHELF, StoragePool
from statecore.executors._worker import WorkerRuntime, WorkerSetup

__all__ = ["ThreadExecutor", "ThreadReseedWarning"]

JOIN_TIMEOUT = 5.0
"""How long shutdown waits, in all, for the worker threads to end."""

Inbox = queue.SimpleQueue[SendTask | ResumeWorker | None]


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


def _death(worker: int, incarnation: int, ended: WorkerDiedError) -> WorkerDied:
    """The report of a worker thread `ended` (see `_ended`) in a loader that replaces lost
    workers: the thread is gone, and its slot's next incarnation takes over its tasks."""
    cause = ended.__cause__
    code = ended.exitcode
    return WorkerDied(
        worker,
        None,
        code,
        reason=f"DataLoader worker thread {worker} ({threading.current_thread().name}) was "
        f"ended by {cause!r}; a thread so ended runs none of the dataset's code after it",
        incarnation=incarnation,
    )


def _ended_in_start(worker: int, error: BaseException, where: str) -> WorkerDiedError:
    """`_ended`, for a worker thread's start-up (its seat's `ended`), noted for `_run`, which
    reports the thread lost where the loader replaces workers."""
    ended = per_thread.ended = _ended(worker, error, where)
    return ended


def _untouched(dataset: Any) -> Any:
    """A copy of `dataset` that no worker loads from, for replacements to copy theirs from;
    `dataset` itself if it cannot be copied (the workers' copies already said so, or failed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return own_copy(dataset)
        except Exception:
            return dataset


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

    capabilities: ClassVar[Capabilities] = Capabilities(
        confirms_answers=True, replaces_workers=True, kills_stuck_workers=False
    )

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.results: Handoff[Event] = Handoff()
        self.inboxes: list[Inbox] = []
        self.threads: list[threading.Thread] = []
        """Per worker slot, the thread of its current incarnation."""
        self.incarnations: list[int] = []
        """Per worker slot, its current incarnation: a thread of an earlier one stops."""
        self.resumed: list[ResumeWorker | None] = []
        """Per worker slot, the last `ResumeWorker` it was given: a replacement's epoch."""
        self.lost: list[threading.Thread] = []
        """Threads of replaced incarnations: told to stop, perhaps still running."""
        self.stuck: set[threading.Thread] = set()
        """Threads reported stuck (`report`): shutdown does not wait for them."""
        self.prepared: set[threading.Thread] = set()
        """Threads done with their start-up (`worker_init_fn` included)."""
        self.original: Any = None
        """The dataset as the loader's iterator found it (a copy): what replacements copy."""
        self.stopped: set[int] = set()
        self.closed = False
        workers = launch.num_workers
        self.storages = StoragePool(spare=workers + 1, most=4 * workers + 4, shelf=SHELF)
        """Where torch's collate takes the batches' storages from (see `storages`); at
        shutdown its free ones are kept for the next executor's pool (`storages.SHELF`)."""
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
        running = self.launch.running_at_start
        copies = [self._copy_for(worker, dataset) for worker in range(running)]
        if self.launch.worker_restarts or running < self.launch.num_workers:
            # One more, untouched by any worker, for replacements (and slots started later) to
            # copy theirs from.
            self.original = _untouched(dataset)
        for worker in range(self.launch.num_workers):
            inbox: Inbox = queue.SimpleQueue()
            # A slot that begins retired gets a thread that is never started: `replace`
            # starts its first one.
            own = copies[worker] if worker < running else (None, None)
            thread = self._thread(worker, 0, self.launch.setup, inbox, *own)
            self.inboxes.append(inbox)
            self.threads.append(thread)
            self.incarnations.append(0)
            self.resumed.append(None)
            if worker < running:
                thread.start()
            else:
                self.stopped.add(worker)

    def _thread(
        self,
        worker: int,
        incarnation: int,
        setup: WorkerSetup,
        inbox: Inbox,
        dataset: Any,
        init_error: BaseException | None,
    ) -> threading.Thread:
        suffix = f".{incarnation}" if incarnation else ""
        return threading.Thread(
            target=self._run,
            args=(worker, incarnation, setup, inbox, dataset, init_error),
            name=f"statecore-worker-{worker}{suffix}",
            daemon=True,
        )

    def replace(self, command: ReplaceWorker, mark: Standing) -> None:
        """Start incarnation `command.incarnation` of `command.worker` in a new thread (see
        the module docstring); the lost one, if it still runs, is told to stop and abandoned,
        since a thread cannot be killed."""
        worker, incarnation = command.worker, command.incarnation
        self.inboxes[worker].put(None)
        if self.threads[worker].ident is not None:  # not a slot that began retired
            self.lost.append(self.threads[worker])
        self.stopped.discard(worker)
        self.incarnations[worker] = incarnation
        original = self.original
        if original is None:
            # An executor not told of restarts (the conformance kit's, say): copied now.
            original = self.original = _untouched(self.launch.setup.dataset)
        dataset, init_error = self._copy_for(worker, original)
        inbox: Inbox = queue.SimpleQueue()
        setup = replacement_setup(self.launch.setup, worker, mark, self.resumed[worker])
        thread = self._thread(worker, incarnation, setup, inbox, dataset, init_error)
        self.inboxes[worker] = inbox
        self.threads[worker] = thread
        thread.start()

    def worker_handles(self) -> list[threading.Thread]:
        """The threads of the workers started so far, by slot: what torch's iterator lists as
        its worker processes in `_workers` (`is_alive()` and `join()`; a thread has no pid or
        exit code)."""
        return [thread for thread in self.threads if thread.ident is not None]

    def report(self, worker: int) -> WorkerReport:
        """No pid (a thread), where the worker's thread is now (its stack, innermost call
        last), and whether it is still starting (in `worker_init_fn`, say). A thread reported
        stuck past its start is not waited for at shutdown."""
        thread = self.threads[worker]
        starting = thread.is_alive() and thread not in self.prepared
        if not starting:
            self.stuck.add(thread)
        frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
        stack = None if frame is None else "".join(traceback.format_stack(frame))
        return WorkerReport(pid=None, stack=stack, starting=starting)

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
        incarnation: int,
        setup: WorkerSetup,
        inbox: Inbox,
        dataset: Any,
        init_error: BaseException | None,
    ) -> None:
        # Without restarts a worker thread that SystemExit ended answers on with that error,
        # as it always has; with them it is a worker lost, reported so that it is replaced.
        replaced = self.launch.worker_restarts > 0
        incarnations = self.incarnations
        try:
            runtime = self._prepare(worker, setup, dataset, init_error)
            self.prepared.add(threading.current_thread())
            ended = getattr(per_thread, "ended", None)
            if replaced and ended is not None:
                self._answer(_death(worker, incarnation, ended))
                return
            if incarnation:
                self._answer(WorkerStarted(worker, incarnation))
            while True:
                command = inbox.get()
                if command is None or incarnations[worker] != incarnation:
                    return  # stopped, or replaced: what it still holds is its successor's
                try:
                    event = runtime.answer(command)
                except BaseException as error:
                    # answer() catches every Exception: this is SystemExit or the like, which
                    # ends the worker (see the module docstring).
                    died = _ended(worker, error, _doing(setup, command))
                    if replaced:
                        self._answer(_death(worker, incarnation, died))
                        return
                    runtime.fail_every_task(died)
                    event = runtime.answer(command)
                self._answer(stamped(event, incarnation))
        except BaseException:
            # Only a fault of our own gets here: the thread is gone, and the scheduler must hear
            # of it, or it would wait for the thread's answers forever.
            self._answer(WorkerDied(worker, None, None, incarnation=incarnation))
            raise
        finally:
            per_thread.__dict__.clear()

    def _prepare(
        self, worker: int, setup: WorkerSetup, dataset: Any, init_error: BaseException | None
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
            ended=_ended_in_start,
        )
        return start_worker(
            rebound(setup, dataset), worker, seat, dataset=dataset, init_error=init_error
        )

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
        self.resumed[command.worker] = command
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
        deadline = time.monotonic() + JOIN_TIMEOUT
        for thread in (*self.threads, *self.lost):
            if thread not in self.stuck and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        self.storages.clear()
