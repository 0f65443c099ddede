"""A simulated world around the real driver and core: a sampler, workers and a consumer.

The world runs the code that runs in a loader: `statecore.executors._driver.Driver` over the
core's `step`, with the world itself as the driver's executor and sampler. It lets the caller
choose what happens next: which worker answers, when the consumer asks, when a worker dies or is
found stuck, when a lost worker's late answer arrives, when a wait times out or is interrupted
(Ctrl-C), when the sampler raises or the executor breaks, when the consumer closes or starts a
new epoch. The Hypothesis machines pick those choices at random
(`statecore.models.machines`); the explorer tries every one (`statecore.models.explorer`).

A consumer's call runs the driver until it returns, raises, or waits on the executor with
nothing to poll: the world's `poll` then raises `Blocked`, which leaves the driver and the core
exactly as before the poll (as a real blocking poll would), and the call goes on when a later
action gives the executor something to report. Workers behave as our executors promise: each
answers its work first in, first out, every task exactly once (a dry iterable worker answers
"exhausted"), a resume after every task sent before it. Workers answer while the consumer
waits, since the driver polls only then; a death may come at any time, and waits in the
executor's outbox until the driver polls.

Workers come and go as our executors promise (`executors._protocol`): the world's executor
replaces a lost worker (`ReplaceWorker`), ending a stuck one if the scenario lets it kill one,
starts the new incarnation set up as the lost one was (an iterable part restored to the mark the
driver gives), answers `WorkerStarted` for it, and stamps every event with the incarnation that
sent it. What a lost incarnation had sent may still arrive after its loss was reported (`Late`).
A worker is found stuck by the real driver's own watch (`worker_timeout`), timed on the world's
clock, which moves only when a wait runs out (`Stall`, `Expire`).

Every action is checked. `World.apply` raises `Violation` when the core refuses an event,
breaks its own invariants (`statecore.violations`), moves along an edge missing from the
transition table, or when the consumer or the workers can see something wrong: a batch out of
order or from an earlier epoch, or lost after the scheduler handed it over; a task for a dry
worker, over the prefetch bound, or before every resume was acknowledged; an epoch that does not
match the reference model, or finished (or its workers stopped) other than by the request told
that it ended; a failure (a death, a timeout, the sampler or the executor) not raised to the
consumer in its turn, or a call that goes on after it; work after shutdown; or a consumer left
waiting with nothing that could answer it. Where workers come and go: a task sent to an
incarnation that has not started, or again to anyone but the replacement of the one it was
lost with; a late answer handed over; a loss not replaced while restarts are left, or replaced
past them; a failure, once they are spent, that does not name every loss.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from statecore import (
    EDGES,
    AddRequested,
    Config,
    Event,
    ExecutorFailed,
    InternalError,
    LoaderCancelledError,
    LoaderTimeoutError,
    Phase,
    Progress,
    ProtocolError,
    ReplaceWorker,
    ResumeWorker,
    SamplerFailed,
    SendTask,
    State,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    Transition,
    WorkerDied,
    WorkerDiedError,
    WorkerExhausted,
    WorkerHungError,
    WorkerResumed,
    WorkerStarted,
    WorkerStatus,
    WorkerStuck,
    violations,
)
from statecore import step as core_step
from statecore.executors._driver import Driver, DriverState, handed_task, restorer
from statecore.executors._incarnation import Carried, RanDry, Standing
from statecore.executors._protocol import Capabilities, WorkerReport
from statecore.models.reference import (
    IterableSpec,
    MapSpec,
    Outcome,
    expected_epoch,
    iterable_batch,
    map_batch,
)

__all__ = [
    "Action",
    "Preempt",
    "Blocked",
    "Break",
    "Close",
    "EdgeObserver",
    "Expire",
    "Interrupt",
    "Kill",
    "Late",
    "Next",
    "Restart",
    "SamplerRaises",
    "Saved",
    "Scenario",
    "Stall",
    "StepFunction",
    "Violation",
    "Work",
    "World",
    "check_checkpoint",
    "run_to_end",
]

StepFunction = Callable[[State, Event], Transition]
EdgeObserver = Callable[[Phase, type, Phase], None]
"""Called with (phase before, event type, phase after) for every event fed to the scheduler."""

_TIMEOUT = 5.0
_WORKER_TIMEOUT = 1.0
"""The loader's `worker_timeout` in scenarios where workers may hang: shorter than `_TIMEOUT`, so
that a wait finds the worker stuck before it times out."""


class Violation(AssertionError):
    """The scheduler or its driver did something a correct one never does."""


class Blocked(Exception):
    """The driver polled the world's executor, which has nothing to report yet.

    The driver takes whatever its executor's poll raises for the executor failing, and tells
    the scheduler `ExecutorFailed`; the world's step function recognises its own `Blocked`
    there and raises it before the scheduler sees it, so the driver unwinds with its state and
    the scheduler's exactly as they were before the poll.
    """


class _TaskError(Exception):
    """What a worker raised for one task, as the consumer receives it. `late`: raised by an
    incarnation already lost, and sent after its loss was reported."""

    def __init__(self, task: int, worker: int, value: object, late: bool = False) -> None:
        super().__init__(task, worker, value, late)
        self.task, self.worker, self.value, self.late = task, worker, value, late


class _SamplerError(Exception):
    """What the world's sampler raises when told to fail."""


class _ExecutorError(OSError):
    """What the world's executor raises once broken, as a broken pipe would."""


@attrs.frozen(cache_hash=True)  # a key of `_SPARE`, looked up at every action
class Scenario:
    """One configuration to simulate: the scheduler's config, the dataset, and what may go wrong."""

    config: Config
    dataset: MapSpec | IterableSpec
    epochs: int = 1
    """Epochs the consumer may start; more than one needs persistent workers."""
    deaths: int = 1
    """Workers that may die during a run."""
    timeouts: bool = True
    closes: bool = True
    interrupts: int = 0
    """Waits (in `next()` or `iter()`) that may be interrupted during a run."""
    sampler_failures: int = 0
    """Times the sampler may raise (on the draw after the action that arms it)."""
    executor_failures: int = 0
    """Times the executor may break (every later call to it raises)."""
    hangs: int = 0
    """Times the worker the waiting consumer waits for may be found stuck (the driver runs with
    a `worker_timeout`). A lost worker, dead or stuck, is replaced while `config.restarts` last."""
    killable: bool = True
    """Whether the executor can kill a stuck worker (a process), or not (a thread)."""
    tunes: int = 0
    """Times a tuner may retire a worker or add a retired one back, between the consumer's
    calls (map-style datasets only: an iterable dataset's workers are never retired)."""
    prefetches: int = 0
    """Times a tuner may change the prefetch bound, one up or one down (from 1 to one over the
    configuration's), between the consumer's calls (any dataset; not where the sampler is read
    on demand, which prefetches nothing)."""

    def __attrs_post_init__(self) -> None:
        if self.config.iterable != isinstance(self.dataset, IterableSpec):
            raise ValueError("config.iterable must match the kind of dataset")
        if isinstance(self.dataset, IterableSpec) and len(self.dataset.lengths) != (
            self.config.num_workers
        ):
            raise ValueError("an iterable dataset needs one shard length per worker")
        if self.epochs > 1 and not self.config.persistent_workers:
            raise ValueError("several epochs on one scheduler need persistent workers")


