"""The driver loop: feeds events to the scheduler and carries out its commands.

This is the only place where the pure core meets the world, and it decides nothing: it tells
the scheduler what happened (a consumer's call, an index drawn or the sampler failing, an
answer or a failure of the executor, an interrupt) and carries out the commands it gets back,
in order. It waits on the executor only while the scheduler says a consumer waits, and turns
what the consumer is owed (a batch, an error, the end) into what a torch user expects.

A call goes in three moves, which the models drive one at a time (`statecore.models.world`):
`request` tells the scheduler of the consumer's call and carries out what follows; `wait`
polls the executor once and does the same with the answer; `hand_over` returns the batch or
raises. While no outcome came, the call `waits` again as long as the scheduler says the
consumer is still waiting (in `next()`) or still inside `iter()`.

An interrupt (Ctrl-C's KeyboardInterrupt, or whatever a Python signal handler raises, such as a
SIGALRM time limit) may arrive between any two bytecodes that Python checks for signals at (a
function's start, after each call, a loop's jump back). Whichever of the consumer's calls it
cuts short tells the scheduler once (`Interrupted`), on its way out, and the scheduler keeps
everything owed. A command it cut short is carried out again on the next call (a draw from the
sampler is abandoned instead, as the scheduler was told). An outcome the scheduler gave is
never held by a frame alone: it is the driver's (`Driver.handed`) from the moment it is taken
off the commands until the store just before the consumer's call returns it, with no call in
between, so an interrupt before that leaves it for the next request. Either way the next
`next()` goes on with the epoch and the next `iter()` starts a new one, as in torch. One window
is torch's too: an index the sampler returned is lost if the interrupt lands before the
scheduler took it, and the epoch then goes on without that index's batch.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import attrs

from statecore import (
    AddRequested,
    Cancelled,
    CloseRequested,
    Command,
    Config,
    Deliver,
    DrawIndex,
    EndEpoch,
    Event,
    ExecutorFailed,
    ExecutorFailure,
    Failure,
    IndexDrawn,
    InternalError,
    Interrupted,
    LoaderCancelledError,
    LoaderTimeoutError,
    NextRequested,
    Pending,
    Phase,
    PrefetchChangeRequested,
    Progress,
    RaiseError,
    ReplaceWorker,
    ResetRequested,
    ResumeWorker,
    RetireRequested,
    SamplerExhausted,
    SamplerFailed,
    SamplerFailure,
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
    WorkerDiedError,
    WorkerExhausted,
    WorkerHang,
    WorkerHungError,
    WorkerStatus,
    WorkerStuck,
    initial_state,
    progress,
    step,
)
from statecore.executors._incarnation import Carried, RanDry, Standing
from statecore.executors._observe.seam import Observer, observed
from statecore.executors._protocol import (
    Executor,
    Replacing,
    capabilities_of,
    confirmer_of,
    replacer_of,
)
from statecore.executors._remote import RemoteError
from statecore.executors._seeding import BatchSeeds
from statecore.executors._signals import HeldSignals, is_interrupt
from statecore.executors._worker import Mark

__all__ = [
    "Driver",
    "Ledger",
    "DriverState",
    "WorkerMarks",
    "death_message",
    "failure_exception",
    "handed_task",
    "is_interrupt",
]

_NEXT = NextRequested()
_MARKED = (TaskCompleted, TaskFailed, WorkerExhausted)
_CARRIED = frozenset((SendTask, ResumeWorker, StopWorker, ReplaceWorker, Shutdown))
"""The commands `carry_out` carries out by a call (see `Driver._carrier`)."""
_SAMPLER_EXHAUSTED = SamplerExhausted()
_CLOSE = CloseRequested()
_INTERRUPTED = Interrupted()

StepFunction = Callable[[State, Event], Transition]


class Driver:
    """Runs one scheduler over one executor, for one loader iterator.

    `step` is the scheduler's transition function; the models pass one that checks every
    transition as well. `observers` watch it through one seam (`executors._observe.seam`):
    each is told of every transition once, and of an internal error or a timeout the driver
    is about to raise. The loader attaches them (its flight recorder, its tracer); the driver
    builds none.
    """

    def __init__(
        self,
        config: Config,
        executor: Executor,
        draw: Callable[[State], Any],
        timeout: float,
        step: StepFunction = step,
        *,
        observers: Iterable[Observer] = (),
        marked: bool = False,
        worker_timeout: float = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`draw` draws the next index from the sampler (StopIteration at its end); it is given
        the scheduler's state as the draw is asked (where the consumer stands, for a sampler's
        checkpoint). `marked`: the workers' answers carry marks though the dataset is map-style
        (its state per worker, see `WorkerRuntime`); an iterable dataset's always do.
        `worker_timeout`: seconds the consumer may wait for one task before its worker is
        reported stuck (`WorkerStuck`); 0 never. `clock`: what that wait is timed with (the
        models pass a clock of their own, to find a worker stuck without waiting)."""
        self.state: State = initial_state(config)
        self.executor = executor
        self.draw = draw
        self.observers = tuple(observers)
        self.step = observed(step, self.observers)
        marking = config.iterable or marked
        self.poll_step = self.step
        """The step an executor's answers go through (`wait`)."""
        self.noted: _Noted | None = None
        """Where the seam notes an answer that carries a mark, for `wait` to take the mark: set
        where answers carry marks and observers watch, so that the seam's one lookup of the
        answer's type serves the observers and the driver alike. With no observer there is no
        seam, and `wait` looks at the type itself, the only place in the shell that does."""
        if marking and self.observers:
            self.noted = _Noted()
            self.poll_step = observed(step, (*self.observers, self.noted.observer()))
        # torch's timeout=0 means "wait as long as it takes".
        self.timeout: float | None = timeout if timeout > 0 else None
        self.confirm = confirmer_of(executor)
        """The executor's `confirm`, if it keeps each answer until told it was recorded."""
        self.replacer: Replacing | None = replacer_of(executor)
        """The executor, if it can replace a lost worker."""
        self.worker_timeout: float | None = worker_timeout if worker_timeout > 0 else None
        self.killable = capabilities_of(executor).kills_stuck_workers
        self.clock = clock
        self.watch: tuple[int, int, float] | None = None
        """(task, incarnation, deadline): the task the consumer waits for and when its worker is
        reported stuck. A clock, not a state: left out of `snapshot`."""
        # The driver's state between calls; `snapshot` takes it as one value.
        self.todo: deque[Command] = deque()
        """Commands still to carry out: those an interrupt left for the next call."""
        # What the scheduler handed over that the consumer did not get: two frozen values that
        # `snapshot` takes as one `Ledger`. Apart here, since a batch reads them several times
        # and a named tuple's field is read through a descriptor call.
        self.handed: Command | None = None
        """The outcome of the call under way, from the moment it is taken off the commands until
        it is handed over; between calls, one that an interrupt kept for the next request."""
        self.void: tuple[tuple[int, int], ...] = ()
        """(task, worker) handed over in a call that raised the executor's failure instead."""
        self.worker_marks = WorkerMarks() if marking else None
        """None where the answers carry no marks (a map-style dataset without a state)."""
        self.confirm_owed = False
        """The state holds the answer the executor returned last, and the executor may not have
        been told yet: an interrupt cut the driver's `confirm` call short."""
        self.seeds: BatchSeeds | None = None
        """The epoch's seeds where the loader seeds per batch: each task goes out seeded."""

    # --- the consumer's calls ----------------------------------------------------------------

    def start_epoch(
        self,
        seed: int | None = None,
        resume: Progress | None = None,
        marks: dict[int, Any] | None = None,
        seeds: BatchSeeds | None = None,
    ) -> None:
        """Start an epoch: return once iter() is done (workers resumed, first tasks out).

        `resume` goes on with a checkpoint's epoch instead; the sampler must be at its `done`,
        and an iterable dataset's workers where `marks` (the checkpoint's) say. `seeds`: the
        epoch's seeds, where the loader seeds per batch.
        """
        self.seeds = seeds
        try:
            # An outcome of the epoch being left behind, and the void: no call between the stores.
            self.handed, self.void = None, ()
            if self.worker_marks is not None:
                dry = () if resume is None else resume.dry
                self.worker_marks = self.worker_marks.begin(marks or {}, dry)
            self.request(ResetRequested(seed, resume))
            self._go_on(False)
        except BaseException as error:
            self._told_if_interrupted(error)
            raise

    def next(self) -> Any:
        """The next batch; StopIteration at the end of the epoch; the worker's error in its turn."""
        self.watch = None  # a worker is stuck if this call waits `worker_timeout` for its task
        try:
            if self.handed is None:
                if self.todo:
                    # Left by an interrupt: carried out before anything new is asked.
                    self.carry_out()
                if self.handed is None:
                    # `request(_NEXT)`, less a frame on every batch.
                    self.state, commands = self.step(self.state, _NEXT)
                    self.todo.extend(commands)
                    del commands
                    self.carry_out()
                    self.finish()
            outcome = self.handed
            if type(outcome) is Deliver:
                # Handed over here rather than in `hand_over`: a return through one frame
                # more is one more place an interrupt could drop the batch at.
                if self.worker_marks is None:  # the common case
                    payload = outcome.payload
                    self.handed = None  # no call from here on: the batch is handed
                    return payload
                worker_marks = self._handing(outcome)
                payload = outcome.payload
                self.worker_marks = worker_marks  # no call from here on, as above
                self.handed = None
                return payload
            del outcome  # see `hand_over`
            return self._go_on(True)
        except BaseException as error:
            self._told_if_interrupted(error)
            raise

    def go_on(self, *, in_next: bool = True) -> Any:
        """The rest of a consumer's call: wait for as long as the scheduler says the consumer
        waits, then hand the outcome over.

        `in_next`: the call is `next()`, which must end with an outcome; `iter()` may end
        without one (None). The models call this to go on with a call that waited.
        """
        try:
            return self._go_on(in_next)
        except BaseException as error:
            self._told_if_interrupted(error)
            raise

    def _go_on(self, in_next: bool) -> Any:
        outcome = self.handed
        if outcome is None:
            outcome = self.finish()
        if type(outcome) is Deliver and self.worker_marks is None:
            # The common case, without `hand_over`'s call.
            payload = outcome.payload
            self.handed = None  # no call from here on: the batch is the consumer's now
            return payload
        if outcome is None:
            if not in_next:
                return None
            raise self._recorded(
                InternalError(f"the scheduler left a request unanswered in {self.state!r}")
            )
        del outcome  # see `hand_over`
        return self.hand_over()

    def close(self) -> None:
        """Stop the workers and release everything. Idempotent; a close an interrupt cut
        short finishes stopping the workers when called again."""
        try:
            before = self.handed
            if self.state.phase is not Phase.CLOSED:
                self.request(_CLOSE)
            elif self.todo:
                self.carry_out()
            outcome = self.handed
            if outcome is not before:
                # What the close itself was answered. A cancellation is the waiting
                # consumer's, not the closer's; an executor that failed to stop its workers is
                # the closer's to hear. An outcome an earlier call left stays the driver's (a
                # checkpoint counts it as not received).
                raises = type(outcome) is RaiseError and type(outcome.failure) is not Cancelled
                del outcome  # see `hand_over`
                try:
                    if raises:
                        self.hand_over()
                finally:
                    self.handed = before
        except BaseException as error:
            self._told_if_interrupted(error)
            raise

    def _told_if_interrupted(self, error: BaseException) -> None:
        """Tell the scheduler that an interrupt cut the consumer's call short: it waits no
        more, and a draw it asked for is abandoned. Once per call, on the call's way out,
        wherever the interrupt landed; telling it again changes nothing."""
        if is_interrupt(error):
            self._interrupted()

    def progress(self) -> Progress:
        """What a checkpoint records now (see `statecore.progress`).

        A batch (or a task's error) the scheduler handed over and the consumer did not get is
        not counted: an interrupt kept it for the next request, or the executor failed and
        its error took the batch's place.
        """
        unreceived = [*self.void, *_tasks_of((self.handed, *self.todo))]
        return progress(self.state, unreceived)

    @property
    def marks(self) -> dict[int, Mark] | None:
        """Each worker's mark that a checkpoint records (see `WorkerMarks`); None where the
        answers carry no marks."""
        worker_marks = self.worker_marks
        return None if worker_marks is None else dict(worker_marks.received)

    @property
    def left(self) -> dict[int, Mark] | None:
        """Where each worker's dataset stood as it went on into this epoch from the one before,
        on this driver's workers: the mark of its last answer of that epoch recorded, received
        or not (see `WorkerMarks.left`); None where the answers carry no marks."""
        worker_marks = self.worker_marks
        return None if worker_marks is None else dict(worker_marks.left)

    @property
    def left_dry(self) -> frozenset[int]:
        """The workers whose iterable part had run dry as the epoch before was left."""
        worker_marks = self.worker_marks
        return frozenset() if worker_marks is None else frozenset(worker_marks.left_dry)

    def snapshot(self) -> DriverState:
        """The driver's state between calls, the scheduler's with it, as one value."""
        return DriverState(
            self.state,
            tuple(self.todo),
            Ledger(self.handed, self.void),
            self.worker_marks,
            self.confirm_owed,
        )

    def restore(self, snapshot: DriverState) -> None:
        """Put back a state `snapshot` took (of this driver, or of one over a like executor)."""
        self.state = snapshot.state
        self.todo = deque(snapshot.todo)
        self.handed, self.void = snapshot.ledger
        self.worker_marks = snapshot.worker_marks
        self.confirm_owed = snapshot.confirm_owed

    # --- a tuner's calls, between the consumer's ---------------------------------------------

    def retire(self, worker: int) -> None:
        """Retire `worker` (map-style datasets only): it is given no new task, and is stopped
        once it has answered those it holds. Raises `ExecutorError`, changing nothing, where the
        scheduler refuses (an iterable dataset, a worker not running, the last one running)."""
        self._tune(RetireRequested(worker))

    def add(self, worker: int) -> None:
        """Start the retired slot `worker` again; it takes tasks once it has started. Spends no
        restart. Raises `ExecutorError`, changing nothing, where the slot is not retired."""
        if self.replacer is None:
            raise TypeError(
                f"cannot start worker {worker} again: the executor "
                f"{type(self.executor).__name__} cannot start a worker (it has no `replace`)"
            )
        self._tune(AddRequested(worker))

    def prefetch(self, prefetch_factor: int) -> None:
        """Bound each worker's unresolved tasks by `prefetch_factor` from now on. Lowering it
        cancels nothing: a worker over it is sent nothing until it holds fewer. Raises
        `ExecutorError`, changing nothing, where the scheduler refuses (no epoch running, a
        value under 1 or the one in force, a scheduler that loads on request)."""
        self._tune(PrefetchChangeRequested(prefetch_factor))

    def _tune(self, event: Event) -> None:
        # Told between the consumer's calls: nothing waits, so no outcome is handed over here;
        # one picked up from commands an interrupt left is kept for the next request.
        try:
            self.request(event)
        except BaseException as error:
            self._told_if_interrupted(error)
            raise

    # --- the moves of a call -------------------------------------------------------------------

    def request(self, event: Event) -> Command | None:
        """Tell the scheduler of a consumer's call; carry out what follows; the outcome if any."""
        self.state, commands = self.step(self.state, event)
        self.todo.extend(commands)
        return self.carry_out()

    def finish(self) -> Command | None:
        """Wait for the call's outcome for as long as the scheduler says the consumer waits."""
        handed = self.handed
        while handed is None and (self.state.waiting or self.state.life.resetting):
            handed = self.wait()  # `carry_out`'s answer: `self.handed`
        return handed

    def wait(self) -> Command | None:
        """Poll the executor once, tell the scheduler, carry out what follows.

        An executor that confirms answers returns an answer again until it is confirmed: one
        whose return an interrupt cut short is fed now, and one recorded is never fed twice.
        """
        confirm = self.confirm
        try:
            if self.confirm_owed and confirm is not None:
                confirm()
                self.confirm_owed = False
            if self.worker_timeout is None:
                # `_poll`'s common case, without its frame.
                try:
                    event = self.executor.poll(self.timeout)
                except Exception as error:
                    if is_interrupt(error):
                        raise
                    event = ExecutorFailed(error)
                if event is None:
                    event = self._nothing_polled()
            else:
                event = self._poll()
            state, commands = self.poll_step(self.state, event)
            worker_marks = self.worker_marks
            if worker_marks is not None:
                noted = self.noted
                answer: TaskCompleted | TaskFailed | WorkerExhausted | None
                if noted is None:
                    answer = event if type(event) in _MARKED else None  # type: ignore[assignment]
                else:
                    # Taken at once: an interrupt from here on drops the answer's state too.
                    answer, noted.answer = noted.answer, None
                # A lost incarnation's late answer was dropped: its mark is not its slot's.
                if answer is not None and _current(answer, state):
                    worker_marks = worker_marks.answer(answer, state.life.base)
            # No call until the last of these stores: an interrupt cannot come between the new
            # state, the answer's mark, the note that the executor is owed its confirmation,
            # and the commands.
            self.state = state
            self.worker_marks = worker_marks
            self.confirm_owed = confirm is not None
            self.todo.extend(commands)
            if confirm is not None:
                confirm()
                self.confirm_owed = False
        except BaseException:
            if self.noted is not None:
                self.noted.answer = None  # the answer's state was not kept: nor is its mark
            raise  # an interrupt: the consumer's call tells the scheduler on its way out
        return self.carry_out()

    def hand_over(self) -> Any:
        """What the consumer gets for the outcome the driver holds: the batch, StopIteration,
        or the error.

        Everything that calls anything comes first; the last stores (the outcome let go, the
        task's mark made its worker's) come with no call between them and the return or
        raise, so an interrupt leaves the outcome for the next request or hands it over, never
        half of each.

        A failure may hold the very exception raised (a worker thread's), whose traceback holds
        the frames it passes: a frame still holding the outcome closes a cycle, and the loader
        with its workers then lives on until the garbage collector runs. So this frame, and
        each caller's, lets go of the outcome before the exception leaves it.
        """
        outcome = self.handed
        worker_marks = self._handing(outcome)
        kind = type(outcome)
        if kind is Deliver:
            payload = outcome.payload  # type: ignore[union-attr]
            self.worker_marks = worker_marks
            self.handed = None
            return payload
        if kind is EndEpoch:
            self.worker_marks = worker_marks
            self.handed = None
            raise StopIteration
        error = failure_exception(outcome.failure)  # type: ignore[union-attr]
        if type(error) is LoaderTimeoutError:
            # torch's message, which logs match, stays as it is: a recorder's file is named in
            # a note. Sticky: a timeout raised again names the same file.
            failure = outcome.failure  # type: ignore[union-attr]
            for observer in self.observers:
                observer.raising(error, self.state, key=failure, as_note=True)
            del failure
        del outcome
        try:
            self.worker_marks = worker_marks
            self.handed = None
            raise error
        finally:
            del error

    def _handing(self, outcome: Command | None) -> WorkerMarks | None:
        """The workers' marks once `outcome` is handed over, for the caller to store with no call
        between the store and the hand-over."""
        worker_marks = self.worker_marks
        if worker_marks is not None:
            handed = handed_task(outcome)
            if handed is not None:
                # The consumer gets the batch or error of the task: its mark is now its worker's.
                worker_marks = worker_marks.receive(handed[0])
        return worker_marks

    def _recorded(self, error: InternalError) -> InternalError:
        """`error`, naming the flight recorder's file of the events that led to it."""
        for observer in self.observers:
            observer.raising(error, self.state)
        return error

    # --- the loop ----------------------------------------------------------------------------

    def _feed(self, event: Event) -> None:
        self.state, commands = self.step(self.state, event)
        self.todo.extend(commands)

    def _interrupted(self) -> None:
        """Tell the scheduler the call was cut short, which abandons the draw it asked for, if
        any: begun or still to do (an interrupt that lands before the commands of the answer
        just recorded are carried out), it is not carried out."""
        self._feed(_INTERRUPTED)
        todo = self.todo
        if any(type(command) is DrawIndex for command in todo):
            kept = [command for command in todo if type(command) is not DrawIndex]
            todo.clear()
            todo.extend(kept)

    def _poll(self) -> Event:
        try:
            if self.worker_timeout is not None:
                watched = self._watched()
                if watched is not None:
                    return self._poll_watching(*watched)
            event = self.executor.poll(self.timeout)
        except Exception as error:
            if is_interrupt(error):
                raise
            return ExecutorFailed(error)
        return self._nothing_polled() if event is None else event

    def _nothing_polled(self) -> Event:
        """What a poll that returned nothing tells the scheduler: the loader's timeout passed."""
        if self.timeout is None:
            raise self._recorded(
                InternalError(
                    f"the scheduler waits in {self.state!r} but the executor owes nothing"
                )
            )
        return TimedOut(self.timeout)

    def _watched(self) -> tuple[int, int] | None:
        """The task the waiting consumer waits for and the worker that holds it: the first
        pending task of a running worker (in order, the next task due). None: nothing to
        watch (no consumer waits, or the task waits for a replacement to start)."""
        state = self.state
        if not state.waiting or not state.window:
            return None
        workers = state.life.workers
        if state.config.in_order:
            slot = state.window[0]
            if type(slot) is Pending and workers[slot.worker] is WorkerStatus.ACTIVE:
                return state.rcvd_idx, slot.worker
            return None
        for i, slot in enumerate(state.window):
            if type(slot) is Pending and workers[slot.worker] is WorkerStatus.ACTIVE:
                return state.rcvd_idx + i, slot.worker
        return None

    def _poll_watching(self, task: int, worker: int) -> Event:
        """Poll for as long as the loader's timeout allows, but report `worker` stuck once the
        consumer has waited `worker_timeout` for `task` in this `next()` call."""
        assert self.worker_timeout is not None
        incarnation = self.state.life.incarnations[worker]
        now = self.clock()
        watch = self.watch
        if watch is None or watch[:2] != (task, incarnation):
            watch = self.watch = (task, incarnation, now + self.worker_timeout)
        deadline = watch[2]
        limit = None if self.timeout is None else now + self.timeout
        while True:
            until = deadline if limit is None else min(deadline, limit)
            event = self.executor.poll(max(0.0, until - self.clock()))
            if event is not None:
                return event
            now = self.clock()
            if limit is not None and now >= limit:
                assert self.timeout is not None
                return TimedOut(self.timeout)
            if now >= deadline:
                report = None if self.replacer is None else self.replacer.report(worker)
                if report is not None and report.starting:
                    # Start-up (spawn's imports, worker_init_fn) is not the task's time.
                    deadline = now + self.worker_timeout
                    self.watch = (task, incarnation, deadline)
                    continue
                self.watch = None
                return WorkerStuck(
                    worker,
                    task,
                    self.worker_timeout,
                    incarnation,
                    pid=None if report is None else report.pid,
                    stack=None if report is None else report.stack,
                    killable=self.killable and self.replacer is not None,
                )

    def carry_out(self) -> Command | None:
        """Carry out every pending command; return what the consumer gets, which the driver
        holds (`handed`) until it is handed over."""
        todo, executor = self.todo, self.executor
        while todo:
            # Taken off only once carried out: an interrupt leaves it to be done again.
            command = todo[0]
            kind = type(command)
            if kind is Deliver or kind is RaiseError or kind is EndEpoch:
                # No call between these two: the outcome is the driver's, not a frame's.
                self.handed = command
                todo.popleft()
                continue
            elif kind is DrawIndex:
                todo.popleft()  # an interrupted draw is abandoned, not repeated
                self._draw()
                continue
            else:
                argument: Any = command
                if kind is SendTask:
                    seeds = self.seeds
                    if seeds is not None:
                        argument = seeds.task(command, self.state.life)  # type: ignore[arg-type]
                elif kind not in _CARRIED:  # pragma: no cover - the core emits no other command
                    raise InternalError(f"the driver cannot carry out {command!r}")
                try:
                    # Each executor method is called in place: `executor.dispatch` taken as a
                    # value would make a bound method for every task (see `_carrier`).
                    if kind is SendTask:
                        executor.dispatch(argument)
                    elif kind is ResumeWorker:
                        executor.resume(argument)
                    elif kind is StopWorker:
                        executor.stop_worker(argument.worker)
                    elif kind is ReplaceWorker:
                        self._replace(argument)
                    else:
                        self._shut_down(None)
                    todo.popleft()
                except BaseException as error:
                    if is_interrupt(error):
                        # Done, and to be taken off, if the interrupt landed as the call
                        # returned rather than inside it: done again, a task sent twice would
                        # be answered twice.
                        carrier = self._carrier(kind)
                        if not _cut_short(error, carrier) and todo and todo[0] is command:
                            todo.popleft()
                        raise
                    if not isinstance(error, Exception):  # pragma: no cover - is_interrupt's
                        raise
                    if isinstance(error, InternalError):
                        self._recorded(error)
                        raise
                    # What the scheduler answers replaces the rest of this run, and the
                    # outcome already picked up in it.
                    void = (*self.void, *_tasks_of((self.handed, *todo)))
                    self.handed, self.void = None, void
                    todo.clear()
                    self._feed(ExecutorFailed(error))
        return self.handed

    def _carrier(self, kind: type[Command]) -> Callable[..., None]:
        """What `carry_out` calls to carry out a command of type `kind` (not `Deliver`,
        `RaiseError`, `EndEpoch` or `DrawIndex`)."""
        executor = self.executor
        carriers: dict[type[Command], Callable[..., None]] = {
            SendTask: executor.dispatch,
            ResumeWorker: executor.resume,
            StopWorker: executor.stop_worker,
            ReplaceWorker: self._replace,
            Shutdown: self._shut_down,
        }
        return carriers[kind]

    def _shut_down(self, _: None) -> None:
        # Once begun, a shutdown finishes: an interrupt is raised after it (and the command,
        # cut short as far as `carry_out` can tell, is carried out again: stopping stopped
        # workers does nothing).
        with HeldSignals():
            self.executor.shutdown()

    def _replace(self, command: ReplaceWorker) -> None:
        if self.replacer is None:
            raise InternalError(
                f"the scheduler replaced a worker ({command!r}) on an executor that cannot"
            )
        marks = self.worker_marks
        mark: Standing = None
        if marks is not None:
            # A driver's epochs after its first are a persistent iterator's: its workers went
            # on into them with their datasets.
            carried = command.epoch > 1
            mark = marks.restoring(command.worker, self.state.config.iterable, carried)
        self.replacer.replace(command, mark)

    def _draw(self) -> None:
        try:
            index = self.draw(self.state)
        except StopIteration:
            self._feed(_SAMPLER_EXHAUSTED)
        except BaseException as error:
            if is_interrupt(error):
                raise  # `carry_out` tells the scheduler, which abandons the draw
            self._feed(SamplerFailed(error))
        else:
            self.state, commands = self.step(self.state, _index_drawn(index))
            self.todo.extend(commands)


