"""The scheduler's state: every value that a transition may read or change lives in this file.

A state is a frozen, hashable value. It is split in two by how often things change:
`Lifecycle` (phase, epoch, worker statuses, failure) changes a few times an epoch, while the
fields of `State` itself (the task window, per-worker loads, the dispatch cursor) change on
nearly every event. Keeping the fast-changing part small keeps `step` cheap, because a
transition builds one new `State` and usually reuses the old `Lifecycle` untouched.

Task numbers never restart: the first task of an epoch follows the last task of the one
before. That is what lets the scheduler tell a late answer from an earlier epoch (a *stale*
task) from an answer it is waiting for.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import attrs

__all__ = [
    "RESOLVED",
    "Cancelled",
    "Config",
    "ExecutorFailure",
    "Failed",
    "Failure",
    "Lifecycle",
    "Pending",
    "Phase",
    "Progress",
    "Ready",
    "Resolved",
    "SamplerFailure",
    "Slot",
    "State",
    "Stats",
    "TaskFailure",
    "Timeout",
    "WorkerDeath",
    "WorkerHang",
    "WorkerLoss",
    "WorkerStatus",
    "initial_state",
]


class Phase(enum.Enum):
    """Where the scheduler is in the life of a loader iterator."""

    IDLE = "idle"
    """Built; no epoch has started. Workers may be starting, but no task is sent."""
    RESUMING = "resuming"
    """Persistent workers were asked to start a new epoch; no task is sent until all acknowledge."""
    RUNNING = "running"
    """The sampler still yields indices; tasks are sent as workers have room for them."""
    DRAINING = "draining"
    """Nothing more will be sent this epoch (sampler done or all workers dry): answers may be
    due, and once none is, the epoch ends with the consumer's next request."""
    FINISHED = "finished"
    """Every task of the epoch is resolved and the consumer was told the epoch ended.
    Persistent workers wait here for the next epoch."""
    FAILED = "failed"
    """A failure ended the epoch: a worker died, a wait timed out, the sampler raised or the
    executor itself failed. Sticky: shutdown was emitted, and every request re-raises the
    failure (a sampler's once, as torch's spent sampler then gives the end)."""
    CLOSED = "closed"
    """Closed by the consumer. Sticky: everything but another close is refused."""

    # Enum hashes by name in Python code; `step` looks a phase up on every event, and an
    # identity hash (members are singletons) is a C slot, several times faster.
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Phase.{self.name}"


class WorkerStatus(enum.Enum):
    """What the scheduler believes about one worker."""

    ACTIVE = "active"
    """Can be given tasks."""
    EXHAUSTED = "exhausted"
    """Its iterable ran dry this epoch; it answers every further task as exhausted."""
    RESUMING = "resuming"
    """Asked to start a new epoch and has not acknowledged yet."""
    STOPPED = "stopped"
    """Told to stop; it owes nothing and gets nothing."""
    STARTING = "starting"
    """A replacement for a lost worker (dead or stuck) is starting in its slot. It takes its
    turn as the lost one did, but the tasks it is given, and those the lost one held, wait in
    the window and are sent once it has started (`WorkerStarted`). A retired slot started
    again (`AddRequested`) is starting too, and takes no turn until it has started
    (`Lifecycle.joining`)."""
    RETIRING = "retiring"
    """Asked to retire (`RetireRequested`): it is given no new task and answers those it holds;
    once it holds none it is told to stop, and its slot is STOPPED (retired)."""

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"WorkerStatus.{self.name}"


# --- the task window -----------------------------------------------------------------------
# One slot per task number in [rcvd_idx, send_idx). Torch tells "pending" from "arrived" by the
# length of a tuple; here each is its own class.