# --- actions: what the environment may do next --------------------------------------------------


@attrs.frozen
class Next:
    """The consumer asks for the next batch."""


@attrs.frozen
class Work:
    """`worker` answers the oldest item in its queue (a task or a resume)."""

    worker: int


@attrs.frozen
class Kill:
    """`worker` dies (SIGKILL): its running incarnation, started or still starting. What it
    was given and had not answered is lost with it, but answers it had already sent may still
    arrive after its death was reported (`Late`)."""

    worker: int


@attrs.frozen
class Late:
    """The oldest answer still on its way from a lost incarnation of `worker` arrives now,
    after its loss was reported: a batch, an exhaustion, a resume or a start it sent before it
    died, or the death of a stuck one its replacement ended."""

    worker: int


@attrs.frozen
class Stall:
    """The worker holding the task the consumer waits for is found stuck: the consumer has waited
    the loader's `worker_timeout` for it (the driver's own watch, on the world's clock)."""


@attrs.frozen
class Expire:
    """The waiting consumer's timeout runs out."""


@attrs.frozen
class Interrupt:
    """The consumer's wait, in `next()` or in `iter()`, is cut short (Ctrl-C)."""


@attrs.frozen
class SamplerRaises:
    """The sampler raises on its next draw."""


@attrs.frozen
class Break:
    """The executor breaks: every later call to it raises."""


@attrs.frozen
class Close:
    """The consumer closes the iterator."""


@attrs.frozen
class Restart:
    """The consumer starts the next epoch on the same (persistent) workers."""


@attrs.frozen
class Retire:
    """A tuner retires `worker` (`Driver.retire`), between the consumer's calls."""

    worker: int


@attrs.frozen
class Add:
    """A tuner starts the retired slot `worker` again (`Driver.add`)."""

    worker: int


@attrs.frozen
class Prefetch:
    """A tuner changes the prefetch bound to `prefetch_factor` (`Driver.prefetch`)."""

    prefetch_factor: int


@attrs.frozen
class Preempt:
    """The program saves the loader's state, and goes on in a fresh loader loaded from it, with
    `workers` workers (an iterable dataset's: as many as before): a preempted job restarted
    elsewhere."""

    workers: int


@attrs.frozen
class Saved:
    """What a loader's checkpoint holds of its scheduler and driver: the epoch's progress, and
    an iterable dataset's worker marks (`(since, None)`: the world's workers keep no state, so
    a resumed worker fast-forwards over the batches of its shard handed over)."""

    progress: Progress
    marks: tuple[tuple[int, Any] | None, ...] | None


Action = (
    Next
    | Work
    | Kill
    | Late
    | Stall
    | Expire
    | Interrupt
    | SamplerRaises
    | Break
    | Close
    | Restart
    | Preempt
    | Retire
    | Add
    | Prefetch
)

_TASK = "task"
_RESUME = "resume"
_START = "start"
Item = tuple[object, ...]  # (_TASK, task, index), (_RESUME, epoch) or (_START, epoch)

# What a consumer's call ended with, as the world records it.
_BATCH, _ERROR, _END, _RETURNED = "batch", "error", "end", "returned"
_DEATH, _TIMEOUT_KIND, _SAMPLER, _EXECUTOR = "death", "timeout", "sampler", "executor"
_HANG = "hang"
_FATAL = (_DEATH, _HANG, _TIMEOUT_KIND, _EXECUTOR)


def _pid(worker: int, incarnation: int) -> int:
    """The world's process id of one incarnation of a worker: three digits, each its own."""
    return 100 * (worker + 1) + incarnation


def _stack(worker: int, incarnation: int) -> str:
    """The stack the world's executor reports of a stuck worker."""
    return f'  File "dataset.py", line 7, in __getitem__ (worker {worker}.{incarnation} stuck)\n'