def handed_task(command: Command | None) -> tuple[int, int] | None:
    """The (task, worker) whose batch or error `command` hands to the consumer, if it does."""
    kind = type(command)
    if kind is Deliver:
        return command.task, command.worker  # type: ignore[union-attr]
    if kind is RaiseError and type(command.failure) is TaskFailure:  # type: ignore[union-attr]
        return command.failure.task, command.failure.worker  # type: ignore[union-attr]
    return None


def _tasks_of(commands: Iterable[Command | None]) -> list[tuple[int, int]]:
    """The (task, worker) whose batch or error these commands hand to the consumer."""
    return [handed for handed in map(handed_task, commands) if handed is not None]


def _cut_short(error: BaseException, call: Callable[..., Any]) -> bool:
    """Whether `error`, caught by the frame that made `call`, was raised inside it (the call
    was cut short) rather than in the catching frame as the call returned: there the next
    frame of the traceback, if any, is a Python signal handler's, not the call's."""
    trace = error.__traceback__
    inner = None if trace is None else trace.tb_next
    if inner is None:
        return False
    code = getattr(getattr(call, "__func__", call), "__code__", None)
    # A call without code of its own (a builtin) is taken to have been cut short.
    return code is None or inner.tb_frame.f_code is code


def _first(item: tuple[int, Any]) -> int:
    return item[0]