@attrs.frozen
class Pending:
    """Sent to `worker` (or held for it while it starts); no answer yet."""

    worker: int
    # Kept only where a lost worker may be replaced, to send the task again; opaque to the
    # scheduler, as a batch is, and not part of the state's value.
    index: object = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Ready:
    """Answered with data that waits for its turn (in order) or for a consumer (out of order)."""

    worker: int
    # The batch is opaque to the scheduler and may be a tensor, which cannot be compared.
    payload: object = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def fast(cls, worker: int, payload: object) -> Ready:
        """`Ready(worker, payload)`, for `step`'s hot path (one per batch): the same value,
        built without attrs' frozen `__init__`, 0.27 against 0.37 us."""
        slot: Ready = _new(cls)
        _ready_worker(slot, worker)
        _ready_payload(slot, payload)
        return slot


# The slots' own setters, for `Ready.fast`.
_new = object.__new__
_ready_worker = Ready.__dict__["worker"].__set__
_ready_payload = Ready.__dict__["payload"].__set__


@attrs.frozen
class Failed:
    """Answered with the worker's exception, raised in the task's turn."""

    worker: int
    error: object = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Resolved:
    """Delivered out of order, or skipped because its worker ran dry; only a placeholder."""

    def __repr__(self) -> str:
        return "RESOLVED"


RESOLVED = Resolved()

Slot = Pending | Ready | Failed | Resolved


# --- failures --------------------------------------------------------------------------------
# Failures are plain values (hashable, comparable) so that states holding them can be
# de-duplicated; the shell turns them into exceptions.


@attrs.frozen
class TaskFailure:
    """A worker raised for one task. Not fatal: the loader goes on with the next task."""

    task: int
    worker: int
    error: object = attrs.field(default=None, eq=False, repr=False)

    def describe(self) -> str:
        return f"worker {self.worker} raised while producing task {self.task}: {self.error!r}"


@attrs.frozen
class WorkerDeath:
    """A worker process ended without being told to. Fatal once no restart is left."""

    worker: int
    pid: int | None = None
    exitcode: int | None = None
    reason: str | None = None
    """What the executor was told of the death (`WorkerDied.reason`), if anything."""
    earlier: tuple[WorkerLoss, ...] = ()
    """The losses replaced before this one, which spent the restarts; empty while none was."""

    def describe(self) -> str:
        return self.describe_alone() + _earlier(self.earlier)

    def describe_alone(self) -> str:
        """This death, without the earlier ones."""
        who = f"DataLoader worker {self.worker}"
        if self.pid is not None:
            who += f" (pid {self.pid})"
        if self.exitcode is None:
            how = "exited unexpectedly"
        elif self.exitcode < 0:
            how = f"was killed by signal {-self.exitcode}"
        else:
            how = f"exited unexpectedly with exit code {self.exitcode}"
        if self.reason is not None:
            how += f": {self.reason}"
        return f"{who} {how}"


@attrs.frozen
class WorkerHang:
    """A worker gave no answer to `task` for `seconds` while the consumer waited for it (the
    loader's `worker_timeout`). Fatal once no restart is left, and always where the worker
    cannot be killed (a thread)."""

    worker: int
    task: int
    seconds: float
    pid: int | None = None
    stack: str | None = None
    """The worker's Python stack when it was found stuck, innermost call last, if captured."""
    killable: bool = True
    """Whether the executor can end the stuck worker; a thread cannot be killed."""
    earlier: tuple[WorkerLoss, ...] = ()
    """As `WorkerDeath.earlier`."""

    def describe(self) -> str:
        return self.describe_alone() + _earlier(self.earlier)

    def describe_alone(self) -> str:
        """This hang, without the earlier losses."""
        who = f"DataLoader worker {self.worker}"
        if self.pid is not None:
            who += f" (pid {self.pid})"
        text = f"{who} gave no answer to task {self.task} in {self.seconds} seconds"
        if not self.killable:
            text += ", and a thread cannot be killed, so it cannot be replaced"
        if self.stack:
            text += f"; it was stuck in:\n{self.stack.rstrip()}"
        return text


WorkerLoss = WorkerDeath | WorkerHang
"""A worker lost mid-run: replaced while restarts are left, fatal after."""


