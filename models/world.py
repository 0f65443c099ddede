"""A simulated world around the scheduler: a sampler, workers, and a consumer, all in memory.

The world drives the core exactly as a driver loop would (it answers `PullIndex` at once, queues
tasks per worker, hands batches to the consumer) but lets the caller choose what happens next:
which worker answers, when the consumer asks, when a worker dies, when a wait times out or is
interrupted (Ctrl-C), when the consumer closes or starts a new epoch. The Hypothesis machines
pick those choices at random (`statecore.models.machines`); the explorer tries every one
(`statecore.models.explorer`).

Workers behave like our executors promise: each answers its tasks first in, first out, answers
every task exactly once (a dry iterable worker answers "exhausted"), and answers a resume after
every task sent before it.

Every action is checked. `World.apply` raises `Violation` when the core refuses an event,
breaks its own invariants (`statecore.violations`), moves along an edge missing from the
transition table, or does something the consumer or the workers can see is wrong: a batch out
of order or from an earlier epoch, a task for a dry worker, more tasks than the prefetch bound,
a task before every resume was acknowledged, an epoch that does not match the reference model,
an epoch finished (or its workers stopped) other than by the request told that it ended, work
after shutdown, or a consumer left waiting with nothing that could answer it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs

from statecore import (
    TRANSITIONS,
    Cancelled,
    CloseRequested,
    Command,
    Config,
    Deliver,
    EndEpoch,
    Event,
    IndexDrawn,
    Interrupted,
    NextRequested,
    Phase,
    ProtocolError,
    PullIndex,
    RaiseError,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    SendTask,
    Shutdown,
    State,
    StopWorker,
    TaskCompleted,
    TaskFailed,
    TaskFailure,
    TimedOut,
    Timeout,
    Transition,
    WorkerDeath,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
    initial_state,
    violations,
)
from statecore import step as core_step
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
    "Close",
    "Expire",
    "Interrupt",
    "Kill",
    "Next",
    "Restart",
    "Scenario",
    "EdgeObserver",
    "StepFunction",
    "Violation",
    "Work",
    "World",
]

StepFunction = Callable[[State, Event], Transition]
EdgeObserver = Callable[[Phase, type, Phase], None]
"""Called with (phase before, event type, phase after) for every event fed to the scheduler."""


class Violation(AssertionError):
    """The scheduler did something a correct scheduler never does."""


@attrs.frozen
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
    """`worker` dies (SIGKILL)."""

    worker: int


@attrs.frozen
class Expire:
    """The waiting consumer's timeout runs out."""


@attrs.frozen
class Interrupt:
    """The consumer's wait, in `next()` or in `iter()`, is cut short (Ctrl-C)."""


@attrs.frozen
class Close:
    """The consumer closes the iterator."""


@attrs.frozen
class Restart:
    """The consumer starts the next epoch on the same (persistent) workers."""


Action = Next | Work | Kill | Expire | Interrupt | Close | Restart

_TASK = "task"
_RESUME = "resume"
Item = tuple[object, ...]  # (_TASK, task, index) or (_RESUME, epoch)