def _current(answer: TaskCompleted | TaskFailed | WorkerExhausted, state: State) -> bool:
    """Whether `answer` came from its worker's current incarnation."""
    return answer.incarnation == state.life.incarnations[answer.worker]


class _Noted:
    """Where the seam notes an answer that carries a mark (`TaskCompleted`, `TaskFailed`), or
    says its worker ran dry (`WorkerExhausted`), for the driver's `wait`, which records it.
    Not the driver itself, which the seam would then
    hold in a cycle: a loader's workers must stop when its iterator is dropped, not when the
    garbage collector runs."""

    __slots__ = ("answer",)

    def __init__(self) -> None:
        self.answer: TaskCompleted | TaskFailed | WorkerExhausted | None = None

    def observer(self) -> Observer:
        """The hooks that note an answer with a mark, for `observed`."""

        def note(state: State, event: Event, transition: Transition) -> None:
            self.answer = event  # type: ignore[assignment]

        on = {TaskCompleted: note, TaskFailed: note, WorkerExhausted: note}
        return Observer(None, on=on, owner=self)


class Ledger(NamedTuple):
    """What the scheduler handed over that the consumer did not get yet, as `Driver.snapshot`
    takes it (the driver holds the two fields as `handed` and `void`, each a value it replaces,
    never changes)."""

    handed: Command | None = None
    """The outcome of the call under way, from the moment it is taken off the commands until
    it is handed over; between calls, one that an interrupt kept for the next request."""
    void: tuple[tuple[int, int], ...] = ()
    """(task, worker) handed over in a call that raised the executor's failure instead."""


