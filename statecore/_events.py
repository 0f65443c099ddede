"""Events: what happened, told to the scheduler. Named in the past tense.

Three kinds of source feed the scheduler, and the kind decides who is blamed when an event is
impossible in the current state (see `statecore._errors`):

- the consumer (the training loop): `ResetRequested`, `NextRequested`, `Interrupted`,
  `CloseRequested`;
- the driver, on the consumer's behalf: `IndexDrawn`, `SamplerExhausted`, `SamplerFailed`,
  `TimedOut`, `ExecutorFailed`;
- the executor, for its workers: `TaskCompleted`, `TaskFailed`, `WorkerExhausted`,
  `WorkerResumed`, `WorkerDied`, `WorkerStarted`;
- the driver, for a worker it found stuck: `WorkerStuck`;
- the driver, on a tuner's behalf (changing how many workers load, and how far ahead):
  `RetireRequested`, `AddRequested`, `PrefetchChangeRequested`.

Every event of a worker names its incarnation: how many times its slot was replaced when the
worker that sent it was started (0 for the first). An event of an earlier incarnation is late
news of a worker already lost, and is dropped.
"""

from __future__ import annotations

import attrs

from statecore._state import Progress

__all__ = [
    "AddRequested",
    "CloseRequested",
    "Event",
    "ExecutorFailed",
    "IndexDrawn",
    "Interrupted",
    "NextRequested",
    "PrefetchChangeRequested",
    "ResetRequested",
    "RetireRequested",
    "SamplerExhausted",
    "SamplerFailed",
    "TaskCompleted",
    "TaskFailed",
    "TimedOut",
    "WorkerDied",
    "WorkerExhausted",
    "WorkerResumed",
    "WorkerStarted",
    "WorkerStuck",
]


class Event:
    """Base of every event. Events are frozen values."""

    __slots__ = ()


# --- from the consumer -------------------------------------------------------------------------


@attrs.frozen
class ResetRequested(Event):
    """The consumer started an epoch (`iter(loader)`). `seed` is passed on to resumed workers.

    `resume` continues an epoch from a checkpoint instead (see `statecore.progress`): the
    sampler is positioned at `resume.done` by the caller, and the draws in `resume.also` are
    dropped as they come. An iterable dataset's workers, restored by the executor, take turns
    from `resume.turn`. Only a fresh scheduler resumes.
    """

    seed: int | None = None
    resume: Progress | None = None


@attrs.frozen
class NextRequested(Event):
    """The consumer asked for the next batch (`next(iterator)`)."""


@attrs.frozen
class Interrupted(Event):
    """The consumer stopped waiting: an exception (Ctrl-C's KeyboardInterrupt, or one raised by
    a signal handler such as a SIGALRM time limit) left `next()` or `iter()` while it waited.

    Nothing is lost: tasks in flight stay in flight and their answers are kept, so the next
    `next()` goes on with the epoch, and the next `iter()` starts a new one.
    """


@attrs.frozen
class CloseRequested(Event):
    """The consumer is done with the iterator: break, deletion, exception or interpreter exit."""


# --- from the driver ---------------------------------------------------------------------------


@attrs.frozen
class IndexDrawn(Event):
    """The sampler yielded `index` in answer to `DrawIndex`."""

    # Batch samplers yield lists: comparable, not hashable.
    index: object = attrs.field(hash=False)

    @classmethod
    def fast(cls, index: object) -> IndexDrawn:
        """`IndexDrawn(index)`, for the shell's hot path (one per batch): the same value, built
        without attrs' frozen `__init__`, 0.20 against 0.30 us."""
        event: IndexDrawn = _new(cls)
        _index(event, index)
        return event


@attrs.frozen
class SamplerExhausted(Event):
    """The sampler raised StopIteration in answer to `DrawIndex`."""


@attrs.frozen
class SamplerFailed(Event):
    """The sampler raised `error` (not StopIteration) in answer to `DrawIndex`."""

    error: object = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class ExecutorFailed(Event):
    """The executor itself raised `error`: its `poll` failed, or it could not carry out a command.

    Commands of the same run not yet carried out are void: the scheduler's answer to this
    event replaces them.
    """

    error: object = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class TimedOut(Event):
    """A waiting consumer got nothing within the loader's timeout."""

    seconds: float


# --- from the executor -------------------------------------------------------------------------