@attrs.frozen
class World:
    """The scheduler's state together with everything around it. A hashable value."""

    scenario: Scenario
    core: State
    epoch: int
    drawn: int
    """Indices the sampler gave out this epoch."""
    sampler_done: bool
    queues: tuple[tuple[Item, ...], ...]
    shards: tuple[tuple[int, int], ...]
    """Per worker, (epoch of its dataset iterator, batches it has yielded from it)."""
    alive: tuple[bool, ...]
    stopped: frozenset[int]
    open_tasks: frozenset[tuple[int, int]]
    """(task, worker) sent this epoch and not yet resolved, as the consumer sees it."""
    answers: frozenset[tuple[int, Outcome]]
    """What workers answered for open tasks."""
    skipped: frozenset[int]
    dry: frozenset[int]
    """Workers that answered "exhausted" this epoch."""
    awaiting: bool
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
    doomed: bool
    """A worker died or a wait expired: the consumer's next answer must be that error."""
    ended: bool
    shut: bool
    deaths_left: int
    closes_left: int
    interrupts_left: int

    @classmethod
    def start(
        cls,
        scenario: Scenario,
        step: StepFunction = core_step,
        on_edge: EdgeObserver | None = None,
    ) -> World:
        """A fresh world whose consumer has just started the first epoch."""
        n = scenario.config.num_workers
        world = cls(
            scenario=scenario,
            core=initial_state(scenario.config),
            epoch=1,
            drawn=0,
            sampler_done=False,
            queues=((),) * n,
            shards=((1, 0),) * n,
            alive=(True,) * n,
            stopped=frozenset(),
            open_tasks=frozenset(),
            answers=frozenset(),
            skipped=frozenset(),
            dry=frozenset(),
            awaiting=False,
            resetting=False,
            delivered=(),
            last_task=-1,
            sent_max=-1,
            resumes_owed=frozenset(),
            outcome=None,
            doomed=False,
            ended=False,
            shut=False,
            deaths_left=scenario.deaths,
            closes_left=2 if scenario.closes else 0,
            interrupts_left=scenario.interrupts,
        )
        sim = _Sim(world, step, on_edge)
        sim.feed(ResetRequested())
        return sim.freeze()

    def actions(self) -> Iterator[Action]:
        """Every action the environment may take now."""
        n = self.scenario.config.num_workers
        blocked = self.awaiting or self.resetting
        if self.outcome is None:
            if not blocked:
                yield Next()  # after the end too: asking again is told again, as in torch
            for w in range(n):
                if self.alive[w] and self.queues[w]:
                    yield Work(w)
            if self.deaths_left:
                for w in range(n):
                    if self.alive[w]:
                        yield Kill(w)
            if blocked and self.scenario.timeouts:
                yield Expire()
            if blocked and self.interrupts_left:
                yield Interrupt()
            # iter() returns once every worker acknowledged the resume, as torch's does; only
            # an interrupted iter() leaves a reset unacknowledged when the next one comes.
            restartable = not (blocked or self.doomed)
            if restartable and self.epoch < self.scenario.epochs:
                yield Restart()
        if self.deaths_left:
            # A worker that was told to stop exits; an executor may still report that.
            for w in sorted(self.stopped):
                yield Kill(w)
        if self.closes_left:
            yield Close()

    def apply(
        self, action: Action, step: StepFunction = core_step, on_edge: EdgeObserver | None = None
    ) -> World:
        """The world after `action`; raises `Violation` if the scheduler misbehaves."""
        sim = _Sim(self, step, on_edge)
        sim.act(action)
        return sim.freeze()

    def stuck(self) -> bool:
        """A consumer waits and no worker has anything to answer: it would wait forever."""
        owed = any(a and q for a, q in zip(self.alive, self.queues, strict=True))
        return self.outcome is None and (self.awaiting or self.resetting) and not owed

    def finished(self) -> bool:
        """The run reached an end: an epoch completed, or an error reached the consumer."""
        return self.ended or self.outcome is not None


_FIELDS = [a.name for a in attrs.fields(World)]