def _earlier(losses: tuple[WorkerLoss, ...]) -> str:
    if not losses:
        return ""
    told = "; ".join(loss.describe_alone() for loss in losses)
    return f" (after {len(losses)} worker restart(s), spending them all: {told})"


@attrs.frozen
class Timeout:
    """No answer came within the loader's timeout. Fatal."""

    seconds: float

    def describe(self) -> str:
        return f"DataLoader timed out after {self.seconds} seconds"


@attrs.frozen
class Cancelled:
    """The loader was closed while a consumer waited for a batch. Fatal."""

    def describe(self) -> str:
        return "the loader was closed while a batch was awaited"


@attrs.frozen
class SamplerFailure:
    """The sampler raised. Ends the epoch: the consumer gets the error once, then the end."""

    error: object = attrs.field(default=None, eq=False, repr=False)

    def describe(self) -> str:
        return f"the sampler raised {self.error!r}"


@attrs.frozen
class ExecutorFailure:
    """The executor itself failed (not a worker's task). Fatal, and raised on every request."""

    error: object = attrs.field(default=None, eq=False, repr=False)

    def describe(self) -> str:
        return f"the executor failed: {self.error!r}"


Failure = (
    TaskFailure | WorkerDeath | WorkerHang | Timeout | Cancelled | SamplerFailure | ExecutorFailure
)


# --- progress, for checkpoints -------------------------------------------------------------


@attrs.frozen
class Progress:
    """How far the consumer got through one epoch: which of the sampler's draws it was handed.

    Positions count the sampler's draws from the start of the epoch, 0 first, whichever run of
    the loader made them: a run resumed from a checkpoint goes on numbering where the
    checkpoint's positions left off. Handed over means delivered as a batch or raised as that
    task's error: a resumed run produces neither again.
    """

    done: int = 0
    """Every position before this one was handed over (and this one was not)."""
    also: frozenset[int] = frozenset()
    """Positions after `done` handed over as well (out of order)."""
    ended: bool = False
    """The sampler ran out and every draw was handed over: nothing of the epoch remains."""
    turn: int = 0
    """The worker whose batch comes next, in order: workers take turns, and a resumed run with
    as many workers goes on with the same one, so that each batch is loaded by the worker that
    loaded it in the original run (an iterable dataset's part, or a map-style dataset's state
    per worker). A map-style epoch resumed with fewer workers starts with worker 0."""
    dry: frozenset[int] = frozenset()
    """An iterable dataset's workers found dry, every batch of which was handed over: a
    resumed run never asks them again. Restarting one would yield its part again when the
    dataset's state after running dry is the state of its start, as many datasets' is."""

    def __attrs_post_init__(self) -> None:
        if self.done < 0 or any(p <= self.done for p in self.also):
            raise ValueError(
                f"progress positions must be after done={self.done} and done at least 0, "
                f"got also={sorted(self.also)}"
            )
        if self.turn < 0:
            raise ValueError(f"the turn is a worker number, at least 0, got {self.turn}")
        if any(w < 0 for w in self.dry):
            raise ValueError(f"dry workers are worker numbers, at least 0, got {sorted(self.dry)}")

    def complete(self, length: int | None) -> bool:
        """Whether nothing of the epoch remains, given the sampler's length if it has one.

        A scheduler that draws only when asked (no workers) has not yet seen the sampler run
        out after the last batch; the length tells.
        """
        return self.ended or (length is not None and self.done >= length)


# --- configuration and state ---------------------------------------------------------------


