"""The thread executor: workers are threads of the main process.

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
  workers will, it also says `worker_method="thread"` and carries the worker's own generators
  in `rng`, seeded from its seed (see `thread_worker_info`), so `torch.thread_safe_generator()`
  returns that worker's torch generator.
- `worker_init_fn(worker_id)` runs in the worker's thread before its first task.

What differs from worker processes:

- Batches are ordinary tensors, not in shared memory. torch's collate functions allocate a
  batch with `UntypedStorage._new_shared` when `get_worker_info()` says they run in a worker,
  so that it can cross to the main process; a thread's batch needs no crossing, and each
  shared batch would hold an open file while it lives. So in a worker thread that call, made
  by torch's collate (called by the loader or from a custom `collate_fn`), gets an ordinary
  storage from the executor's pool (`_storages`): one the consumer has let go of, or a new
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

import contextlib
import copy
import functools
import queue
import random
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
import torch.random
import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import Dataset, IterDataPipe, MapDataPipe

from statecore import Event, ResumeWorker, SendTask, WorkerDied, WorkerDiedError
from statecore.executors._confirm import Confirming
from statecore.executors._handoff import Handoff
from statecore.executors._protocol import Capabilities, Launch
from statecore.executors._storages import StoragePool
from statecore.executors._worker import (
    WorkerRuntime,
    WorkerSetup,
    prepare_dataset,
    thread_worker_info,
)

__all__ = ["ThreadExecutor", "ThreadReseedWarning"]

JOIN_TIMEOUT = 5.0

_threads = threading.local()
"""In a worker thread: `info` (its WorkerInfo), `on_reseed` (told of each seeding call),
`where` (what the thread is doing, for the warning), `pool` (the executor's StoragePool) and
`claiming` (torch's collate has just asked for the worker info, and will ask for a storage).
Absent in every other thread."""
_installed = threading.Lock()
_COLLATE_MODULE = "torch.utils.data._utils.collate"


class ThreadReseedWarning(RuntimeWarning):
    """A worker thread reseeded a random generator that every thread of the process shares."""


def _install_thread_worker_info() -> None:
    """Make torch's get_worker_info() answer per thread, once per process.

    torch keeps the worker's info in a module global, one per process. We give the function a
    body that first looks at this thread's info; everyone holding a reference to it, such as
    `torch.utils.data.get_worker_info`, sees the change. Outside our worker threads it returns
    exactly what it returned before. Called from torch's collate module in a worker thread, it
    answers None: see the module docstring.
    """
    with _installed:
        namespace = torch_worker.__dict__
        if namespace.get("_statecore_threads") is _threads:
            return
        namespace["_statecore_threads"] = _threads
        namespace["_statecore_caller"] = sys._getframe
        namespace["_statecore_collate"] = _COLLATE_MODULE
        namespace["_statecore_collating"] = _collating
        source = (
            "def get_worker_info():\n"
            "    info = getattr(_statecore_threads, 'info', None)\n"
            "    if info is None:\n"
            "        return _worker_info\n"
            "    if _statecore_caller(1).f_globals.get('__name__') == _statecore_collate:\n"
            "        return _statecore_collating(info)\n"
            "    return info\n"
        )
        compiled: dict[str, Any] = {}
        exec(compile(source, "<statecore thread worker info>", "exec"), namespace, compiled)
        torch_worker.get_worker_info.__code__ = compiled["get_worker_info"].__code__


def _collating(info: Any) -> Any:
    """What torch's collate module hears from get_worker_info() in a worker thread: the info,
    if the thread has a pool to give it the batch's storage from (it then asks for one with
    `_new_shared`); else None, so that it allocates an ordinary batch itself."""
    if getattr(_threads, "pool", None) is None:
        return None
    _threads.claiming = True
    return info


def _install_pooled_storages() -> None:
    """Have `UntypedStorage._new_shared`, asked by torch's collate in a worker thread, return
    an ordinary storage from that thread's pool, once per process. Every other call, in any
    thread, gets what it got before."""
    with _installed:
        current = torch.UntypedStorage._new_shared
        if getattr(current, "_statecore_pooled", False):
            return
        original: Callable[..., torch.UntypedStorage] = current

        def new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
            pool = getattr(_threads, "pool", None)
            if pool is not None and getattr(_threads, "claiming", False):
                # This call answers collate's question, pooled or not: a later call of the
                # thread's own (a dataset asking for shared memory) must get shared memory.
                _threads.claiming = False
                if cls is torch.UntypedStorage and torch.device(device).type == "cpu":
                    claimed: torch.UntypedStorage = pool.claim(size)
                    return claimed
            return original(size, device=device)

        new_shared._statecore_pooled = True  # type: ignore[attr-defined]
        torch.UntypedStorage._new_shared = classmethod(new_shared)  # type: ignore[assignment,method-assign]


def _reseeding(label: str) -> None:
    """Called by every watched seeding function before it seeds, in whatever thread."""
    report = getattr(_threads, "on_reseed", None)
    if report is not None:
        report(label)


def _install_reseed_watch() -> None:
    """Have the process-wide seeding functions tell a worker thread's executor they ran, once
    per process.

    torch's `manual_seed` and `seed` keep their identity (their code is replaced, as for
    get_worker_info): torch._dynamo and others recognise them by it. `random.seed` and
    `numpy.random.seed` are bound or compiled functions, replaced by a wrapper in their module;
    references taken before that are not watched.
    """
    with _installed:
        namespace = torch.random.__dict__
        if namespace.get("_statecore_reseeding") is _reseeding:
            return
        namespace["_statecore_reseeding"] = _reseeding
        for name, parameters in (("manual_seed", "seed"), ("seed", "")):
            function = namespace[name]
            namespace[f"_statecore_{name}"] = types.FunctionType(
                function.__code__, function.__globals__, name, function.__defaults__
            )
            source = (
                f"def {name}({parameters}):\n"
                f"    _statecore_reseeding('torch.{name}')\n"
                f"    return _statecore_{name}({parameters})\n"
            )
            compiled: dict[str, Any] = {}
            exec(compile(source, "<statecore reseed watch>", "exec"), namespace, compiled)
            function.__code__ = compiled[name].__code__
        random.seed = _watching(random.seed, "random.seed")
        with contextlib.suppress(ImportError):
            import numpy.random

            numpy.random.seed = _watching(numpy.random.seed, "numpy.random.seed")


def _watching(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def seed(*args: Any, **kwargs: Any) -> Any:
        _reseeding(label)
        return function(*args, **kwargs)

    return seed


_warned: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Datasets already warned about, by id; an entry goes when its dataset does."""
_warned_lock = threading.Lock()


