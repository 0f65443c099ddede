"""What a worker does, wherever it runs: answer tasks from its own dataset.

`WorkerSetup` is everything a worker needs, shipped to it once. `WorkerRuntime` lives inside
the worker and turns each command (`SendTask`, `ResumeWorker`) into the event that answers it.
How a worker starts (seeding, its WorkerInfo, `worker_init_fn`) is `executors._startup`'s,
one path for every executor. The multiprocessing executor runs one runtime per process; the
loop around it, the pipes and the watchdog are that executor's business.

Datapipes get what torch's workers give them: each worker reseeds its datapipe with the
loader's shared seed (again at every resume) and shards it with `apply_sharding` as instance
`worker_id * world_size + rank` of `num_workers * world_size`, before `worker_init_fn`. Loading
in the main process shards it as instance `rank` of `world_size`, as torch's single-process
iterator does. The sharding is state inside the datapipe's graph, so every worker needs a
datapipe of its own: a process has its copy; the thread executor makes one per thread.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.dataloader import _DatasetKind

from statecore import (
    Event,
    ResumeWorker,
    SendTask,
    TaskCompleted,
    TaskFailed,
    WorkerExhausted,
    WorkerResumed,
)
from statecore.executors._remote import RemoteError
from statecore.executors._seeding import SeededTask, Seeder
from statecore.executors._timing import CPU_SAMPLED_EVERY, FAST_TASK, TaskTiming, TimedFetch

__all__ = ["DATAPIPE_GRAPH", "WorkerRuntime", "WorkerSetup", "capture", "prepare_dataset"]

DATAPIPE_GRAPH = threading.RLock()
"""Held while a datapipe's graph is walked or a datapipe copied, in any thread.

torch walks a datapipe's graph (to reseed or shard it) by pickling it with a hook set on the
datapipe classes themselves, for every thread of the process. A second walk meanwhile fails
("Attempt to override existing reduce_ex_hook"), and a datapipe deep-copied meanwhile comes
out as the hook's stub, the string "STUB", with no error. Worker threads prepare their
datapipes side by side, and the consumer copies one for each worker it adds."""


def _distributed_settings() -> tuple[int, int]:
    """torch.distributed's (world size, rank) in this process; (1, 0) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@attrs.frozen
class WorkerSetup:
    """Everything a worker needs to produce batches; the same for every worker of a loader."""

    dataset: Any = attrs.field(eq=False)
    dataset_kind: int
    auto_collation: bool
    collate_fn: Callable[[Any], Any] | None = attrs.field(eq=False)
    drop_last: bool
    base_seed: int
    num_workers: int
    worker_init_fn: Callable[[int], None] | None = attrs.field(default=None, eq=False)
    shared_seed: int | None = None
    distributed: tuple[int, int] = attrs.field(factory=_distributed_settings)
    """(world size, rank) of torch.distributed, read in the main process when the setup is made
    (once per loader iterator, as torch reads them); a datapipe is sharded across both."""
    resume: tuple[Mark | None, ...] | None = attrs.field(default=None, eq=False)
    """An iterable dataset's first epoch goes on from a checkpoint: per worker, the mark of
    its last batch handed over, from which the worker restores its part of the dataset."""
    ended: tuple[Mark | None, ...] | None = attrs.field(default=None, eq=False)
    """The first epoch starts from a checkpoint, and this worker's dataset would have lived on
    into it from the epoch before (persistent workers, or loading in the main process): per
    worker, the mark of its last batch of that epoch before. A stateful dataset is brought back
    to where it stood as that epoch ended, and starts the next from there; the worker's mark
    in `resume`, if any, then positions it in the resumed epoch."""
    ended_open: frozenset[int] = attrs.field(default=frozenset(), eq=False)
    resume_dry: frozenset[int] = attrs.field(default=frozenset(), eq=False)
    """The workers whose part of an iterable dataset the checkpoint of `resume` had found dry
    (or, for a replacement, the lost worker's driver: `executors._incarnation.RanDry`): the
    epoch may ask them nothing more, and their part is run dry as their next epoch starts, as
    the original's was (a dataset may count its epochs as its part runs dry)."""
    batch_size: int | None = None
    """An iterable dataset's batch size (with `auto_collation`), for reading batches again
    outside a task (`WorkerRuntime._carry`)."""
    """The workers of an iterable dataset whose mark in `ended` is of an iterator left before
    it ran dry (that epoch was broken out of): brought to the mark, not run dry."""
    snapshot_every: int | None = 1
    """A worker with a stateful iterable dataset sends its state with every this many batches
    it yields (None: never; a resume then fast-forwards from the epoch's start)."""
    trace: bool = False
    """The loader is traced: every answer carries a `TaskTiming` (see `executors._timing`)."""

    @property
    def iterable(self) -> bool:
        return self.dataset_kind == _DatasetKind.Iterable


