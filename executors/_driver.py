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
SIGALRM time limit) may arrive anywhere; the scheduler is told (`Interrupted`), and keeps
everything owed. A command it cut short is carried out again on the next call (a draw from the
sampler is abandoned instead, as the scheduler was told), and an outcome already given is
handed over by the next request. Either way the next `next()` goes on with the epoch and the
next `iter()` starts a new one, as in torch.
"""

from __future__ import annotations

import contextlib
import signal
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from statecore import (
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
    InternalError,
    Interrupted,
    LoaderCancelledError,
    LoaderTimeoutError,
    NextRequested,
    Phase,
    Progress,
    RaiseError,
    ResetRequested,
    ResumeWorker,
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
    initial_state,
    progress,
    step,
)
from statecore.executors._flight import FlightRecorder
from statecore.executors._protocol import Executor, confirmer_of
from statecore.executors._quick import index_drawn
from statecore.executors._remote import RemoteError
from statecore.executors._signals import HeldSignals, is_interrupt

__all__ = ["Driver", "death_message", "failure_exception", "is_interrupt"]

_NEXT = NextRequested()
_SAMPLER_EXHAUSTED = SamplerExhausted()
_CLOSE = CloseRequested()
_INTERRUPTED = Interrupted()
_MARKED = (TaskCompleted, TaskFailed)

StepFunction = Callable[[State, Event], Transition]


class Driver:
    """Runs one scheduler over one executor, for one loader iterator.

    `step` is the scheduler's transition function; the models pass one that checks every
    transition as well, a traced loader one that watches it. With `flight`, a flight recorder
    wraps it: the last events are kept, and an internal error, an executor reporting the
    impossible or a timeout writes them to a file that the error names
    (`statecore.executors._flight`, docs/flight-recorder.md). By default it records unless the
    scheduler is lazy, that is loads in the calling thread: there a batch costs so little that
    the recorder would add 3 to 4% to it, and no timeout can happen.
    """

    def __init__(
        self,
        config: Config,
        executor: Executor,
        draw: Callable[[State], Any],
        timeout: float,
        step: StepFunction = step,
        *,
        flight: bool | None = None,
        marked: bool = False,
    ) -> None:
        """`draw` draws the next index from the sampler (StopIteration at its end); it is given
        the scheduler's state as the draw is asked (where the consumer stands, for a sampler's
        checkpoint). `marked`: the workers' answers carry marks though the dataset is map-style
        (its state per worker, see `WorkerRuntime`); an iterable dataset's always do."""
        self.state: State = initial_state(config)
        self.executor = executor
        self.draw = draw
        if flight is None:
            flight = not config.lazy
        self.flight = FlightRecorder(config) if flight else None
        self.step = step if self.flight is None else self.flight.wrap(step)
        # torch's timeout=0 means "wait as long as it takes".
        self.timeout: float | None = timeout if timeout > 0 else None
        self.todo: deque[Command] = deque()
        self.confirm = confirmer_of(executor)
        """The executor's `confirm`, if it keeps each answer until told it was recorded."""
        self.confirm_owed = False
        """The state holds the answer the executor returned last, and the executor may not have
        been told yet: an interrupt cut the driver's `confirm` call short."""
        self.handed: Command | None = None
        """An outcome given in a call that an interrupt then cut short: the next request's."""
        self.void: list[tuple[int, int]] = []
        """(task, worker) handed over in a call that raised the executor's failure instead."""
        self.marks: dict[int, Any] | None = {} if config.iterable or marked else None
        """An iterable (or stateful map-style) dataset's workers: the mark of each one's last
        batch (or task error) the consumer received, which a checkpoint records (see
        `WorkerRuntime` for marks)."""
        self.answered: dict[int, tuple[int, Any]] = {}
        """The marks of tasks answered this epoch and not yet received: task -> (worker, mark)."""

    # --- the consumer's calls ----------------------------------------------------------------

    def start_epoch(
        self,
        seed: int | None = None,
        resume: Progress | None = None,
        marks: dict[int, Any] | None = None,
    ) -> None:
        """Start an epoch: return once iter() is done (workers resumed, first tasks out).

        `resume` goes on with a checkpoint's epoch instead; the sampler must be at its `done`,
        and an iterable dataset's workers where `marks` (the checkpoint's) say.
        """
        self.handed = None  # an outcome of the epoch being left behind
        self.void = []
        if self.marks is not None:
            self.marks = dict(marks or {})
            self.answered = {}
        outcome = self.finish(self.request(ResetRequested(seed, resume)))
        if outcome is not None:
            try:
                self.hand_over(outcome)
            finally:
                del outcome  # see `hand_over`

    def next(self) -> Any:
        """The next batch; StopIteration at the end of the epoch; the worker's error in its turn."""
        outcome, self.handed = self.handed, None
        if outcome is None and self.todo:
            # Left by an interrupt: carried out before anything new is asked.
            outcome = self.carry_out()
        if outcome is None:
            outcome = self.request(_NEXT)
            if outcome is None:
                outcome = self.finish(outcome)
            if type(outcome) is Deliver:
                if self.marks is not None:
                    self._received(outcome.task)
                return outcome.payload
            if outcome is None:
                raise self._recorded(
                    InternalError(f"the scheduler left a request unanswered in {self.state!r}")
                )
        try:
            return self.hand_over(outcome)
        finally:
            del outcome  # see `hand_over`

    def close(self) -> None:
        """Stop the workers and release everything. Idempotent."""
        if self.state.phase is Phase.CLOSED:
            return
        outcome = self.request(_CLOSE)
        # A cancellation is the waiting consumer's, not the closer's; an executor that failed
        # to stop its workers is the closer's to hear.
        if type(outcome) is RaiseError and type(outcome.failure) is not Cancelled:
            try:
                self.hand_over(outcome)
            finally:
                del outcome  # see `hand_over`

    def progress(self) -> Progress:
        """What a checkpoint records now (see `statecore.progress`).

        A batch (or a task's error) the scheduler handed over and the consumer did not get is
        not counted: an interrupt kept it for the next request, or the executor failed and
        its error took the batch's place.
        """
        unreceived = [*self.void, *_tasks_of((self.handed, *self.todo))]
        return progress(self.state, unreceived)

    # --- the moves of a call -------------------------------------------------------------------

    def request(self, event: Event) -> Command | None:
        """Tell the scheduler of a consumer's call; carry out what follows; the outcome if any."""
        self.state, commands = self.step(self.state, event)
        self.todo.extend(commands)
        return self.carry_out()

    def finish(self, outcome: Command | None) -> Command | None:
        """Wait for the call's outcome for as long as the scheduler says the consumer waits."""
        while outcome is None and (self.state.waiting or self.state.life.resetting):
            outcome = self.wait()
        return outcome

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
            event = self._poll()
            state, commands = self.step(self.state, event)
            # No call until the last of these stores: an interrupt cannot come between the new
            # state, the note that the executor is owed its confirmation, and the commands.
            self.state = state
            self.confirm_owed = confirm is not None
            self.todo.extend(commands)
            if confirm is not None:
                confirm()
                self.confirm_owed = False
            if self.marks is not None and type(event) in _MARKED:
                self._answered(event)  # type: ignore[arg-type]
        except BaseException as error:
            # Also an interrupt raised just as poll returned: it surfaces on entering step.
            if is_interrupt(error):
                self._interrupted()
            raise
        return self.carry_out()

    def hand_over(self, outcome: Command) -> Any:
        """What the consumer gets for an outcome: the batch, StopIteration, or the error.

        A failure may hold the very exception raised (a worker thread's), whose traceback holds
        the frames it passes: a frame still holding the outcome closes a cycle, and the loader
        with its workers then lives on until the garbage collector runs. So this frame, and
        each caller's, lets go of the outcome before the exception leaves it.
        """
        if type(outcome) is Deliver:
            if self.marks is not None:
                self._received(outcome.task)
            return outcome.payload
        if type(outcome) is EndEpoch:
            raise StopIteration
        if self.marks is not None and type(outcome.failure) is TaskFailure:  # type: ignore[attr-defined]
            self._received(outcome.failure.task)  # type: ignore[attr-defined]
        error = failure_exception(outcome.failure)  # type: ignore[attr-defined]
        if type(error) is LoaderTimeoutError and self.flight is not None:
            # torch's message, which logs match, stays as it is: the file is named in a note.
            # Sticky: a timeout raised again names the same file.
            failure = outcome.failure  # type: ignore[attr-defined]
            self.flight.attach(error, self.state, key=failure, as_note=True)
        del outcome
        try:
            raise error
        finally:
            del error

    def _recorded(self, error: InternalError) -> InternalError:
        """`error`, naming the flight recorder's file of the events that led to it."""
        if self.flight is not None:
            self.flight.attach(error, self.state)
        return error

    def _answered(self, answer: TaskCompleted | TaskFailed) -> None:
        """Keep the mark of an answer of this epoch (not a stale one) until it is received."""
        if answer.task >= self.state.life.base:
            self.answered[answer.task] = (answer.worker, answer.mark)

    def _received(self, task: int) -> None:
        """The consumer got `task`'s batch or error: its mark is now its worker's."""
        answer = self.answered.pop(task, None)
        if answer is None or answer[1] is None:
            return
        worker, (since, snapshot) = answer
        if snapshot is ...:
            # Workers send their dataset's state only every so many batches; in between, a mark
            # counts the batches since the state it last sent, which this worker's last mark has.
            previous = self.marks.get(worker)  # type: ignore[union-attr]
            snapshot = None if previous is None else previous[1]
        self.marks[worker] = (since, snapshot)  # type: ignore[index]

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
            event = self.executor.poll(self.timeout)
        except Exception as error:
            if is_interrupt(error):
                raise
            return ExecutorFailed(error)
        if event is None:
            if self.timeout is None:
                raise self._recorded(
                    InternalError(
                        f"the scheduler waits in {self.state!r} but the executor owes nothing"
                    )
                )
            event = TimedOut(self.timeout)
        return event

    def carry_out(self) -> Command | None:
        """Carry out every pending command; return the last telling what the consumer gets."""
        outcome: Command | None = None
        todo, executor = self.todo, self.executor
        try:
            while todo:
                # Taken off only once carried out: an interrupt leaves it to be done again.
                command = todo[0]
                kind = type(command)
                if kind is Deliver or kind is RaiseError or kind is EndEpoch:
                    outcome = command
                elif kind is DrawIndex:
                    todo.popleft()  # an interrupted draw is abandoned, not repeated
                    self._draw()
                    continue
                else:
                    try:
                        if kind is SendTask:
                            executor.dispatch(command)  # type: ignore[arg-type]
                        elif kind is ResumeWorker:
                            executor.resume(command)  # type: ignore[arg-type]
                        elif kind is StopWorker:
                            executor.stop_worker(command.worker)  # type: ignore[attr-defined]
                        elif kind is Shutdown:
                            # Once begun, a shutdown finishes: an interrupt is raised after it.
                            with HeldSignals():
                                executor.shutdown()
                        else:  # pragma: no cover - the core emits no other command
                            raise InternalError(f"the driver cannot carry out {command!r}")
                    except Exception as error:
                        if isinstance(error, InternalError):
                            self._recorded(error)
                        if is_interrupt(error) or isinstance(error, InternalError):
                            raise
                        # What the scheduler answers replaces the rest of this run, and the
                        # outcome already picked up in it.
                        self.void.extend(_tasks_of((outcome, *todo)))
                        todo.clear()
                        self._feed(ExecutorFailed(error))
                        continue
                todo.popleft()
        except BaseException as error:
            if is_interrupt(error):
                if outcome is not None:
                    self.handed = outcome
                self._interrupted()
            raise
        return outcome

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
            self.state, commands = self.step(self.state, index_drawn(index))
            self.todo.extend(commands)


def _tasks_of(commands: Iterable[Command | None]) -> list[tuple[int, int]]:
    """The (task, worker) whose batch or error these commands hand to the consumer."""
    tasks = []
    for command in commands:
        if type(command) is Deliver:
            tasks.append((command.task, command.worker))
        elif type(command) is RaiseError and type(command.failure) is TaskFailure:
            tasks.append((command.failure.task, command.failure.worker))
    return tasks


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
    return (
        message + detail + "If this repeats, run with num_workers=0 to see the error in the "
        "main process."
    )