def _at_least_zero(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an integer of at least 0, got {value!r}")


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer of at least 1, got {value!r}")


@attrs.frozen
class Config:
    """What does not change during the life of a scheduler, but for the prefetch bound.

    `num_workers` counts the workers that take tasks; the in-process loader is one worker.
    `prefetch_factor` bounds the unresolved tasks (sent, not yet delivered or skipped) that any
    one worker holds, which is torch's documented meaning ("batches loaded in advance by each
    worker"). A tuner may change it mid-epoch (`PrefetchChangeRequested`): the state then holds
    a config with the new bound, and `Lifecycle.lowered_at` says which tasks it applies to.
    """

    num_workers: int = attrs.field(validator=_at_least_one)
    prefetch_factor: int = attrs.field(default=2, validator=_at_least_one)
    in_order: bool = True
    iterable: bool = False
    persistent_workers: bool = False
    lazy: bool = False
    """Draw an index only when a consumer waits and nothing is in hand: torch's behaviour
    without workers, where the sampler is read at `next()`, never ahead of it."""
    restarts: int = attrs.field(default=0, validator=_at_least_zero)
    """Lost workers (dead, or stuck and killable) this scheduler replaces before a loss is
    fatal; 0, torch's behaviour, replaces none."""
    started: int | None = None
    """How many worker slots run from the start (the first ones); the others begin retired
    (STOPPED) and run only once `AddRequested` starts them. None: every slot runs. A loader
    tuning its worker count (`num_workers="auto"`) starts small this way. Map-style datasets
    only: an iterable dataset's slot holds its own part of the data, which a slot that never
    runs would lose."""

    def __attrs_post_init__(self) -> None:
        started = self.started
        if started is None:
            return
        if (
            not isinstance(started, int)
            or isinstance(started, bool)
            or not 1 <= started <= self.num_workers
        ):
            raise ValueError(
                f"started must be an integer from 1 to num_workers={self.num_workers} (the worker "
                f"slots running from the start), or None for all of them, got {started!r}"
            )
        if self.iterable and started < self.num_workers:
            raise ValueError(
                f"started={started} of {self.num_workers} worker slots: an iterable dataset's "
                "slot holds its own part of the data, which a slot that never runs would lose; "
                "start every slot (started=None)"
            )

    @property
    def running_at_start(self) -> int:
        """The worker slots that run from the start: `started`, or all of them."""
        return self.num_workers if self.started is None else self.started


@attrs.frozen
class Lifecycle:
    """The slowly changing part of the state."""

    phase: Phase
    epoch: int
    """Epochs started so far; the first epoch is 1."""
    base: int
    """The first task number of the current epoch."""
    workers: tuple[WorkerStatus, ...]
    stale: frozenset[tuple[int, int]]
    """(task, worker) sent in an earlier epoch and still owed an answer, discarded on arrival."""
    skipped: int
    """Tasks of this epoch resolved without delivery because their worker had run dry."""
    dropped: int
    """Tasks of this epoch abandoned unresolved when the loader failed or was closed."""
    failure: Failure | None
    resetting: bool = False
    """The consumer is inside `iter()`. As torch's, it returns once every persistent worker has
    acknowledged the new epoch (RESUMING) and the first tasks went out: a sampler that fails
    while they are drawn fails `iter()`."""
    reported: bool = False
    """The consumer has been given `failure`. A sampler's failure is given once, then the end."""
    resumed: Progress | None = None
    """The checkpoint this epoch resumed from: its handed-over draws are drawn again (the
    sampler cannot skip them) and dropped, and positions go on from its own."""
    passed: int = 0
    """Draws of `resumed.also` met and dropped so far this epoch."""
    left: Progress | None = None
    """The epoch's progress when the loader failed or closed and its window was dropped."""
    incarnations: tuple[int, ...] = ()
    """Per worker slot: how many times it was replaced (0 for the worker it started with). An
    event of an earlier incarnation is news of a lost worker, dropped on arrival."""
    replaced: tuple[WorkerLoss, ...] = ()
    """The losses replaced so far, in order: they spend `Config.restarts`."""
    added: int = 0
    """Retired slots started again (`AddRequested`): each is a new incarnation of its slot, and
    spends no restart."""
    joining: frozenset[int] = frozenset()
    """Retired slots started again (`AddRequested`) that have not started yet: passed over by
    the turns until they have (`WorkerStarted`), as a retired slot is, so that no batch waits
    for a process still starting. Only a map-style dataset's slots are added, and its batches
    do not depend on which worker loads them. A lost worker's replacement keeps its turn."""
    lowered_at: int = 0
    """The first task sent under the prefetch bound in force: `send_idx` when
    `PrefetchChangeRequested` last lowered it (0 before). Lowering cancels nothing, so a worker
    may hold more tasks than the bound, but only ones numbered before this."""
    retiring: bool = attrs.field(init=False, eq=False, repr=False)
    """Whether a worker is retiring: derived from `workers` as the value is built, so that `step`
    does not look through every worker on every step for one (the rule "retired", the steady
    route): 2.5 us a step with 256 workers. Not part of the value: it follows from `workers`."""

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "retiring", WorkerStatus.RETIRING in self.workers)