# Bound once: a class method looked up on its class is bound anew at each call (one a batch).
_completed = TaskCompleted.fast

_TIMING_SLOT = {
    TaskCompleted: TaskCompleted.__dict__["timing"].__set__,
    TaskFailed: TaskFailed.__dict__["timing"].__set__,
}

Mark = tuple[int, Any]
"""Where a worker's iterable dataset stands after a batch: `(since, snapshot)`.

`snapshot` is the dataset's state as a worker restores it, `{"dataset": ..., "iterator": ...}`
from the `state_dict()` of the dataset and of its iterator (those that have one, torchdata's
`Stateful` protocol), or None for a fresh iterator (a dataset without state); `since` counts
the batches the worker yielded after that state, which a resumed worker fast-forwards. A
snapshot of `...` means the one of this worker's previous mark: a stateful dataset sends its
state only every `snapshot_every` batches.
"""


def _discard(batch: Any) -> None:
    return None


def has_state(thing: Any) -> bool:
    """Whether `thing` keeps a state it can give and take back: torchdata's Stateful protocol."""
    return callable(getattr(thing, "state_dict", None)) and callable(
        getattr(thing, "load_state_dict", None)
    )


def prepare_dataset(setup: WorkerSetup, worker_id: int, dataset: Any) -> Any:
    """`dataset` made ready for worker `worker_id`, as torch's workers make it: a datapipe is
    reseeded with the loader's shared seed and sharded for this worker, in place.

    Call it in the worker, on the worker's own copy, before `worker_init_fn`. Anything else is
    returned as it is.
    """
    if isinstance(dataset, IterDataPipe) and setup.shared_seed is not None:
        dataset = _reseed_datapipe(dataset, setup.shared_seed)
    _shard_datapipe(setup, worker_id, dataset)
    return dataset


def _shard_datapipe(setup: WorkerSetup, worker_id: int, dataset: Any) -> None:
    if isinstance(dataset, IterDataPipe | MapDataPipe):
        from torch.utils.data.graph_settings import apply_sharding

        # Distributed ranks first, then the workers of each rank: torch's order, so that every
        # rank gets an even share.
        world_size, rank = setup.distributed
        with DATAPIPE_GRAPH:
            apply_sharding(dataset, setup.num_workers * world_size, worker_id * world_size + rank)