_NO_LEDGER = Ledger()
# Bound once: a class method looked up on its class is bound anew at each call (one a batch).
_index_drawn = IndexDrawn.fast


@attrs.frozen
class WorkerMarks:
    """An iterable (or stateful map-style) dataset's workers: the mark of each one's last batch
    (or task error) the consumer received, which a checkpoint records (see `WorkerRuntime` for
    marks), the marks of this epoch's answers not received yet, and where each worker's
    dataset stands: the mark of its last answer recorded, received or not, and of the one it
    recorded last in the epoch before. A value, as `Ledger` is; its pairs are sorted, so that
    equal marks make equal values."""

    received: tuple[tuple[int, Mark], ...] = ()
    """(worker, mark), by worker."""
    answered: tuple[tuple[int, tuple[int, Any]], ...] = ()
    """(task, (worker, mark)), by task."""
    recorded: tuple[tuple[int, Mark], ...] = ()
    """(worker, mark) of each worker's last answer of this epoch recorded, received or not, by
    worker: where its dataset stands, the batches it loaded ahead included."""
    left: tuple[tuple[int, Mark], ...] = ()
    """(worker, mark) of each worker's last answer of the epoch before recorded, by worker,
    those recorded after that epoch was left (a `break`) included: where a persistent worker's
    dataset stood as it went on into this epoch (see `begin`)."""
    dry: tuple[int, ...] = ()
    """The workers whose iterable part ran dry this epoch (their exhaustion recorded, or the
    checkpoint's this epoch resumes)."""
    left_dry: tuple[int, ...] = ()
    """The workers whose part had run dry as the epoch before was left: the others' stand
    where `left` says, in an iterator not read to its end."""

    @classmethod
    def of(cls, marks: Mapping[int, Mark]) -> WorkerMarks:
        """Each worker's mark as received (a checkpoint's), nothing answered."""
        return cls(_sorted(marks))

    def begin(self, marks: Mapping[int, Mark], dry: Iterable[int] = ()) -> WorkerMarks:
        """The marks as the next epoch starts from `marks` (a checkpoint's, or none), on the
        same workers: where each one's dataset stands now becomes where it stood as the epoch
        before was left. `dry`: the workers the checkpoint had found dry, whose parts ran dry
        in this epoch before it was resumed (asked nothing, they answer no exhaustion).

        An epoch left before its end (a `break`) leaves tasks with the workers, which they
        still load, in their turn, before they start the next epoch (their answers are stale:
        never handed over). Those answers' marks go on into `left` as they are recorded (see
        `answer`), so that it ends where each worker's dataset stood as the next epoch began.
        """
        standing = {w: mark for w in self._workers() if (mark := self.latest(w)) is not None}
        return WorkerMarks(
            _sorted(marks), dry=tuple(sorted(set(dry))), left=_sorted(standing), left_dry=self.dry
        )

    def latest(self, worker: int) -> Mark | None:
        """The mark of `worker`'s last answer recorded this epoch, received or not, else its
        received one (a checkpoint's, as an epoch resumed from it starts); None if neither.

        Where that worker's dataset stands: a worker that takes up its work (a replacement for
        one that died, say) is restored from it."""
        return _get(self.recorded, worker) or _get(self.received, worker)

    def restoring(self, worker: int, iterable: bool, carried: bool = False) -> Standing:
        """Where a replacement for `worker` is restored to (None: the executor's own start of
        the epoch, `Replacing.replace`): `latest`, or, for a worker that went on into this
        epoch from the epoch before (`carried`: a persistent iterator's epoch after its first),
        where it stood as this epoch began.

        A map-style worker starts an epoch with its dataset as its last answer left it (a new
        epoch makes a fetcher, nothing else), and its mark is the whole state: its mark in
        `left`, restored, is where the epoch began. Not so for an iterable part: the worker's
        dataset moved on past `left` (its part run dry, or read as far as `left` after a
        `break`, and `iter()` called again), and a mark restores a position in an iterator,
        not that. So its replacement is told both, `Carried`, and brought there as a
        checkpoint of this epoch brings a worker (`WorkerSetup.ended`), then to `latest`.
        """
        mark = self.latest(worker)
        if carried and iterable:
            open_ = worker not in self.left_dry
            standing: Mark | Carried | None = Carried(_get(self.left, worker), open_, mark)
        elif mark is None and not iterable:
            standing = _get(self.left, worker)
        else:
            standing = mark
        # Its part had run dry: its replacement may be asked nothing more this epoch.
        return RanDry(standing) if iterable and worker in self.dry else standing

    def answer(
        self, answer: TaskCompleted | TaskFailed | WorkerExhausted, base: int
    ) -> WorkerMarks:
        """With the mark of `answer`, kept until it is received, if it is of the epoch whose
        first task is `base`; one of the epoch before (a stale one) moves `left` on. A worker
        found dry is noted as such."""
        task, worker = answer.task, answer.worker
        if isinstance(answer, WorkerExhausted):
            if task < base:
                return attrs.evolve(self, left_dry=_with(self.left_dry, worker))
            return attrs.evolve(self, dry=_with(self.dry, worker))
        mark: Mark | None = answer.mark  # type: ignore[assignment]  # the core carries it opaque
        if task < base:
            # Never handed over, but the worker's dataset moved on by it all the same.
            return attrs.evolve(self, left=_moved(self.left, worker, mark, self.left))
        kept = [item for item in self.answered if item[0] != task]
        kept.append((task, (worker, mark)))
        kept.sort(key=_first)
        recorded = _moved(self.recorded, worker, mark, self.received)
        return attrs.evolve(self, answered=tuple(kept), recorded=recorded)

    def receive(self, task: int) -> WorkerMarks:
        """The consumer got `task`'s batch or error: its mark is now its worker's."""
        answered = self.answered
        at = next((i for i, item in enumerate(answered) if item[0] == task), None)
        if at is None:
            return self
        worker, mark = answered[at][1]
        rest = answered[:at] + answered[at + 1 :]
        received = _moved(self.received, worker, mark, self.received)
        return attrs.evolve(self, received=received, answered=rest)

    def _workers(self) -> set[int]:
        return {w for w, _ in self.received} | {w for w, _ in self.recorded}


