"""How a worker starts, wherever it runs: the steps every worker takes before its first task.

Every executor starts its workers through `start_worker`, told where the worker runs by a
`Seat`: a process of its own (an `mp` worker process, a Ray actor), a thread of the loader's
process (the thread executor), or the loader's own thread (`num_workers=0`). One path, so
that what a worker sees cannot differ from one executor to the next except where the seat
makes it differ. In torch's order, a worker:

1. is seeded: a process of its own seeds `random`, torch and numpy as torch seeds its workers
   (`seed_worker`). A thread cannot seed the process-wide generators for itself alone: its
   WorkerInfo carries generators of its own instead (`worker_info`);
2. prepares its dataset: a datapipe is reseeded with the loader's shared seed and sharded for
   this worker (`prepare_dataset`);
3. is told who it is: `get_worker_info()`, ours and torch's, returns its WorkerInfo, built by
   `worker_info`, the one place that builds one;
4. calls `worker_init_fn(worker_id)`;
5. builds its `WorkerRuntime`, which restores the dataset's state from a checkpoint and makes
   the dataset's fetcher, and is told how its seat seeds a batch where the loader seeds per
   batch (`executors._seeding.seeder_for`: the caller's thread too, which puts its generators
   back after each batch).

An `Exception` in steps 2 to 5 does not stop the worker: the runtime answers its first task
with it, so that it reaches the consumer in that task's turn, as torch does. In the loader's
own thread torch neither seeds, nor sets worker info, nor calls `worker_init_fn`: there only
step 5 runs, and the runtime shards a datapipe as torch's single-process iterator does.
"""

from __future__ import annotations

import contextlib
import enum
import random
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data._utils import HAS_NUMPY
from torch.utils.data._utils import worker as torch_worker

from statecore.executors._remote import RemoteError
from statecore.executors._seeding import seeder_for
from statecore.executors._worker import WorkerRuntime, WorkerSetup, capture, prepare_dataset

__all__ = [
    "Seat",
    "SeatKind",
    "as_worker",
    "get_worker_info",
    "seed_worker",
    "start_worker",
    "worker_info",
]


def get_worker_info() -> torch_worker.WorkerInfo | None:
    """The current worker's WorkerInfo, or None in the main process.

    The same object that `torch.utils.data.get_worker_info()` returns inside our workers, so
    IterableDatasets that shard themselves with torch's function work unchanged.
    """
    return torch.utils.data.get_worker_info()


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed `random`, torch and numpy as torch seeds its workers; return the worker's seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    if HAS_NUMPY:
        import numpy

        numpy.random.seed(torch_worker._generate_state(base_seed, worker_id))  # type: ignore[no-untyped-call]
    return seed


def worker_info(
    setup: WorkerSetup, worker_id: int, dataset: Any, thread: bool = False
) -> torch_worker.WorkerInfo:
    """The WorkerInfo of worker `worker_id`, whose own dataset is `dataset`: id, num_workers,
    seed (`base_seed + worker_id`) and dataset, as torch's workers have it.

    For a worker `thread`, as torch's own thread workers will build it: a thread cannot seed
    the process-wide generators for itself alone, so it gets generators of its own in `rng`,
    seeded from the worker's seed as `seed_worker` seeds the process-wide ones:
    `random.Random(seed)` and a CPU `torch.Generator` draw what `random` and torch's default
    generator draw in a worker process. `worker_method="thread"` is what makes
    `torch.thread_safe_generator()` return `rng.torch_generator`. numpy's generator is a
    `numpy.random.Generator` over the worker's numpy seed, as torch's thread workers (on
    pytorch's main branch, after 2.13) make it; its numbers are not those of numpy's global
    functions in a worker process. A torch without these fields (before 2.13) gets the
    WorkerInfo it gives its processes.
    """
    base_seed, seed = setup.base_seed, setup.base_seed + worker_id
    container = getattr(torch_worker, "_RNG", None) if thread else None
    if container is None:
        return torch_worker.WorkerInfo(
            id=worker_id, num_workers=setup.num_workers, seed=seed, dataset=dataset
        )
    torch_generator = torch.Generator()
    torch_generator.manual_seed(seed)
    numpy_generator = None
    if HAS_NUMPY:
        import numpy

        numpy_generator = numpy.random.default_rng(
            torch_worker._generate_state(base_seed, worker_id)  # type: ignore[no-untyped-call]
        )
    rng = container(
        random_generator=random.Random(seed),
        torch_generator=torch_generator,
        numpy_generator=numpy_generator,
    )
    return torch_worker.WorkerInfo(
        id=worker_id,
        num_workers=setup.num_workers,
        seed=seed,
        dataset=dataset,
        rng=rng,
        worker_method="thread",
    )


def _tell_process(info: torch_worker.WorkerInfo) -> None:
    # torch's own global, so that torch.utils.data.get_worker_info() sees this worker, and
    # default_collate builds batches straight in shared memory as it does in torch's workers.
    torch_worker._worker_info = info


@contextlib.contextmanager
def as_worker(setup: WorkerSetup, worker_id: int) -> Iterator[None]:
    """Within the block, `get_worker_info()` (ours and torch's) describes worker `worker_id`.

    For executors that run several workers on one thread: wrap each worker's dataset work
    (creating its `WorkerRuntime`, answering its commands) so that datasets which shard
    themselves by worker see the right worker.
    """
    saved = torch_worker._worker_info
    _tell_process(worker_info(setup, worker_id, setup.dataset))
    try:
        yield
    finally:
        torch_worker._worker_info = saved