@attrs.frozen(cache_hash=True)  # the explorer looks each world up once or twice
class World:
    """The driver's and scheduler's state together with everything around them. A value."""

    scenario: Scenario
    driven: DriverState
    """The driver's state between calls, and the scheduler's (`Driver.snapshot`)."""
    epoch: int
    before: int
    """The loader's epochs before this scheduler's first: a scheduler counts its own epochs,
    and one resumed from a checkpoint of epoch e starts with e (or e + 1 after its end)."""
    drawn: int
    """Indices the sampler gave out this epoch."""
    sampler_done: bool
    sampler_armed: bool
    queues: tuple[tuple[Item, ...], ...]
    outbox: tuple[Event, ...]
    """What workers reported and the driver has not polled yet, oldest first."""
    shards: tuple[tuple[int, int], ...]
    """Per worker, (epoch of its dataset iterator, batches it has yielded from it)."""
    alive: tuple[bool, ...]
    incarnations: tuple[int, ...]
    """Per worker slot, the incarnation running in it: 0, then one more for each replacement."""
    started: tuple[bool, ...]
    """Per worker slot, whether its incarnation has answered `WorkerStarted` (the first has)."""
    ghosts: tuple[tuple[Event, ...], ...]
    """Per worker slot, answers of its lost incarnations still on their way, oldest first."""
    sent: frozenset[tuple[int, int, int, object]]
    """(task, worker, incarnation, index) sent this epoch and not yet resolved."""
    numbers: frozenset[int]
    """The task numbers sent this epoch."""
    unsent: tuple[object, ...]
    """Indices the sampler gave out this epoch that were not sent yet: held for a replacement
    still starting, or on their way."""
    restarts: int
    """Lost workers the scheduler had replaced so far."""
    losses: tuple[int, ...]
    """The pids of the lost workers it replaced, in order: a failure once the restarts are spent
    names them all."""
    named: tuple[str, ...]
    """What the failure the consumer is owed must say: every loss, earlier ones included."""
    watching: bool
    """The driver's last poll watched the task the consumer waits for (it read the clock): its
    worker may be found stuck."""
    open_tasks: frozenset[tuple[int, int]]
    """(task, worker) sent this epoch and not yet resolved, as the consumer sees it."""
    answers: frozenset[tuple[int, Outcome]]
    """What workers answered for open tasks."""
    skipped: frozenset[int]
    dry: frozenset[int]
    """Workers that answered "exhausted" this epoch."""
    awaiting: bool
    """The consumer is inside `next()`, which waits on the executor."""
    resetting: bool
    """The consumer is inside `iter()`, which returns once every worker resumed."""
    delivered: tuple[Outcome, ...]
    last_task: int
    """In order: the last task handed over, or the last task of earlier epochs."""
    sent_max: int
    """The highest task number sent so far, in any epoch."""
    resumes_owed: frozenset[int]
    """Workers that have not acknowledged the resume of the current epoch."""
    outcome: str | None
    """None while in use, then "failed" or "closed"."""
    expect: str | None
    """The failure the scheduler was told of and the consumer is owed (see `_FATAL`)."""
    served: bool
    """The call in which a sampler failed had already been handed its batch."""
    told: str | None
    """The failure the consumer was given: later requests get it again (the sampler's: the end)."""
    ended: bool
    shut: bool
    broken: bool
    deaths_left: int
    hangs_left: int
    closes_left: int
    interrupts_left: int
    sampler_failures_left: int
    executor_failures_left: int
    tunes_left: int = 0
    retiring: frozenset[int] = frozenset()
    """Workers a tuner retired that were not stopped yet: sent no new task."""
    retired: frozenset[int] = frozenset()
    """Worker slots retired and stopped: sent nothing, resumed by no new epoch."""
    prefetches_left: int = 0
    prefetch: int = 0
    """The prefetch bound a tuner set last (`Prefetch`), that a send must keep within; 0 while
    none did: the configuration's."""
    lowered_from: int = 0
    """The first task number sent under the bound since a tuner last lowered it: older tasks
    were sent under a higher one and may stay over it, a lost worker's replacement being sent
    them again included (the core's `Lifecycle.lowered_at`)."""

    @classmethod
    def start(
        cls,
        scenario: Scenario,
        step: StepFunction = core_step,
        on_edge: EdgeObserver | None = None,
        begin: bool = True,
    ) -> World:
        """A fresh world whose consumer has just started the first epoch (unless not `begin`)."""
        n = scenario.config.num_workers
        # Slots that begin retired (`Config.started`, as num_workers="auto" starts a few of
        # its slots) have no worker until a tuner's add starts one: retired slots.
        running = scenario.config.running_at_start
        world = cls(
            scenario=scenario,
            driven=DriverState.initial(scenario.config),
            epoch=1,
            before=0,
            drawn=0,
            sampler_done=False,
            sampler_armed=False,
            queues=((),) * n,
            outbox=(),
            shards=((1, 0),) * n,
            alive=(True,) * running + (False,) * (n - running),
            incarnations=(0,) * n,
            started=(True,) * n,
            ghosts=((),) * n,
            sent=frozenset(),
            numbers=frozenset(),
            unsent=(),
            restarts=0,
            losses=(),
            named=(),
            watching=False,
            open_tasks=frozenset(),
            answers=frozenset(),
            skipped=frozenset(),
            dry=frozenset(),
            awaiting=False,
            resetting=True,
            delivered=(),
            last_task=-1,
            sent_max=-1,
            resumes_owed=frozenset(),
            outcome=None,
            expect=None,
            served=False,
            told=None,
            ended=False,
            shut=False,
            broken=False,
            deaths_left=scenario.deaths,
            hangs_left=scenario.hangs,
            closes_left=2 if scenario.closes else 0,
            interrupts_left=scenario.interrupts,
            sampler_failures_left=scenario.sampler_failures,
            executor_failures_left=scenario.executor_failures,
            tunes_left=scenario.tunes,
            prefetches_left=scenario.prefetches,
            retired=frozenset(range(running, n)),
        )
        if not begin:
            return world
        sim = _sim(world, step, on_edge)
        sim.call(sim.driver.start_epoch, iterating=True)
        return sim.freeze()

    @property
    def core(self) -> State:
        """The scheduler's state."""
        return self.driven.state

    def actions(self) -> Iterator[Action]:
        """Every action the environment may take now."""
        n = self.scenario.config.num_workers
        blocked = self.awaiting or self.resetting
        if self.outcome != "closed" and not blocked:
            # After the end or a failure too: asking again is answered again, as in torch.
            yield Next()
        if self.outcome is None:
            if blocked:
                # An answer given while the consumer is away would wait in the executor until
                # the driver polls, and it polls only in a wait: answering then is the same to
                # the driver and the scheduler, and keeps the space the explorer walks small.
                for w in range(n):
                    if self.alive[w] and self.queues[w]:
                        yield Work(w)
                for w in range(n):
                    if self.ghosts[w]:
                        yield Late(w)
            if self.awaiting and self.watching and self.hangs_left:
                yield Stall()
            if self.deaths_left:
                for w in range(n):
                    if self.alive[w]:
                        yield Kill(w)
            if blocked and self.scenario.timeouts:
                yield Expire()
            if blocked and self.interrupts_left:
                yield Interrupt()
            if self.sampler_failures_left and not self.sampler_armed:
                yield SamplerRaises()
            if self.executor_failures_left and not self.broken:
                yield Break()
            # iter() returns once every worker acknowledged the resume, as torch's does; only
            # an interrupted iter() leaves a reset unacknowledged when the next one comes.
            if self.tunes_left and not blocked:
                yield from self._tunings()
            if self.prefetches_left and not blocked:
                yield from self._prefetches()
            restartable = not (blocked or self.expect)
            if restartable and self.epoch < self.scenario.epochs:
                yield Restart()
        if self.closes_left and not blocked:
            yield Close()

    def _tunings(self) -> Iterator[Action]:
        """What a tuner may do now: retire a worker the scheduler would let go (running, no
        index drawn for it, another left to take tasks), or add back a retired slot."""
        core = self.core
        if self.scenario.config.iterable or core.phase not in (Phase.RUNNING, Phase.DRAINING):
            return
        workers = core.life.workers
        takers = [w for w, s in enumerate(workers) if s in (_ACTIVE, _STARTING)]
        for w, status in enumerate(workers):
            if status is _ACTIVE and core.drawing_for != w and len(takers) > 1:
                yield Retire(w)
        for w in sorted(self.retired):
            yield Add(w)

    def _prefetches(self) -> Iterator[Prefetch]:
        """The bounds a tuner may set now: one under or one over the one in force, from 1 to
        one over the configuration's, while an epoch runs or drains; not a lowering that would
        leave the worker an index is being drawn for over it (the core refuses that)."""
        core = self.core
        config = self.scenario.config
        if config.lazy or core.phase not in (Phase.RUNNING, Phase.DRAINING):
            return
        now = core.config.prefetch_factor
        drawn_for = core.drawing_for
        for bound in (now - 1, now + 1):
            if not 1 <= bound <= config.prefetch_factor + 1:
                continue
            if drawn_for is not None and core.loads[drawn_for] >= bound:
                continue
            yield Prefetch(bound)

    def apply(
        self, action: Action, step: StepFunction = core_step, on_edge: EdgeObserver | None = None
    ) -> World:
        """The world after `action`; raises `Violation` if the scheduler or driver misbehaves."""
        if isinstance(action, Preempt):
            return self.resumed(self.checkpoint(), action.workers, step, on_edge)
        sim = _sim(self, step, on_edge)
        sim.act(action)
        return sim.freeze()

    def stuck(self) -> bool:
        """A consumer waits and nothing could answer it: it would wait forever."""
        owed = bool(self.outbox) or any(
            a and q for a, q in zip(self.alive, self.queues, strict=True)
        )
        return self.outcome is None and (self.awaiting or self.resetting) and not owed

    def finished(self) -> bool:
        """The run reached an end: an epoch completed, or an error reached the consumer."""
        return self.ended or self.outcome is not None

    def checkpoint(self) -> Saved:
        """What the loader's `state_dict()` records of the epoch now, through the real driver."""
        sim = _sim(self, core_step)
        driver = sim.driver
        marks = driver.marks
        n = self.scenario.config.num_workers
        saved = Saved(
            driver.progress(), None if marks is None else tuple(marks.get(w) for w in range(n))
        )
        sim.release()
        return saved

    def resumed(
        self,
        at: Saved,
        workers: int,
        step: StepFunction = core_step,
        on_edge: EdgeObserver | None = None,
        faults: bool = True,
    ) -> World:
        """A fresh loader's world, loaded from checkpoint `at` of this one, after its `iter()`.

        It has `workers` workers (loading in the calling thread stays so for one worker) and
        the scenario's own budget of faults, or none. What the consumer was handed before the
        checkpoint stays handed over: the epoch's end then checks before and after together
        against the reference. A checkpoint of a complete epoch starts the next one, as the
        loader does.
        """
        scenario = self.scenario
        spec = scenario.dataset
        old = scenario.config
        if isinstance(spec, IterableSpec) and workers != old.num_workers:
            raise ValueError(
                f"an iterable dataset resumes with its {old.num_workers} workers, not {workers}"
            )
        config = attrs.evolve(old, num_workers=workers, lazy=old.lazy and workers == 1)
        scenario = attrs.evolve(scenario, config=config)
        if not faults:
            scenario = attrs.evolve(
                scenario,
                deaths=0,
                hangs=0,
                timeouts=False,
                closes=False,
                interrupts=0,
                sampler_failures=0,
                executor_failures=0,
            )
        progress = at.progress
        complete = progress.complete(spec.batches if isinstance(spec, MapSpec) else None)
        epoch = self.epoch + 1 if complete else self.epoch
        marks = {}
        if at.marks is not None and not complete:
            marks = {w: mark for w, mark in enumerate(at.marks) if mark is not None}
        fresh = World.start(scenario, step, on_edge, begin=False)
        fresh = attrs.evolve(
            fresh,
            epoch=epoch,
            before=epoch - 1,
            drawn=0 if complete else progress.done,
            delivered=() if complete else self.delivered,
            # A worker restores its part of the dataset from its mark, as `WorkerRuntime` does.
            shards=tuple((epoch, marks[w][0] if w in marks else 0) for w in range(workers)),
        )
        sim = _sim(fresh, step, on_edge)
        resume = None if complete else progress
        sim.call(lambda: sim.driver.start_epoch(resume=resume, marks=marks), iterating=True)
        return sim.freeze()