def _sorted(marks: Mapping[int, Mark]) -> tuple[tuple[int, Mark], ...]:
    return tuple(sorted(marks.items(), key=_first))


def _with(workers: tuple[int, ...], worker: int) -> tuple[int, ...]:
    return workers if worker in workers else tuple(sorted((*workers, worker)))


def _get(pairs: tuple[tuple[int, Mark], ...], worker: int) -> Mark | None:
    return next((mark for w, mark in pairs if w == worker), None)


def _moved(
    pairs: tuple[tuple[int, Mark], ...],
    worker: int,
    mark: Mark | None,
    before: tuple[tuple[int, Mark], ...],
) -> tuple[tuple[int, Mark], ...]:
    """`pairs` with `worker`'s mark now `mark` (none: as they were)."""
    if mark is None:
        return pairs
    since, snapshot = mark
    if snapshot is ...:
        # Workers send their dataset's state only every so many batches; in between, a mark
        # counts the batches since the state it last sent, which this worker's mark in `before`
        # (or in `pairs` itself) has.
        previous = _get(pairs, worker) or _get(before, worker)
        snapshot = None if previous is None else previous[1]
    marks = dict(pairs)
    marks[worker] = (since, snapshot)
    return _sorted(marks)


@attrs.frozen
class DriverState:
    """A driver's state between calls, with its scheduler's (`Driver.snapshot`)."""

    state: State
    todo: tuple[Command, ...] = ()
    ledger: Ledger = _NO_LEDGER
    worker_marks: WorkerMarks | None = None
    confirm_owed: bool = False

    @classmethod
    def initial(cls, config: Config, marked: bool = False) -> DriverState:
        """A new driver's (see `Driver`'s `marked`)."""
        worker_marks = WorkerMarks() if config.iterable or marked else None
        return cls(initial_state(config), worker_marks=worker_marks)