class SeatKind(enum.Enum):
    """Where a worker runs."""

    PROCESS = "process"
    """A process of its own: an `mp` worker process, a Ray actor."""
    THREAD = "thread"
    """A thread of the loader's process, beside other workers' threads."""
    CALLER = "caller"
    """The thread that iterates the loader (`num_workers=0`): not a worker, for torch."""


def _carry_on(where: str) -> None:
    return None


@attrs.frozen
class Seat:
    """Where a worker runs, and so what its start-up does (see `start_worker`).

    Make one with `Seat.process`, `Seat.thread` or `Seat.caller`.
    """

    kind: SeatKind
    pid: int | None = None
    """The worker's own process: its errors then cross to the loader's process as data
    (`RemoteError`). None: it runs in the loader's process, and its errors stay exceptions."""
    note: str | None = None
    """Added to each error of a worker in the loader's process: which worker raised it."""
    tell: Callable[[torch_worker.WorkerInfo], None] = attrs.field(default=_tell_process, eq=False)
    """How the worker's WorkerInfo reaches `get_worker_info()`."""
    doing: Callable[[str], None] = attrs.field(default=_carry_on, eq=False)
    """Told what the worker starts to do (a step of its start-up, then "while loading")."""
    ended: Callable[[int, BaseException, str], BaseException] | None = attrs.field(
        default=None, eq=False
    )
    """The error for a worker that a `BaseException` (SystemExit, ...) ended in a step of its
    start-up; None lets it end the worker's process."""

    @classmethod
    def process(cls, pid: int | None) -> Seat:
        """A worker process (or actor) with this pid (None: its errors stay exceptions)."""
        return cls(SeatKind.PROCESS, pid=pid)

    @classmethod
    def thread(
        cls,
        note: str,
        tell: Callable[[torch_worker.WorkerInfo], None],
        doing: Callable[[str], None],
        ended: Callable[[int, BaseException, str], BaseException],
    ) -> Seat:
        """A worker thread: `tell` gives its WorkerInfo to that thread alone."""
        return cls(SeatKind.THREAD, note=note, tell=tell, doing=doing, ended=ended)

    @classmethod
    def caller(cls, note: str | None = None) -> Seat:
        """The thread that iterates the loader."""
        return cls(SeatKind.CALLER, note=note)


def start_worker(
    setup: WorkerSetup,
    worker_id: int,
    seat: Seat,
    dataset: Any = None,
    init_error: BaseException | None = None,
) -> WorkerRuntime:
    """Start worker `worker_id` where `seat` says it runs (see the module docstring) and
    return its runtime, ready for its first task.

    `dataset` is the worker's own copy, made by the executor (None: `setup.dataset`, which a
    worker process unpickled for itself); `init_error`, an error met making that copy, with
    which the worker answers its first task.
    """
    if seat.kind is SeatKind.CALLER:
        caller = WorkerRuntime(setup, worker_id, None, note=seat.note)
        caller.seeder = seeder_for(seat.kind.value)
        return caller
    if seat.kind is SeatKind.PROCESS:
        seed_worker(setup.base_seed, worker_id)
    start = _Start(seat, worker_id, init_error)
    own = setup.dataset if dataset is None else dataset
    if start.failed is None:
        where = "while sharding the datapipe"
        prepared = start.attempt(where, prepare_dataset, setup, worker_id, own)
        own = own if start.failed is not None else prepared
    seat.tell(worker_info(setup, worker_id, own, thread=seat.kind is SeatKind.THREAD))
    if start.failed is None and setup.worker_init_fn is not None:
        start.attempt("in worker_init_fn", setup.worker_init_fn, worker_id)
    runtime = None
    if start.failed is None:
        runtime = start.attempt(
            "while creating the dataset fetcher",
            WorkerRuntime,
            setup,
            worker_id,
            seat.pid,
            own,
            None,
            seat.note,
        )
    if runtime is None:
        runtime = WorkerRuntime(setup, worker_id, seat.pid, own, start.failed, seat.note)
    runtime.seeder = seeder_for(seat.kind.value)
    seat.doing("while loading")
    return runtime


class _Start:
    """The first error of a worker's start-up, with which it answers its first task."""

    def __init__(
        self, seat: Seat, worker_id: int, failed: BaseException | RemoteError | None
    ) -> None:
        self.seat = seat
        self.worker_id = worker_id
        self.failed = failed

    def attempt(self, where: str, action: Callable[..., Any], *args: Any) -> Any:
        """`action(*args)`, a step of the start-up that `where` names; None if it raised, and
        the error is kept (raised in the turn of the first task, as torch does, so it reaches
        the consumer). A `BaseException` ends the worker, unless its seat says what a worker
        so ended answers (a thread cannot be killed)."""
        seat = self.seat
        seat.doing(where)
        try:
            return action(*args)
        except Exception as error:
            self.failed = capture(error, self.worker_id, seat.pid, seat.note, None, where)
        except BaseException as error:
            if seat.ended is None:
                raise
            self.failed = seat.ended(self.worker_id, error, where)
        return None