@attrs.frozen
class TaskCompleted(Event):
    """`worker` produced the batch for `task`."""

    task: int
    worker: int
    payload: object = attrs.field(default=None, eq=False, repr=False)
    mark: object = attrs.field(default=None, eq=False, repr=False)
    """Where the worker's iterable dataset stands after this batch, for checkpoints (see
    `WorkerRuntime`); None for map-style datasets. The scheduler passes it by: the driver
    keeps the mark of each worker's last batch the consumer received."""
    timing: object = attrs.field(default=None, eq=False, repr=False)
    """What the worker measured of the task, for a traced loader (see `executors._timing`);
    None when nobody traces. The scheduler passes it by, as it does the payload."""
    incarnation: int = 0

    @classmethod
    def fast(
        cls,
        task: int,
        worker: int,
        payload: object,
        mark: object = None,
        timing: object = None,
        incarnation: int = 0,
    ) -> TaskCompleted:
        """`TaskCompleted(task, worker, payload, mark, timing, incarnation)`, for the workers'
        hot path (one per batch): the same value, built without attrs' frozen `__init__`, 0.34
        against 0.47 us."""
        event: TaskCompleted = _new(cls)
        _task(event, task)
        _worker(event, worker)
        _payload(event, payload)
        _mark(event, mark)
        _timing(event, timing)
        _incarnation(event, incarnation)
        return event


@attrs.frozen
class TaskFailed(Event):
    """`worker` raised while producing `task`; `error` is the executor's record of it."""

    task: int
    worker: int
    error: object = attrs.field(default=None, eq=False, repr=False)
    mark: object = attrs.field(default=None, eq=False, repr=False)
    """As `TaskCompleted.mark`: the task's error is handed over in its turn, as a batch is."""
    timing: object = attrs.field(default=None, eq=False, repr=False)
    """As `TaskCompleted.timing`."""
    incarnation: int = 0


@attrs.frozen
class WorkerExhausted(Event):
    """`worker`'s iterable dataset ran dry at `task` (or was already dry when `task` came)."""

    task: int
    worker: int
    incarnation: int = 0


@attrs.frozen
class WorkerResumed(Event):
    """`worker` acknowledged the `ResumeWorker` of `epoch` and is ready for that epoch's tasks.

    The epoch tells an acknowledgement of an abandoned reset (the consumer interrupted `iter()`
    and then called it again) from the one the scheduler waits for.
    """

    worker: int
    epoch: int
    incarnation: int = 0


@attrs.frozen
class WorkerDied(Event):
    """`worker` ended without being told to. A negative exit code is a signal number, negated.

    `reason` is what the executor was told of the death, when that says more than an exit code
    (a cluster's account of a lost worker, say); it ends up in the user's error message.
    """

    worker: int
    pid: int | None = None
    exitcode: int | None = None
    reason: str | None = None
    incarnation: int = 0


@attrs.frozen
class WorkerStarted(Event):
    """Incarnation `incarnation` of `worker`, started in answer to `ReplaceWorker`, is set up
    and ready for the tasks it is owed."""

    worker: int
    incarnation: int


@attrs.frozen
class WorkerStuck(Event):
    """The consumer waited `seconds` (the loader's `worker_timeout`) for `task`, and `worker`,
    which holds it, gave no answer. Told by the driver, which asked the executor for the
    worker's stack first: nothing is killed before the scheduler decides."""

    worker: int
    task: int
    seconds: float
    incarnation: int = 0
    pid: int | None = None
    stack: str | None = None
    killable: bool = True
    """Whether the executor can end the worker (a process can be killed, a thread cannot)."""


# --- from the driver, on a tuner's behalf -------------------------------------------------------


@attrs.frozen
class RetireRequested(Event):
    """Retire `worker` mid-epoch: it is given no new task, finishes those it holds, and is then
    stopped (`StopWorker`); its slot stays empty until `AddRequested` starts it again. Map-style
    datasets only: an iterable dataset's worker holds its own part of the data."""

    worker: int


@attrs.frozen
class AddRequested(Event):
    """Start `worker`'s retired slot again (`ReplaceWorker` with its next incarnation); it takes
    tasks once it has started (`WorkerStarted`). Spends no restart."""

    worker: int


@attrs.frozen
class PrefetchChangeRequested(Event):
    """Bound each worker's unresolved tasks by `prefetch_factor` from now on, mid-epoch.

    Raising it sends more at once, to workers with room under the new bound. Lowering it
    cancels nothing: a worker holding more than the new bound keeps its tasks and answers them,
    and is sent no new one until it holds fewer than the bound. Not for a scheduler that draws
    only on request (`Config.lazy`: no workers), which prefetches nothing."""

    prefetch_factor: int


# The slots' own setters, for the `fast` constructors: attrs' frozen `__init__` sets each field
# through a generic path that costs a third more.
_new = object.__new__
_index = IndexDrawn.__dict__["index"].__set__
_task = TaskCompleted.__dict__["task"].__set__
_worker = TaskCompleted.__dict__["worker"].__set__
_payload = TaskCompleted.__dict__["payload"].__set__
_mark = TaskCompleted.__dict__["mark"].__set__
_timing = TaskCompleted.__dict__["timing"].__set__
_incarnation = TaskCompleted.__dict__["incarnation"].__set__

CONSUMER_EVENTS: frozenset[type[Event]] = frozenset(
    {ResetRequested, NextRequested, Interrupted, CloseRequested}
)