def failure_exception(failure: Failure) -> BaseException:
    """The exception a torch user gets for a failure the scheduler reports."""
    if isinstance(failure, TaskFailure):
        error = failure.error
        if isinstance(error, RemoteError):
            return error.exception()
        if isinstance(error, BaseException):
            return error
        return RuntimeError(f"worker {failure.worker} failed on task {failure.task}: {error!r}")
    if isinstance(failure, WorkerDeath):
        return WorkerDiedError(
            death_message(failure), failure.worker, failure.pid, failure.exitcode
        )
    if isinstance(failure, WorkerHang):
        return WorkerHungError(failure.describe(), failure.worker, failure.pid, failure.stack)
    if isinstance(failure, Timeout):
        return LoaderTimeoutError(failure.describe())
    if isinstance(failure, Cancelled):
        return LoaderCancelledError(failure.describe())
    if isinstance(failure, (SamplerFailure, ExecutorFailure)):
        error = failure.error
        if isinstance(error, BaseException):
            return error
        return RuntimeError(failure.describe())
    raise InternalError(f"unknown failure {failure!r}")  # pragma: no cover


def death_message(death: WorkerDeath) -> str:
    """torch's sentence for a dead worker, which logs and alert rules match, then our detail."""
    if death.pid is not None:
        who = f"pid {death.pid}"
    elif death.reason is not None:
        # An executor with an account of its own (Ray's actor that died starting): not a thread.
        who = f"worker {death.worker}"
    else:
        who = f"thread {death.worker}"
    code = death.exitcode
    if code is not None and code < 0:
        number = -code
        name = signal.strsignal(number) or f"Unknown signal {number}"
        message = f"DataLoader worker ({who}) is killed by signal: {name}. "
        detail = f"It was statecore worker {death.worker}, ended by signal {number}"
        with contextlib.suppress(ValueError):
            detail += f" ({signal.Signals(number).name})"
        detail += ". "
        if number == signal.SIGBUS:
            detail += (
                "It is possible that the workers are out of shared memory: raise the shared "
                "memory limit (/dev/shm, docker's --shm-size). "
            )
        elif number == signal.SIGKILL:
            detail += "A SIGKILL is most often the kernel's out-of-memory killer. "
        else:
            detail += "It may have crashed in native code. "
    elif code is not None:
        message = f"DataLoader worker ({who}) exited unexpectedly with exit code {code}. "
        detail = f"It was statecore worker {death.worker}. "
    else:
        message = f"DataLoader worker ({who}) exited unexpectedly. "
        detail = f"It was statecore worker {death.worker}. "
    if death.reason is not None:
        # The executor's own account (Ray's, say), which often names the cause outright.
        detail += f"The executor reported: {death.reason} "
    if death.earlier:
        told = "; ".join(loss.describe_alone() for loss in death.earlier)
        detail += (
            f"Its {len(death.earlier)} worker restart(s) (worker_restarts) were spent before "
            f"it, on: {told}. "
        )
    return (
        message + detail + "If this repeats, run with num_workers=0 to see the error in the "
        "main process."
    )


def restorer(driver: Driver) -> Callable[[DriverState], None]:
    """A restore that makes `driver` what a new driver over the same executor, given the same
    arguments and then `Driver.restore`d, would be, from whatever calls it made since.

    For a caller that drives many states one call at a time through one executor (the models'
    explorer, `statecore.models.world`), where building a driver for each state took an
    eighth of its time. Everything `__init__` set is put back as it was built, so what a call
    leaves outside the snapshot (the stuck-worker watch, the epoch's seeds) does not carry over;
    the objects it was built with (its executor, its observers) are the same ones.
    """
    built = dict(vars(driver))
    attributes = vars(driver)

    def restore(snapshot: DriverState) -> None:
        attributes.clear()
        attributes.update(built)
        driver.restore(snapshot)

    return restore