class WorkerRuntime:
    """One worker's dataset iterator and its answers to the scheduler's commands.

    Build it with `WorkerRuntime.in_worker` inside a worker (seeded, with worker info, after
    `worker_init_fn`), or directly for loading in the main process, where torch neither seeds
    nor sets worker info. Given no `dataset`, the runtime loads `setup.dataset` itself and, if
    it is a datapipe, shards it for worker `worker_id` first (in the main process: instance
    `rank` of `world_size`, as torch's single-process iterator does). Given a `dataset`, the
    caller has prepared it (`prepare_dataset`).
    """

    def __init__(
        self,
        setup: WorkerSetup,
        worker_id: int,
        pid: int | None = None,
        dataset: Any = None,
        init_error: BaseException | RemoteError | None = None,
        note: str | None = None,
    ) -> None:
        """`pid` None means this runs in the main process: errors then stay exception objects
        (with `note` added, if given) instead of being turned into data for another process."""
        self.setup = setup
        self.worker_id = worker_id
        self.pid = pid
        self.note = note
        self.exhausted = False
        self.init_error = init_error
        self.iterable = setup.iterable
        self.since = 0
        """Batches yielded since the last state sent (see `Mark`)."""
        self.skip = 0
        """Batches to fast-forward before the next one: those handed over before a checkpoint."""
        self.stateful = False
        self.opening: dict[str, Any] | None = None
        """A stateful iterable dataset's state as this epoch's iterator was made, sent with the
        first mark that would otherwise refer back to a state taken before it (see `_mark`)."""
        # A worker that failed to start runs none of the dataset's code, lookups included:
        # the failure may be the dataset's own, met looking it up.
        self.stateful_map = (
            init_error is None
            and not self.iterable
            and has_state(dataset if dataset is not None else setup.dataset)
        )
        """A map-style dataset with a state (an augmentation's generator, say): sent with every
        batch, as the state after it, since a map-style worker cannot fast-forward."""
        self.restore: Any = None
        """A map-style dataset's state from the checkpoint, loaded before its first task."""
        self.ready: float | None = time.perf_counter() if setup.trace else None
        """For a traced loader: when this worker became ready (seeded, `worker_init_fn` run,
        its dataset prepared), told with its first answer, then None."""
        self.cpu_skip = 0
        """For a traced loader: tasks to go before the next whose CPU time is read."""
        self.seeder: Seeder | None = None
        """How this worker seeds itself for a batch of a loader that seeds per batch (a
        `SeededTask`), as its seat allows (`_seeding.seeder_for`); set by the start-up. None:
        its tasks are loaded unseeded."""
        self.dry_unread = setup.iterable and worker_id in setup.resume_dry
        """Found dry at the checkpoint this epoch resumes (or, for a replacement, by the worker
        it replaces), this worker may be asked nothing more in it: its part, restored where its
        last batch left it, is read to its end as its next epoch starts (a persistent
        worker's), where the original's ran dry; unless a task finds it dry first."""
        if dataset is None:
            dataset = setup.dataset
            if init_error is None:
                try:
                    _shard_datapipe(setup, worker_id, dataset)
                except Exception as error:
                    self.init_error = self._capture(error, None, "while sharding the datapipe")
        self.dataset = dataset
        if self.init_error is None:
            mark = None
            if setup.resume is not None and self.iterable:
                mark = setup.resume[worker_id]
            carried = setup.ended is not None and worker_id < len(setup.ended)
            # What the previous epoch left in the dataset first, then the resumed epoch's own
            # position in it (a mark of this epoch), which supersedes it.
            self._restart("while creating the dataset fetcher", None if carried else mark)
            if carried:
                assert setup.ended is not None
                self._carry(setup.ended[worker_id], worker_id in setup.ended_open)
                if mark not in (None, (0, None)) and self.init_error is None:
                    self._restart("while loading the dataset's state from the checkpoint", mark)
            if setup.resume is not None and worker_id < len(setup.resume) and self.stateful_map:
                saved = setup.resume[worker_id]
                if saved is not None and saved[1] not in (None, ...):
                    # Loaded with the first task, not now: in the main process iter() still
                    # draws its seeds, and a dataset's state may be torch's global generator's.
                    self.restore = saved[1].get("dataset")

    @classmethod
    def in_worker(cls, setup: WorkerSetup, worker_id: int, pid: int | None) -> WorkerRuntime:
        """Prepare this process as worker `worker_id`, the way torch's workers are: the start-up
        every worker takes (`executors._startup.start_worker`), seated in a process of its own."""
        # Imported here: the start-up builds runtimes, so its module imports this one.
        from statecore.executors._startup import Seat, start_worker

        return start_worker(setup, worker_id, Seat.process(pid))

    def _restart(self, where: str, mark: Mark | None = None) -> bool:
        """A fresh dataset iterator, positioned at `mark` if one is given; False if that
        failed (`init_error` then holds why)."""
        setup = self.setup
        self.since = self.skip = 0
        snapshot = mark[1] if mark is not None and mark[1] is not ... else None
        try:
            if snapshot is not None and snapshot.get("dataset") is not None:
                where = "while loading the dataset's state_dict from the checkpoint"
                self.dataset.load_state_dict(snapshot["dataset"])
            self.fetcher = _DatasetKind.create_fetcher(  # type: ignore[no-untyped-call]
                setup.dataset_kind,
                self.dataset,
                setup.auto_collation,
                setup.collate_fn,
                setup.drop_last,
            )
            self.fetch: Callable[[Any], Any] = (
                TimedFetch(self.fetcher, not self.iterable) if setup.trace else self.fetcher.fetch
            )
            if not self.iterable:
                return True
            iterator = self.fetcher.dataset_iter
            if snapshot is not None and snapshot.get("iterator") is not None:
                where = "while loading the dataset iterator's state_dict from the checkpoint"
                iterator.load_state_dict(snapshot["iterator"])
        except Exception as error:
            self.init_error = self._capture(error, None, where)
            return False
        # An iterator that is the dataset itself keeps its state once, as the iterator's: a
        # state loaded before iter() would be lost when its __iter__ starts over.
        self.stateful_iterator = has_state(iterator)
        self.stateful_dataset = has_state(self.dataset) and iterator is not self.dataset
        self.stateful = self.stateful_iterator or self.stateful_dataset
        self.opening = None
        if mark is not None:
            self.since = self.skip = mark[0]
        elif self.stateful and self.setup.snapshot_every is not None:
            # A new iterator: a mark of `...` would name the last state taken, of an iterator
            # before this one (the epoch before's). A dataset that moves on as its part runs
            # dry (counting its epochs) stands elsewhere now, and only this state says where.
            # A state_dict() that fails is met, and told, with the next state taken.
            with contextlib.suppress(Exception):
                self.opening = self._snapshot()
        return True

    def _carry(self, mark: Mark | None, left_open: bool = False) -> None:
        """Bring a stateful dataset to where it stood as the checkpoint's epoch ended.

        A dataset may change its state as its iterator runs dry (counting its epochs, say), so
        an iterable worker's part is restored at its last batch and run dry again, dropped,
        and the next epoch's iterator made from there, as a persistent worker's would be;
        `left_open`: that epoch was broken out of before this part ran dry, and it is only
        brought to its last batch. A map-style dataset's state after its last batch is loaded
        before its first task.
        """
        if self.init_error is not None:
            return
        if not self.iterable:
            if self.stateful_map and mark is not None and mark[1] not in (None, ...):
                self.restore = mark[1].get("dataset")
            return
        if not self.stateful:
            return  # nothing of the epoch lives on in the dataset: no need to run it again
        # No mark: the worker's part was empty, and runs dry again at once.
        if not self._restart("while loading the dataset's state_dict from the checkpoint", mark):
            return  # `init_error` says why, with the first task
        if left_open:
            # Broken out of: read as far as its last batch, no further.
            if self.skip:
                size = self.setup.batch_size
                batched = self.setup.auto_collation and size is not None
                self._fast_forward([None] * size if batched and size is not None else None)
            self._restart("while restarting the dataset for the next epoch")
            return
        # The epoch is over: every item left of it, the `skip` batches' included, was read.
        self._read_to_end()
        self._restart("while restarting the dataset for the next epoch")

    def _read_to_end(self) -> None:
        """Read the dataset iterator's items to its end, nothing collated, as the original's
        were (a dataset may change its state as its iterator runs dry)."""
        iterator, self.skip = self.fetcher.dataset_iter, 0
        while True:
            try:
                next(iterator)
            except StopIteration:
                break
            except Exception:
                continue  # its error was handed over before the checkpoint

    def _mark(self) -> Mark:
        """The mark of the batch (or error) just yielded, its dataset's state every so often."""
        since = self.since + 1
        every = self.setup.snapshot_every
        if not self.stateful:
            self.since = since
            return (since, None)
        # A short last batch ran the iterator dry: many iterators then go back to their start,
        # and a state taken now would resume the whole part again. The last state taken, with
        # this batch fast-forwarded, runs dry again instead.
        if every is None or since < every or self.fetcher.ended:
            self.since = since
            opening, self.opening = self.opening, None
            return (since, ...) if opening is None else (since, opening)
        snapshot = self._snapshot()
        self.since = 0
        self.opening = None
        return (0, snapshot)

    def _snapshot(self) -> dict[str, Any]:
        snapshot: dict[str, Any] = {}
        if self.stateful_dataset:
            snapshot["dataset"] = self.dataset.state_dict()
        if self.stateful_iterator:
            snapshot["iterator"] = self.fetcher.dataset_iter.state_dict()
        # A copy, taken now: a dataset may hand out the very dict it goes on updating, and the
        # state is pickled later (a worker process's sending thread) or never (threads, the
        # main process), after the dataset has moved on.
        return copy.deepcopy(snapshot)

    def _fast_forward(self, index: object) -> None:
        """Yield again, and drop, the batches handed over before the checkpoint, uncollated."""
        fetcher, count = self.fetcher, self.skip
        self.skip = 0
        collate = fetcher.collate_fn
        fetcher.collate_fn = _discard
        try:
            for _ in range(count):
                try:
                    fetcher.fetch(index)
                except StopIteration:
                    break
                except Exception:
                    continue  # its error was handed over before the checkpoint
        finally:
            fetcher.collate_fn = collate

    def fail_every_task(self, error: BaseException | RemoteError) -> None:
        """From now on answer every task with `error`, and run none of the dataset's code: for a
        worker that must not go on (its thread was ended by SystemExit, say). Resumes are still
        acknowledged, so that nothing waits for this worker."""
        self.init_error = error

    def answer(self, command: SendTask | ResumeWorker) -> Event:
        """The event that answers `command`: every task gets exactly one answer."""
        if isinstance(command, ResumeWorker):
            return self.resume(command)
        if not self.setup.trace:
            return self._answer(command)
        # The CPU clock is a system call (0.8 us, twice a task): read for every task that takes
        # long enough for that not to matter, and for one in `CPU_SAMPLED_EVERY` of the rest.
        timing_cpu = self.cpu_skip == 0
        cpu = time.thread_time() if timing_cpu else 0.0
        started = time.perf_counter()
        event = self._answer(command)
        finished = time.perf_counter()
        fast = finished - started < FAST_TASK
        if timing_cpu:
            took: float | None = time.thread_time() - cpu
            self.cpu_skip = CPU_SAMPLED_EVERY - 1 if fast else 0
        else:
            took = None
            self.cpu_skip = self.cpu_skip - 1 if fast else 0
        kind = type(event)
        if kind is TaskCompleted or kind is TaskFailed:
            fetch = getattr(self, "fetch", None)
            timing: TaskTiming = (
                started,
                finished,
                took,
                fetch.slowest if isinstance(fetch, TimedFetch) else (),
                self.ready,
            )
            self.ready = None
            # The event was made just now, here, and nobody else holds it yet: its slot is
            # filled in place rather than the event copied (attrs.evolve: 3 us a batch).
            _TIMING_SLOT[kind](event, timing)
        return event

    def _answer(self, command: SendTask) -> Event:
        task, worker = command.task, self.worker_id
        if self.init_error is not None:
            return TaskFailed(task, worker, self.init_error)
        if self.exhausted:
            return WorkerExhausted(task, worker)
        if not self.iterable:
            # The seeder first: None unless batches are seeded, it spares most tasks `type()`.
            if self.seeder is not None and type(command) is SeededTask:
                return self._answer_seeded(command)
            if self.stateful_map:
                return self._answer_stateful_map(command)
            # `_answer_map`, without its frame: the common task of all, one per batch.
            try:
                data = self.fetch(command.index)
            except Exception as error:
                return TaskFailed(task, worker, self._capture(error, command.index))
            return _completed(task, worker, data)
        try:
            if self.skip:
                self._fast_forward(command.index)
            data = self.fetch(command.index)
        except StopIteration:
            # Read to its end now: a part the checkpoint (or a lost worker) left dry is not read
            # again as the next epoch starts (an iterator may start over once dry).
            self.exhausted, self.dry_unread = True, False
            return WorkerExhausted(task, worker)
        except Exception as error:
            failed = self._capture(error, command.index)
            try:
                return TaskFailed(task, worker, failed, self._mark())
            except Exception:
                return TaskFailed(task, worker, failed, self._counted())
        try:
            mark = self._mark()
        except Exception as error:
            error.add_note(
                "Raised by the dataset's state_dict(), which statecore calls every "
                "snapshot_every_n_steps batches of a worker, so that a checkpoint can resume it"
            )
            where = "in the dataset's state_dict, for a checkpoint"
            return TaskFailed(
                task, worker, self._capture(error, command.index, where), self._counted()
            )
        return _completed(task, worker, data, mark)

    def _answer_seeded(self, command: SeededTask) -> Event:
        """A map-style task loaded under its batch's own seed (seeding per batch): the one
        place where every worker, whatever runs it, seeds for a batch."""
        assert self.seeder is not None
        restore = self.seeder(command.seed)
        try:
            return self._answer_map(command)
        finally:
            if restore is not None:
                restore()

    def _answer_map(self, command: SendTask) -> Event:
        if self.stateful_map:
            return self._answer_stateful_map(command)
        try:
            data = self.fetch(command.index)
        except Exception as error:
            return TaskFailed(command.task, self.worker_id, self._capture(error, command.index))
        return _completed(command.task, self.worker_id, data)

    def _answer_stateful_map(self, command: SendTask) -> Event:
        """A map-style task whose answer carries the dataset's state after it (its mark)."""
        task, worker, index = command.task, self.worker_id, command.index
        if self.restore is not None:
            saved, self.restore = self.restore, None
            try:
                self.dataset.load_state_dict(saved)
            except Exception as error:
                where = "while loading the dataset's state_dict from the checkpoint"
                return TaskFailed(task, worker, self._capture(error, index, where))
        try:
            data = self.fetch(index)
        except Exception as error:
            failed = self._capture(error, index)
            try:
                return TaskFailed(task, worker, failed, self._map_mark())
            except Exception:
                return TaskFailed(task, worker, failed)
        try:
            mark = self._map_mark()
        except Exception as error:
            error.add_note(
                "Raised by the dataset's state_dict(), which statecore calls after every batch "
                "of a map-style dataset that has one, so that a checkpoint can restore it"
            )
            where = "in the dataset's state_dict, for a checkpoint"
            return TaskFailed(task, worker, self._capture(error, index, where))
        return _completed(task, worker, data, mark)

    def _map_mark(self) -> Mark:
        snapshot = {"dataset": self.dataset.state_dict()}
        if self.pid is None:
            # In the main process nothing pickles it: see `_mark`.
            snapshot = copy.deepcopy(snapshot)
        return (0, snapshot)

    def _counted(self) -> Mark:
        """The mark of a batch yielded whose state could not be taken: skipped on resume."""
        self.since += 1
        return (self.since, ...)

    def resume(self, command: ResumeWorker) -> Event:
        """Start a new epoch: a fresh dataset iterator, as torch's workers do on resume."""
        if command.seed is not None and isinstance(self.dataset, IterDataPipe):
            # This worker's own datapipe, whose sharding stays as it was set at the start.
            self.dataset = _reseed_datapipe(self.dataset, command.seed)
        self.exhausted = False
        if self.init_error is None:
            if self.dry_unread and self.stateful:
                self._read_to_end()
            self._restart("while restarting the dataset for a new epoch")
        self.dry_unread = False
        return WorkerResumed(self.worker_id, command.epoch)

    def _capture(
        self, error: BaseException, index: object, where: str = "while loading"
    ) -> BaseException | RemoteError:
        return capture(error, self.worker_id, self.pid, self.note, index, where)


def capture(
    error: BaseException,
    worker: int,
    pid: int | None,
    note: str | None,
    index: object,
    where: str = "while loading",
) -> BaseException | RemoteError:
    """Worker `worker`'s `error`, met `where` (at dataset `index`, if not None), as its answer
    carries it: in a process of its own (`pid`), as data that crosses to the loader's process;
    in the loader's process, the exception itself, with `note` added if given."""
    if pid is None:
        if note is not None:
            at = "" if index is None else f" at dataset index {index!r}"
            error.add_note(f"{note} {where}{at}")
        return error
    return RemoteError.capture(error, worker=worker, pid=pid, index=index, where=where)


def _reseed_datapipe(dataset: Any, seed: int) -> Any:
    from torch.utils.data.graph_settings import apply_random_seed

    rng = torch.Generator()
    rng.manual_seed(seed)
    with DATAPIPE_GRAPH:
        return apply_random_seed(dataset, rng)