def _first_warning_for(dataset: Any) -> bool:
    with _warned_lock:
        if _warned.get(id(dataset)) is dataset:
            return False
        with contextlib.suppress(TypeError):  # not weakly referenceable: warned per iterator
            _warned[id(dataset)] = dataset
        return True


def _rebound(setup: WorkerSetup, dataset: Any) -> WorkerSetup:
    """`setup` whose worker_init_fn and collate_fn, if methods of the loader's dataset, are
    methods of the worker's copy `dataset` instead.

    A worker process unpickles the dataset and these functions together, so `ds.init` given as
    worker_init_fn sets its attributes on the worker's copy; a thread must do the same by hand.
    """
    original = setup.dataset
    if dataset is original:
        return setup

    def mine(function: Any) -> Any:
        if getattr(function, "__self__", None) is original and hasattr(function, "__func__"):
            return types.MethodType(function.__func__, dataset)
        return function

    return attrs.evolve(
        setup, worker_init_fn=mine(setup.worker_init_fn), collate_fn=mine(setup.collate_fn)
    )


def _own_copy(dataset: Any) -> Any:
    """What one worker loads from: see the module docstring. Raises if a datapipe cannot be
    copied (sharing one breaks it); warns and shares anything else that cannot."""
    if isinstance(dataset, IterDataPipe | MapDataPipe):
        return copy.deepcopy(dataset)
    if isinstance(dataset, torch.Tensor) or not (
        isinstance(dataset, Dataset) or hasattr(dataset, "__dict__")
    ):
        return dataset
    try:
        return copy.copy(dataset)
    except Exception as error:
        warnings.warn(
            f"The thread executor could not copy the dataset ({type(dataset).__name__}) for "
            f"each worker: {error!r}. Its worker threads share the one object, so what a worker "
            "or worker_init_fn sets on it is seen by every worker. Make the dataset copyable "
            '(copy.copy), or load in worker processes with executor="mp".',
            RuntimeWarning,
            stacklevel=2,
        )
        return dataset


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
        """Where torch's collate takes the batches' storages from (see `_storages`)."""
        self.reseeded: tuple[int, str, str] | None = None
        """(worker, seeding function, where) of the first reseeding seen; set by a worker."""
        self.reseed_warned = False

    def start(self) -> None:
        _install_thread_worker_info()
        _install_reseed_watch()
        _install_pooled_storages()
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
            return _own_copy(dataset), None
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
        note = f"Raised in DataLoader worker thread {worker}"
        try:
            runtime = self._prepare(worker, dataset, init_error, note)
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
            _threads.__dict__.clear()

    def _prepare(
        self, worker: int, dataset: Any, init_error: BaseException | None, note: str
    ) -> WorkerRuntime:
        """Make this thread worker `worker`: its WorkerInfo, its datapipe's seed and shard, and
        `worker_init_fn`, as in torch's worker processes (which also seed the process-wide
        generators: threads cannot)."""
        setup = _rebound(self.launch.setup, dataset)
        _threads.info = thread_worker_info(setup.base_seed, worker, setup.num_workers, dataset)
        _threads.on_reseed = functools.partial(self._saw_reseed, worker)
        _threads.pool = self.storages
        where = "while sharding the datapipe"
        try:
            if init_error is None:
                prepare_dataset(setup, worker, dataset)
                where = "in worker_init_fn"
                _threads.where = where
                if setup.worker_init_fn is not None:
                    setup.worker_init_fn(worker)
                where = "while creating the dataset fetcher"
            _threads.where = "while loading"
            return WorkerRuntime(
                setup, worker, None, dataset=dataset, init_error=init_error, note=note
            )
        except Exception as error:
            # Raised in the turn of the first task, as torch does, so it reaches the consumer.
            error.add_note(f"{note} {where}")
            init_error = error
        except BaseException as error:
            init_error = _ended(worker, error, where)
        _threads.where = "while loading"
        return WorkerRuntime(setup, worker, None, dataset=dataset, init_error=init_error, note=note)

    def _saw_reseed(self, worker: int, label: str) -> None:
        # In the worker's thread. Two workers racing here both find None: either report will do.
        if self.reseeded is None:
            self.reseeded = (worker, label, getattr(_threads, "where", "while loading"))

    def _warn_reseeded(self, worker: int, label: str, where: str) -> None:
        self.reseed_warned = True
        dataset = self.launch.setup.dataset
        if not _first_warning_for(dataset):
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