_FIELDS = tuple(a.name for a in attrs.fields(World))
_FIELDS_OF = operator.attrgetter(*_FIELDS)
"""A world's (or a `_Sim`'s) fields, in `World`'s order: what `World(*...)` takes."""
_ACTIVE = WorkerStatus.ACTIVE
_STARTING = WorkerStatus.STARTING
_CAPABLE = Capabilities(replaces_workers=True, kills_stuck_workers=True)
_CAPABLE_UNKILLABLE = Capabilities(replaces_workers=True)


class _Sim:
    """A mutable copy of a World for one action: the driver's executor and sampler, and the
    consumer that calls the driver. Built once for a scenario, step and edge observer, and
    `load`ed with each world that takes an action (`_sim`): building the driver and the copy for
    each action was a third of the explorer's time."""

    def __init__(
        self, scenario: Scenario, step: StepFunction, on_edge: EdgeObserver | None
    ) -> None:
        self.scenario = scenario
        self.step = step
        self.on_edge = on_edge
        # As the real executors do: it replaces lost workers, and kills stuck ones if it can.
        # Declared only where workers may be replaced or found stuck: the driver then looks up
        # the methods that take part in that, which the other scenarios can do without.
        if scenario.config.restarts or scenario.hangs or scenario.tunes:
            self.capabilities = _CAPABLE if scenario.killable else _CAPABLE_UNKILLABLE
        # No flight recorder: each action restores the world's state into the driver, so a
        # recording would start from a state it never saw.
        self.driver = Driver(
            scenario.config,
            self,
            self.draw,
            _TIMEOUT,
            step=self.checked_step,
            worker_timeout=_WORKER_TIMEOUT if scenario.hangs else 0,
            clock=self.clock,
        )
        # The real driver, put back as new (`restorer`) with the world's state before each
        # action: what one action's calls left in it cannot reach the next.
        self._restore_driver = restorer(self.driver)

    def load(self, world: World) -> _Sim:
        """This copy, holding `world` as a new one would: its fields, nothing of an earlier
        action, and the driver restored to the world's state."""
        vars(self).update(zip(_FIELDS, _FIELDS_OF(world), strict=True))
        self.violation: Violation | None = None
        self.poll_with: str | None = None
        """What the next poll does instead of reporting: "expire" or "interrupt"."""
        self.handed_in_call = False
        self.in_hand: tuple[int, int] | None = None
        """(task, worker) the scheduler handed over in this call: the consumer's, not a load."""
        self.resumed: set[int] = set()
        self.now = 0.0
        """The world's clock, which the driver times its watch for stuck workers with: it moves
        only when a wait runs out (`Expire`, `Stall`)."""
        self.timed = False
        """The driver read the clock since the last poll: it watches the task the consumer
        waits for (whom it watches is its own decision, never worked out here)."""
        self.stuck_worker: int | None = None
        """The worker the driver found stuck in this action, asked for its stack."""
        self._restore_driver(self.driven)
        return self

    def freeze(self) -> World:
        """The world this action left; this copy goes back to be loaded again."""
        self.driven = self.driver.snapshot()
        world = World(*_FIELDS_OF(self))
        self.release()
        return world

    def release(self) -> None:
        """Done with: the next action of a world of this scenario may load this copy."""
        key = (self.scenario, self.step, self.on_edge)
        spare = _SPARE.get(key)
        if spare is None:
            if len(_SPARE) >= _SPARE_KEYS:
                _SPARE.clear()  # the scenarios of explorations over and done with
            spare = _SPARE[key] = []
        spare.append(self)

    def clock(self) -> float:
        self.timed = True
        return self.now

    # These annotations let mypy see the fields copied from World.
    scenario: Scenario
    driven: DriverState
    epoch: int
    before: int
    drawn: int
    sampler_done: bool
    sampler_armed: bool
    queues: tuple[tuple[Item, ...], ...]
    outbox: tuple[Event, ...]
    shards: tuple[tuple[int, int], ...]
    alive: tuple[bool, ...]
    incarnations: tuple[int, ...]
    started: tuple[bool, ...]
    ghosts: tuple[tuple[Event, ...], ...]
    sent: frozenset[tuple[int, int, int, object]]
    numbers: frozenset[int]
    unsent: tuple[object, ...]
    restarts: int
    losses: tuple[int, ...]
    named: tuple[str, ...]
    watching: bool
    open_tasks: frozenset[tuple[int, int]]
    answers: frozenset[tuple[int, Outcome]]
    skipped: frozenset[int]
    dry: frozenset[int]
    awaiting: bool
    resetting: bool
    delivered: tuple[Outcome, ...]
    last_task: int
    sent_max: int
    resumes_owed: frozenset[int]
    outcome: str | None
    expect: str | None
    served: bool
    told: str | None
    ended: bool
    shut: bool
    broken: bool
    deaths_left: int
    hangs_left: int
    closes_left: int
    interrupts_left: int
    sampler_failures_left: int
    executor_failures_left: int
    tunes_left: int
    retiring: frozenset[int]
    retired: frozenset[int]
    prefetches_left: int
    prefetch: int
    lowered_from: int

    def _violate(self, message: str) -> Violation:
        # Kept, because the driver takes an exception from its executor for the executor's own
        # failure: the world raises it again once the driver's call is over.
        violation = Violation(message)
        if self.violation is None:
            self.violation = violation
        return violation

    # --- the scheduler, as the driver calls it -------------------------------------------------

    def checked_step(self, before: State, event: Event) -> Transition:
        if type(event) is ExecutorFailed and type(event.error) is Blocked:
            raise event.error
        self._raise_violation()  # one the driver took for an executor failure
        try:
            transition = self.step(before, event)
        except ProtocolError as error:
            raise self._violate(f"the scheduler refused {event!r}: {error}") from error
        after = transition.state
        allowed = EDGES[before.phase].get(type(event), frozenset())
        if after.phase not in allowed:
            raise self._violate(
                f"{event!r} moved {before.phase!r} to {after.phase!r}, "
                "an edge the transition table does not have"
            )
        if self.on_edge is not None:
            self.on_edge(before.phase, type(event), after.phase)
        broken = violations(after)
        if broken:
            raise self._violate(f"after {event!r}: " + "; ".join(broken))
        kind = type(event)
        late = before.phase in (Phase.FAILED, Phase.CLOSED)
        if kind is WorkerDied or kind is WorkerStuck:
            self._lost(event, transition, late)  # type: ignore[arg-type]
        elif kind is TimedOut:
            self._owe(_TIMEOUT_KIND)
        elif kind is SamplerFailed:
            self._owe(_SAMPLER)
            self.served = self.handed_in_call
        elif kind is ExecutorFailed:
            self._owe(_EXECUTOR)
        elif kind is WorkerExhausted:
            # Known to the scheduler from now on: no task may go to the worker any more.
            task, w = event.task, event.worker  # type: ignore[attr-defined]
            current = event.incarnation == self.incarnations[w]  # type: ignore[attr-defined]
            if current and (task, w) in self.open_tasks:
                self.open_tasks = self.open_tasks - {(task, w)}
                self.skipped = self.skipped | {task}
                self.dry = self.dry | {w}
        for command in transition.commands:
            handed = handed_task(command)
            if handed is not None:
                self.in_hand = handed
                self.handed_in_call = True
            elif type(command) is ReplaceWorker:
                if type(event) is AddRequested:
                    # A retired slot started again: only a tuner's add does that, and it spends
                    # no restart.
                    if command.worker not in self.retired:
                        raise self._violate(f"{command!r} starts a slot that was not retired")
                    continue
                if self.restarts >= self.scenario.config.restarts:
                    raise self._violate(
                        f"{command!r} after {self.restarts} restart(s), more than the "
                        f"{self.scenario.config.restarts} allowed"
                    )
                self.restarts += 1
        return transition

    def _lost(self, event: WorkerDied | WorkerStuck, transition: Transition, late: bool) -> None:
        """A worker's death or hang reached the scheduler: if it is news of the running
        incarnation, it is a loss, replaced while restarts are left (and, if stuck, while it can
        be killed), else the loader's failure, naming every loss."""
        w = event.worker
        if late or event.incarnation != self.incarnations[w]:
            return  # after everything stopped, or late news of an incarnation already lost
        if w in self.retired:
            return  # died once retired and stopped, holding nothing: nothing is lost
        config = self.scenario.config
        stuck = type(event) is WorkerStuck
        if stuck and (_TASK, event.task) not in {item[:2] for item in self.queues[w]}:  # type: ignore[union-attr]
            raise self._violate(f"{event!r}, but worker {w} answered that task or never had it")
        replaceable = self.restarts < config.restarts and (not stuck or self.scenario.killable)
        replaced = any(type(c) is ReplaceWorker for c in transition.commands)
        if replaceable and not replaced:
            raise self._violate(
                f"worker {w} was lost ({event!r}) with {config.restarts - self.restarts} "
                "restart(s) left, and not replaced"
            )
        pid = _pid(w, event.incarnation)
        if replaced:
            self.losses = self.losses + (pid,)
            return
        kind = _HANG if stuck else _DEATH
        if self._owe(kind):
            named = [f"pid {p}" for p in (*self.losses, pid)]
            if stuck:
                named.append(_stack(w, event.incarnation).rstrip())
            self.named = tuple(named)

    def _owe(self, kind: str) -> bool:
        # The executor failing is raised in the call that met it, ahead of anything else owed.
        if kind == _EXECUTOR or (self.expect is None and self.told not in _FATAL):
            self.expect = kind
            self.named = ()
            return True
        return False

    # --- the executor, as the driver calls it --------------------------------------------------

    def _check_working(self) -> None:
        if self.broken:
            raise _ExecutorError("the executor's pipe is broken")
        if self.shut:
            raise self._violate("the executor was used after its shutdown")

    def start(self) -> None:  # pragma: no cover - the world's workers start with it
        pass

    def dispatch(self, command: SendTask) -> None:
        self._check_working()
        w = command.worker
        if self.outcome is not None:
            raise self._violate(f"{command!r} after the loader {self.outcome}")
        if self.resumes_owed:
            raise self._violate(f"{command!r} before workers {sorted(self.resumes_owed)} resumed")
        if w in self.dry:
            raise self._violate(f"{command!r} sent to worker {w}, which had run dry")
        if not self.alive[w] and not self._death_unreported(w):
            raise self._violate(f"{command!r} sent to worker {w}, which is not running")
        incarnation = self.incarnations[w]
        if not self.started[w]:
            raise self._violate(
                f"{command!r} sent to worker {w}'s incarnation {incarnation}, which has not "
                "answered that it started"
            )
        task, index = command.task, command.index
        if (task, w) in self.open_tasks:
            # Sent again: only to the replacement of the incarnation it was sent to.
            earlier = [i for t, v, i, _ in self.sent if (t, v) == (task, w)]
            if incarnation in earlier:
                raise self._violate(
                    f"{command!r} sent twice to worker {w}'s incarnation {incarnation}: its "
                    "batch would be delivered twice"
                )
            if (task, w, max(earlier), index) not in self.sent:
                raise self._violate(f"{command!r} sent again with another index")
        else:
            if w in self.retiring:
                raise self._violate(f"{command!r}: a new task sent to retiring worker {w}")
            others = sorted(v for t, v in self.open_tasks if t == task)
            if others:
                raise self._violate(
                    f"{command!r} sent to worker {w} while worker {others[0]} holds it: its "
                    "batch would be delivered twice"
                )
            if task in self.numbers or task <= self.last_task:
                raise self._violate(f"{command!r} reuses or goes back on a task number")
            if index not in self.unsent:
                raise self._violate(
                    f"{command!r} does not carry an index drawn and not sent yet: "
                    f"{list(self.unsent)}"
                )
            at = self.unsent.index(index)
            self.unsent = self.unsent[:at] + self.unsent[at + 1 :]
            self.numbers = self.numbers | {task}
            self.sent_max = max(self.sent_max, task)
        self.sent = self.sent | {(task, w, incarnation, index)}
        self.open_tasks = self.open_tasks | {(command.task, w)}
        held = sum(
            1
            for t in self.open_tasks
            if t[1] == w and t != self.in_hand and t[0] >= self.lowered_from
        )
        limit = self.prefetch or self.scenario.config.prefetch_factor
        if held > limit:
            raise self._violate(f"worker {w} holds {held} unresolved tasks, over prefetch {limit}")
        self._enqueue(w, (_TASK, command.task, command.index))

    def resume(self, command: ResumeWorker) -> None:
        self._check_working()
        if self.before + command.epoch != self.epoch:
            raise self._violate(
                f"{command!r} names the wrong epoch, not {self.epoch - self.before} (the "
                f"scheduler's count, which begins after the loader's first {self.before})"
            )
        self._enqueue(command.worker, (_RESUME, command.epoch))
        self.resumes_owed = self.resumes_owed | {command.worker}
        self.resumed.add(command.worker)

    def replace(self, command: ReplaceWorker, mark: Standing) -> None:
        self._check_working()
        w = command.worker
        incarnation = self.incarnations[w]
        if command.incarnation != incarnation + 1:
            raise self._violate(
                f"{command!r} does not number the incarnation after {incarnation}, the one lost"
            )
        if self.before + command.epoch != self.epoch:
            raise self._violate(f"{command!r} names the wrong epoch")
        if self.stuck_worker == w:
            if not self.scenario.killable:
                raise self._violate(f"{command!r} replaces a stuck worker that cannot be killed")
            # Ended by the replacement (the executor kills it): the news of its death comes late.
            self.stuck_worker = None
            self.alive = _replace(self.alive, w, False)
            self.queues = _replace(self.queues, w, ())
            death = WorkerDied(w, _pid(w, incarnation), -9, incarnation=incarnation)
            self.ghosts = _replace(self.ghosts, w, self.ghosts[w] + (death,))
        elif self.alive[w]:
            raise self._violate(f"{command!r} replaces worker {w}, which was not lost")
        # A retiring worker lost is replaced as a running one (its retirement lapses); a
        # retired slot is started again.
        self.retiring = self.retiring - {w}
        self.retired = self.retired - {w}
        self.incarnations = _replace(self.incarnations, w, command.incarnation)
        self.started = _replace(self.started, w, False)
        # Set up for the epoch it starts in, it owes no resume; it is sent nothing before it has
        # started (`dispatch`), and it finds out for itself whether its part has run dry.
        self.resumes_owed = self.resumes_owed - {w}
        self.dry = self.dry - {w}
        self.alive = _replace(self.alive, w, True)
        self.queues = _replace(self.queues, w, ((_START, command.epoch),))
        # Set up as the lost one was: an iterable worker's part restored to `mark`, where the
        # last answer the main process recorded from it left it. This world's parts keep no
        # state from one epoch to the next: of a `Carried`, only this epoch's mark counts.
        if isinstance(mark, RanDry):
            mark = mark.standing
        if isinstance(mark, Carried):
            mark = mark.mark
        since = 0 if mark is None else mark[0]
        self.shards = _replace(self.shards, w, (self.before + command.epoch, since))

    def report(self, worker: int) -> WorkerReport:
        w = worker
        incarnation = self.incarnations[w]
        held = any(item[0] == _TASK for item in self.queues[w])
        if not (self.alive[w] and self.started[w] and held):
            raise self._violate(
                f"worker {w} was reported stuck, but it holds no task it has not answered"
            )
        self.stuck_worker = w
        return WorkerReport(pid=_pid(w, incarnation), stack=_stack(w, incarnation))

    def poll(self, timeout: float | None) -> Event | None:
        self._check_working()
        self.watching, self.timed = self.timed, False
        what, self.poll_with = self.poll_with, None
        if what == "interrupt":
            raise KeyboardInterrupt
        if what == "expire":
            self.now += _TIMEOUT
            return None
        if what == "stall":
            self.now += _WORKER_TIMEOUT
            return None
        if not self.outbox:
            raise Blocked
        event, self.outbox = self.outbox[0], self.outbox[1:]
        return event

    def stop_worker(self, worker: int) -> None:
        self._check_working()
        if self.driver.state.phase is Phase.FINISHED and (self.open_tasks or not self.awaiting):
            # A normal end stops the workers in the request it answers with EndEpoch, so
            # never before the last batch was handed over, nor along with it.
            raise self._violate(
                f"worker {worker} was stopped before the consumer asked past the last batch"
            )
        if worker in self.retiring:
            held = [item for item in self.queues[worker] if item[0] == _TASK]
            live = self.driver.state.phase in (Phase.RUNNING, Phase.DRAINING)
            if held and live:
                raise self._violate(f"retiring worker {worker} was stopped holding {held}")
            self.retiring = self.retiring - {worker}
            self.retired = self.retired | {worker}
        self.alive = _replace(self.alive, worker, False)
        self.queues = _replace(self.queues, worker, ())

    def shutdown(self) -> None:
        self._check_working()
        if any(self.alive):
            raise self._violate("Shutdown was emitted while workers were left running")
        self.shut = True
        # What stopped workers still had to say is dropped with the queues.
        self.outbox = ()
        self.ghosts = ((),) * len(self.ghosts)

    # --- the sampler, as the driver calls it ---------------------------------------------------

    def draw(self, state: State) -> object:
        if self.sampler_armed:
            self.sampler_armed = False
            raise _SamplerError("the sampler raised")
        spec = self.scenario.dataset
        if isinstance(spec, MapSpec):
            if self.drawn >= spec.batches:
                self.sampler_done = True
                raise StopIteration
            index: object = (self.epoch, self.drawn)
            self.drawn += 1
        else:
            index = None  # torch's sampler for iterable datasets yields None forever
        self.unsent = self.unsent + (index,)
        return index

    def _death_unreported(self, worker: int) -> bool:
        # A worker may die after the driver polled last: work sent to it then is lost with it,
        # and its death, still to be polled, fails the loader.
        incarnation = self.incarnations[worker]
        return any(
            type(e) is WorkerDied and e.worker == worker and e.incarnation == incarnation
            for e in self.outbox
        )

    def _enqueue(self, worker: int, item: Item) -> None:
        if self.alive[worker]:
            self.queues = _replace(self.queues, worker, self.queues[worker] + (item,))

    # --- the consumer's calls ------------------------------------------------------------------

    def call(self, run: Callable[[], Any], iterating: bool = False) -> None:
        """Run a consumer's call on the driver (or go on with one) and check what it gave."""
        self.handed_in_call = False
        if iterating:
            self.resetting = True
        else:
            self.awaiting = True
        try:
            value = run()
        except Blocked:
            self._raise_violation()
            if self.expect in _FATAL:
                raise Violation(
                    f"the consumer still waits after the {self.expect} was reported"
                ) from None
            return
        except StopIteration:
            result: tuple[Any, ...] = (_END,)
        except _TaskError as error:
            result = (_ERROR, error.task, error.worker, ("error", error.value), error.late)
        except WorkerDiedError as error:
            result = (_DEATH, str(error))
        except WorkerHungError as error:
            result = (_HANG, str(error))
        except LoaderTimeoutError:
            result = (_TIMEOUT_KIND,)
        except _SamplerError:
            result = (_SAMPLER,)
        except _ExecutorError:
            result = (_EXECUTOR,)
        except LoaderCancelledError:
            raise Violation("a consumer's own call was cancelled") from None
        except InternalError as error:
            raise Violation(f"the driver failed: {error}") from error
        else:
            if iterating:
                result = (_RETURNED,)
            else:
                task, worker, outcome, late = value
                result = (_BATCH, task, worker, outcome, late)
        self._raise_violation()
        self.awaiting = False
        self.resetting = False
        self._receive(result, iterating)
        if self.driver.state.phase is Phase.FINISHED and not self.ended and self.outcome is None:
            # As in torch, an epoch ends only in the request that finds it over, and says so.
            raise Violation("the epoch finished without telling the consumer")

    def _raise_violation(self) -> None:
        if self.violation is not None:
            raise self.violation

    def _go_on(self) -> Any:
        """The rest of a call that waited, in `next()` or in `iter()`."""
        return self.driver.go_on(in_next=self.awaiting)

    def _go_on_if_waiting(self) -> None:
        if (self.awaiting or self.resetting) and (self.outbox or self.poll_with or self.broken):
            self.call(self._go_on, iterating=self.resetting)

    def _receive(self, result: tuple[Any, ...], iterating: bool) -> None:
        kind = result[0]
        told = self.told
        if told is not None:
            # After a failure reached the consumer: the same again, or after the sampler's, the end.
            wanted = _END if told == _SAMPLER else told
            if kind != wanted:
                raise Violation(
                    f"after the {told} was raised, a request gave {result[:1]}, not {wanted}"
                )
            return
        expect = self.expect
        in_hand, self.in_hand = self.in_hand, None
        if kind in (_BATCH, _ERROR):
            if (result[1], result[2]) != in_hand:
                raise Violation(
                    f"the consumer got task {result[1]}, but the scheduler handed over {in_hand}"
                )
            if expect in _FATAL or (expect == _SAMPLER and not self.served):
                raise Violation(f"a batch was handed over although the {expect} was due")
            self.served = False  # the sampler's error comes with the next request
            if result[4]:
                raise Violation(
                    f"task {result[1]} was handed over with an answer worker {result[2]}'s lost "
                    "incarnation sent after its loss was reported"
                )
            self._hand_over(result[1], result[2], result[3])
            return
        if in_hand is not None and kind != _EXECUTOR:
            # Only the executor failing takes the place of what the call was to return.
            raise Violation(f"task {in_hand[0]} was handed over, and the consumer got {kind}")
        if kind == _RETURNED:
            if expect is not None:
                raise Violation(f"iter() returned although the {expect} was due")
            if self.resumes_owed:
                raise Violation(
                    f"iter() returned with workers {sorted(self.resumes_owed)} owing their resume"
                )
            return
        if kind == _END:
            if expect is not None:
                raise Violation(f"the epoch ended although the {expect} was due")
            self._end_epoch()
            return
        if kind != expect:
            raise Violation(
                f"the consumer got a {kind} error although {expect or 'nothing'} failed"
            )
        for name in self.named:
            if name not in result[1]:
                raise Violation(
                    f"the {kind} error does not name {name!r}, one of the losses that spent "
                    f"the restarts: {result[1]!r}"
                )
        self.told, self.expect, self.named = kind, None, ()
        self.outcome = "failed"
        if not self.shut and not self.broken:
            raise Violation(f"the {kind} was raised but the workers were not shut down")

    def _hand_over(self, task: int, worker: int, outcome: Outcome) -> None:
        if (task, worker) not in self.open_tasks:
            raise Violation(f"task {task} was handed over but is not an open task of this epoch")
        if (task, outcome) not in self.answers:
            raise Violation(f"task {task} was handed over with something its worker never gave")
        if self.scenario.config.in_order:
            if task <= self.last_task:
                raise Violation(f"task {task} was handed over after task {self.last_task}")
            for earlier in range(self.last_task + 1, task):
                if earlier not in self.skipped:
                    raise Violation(f"task {task} was handed over before task {earlier}")
            self.last_task = task
        self.open_tasks = self.open_tasks - {(task, worker)}
        self.answers = self.answers - {(task, outcome)}
        self.delivered = self.delivered + (outcome,)

    def _end_epoch(self) -> None:
        if self.ended:
            return  # asking again after the end is told again, as in torch
        if self.driver.state.phase is not Phase.FINISHED:
            raise Violation(
                f"the epoch was ended while the scheduler is {self.driver.state.phase.value}"
            )
        if self.open_tasks:
            raise Violation(f"the epoch was ended with tasks unresolved: {sorted(self.open_tasks)}")
        spec = self.scenario.dataset
        if isinstance(spec, MapSpec) and not self.sampler_done:
            raise Violation("the epoch was ended before the sampler ran out")
        expected = list(expected_epoch(spec, self.epoch))
        got = list(self.delivered)
        if not self.scenario.config.in_order:
            expected.sort(key=repr)
            got.sort(key=repr)
        if got != expected:
            raise Violation(f"the epoch handed over {got}, the reference model says {expected}")
        self.ended = True

    # --- the environment's moves ---------------------------------------------------------------

    def act(self, action: Action) -> None:
        if isinstance(action, Next):
            self.call(self.driver.next)
        elif isinstance(action, Work):
            self._work(action.worker)
        elif isinstance(action, Kill):
            self._kill(action.worker)
        elif isinstance(action, Late):
            self._late(action.worker)
        elif isinstance(action, Stall):
            self.hangs_left -= 1
            self.poll_with = "stall"
        elif isinstance(action, Expire):
            self.poll_with = "expire"
        elif isinstance(action, Interrupt):
            self.interrupts_left -= 1
            self.poll_with = "interrupt"
            self._interrupt()
            return
        elif isinstance(action, SamplerRaises):
            self.sampler_failures_left -= 1
            self.sampler_armed = True
        elif isinstance(action, Break):
            self.executor_failures_left -= 1
            self.broken = True
        elif isinstance(action, Close):
            self._close()
            return
        elif isinstance(action, Restart):
            self._restart()
            return
        elif isinstance(action, Retire):
            self.tunes_left -= 1
            self.retiring = self.retiring | {action.worker}
            self.driver.retire(action.worker)
            self._raise_violation()
            return
        elif isinstance(action, Add):
            self.tunes_left -= 1
            self.driver.add(action.worker)
            self._raise_violation()
            return
        elif isinstance(action, Prefetch):
            # Lowered, nothing sent is cancelled (every batch is still delivered once, as the
            # end of the epoch checks), and no send may go over it from now on (`send`).
            self.prefetches_left -= 1
            if action.prefetch_factor < (self.prefetch or self.scenario.config.prefetch_factor):
                self.lowered_from = self.sent_max + 1
            self.prefetch = action.prefetch_factor
            self.driver.prefetch(action.prefetch_factor)
            self._raise_violation()
            return
        else:  # pragma: no cover
            raise TypeError(f"unknown action {action!r}")
        self._go_on_if_waiting()

    def _work(self, w: int) -> None:
        head, *rest = self.queues[w]
        self.queues = _replace(self.queues, w, tuple(rest))
        event, shard, outcome = self._answer(w, self.incarnations[w], head, self.shards[w])
        self.shards = _replace(self.shards, w, shard)
        kind = type(event)
        if kind is WorkerResumed:
            if self.before + head[1] == self.epoch:  # type: ignore[operator]
                self.resumes_owed = self.resumes_owed - {w}  # not a reset abandoned since
        elif kind is WorkerStarted:
            self.started = _replace(self.started, w, True)
            if self.before + head[1] == self.epoch:  # type: ignore[operator]
                # One lost while resuming: its replacement is set up for the epoch it starts in.
                self.resumes_owed = self.resumes_owed - {w}
        elif outcome is not None and (head[1], w) in self.open_tasks:
            self.answers = self.answers | {(head[1], outcome)}  # type: ignore[arg-type]
        self.outbox = self.outbox + (event,)

    def _answer(
        self, w: int, incarnation: int, item: Item, shard: tuple[int, int], late: bool = False
    ) -> tuple[Event, tuple[int, int], Outcome | None]:
        """What incarnation `incarnation` of worker `w`, its part of an iterable dataset at
        `shard`, answers to `item`; where its part stands after; the task's outcome, if any.
        `late`: it is lost, and the answer arrives after its loss was reported."""
        if item[0] == _RESUME:
            epoch = item[1]
            assert isinstance(epoch, int)
            return WorkerResumed(w, epoch, incarnation), (self.before + epoch, 0), None
        if item[0] == _START:
            return WorkerStarted(w, incarnation), shard, None
        _, task, index = item
        assert isinstance(task, int)
        spec = self.scenario.dataset
        if isinstance(spec, MapSpec):
            assert isinstance(index, tuple)
            epoch_of_index, position = index
            outcome: Outcome | None = map_batch(spec, epoch_of_index, position)
        else:
            shard_epoch, k = shard
            outcome = iterable_batch(spec, w, shard_epoch, k)
            if outcome is not None:
                shard = (shard_epoch, k + 1)
        if outcome is None:
            return WorkerExhausted(task, w, incarnation), shard, None
        kind, value = outcome
        # An iterable worker's mark: the batches of its shard yielded so far this epoch.
        mark = None if isinstance(spec, MapSpec) else (shard[1], None)
        event: Event
        if kind == "data":
            event = TaskCompleted(task, w, (task, w, outcome, late), mark, incarnation=incarnation)
        else:
            error = _TaskError(task, w, value, late)
            event = TaskFailed(task, w, error, mark, incarnation=incarnation)
        return event, shard, outcome

    def _kill(self, w: int) -> None:
        """Worker `w`'s running incarnation dies. What it was given and had not answered may
        still come, late (`Late`): it may have sent the answers just before it died."""
        incarnation = self.incarnations[w]
        shard, ghosts = self.shards[w], []
        for item in self.queues[w]:
            event, shard, _ = self._answer(w, incarnation, item, shard, late=True)
            ghosts.append(event)
        self.ghosts = _replace(self.ghosts, w, self.ghosts[w] + tuple(ghosts))
        self.alive = _replace(self.alive, w, False)
        self.queues = _replace(self.queues, w, ())
        self.deaths_left -= 1
        death = WorkerDied(w, pid=_pid(w, incarnation), exitcode=-9, incarnation=incarnation)
        self.outbox = self.outbox + (death,)

    def _late(self, w: int) -> None:
        head, *rest = self.ghosts[w]
        self.ghosts = _replace(self.ghosts, w, tuple(rest))
        self.outbox = self.outbox + (head,)

    def _interrupt(self) -> None:
        # The consumer is back in its own code: in the middle of the epoch, or before it, if
        # iter() was interrupted; either way it may ask again, or start the next epoch.
        before = self.driver.state
        iterating = self.resetting
        try:
            self._go_on()
        except KeyboardInterrupt:
            pass
        except Blocked:  # pragma: no cover - the poll raises the interrupt first
            raise Violation("the interrupt did not reach the driver's wait") from None
        else:
            raise Violation("the interrupted call went on as if nothing happened")
        self._raise_violation()
        self.awaiting = self.resetting = False
        after = self.driver.state
        if after.waiting or after.life.resetting:
            raise Violation(
                f"the scheduler waits on after {'iter()' if iterating else 'next()'} was cut short"
            )
        if self.driver.snapshot().todo or after.window != before.window:
            raise Violation("an interrupted wait changed what was owed")

    def _close(self) -> None:
        again = self.driver.state.phase is Phase.CLOSED
        self.closes_left -= 1
        shut_before = self.shut
        try:
            self.driver.close()
        except _ExecutorError:
            if not self.broken:
                raise Violation("close raised an executor failure that did not happen") from None
        self._raise_violation()
        if again and self.shut != shut_before:
            raise Violation("a second close shut the workers down again")
        if not self.shut and not self.broken:
            raise Violation("close did not shut the workers down")
        self.outcome = "closed"
        self.expect = None

    def _restart(self) -> None:
        self.epoch += 1
        self.drawn = 0
        self.sampler_done = False
        self.open_tasks = frozenset()
        self.answers = frozenset()
        self.skipped = frozenset()
        self.dry = frozenset()
        self.delivered = ()
        # The epoch left behind numbered its tasks up to the scheduler's send_idx, held ones
        # too (those owed to a replacement that had not started): never sent, never handed over.
        self.last_task = max(self.sent_max, self.driver.state.send_idx - 1)
        self.sent = frozenset()
        self.numbers = frozenset()
        self.unsent = ()
        self.ended = False
        self.call(lambda: self.driver.start_epoch(seed=self.epoch), iterating=True)
        everyone = set(range(self.scenario.config.num_workers)) - self.retired
        if not self.broken and self.resumed != everyone:
            raise Violation(f"a new epoch resumed workers {sorted(self.resumed)}, not every worker")