class State(NamedTuple):
    """The whole scheduler state. Build the first one with `initial_state`.

    Unlike every other value of the core this is a NamedTuple, not an attrs class: `step`
    builds one per event, and a tuple is built in a third of the time. It is just as frozen,
    hashable and printable; change fields with `state._replace(...)`.
    """

    config: Config
    life: Lifecycle
    rcvd_idx: int
    """The lowest unresolved task number (torch's `_rcvd_idx`)."""
    window: tuple[Slot, ...]
    """Slots of tasks rcvd_idx, rcvd_idx + 1, ...; never starts with a resolved slot."""
    loads: tuple[int, ...]
    """Per worker: unresolved tasks of this epoch it was given."""
    cursor: int
    """Where the round-robin scan for the next worker starts."""
    drawing_for: int | None
    """The worker that the index being drawn from the sampler will go to, if one is drawn."""
    waiting: bool
    """A consumer asked for the next batch and has not had it."""

    @property
    def phase(self) -> Phase:
        return self.life.phase

    @property
    def send_idx(self) -> int:
        """The next task number to hand out (torch's `_send_idx`)."""
        return self.rcvd_idx + len(self.window)

    @property
    def outstanding(self) -> int:
        """Tasks of this epoch sent and not answered (torch's `_tasks_outstanding`)."""
        return sum(1 for slot in self.window if type(slot) is Pending)

    @property
    def buffered(self) -> int:
        """Tasks answered and not yet handed to the consumer."""
        return sum(1 for slot in self.window if type(slot) is Ready or type(slot) is Failed)

    def stats(self) -> Stats:
        """A snapshot for logs and metrics, so observers need not read the internals."""
        resolved_in_window = sum(1 for slot in self.window if slot is RESOLVED)
        resolved = self.rcvd_idx - self.life.base + resolved_in_window
        return Stats(
            phase=self.life.phase,
            epoch=self.life.epoch,
            in_flight=self.outstanding,
            buffered=self.buffered,
            delivered=resolved - self.life.skipped - self.life.dropped,
            skipped=self.life.skipped,
            loads=self.loads,
            workers=self.life.workers,
            restarts=len(self.life.replaced),
        )


@attrs.frozen
class Stats:
    """A frozen snapshot of the scheduler's bookkeeping for the current epoch."""

    phase: Phase
    epoch: int
    in_flight: int
    buffered: int
    delivered: int
    """Batches and task errors handed to the consumer this epoch."""
    skipped: int
    loads: tuple[int, ...]
    workers: tuple[WorkerStatus, ...]
    restarts: int = 0
    """Lost workers replaced so far, over the scheduler's life."""


def initial_state(config: Config) -> State:
    """The state of a scheduler that has not started an epoch: the slots past
    `config.started` begin retired."""
    running = config.running_at_start
    workers = (WorkerStatus.ACTIVE,) * running + (WorkerStatus.STOPPED,) * (
        config.num_workers - running
    )
    life = Lifecycle(
        phase=Phase.IDLE,
        epoch=0,
        base=0,
        workers=workers,
        stale=frozenset(),
        skipped=0,
        dropped=0,
        failure=None,
        incarnations=(0,) * config.num_workers,
    )
    return State(
        config=config,
        life=life,
        rcvd_idx=0,
        window=(),
        loads=(0,) * config.num_workers,
        cursor=0,
        drawing_for=None,
        waiting=False,
    )