class _Sim:
    """A mutable copy of a World for the duration of one action."""

    def __init__(
        self, world: World, step: StepFunction, on_edge: EdgeObserver | None = None
    ) -> None:
        for name in _FIELDS:
            setattr(self, name, getattr(world, name))
        self.step = step
        self.on_edge = on_edge
        self.pending_index: object = None

    def freeze(self) -> World:
        return World(**{name: getattr(self, name) for name in _FIELDS})

    # These annotations let mypy see the fields copied from World.
    scenario: Scenario
    core: State
    epoch: int
    drawn: int
    sampler_done: bool
    queues: tuple[tuple[Item, ...], ...]
    shards: tuple[tuple[int, int], ...]
    alive: tuple[bool, ...]
    stopped: frozenset[int]
    open_tasks: frozenset[tuple[int, int]]
    answers: frozenset[tuple[int, Outcome]]
    skipped: frozenset[int]
    dry: frozenset[int]
    awaiting: bool
    resetting: bool
    delivered: tuple[Outcome, ...]
    last_task: int
    """In order: the last task handed over, or the last task of earlier epochs."""
    sent_max: int
    """The highest task number sent so far, in any epoch."""
    resumes_owed: frozenset[int]
    outcome: str | None
    doomed: bool
    ended: bool
    shut: bool
    deaths_left: int
    closes_left: int
    interrupts_left: int

    # --- feeding the core ----------------------------------------------------------------------

    def feed(self, event: Event) -> tuple[Command, ...]:
        before = self.core
        try:
            transition = self.step(before, event)
        except ProtocolError as error:
            raise Violation(f"the scheduler refused {event!r}: {error}") from error
        after = transition.state
        allowed = TRANSITIONS[before.phase].get(type(event), frozenset())
        if after.phase not in allowed:
            raise Violation(
                f"{event!r} moved {before.phase!r} to {after.phase!r}, "
                "an edge the transition table does not have"
            )
        if self.on_edge is not None:
            self.on_edge(before.phase, type(event), after.phase)
        broken = violations(after)
        if broken:
            raise Violation(f"after {event!r}: " + "; ".join(broken))
        self.core = after
        for command in transition.commands:
            self.carry_out(command)
        if after.phase is Phase.FINISHED and not self.ended:
            # As in torch, an epoch ends only in the request that finds it over, and says so.
            raise Violation(f"{event!r} finished the epoch without telling the consumer")
        if self.resetting and self.outcome is None and not self.doomed:
            # iter() returns exactly when the last worker has acknowledged this epoch's resume.
            if after.life.resetting != bool(self.resumes_owed):
                raise Violation(
                    f"after {event!r} iter() would {'wait' if after.life.resetting else 'return'}"
                    f" with workers {sorted(self.resumes_owed)} still owing their resume"
                )
            if not after.life.resetting:
                self.resetting = False
        return transition.commands

    def carry_out(self, command: Command) -> None:
        kind = type(command)
        cleanup = kind is StopWorker or kind is Shutdown or kind is RaiseError
        if not cleanup and self.outcome is not None:
            raise Violation(f"{command!r} after the loader {self.outcome}")
        if isinstance(command, PullIndex):
            self._pull()
        elif isinstance(command, SendTask):
            self._send(command)
        elif isinstance(command, Deliver):
            self._hand_over(command.task, command.worker, ("data", command.payload))
        elif isinstance(command, RaiseError):
            self._raise(command)
        elif isinstance(command, EndEpoch):
            self._end_epoch()
        elif isinstance(command, ResumeWorker):
            if command.epoch != self.epoch:
                raise Violation(f"{command!r} names the wrong epoch, not {self.epoch}")
            self._enqueue(command.worker, (_RESUME, command.epoch))
            self.resumes_owed = self.resumes_owed | {command.worker}
        elif isinstance(command, StopWorker):
            if self.core.phase is Phase.FINISHED and (self.open_tasks or not self.awaiting):
                # A normal end stops the workers in the request it answers with EndEpoch, so
                # never before the last batch was handed over, nor along with it.
                raise Violation(f"{command!r} before the consumer asked past the last batch")
            self.alive = _replace(self.alive, command.worker, False)
            self.stopped = self.stopped | {command.worker}
            self.queues = _replace(self.queues, command.worker, ())
        elif isinstance(command, Shutdown):
            if self.shut:
                raise Violation("Shutdown was emitted twice")
            if any(self.alive):
                raise Violation("Shutdown was emitted while workers were left running")
            self.shut = True
        else:  # pragma: no cover - every command type is handled above
            raise Violation(f"unknown command {command!r}")

    def _pull(self) -> None:
        spec = self.scenario.dataset
        if isinstance(spec, MapSpec):
            if self.drawn < spec.batches:
                index: object = (self.epoch, self.drawn)
                self.drawn += 1
            else:
                self.sampler_done = True
                self.feed(SamplerExhausted())
                return
        else:
            index = None  # torch's sampler for iterable datasets yields None forever
        self.pending_index = index
        self.feed(IndexDrawn(index))

    def _send(self, command: SendTask) -> None:
        w = command.worker
        if self.resumes_owed:
            raise Violation(f"{command!r} before workers {sorted(self.resumes_owed)} resumed")
        if w in self.dry:
            raise Violation(f"{command!r} sent to worker {w}, which had run dry")
        if not self.alive[w]:
            raise Violation(f"{command!r} sent to worker {w}, which is not running")
        if command.index != self.pending_index:
            raise Violation(f"{command!r} does not carry the index just drawn")
        if command.task <= self.sent_max:
            raise Violation(f"{command!r} reuses or goes back on a task number")
        self.sent_max = command.task
        self.pending_index = None
        self.open_tasks = self.open_tasks | {(command.task, w)}
        held = sum(1 for _, worker in self.open_tasks if worker == w)
        limit = self.scenario.config.prefetch_factor
        if held > limit:
            raise Violation(f"worker {w} holds {held} unresolved tasks, over prefetch {limit}")
        self._enqueue(w, (_TASK, command.task, command.index))

    def _enqueue(self, worker: int, item: Item) -> None:
        self.queues = _replace(self.queues, worker, self.queues[worker] + (item,))

    def _hand_over(self, task: int, worker: int, outcome: Outcome) -> None:
        if not self.awaiting:
            raise Violation(f"task {task} was handed over with no consumer waiting")
        if self.doomed:
            raise Violation(f"task {task} was handed over after the loader should have failed")
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
        self.awaiting = False

    def _raise(self, command: RaiseError) -> None:
        failure = command.failure
        if isinstance(failure, TaskFailure):
            self._hand_over(failure.task, failure.worker, ("error", failure.error))
            return
        if not (self.awaiting or self.resetting):
            raise Violation(f"{command!r} with no consumer waiting")
        if isinstance(failure, (WorkerDeath, Timeout)) and not self.doomed:
            raise Violation(f"{command!r} although nothing died or timed out")
        if isinstance(failure, Cancelled) and self.core.phase is not Phase.CLOSED:
            raise Violation(f"{command!r} although the loader was not closed")
        self.awaiting = False
        self.resetting = False
        self.doomed = False
        self.outcome = self.outcome or "failed"

    def _end_epoch(self) -> None:
        if not self.awaiting:
            raise Violation("the epoch was ended with no consumer waiting")
        if self.core.phase is not Phase.FINISHED:
            raise Violation(f"the epoch was ended while the scheduler is {self.core.phase.value}")
        if self.doomed:
            raise Violation("the epoch was ended normally after the loader should have failed")
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
        self.awaiting = False

    # --- the environment's moves ---------------------------------------------------------------

    def act(self, action: Action) -> None:
        if isinstance(action, Next):
            self.awaiting = True
            self.feed(NextRequested())
            if self.doomed and self.awaiting:
                raise Violation("the consumer still waits after a worker died: it would hang")
        elif isinstance(action, Work):
            self._work(action.worker)
        elif isinstance(action, Kill) and action.worker in self.stopped:
            self.deaths_left -= 1
            self.stopped = self.stopped - {action.worker}
            commands = self.feed(WorkerDied(action.worker, pid=None, exitcode=0))
            if commands:
                raise Violation(f"the exit of a stopped worker emitted {commands!r}")
        elif isinstance(action, Kill):
            self.alive = _replace(self.alive, action.worker, False)
            self.queues = _replace(self.queues, action.worker, ())
            self.deaths_left -= 1
            self.doomed = True
            self.feed(WorkerDied(action.worker, pid=None, exitcode=-9))
            if self.awaiting or self.resetting:
                raise Violation(f"the consumer still waits after worker {action.worker} died")
        elif isinstance(action, Expire):
            self.doomed = True
            self.feed(TimedOut(5.0))
            if self.awaiting or self.resetting:
                raise Violation("the consumer still waits after its timeout ran out")
        elif isinstance(action, Interrupt):
            self._interrupt()
        elif isinstance(action, Close):
            self._close()
        elif isinstance(action, Restart):
            self._restart()
        else:  # pragma: no cover
            raise TypeError(f"unknown action {action!r}")
        if self.outcome is None and self.core.phase is Phase.FAILED and not self.doomed:
            raise Violation("the loader failed but nothing died or timed out")

    def _work(self, w: int) -> None:
        head, *rest = self.queues[w]
        self.queues = _replace(self.queues, w, tuple(rest))
        if head[0] == _RESUME:
            epoch = head[1]
            assert isinstance(epoch, int)
            self.shards = _replace(self.shards, w, (epoch, 0))
            if epoch == self.epoch:  # not the answer to a reset abandoned since
                self.resumes_owed = self.resumes_owed - {w}
            self.feed(WorkerResumed(w, epoch))
            return
        _, task, index = head
        assert isinstance(task, int)
        spec = self.scenario.dataset
        if isinstance(spec, MapSpec):
            assert isinstance(index, tuple)
            epoch_of_index, position = index
            outcome: Outcome | None = map_batch(spec, epoch_of_index, position)
        else:
            shard_epoch, k = self.shards[w]
            outcome = iterable_batch(spec, w, shard_epoch, k)
            if outcome is not None:
                self.shards = _replace(self.shards, w, (shard_epoch, k + 1))
        current = (task, w) in self.open_tasks
        if outcome is None:
            if current:
                self.open_tasks = self.open_tasks - {(task, w)}
                self.skipped = self.skipped | {task}
                self.dry = self.dry | {w}
            self.feed(WorkerExhausted(task, w))
            return
        if current:
            self.answers = self.answers | {(task, outcome)}
        kind, value = outcome
        self.feed(TaskCompleted(task, w, value) if kind == "data" else TaskFailed(task, w, value))

    def _close(self) -> None:
        again = self.core.phase is Phase.CLOSED
        self.closes_left -= 1
        commands = self.feed(CloseRequested())
        if again and commands:
            raise Violation(f"a second close emitted {commands!r}")
        if not self.shut:
            raise Violation("close did not shut the workers down")
        if self.awaiting or self.resetting:
            raise Violation("the consumer still waits after close")
        self.outcome = "closed"
        self.doomed = False

    def _restart(self) -> None:
        self.epoch += 1
        self.drawn = 0
        self.sampler_done = False
        self.open_tasks = frozenset()
        self.answers = frozenset()
        self.skipped = frozenset()
        self.dry = frozenset()
        self.delivered = ()
        self.last_task = self.sent_max
        self.ended = False
        self.resetting = True
        commands = self.feed(ResetRequested(seed=self.epoch))
        resumed = sorted(c.worker for c in commands if isinstance(c, ResumeWorker))
        if resumed != list(range(self.scenario.config.num_workers)):
            raise Violation(f"a new epoch resumed workers {resumed}, not every worker")

    def _interrupt(self) -> None:
        # The consumer is back in its own code: in the middle of the epoch, or before it, if
        # iter() was interrupted; either way it may ask again, or start the next epoch.
        self.interrupts_left -= 1
        self.awaiting = False
        self.resetting = False
        commands = self.feed(Interrupted())
        if commands:
            raise Violation(f"an interrupted wait emitted {commands!r}")


def _replace(values: tuple, index: int, value: object) -> tuple:  # type: ignore[type-arg]
    return values[:index] + (value,) + values[index + 1 :]