_SPARE: dict[tuple[Scenario, StepFunction, EdgeObserver | None], list[_Sim]] = {}
"""Copies done with, by scenario, step and edge observer, to be loaded again (`_sim`)."""
_SPARE_KEYS = 64


def _sim(world: World, step: StepFunction, on_edge: EdgeObserver | None = None) -> _Sim:
    """A `_Sim` of `world`: one done with for its scenario, step and observer if there is one.
    One in use is never handed out (an action that fails keeps its copy: it is dropped)."""
    spare = _SPARE.get((world.scenario, step, on_edge))
    sim = spare.pop() if spare else _Sim(world.scenario, step, on_edge)
    return sim.load(world)


def _replace(values: tuple, index: int, value: object) -> tuple:  # type: ignore[type-arg]
    return values[:index] + (value,) + values[index + 1 :]


def run_to_end(
    world: World, step: StepFunction = core_step, on_edge: EdgeObserver | None = None
) -> World:
    """Drive `world` to the end of its epoch the plain way: the consumer asks, and the lowest
    worker with work answers while it waits. Raises `Violation` on the way, as `apply` does."""
    while not world.ended:
        if world.outcome is not None:
            raise Violation(f"a run without faults {world.outcome}")
        if world.stuck():
            raise Violation("deadlock: a consumer waits and no worker owes an answer")
        if world.awaiting or world.resetting:
            action: Action = next(a for a in world.actions() if type(a) is Work)
        else:
            action = Next()
        world = world.apply(action, step, on_edge)
    return world


def check_checkpoint(
    world: World,
    workers: int,
    step: StepFunction = core_step,
    on_edge: EdgeObserver | None = None,
) -> None:
    """A checkpoint of `world`, resumed with `workers` workers, loses and repeats nothing.

    The resumed run goes to the end of its epoch, which must then have handed over exactly the
    reference epoch, before and after the checkpoint together (in order, or the same batches).
    An epoch the consumer was told had ended checkpoints as complete, and resumes as the next
    epoch, in full.
    """
    spec = world.scenario.dataset
    at = world.checkpoint()
    if world.ended and not at.progress.complete(
        spec.batches if isinstance(spec, MapSpec) else None
    ):
        raise Violation(
            f"after the epoch ended the checkpoint says {at!r}: a resumed loader would not "
            "start the next epoch"
        )
    run_to_end(world.resumed(at, workers, step, on_edge, faults=False), step, on_edge)
