"""The driver loop: feeds events to the scheduler and carries out its commands.

This is the only place where the pure core meets the world. The loop decides nothing. It
carries out commands in the order given, draws an index when told, waits on the executor only
when the scheduler has nothing to hand over, and turns the scheduler's failures into the
exceptions a torch user expects.

An interrupt (Ctrl-C's KeyboardInterrupt, or whatever a Python signal handler raises, such as a
SIGALRM time limit) may arrive anywhere. Arriving in a wait, it is told to the scheduler
(`Interrupted`), which keeps everything owed; arriving while commands are carried out, the
command it cut short is carried out again on the next call (a draw from the sampler is
abandoned instead), and a batch already handed over is kept for the next request. Either way
the next `next()` goes on with the epoch and the next `iter()` starts a new one, as in torch.
"""

from __future__ import annotations

import contextlib
import signal
from collections import deque
from collections.abc import Callable
from typing import Any

from statecore import (
    Cancelled,
    CloseRequested,
    Command,
    Config,
    Deliver,
    EndEpoch,
    Event,
    Failure,
    IndexDrawn,
    InternalError,
    Interrupted,
    LoaderCancelledError,
    LoaderTimeoutError,
    NextRequested,
    Phase,
    PullIndex,
    RaiseError,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    SendTask,
    Shutdown,
    State,
    StopWorker,
    TaskFailure,
    TimedOut,
    Timeout,
    WorkerDeath,
    WorkerDiedError,
    initial_state,
    step,
)
from statecore.executors._protocol import Executor
from statecore.executors._remote import RemoteError
from statecore.executors._signals import HeldSignals, is_interrupt

__all__ = ["Driver", "death_message", "failure_exception", "is_interrupt"]

_NEXT = NextRequested()
_SAMPLER_EXHAUSTED = SamplerExhausted()
_CLOSE = CloseRequested()
_INTERRUPTED = Interrupted()


class Driver:
    """Runs one scheduler over one executor, for one loader iterator."""

    def __init__(
        self, config: Config, executor: Executor, draw: Callable[[], Any], timeout: float
    ) -> None:
        self.state: State = initial_state(config)
        self.executor = executor
        self.draw = draw
        # torch's timeout=0 means "wait as long as it takes".
        self.timeout: float | None = timeout if timeout > 0 else None
        self.todo: deque[Command] = deque()
        self.sampler_failed = False
        self.sampler_error: BaseException | None = None
        self.broken: BaseException | None = None
        """The executor's own failure (its poll raised): every later request raises it."""
        self.confirms = hasattr(executor, "unconfirmed")
        """Whether the executor keeps the answer it returned until told it was recorded."""
        self.handed: Command | None = None
        """What the scheduler gave the consumer in a call that an interrupt then cut short."""

    # --- the consumer's calls ----------------------------------------------------------------

    def start_epoch(self, seed: int | None = None) -> None:
        """Start an epoch; for a later epoch, return once every worker has resumed (as torch)."""
        self.handed = None  # a batch of the epoch being left behind
        self._feed(ResetRequested(seed))
        outcome = self._carry_out()
        while self.state.life.resetting:
            self._wait()
            outcome = self._carry_out() or outcome
        self._raise_sampler_error()  # priming the workers read the sampler, as torch's does
        if outcome is not None:
            self._hand_over(outcome)

    def next(self) -> Any:
        """The next batch; StopIteration at the end of the epoch; the worker's error in its turn."""
        if self.sampler_failed:
            self._raise_sampler_error()
            raise StopIteration  # as in torch, whose sampler iterator is spent once it raised
        if self.broken is not None:
            raise self.broken
        if self.handed is not None:
            handed, self.handed = self.handed, None
            return self._hand_over(handed)
        if self.todo:
            # Left by an interrupt: carried out before anything new is asked.
            self.handed = self._carry_out()
            if self.handed is not None:
                return self.next()
        self._feed(_NEXT)
        while True:
            outcome = self._carry_out()
            if outcome is not None:
                if type(outcome) is Deliver:
                    return outcome.payload
                return self._hand_over(outcome)
            if self.sampler_error is not None:
                self._raise_sampler_error()
            self._wait()

    def close(self) -> None:
        """Stop the workers and release everything. Idempotent."""
        if self.state.phase is not Phase.CLOSED:
            self._feed(_CLOSE)
            self._carry_out()

    # --- the loop ----------------------------------------------------------------------------

    def _feed(self, event: Event) -> None:
        self.state, commands = step(self.state, event)
        self.todo.extend(commands)

    def _wait(self) -> None:
        executor = self.executor
        try:
            # An answer returned by a poll whose return an interrupt cut short: fed now.
            event = executor.unconfirmed if self.confirms else None  # type: ignore[attr-defined]
            if event is None:
                event = self._poll()
            state, commands = step(self.state, event)
        except BaseException as error:
            # Also an interrupt raised just as poll returned: it surfaces on entering step.
            if is_interrupt(error):
                self._interrupted()
            raise
        # No call until the last of these stores: an interrupt cannot come between the new
        # state, the executor learning the answer was recorded, and the commands it brings.
        self.state = state
        if self.confirms:
            executor.unconfirmed = None  # type: ignore[attr-defined]
        self.todo.extend(commands)

    def _poll(self) -> Event:
        try:
            event = self.executor.poll(self.timeout)
        except Exception as error:
            if is_interrupt(error):
                raise
            # The executor itself broke: nothing it owes will come. Stop its workers, and give
            # every later request the same error, as torch does once its pin thread is gone.
            self.broken = error
            self.todo.clear()
            self.close()
            raise
        if event is None:
            if self.timeout is None:
                raise InternalError(
                    f"the scheduler waits in {self.state!r} but the executor owes nothing"
                )
            event = TimedOut(self.timeout)
        return event

    def _interrupted(self) -> None:
        """Tell the scheduler that the consumer's wait ended without an answer."""
        state = self.state
        if state.waiting or state.life.resetting or state.pulling_for is not None:
            self._feed(_INTERRUPTED)

    def _carry_out(self) -> Command | None:
        """Carry out every pending command; return the one telling what the consumer gets."""
        try:
            return self._carry_out_all()
        except BaseException as error:
            if is_interrupt(error):
                self._interrupted()
                raise
            # The executor failed to carry out a command (a worker that could not be started,
            # say): what the scheduler asked next can no longer be done. Stop what runs, and
            # give every later request the same error.
            self.broken = error
            self.todo.clear()
            self.close()
            raise

    def _carry_out_all(self) -> Command | None:
        outcome: Command | None = None
        todo, executor = self.todo, self.executor
        try:
            while todo:
                # Taken off only once carried out: an interrupt leaves it to be done again.
                command = todo[0]
                kind = type(command)
                if kind is SendTask:
                    executor.dispatch(command)  # type: ignore[arg-type]
                elif kind is PullIndex:
                    todo.popleft()  # an interrupted draw is abandoned, not repeated
                    self._pull()
                    continue
                elif kind is Deliver or kind is RaiseError or kind is EndEpoch:
                    outcome = command
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
                todo.popleft()
        except BaseException as error:
            if outcome is not None and is_interrupt(error):
                self.handed = outcome  # the consumer gets it with its next request
            raise
        return outcome

    def _pull(self) -> None:
        try:
            index = self.draw()
        except StopIteration:
            self._feed(_SAMPLER_EXHAUSTED)
        except BaseException as error:
            if is_interrupt(error):
                raise  # `_carry_out` abandons the draw
            # The sampler itself failed: nothing sensible can follow, so leave nothing behind.
            # A batch handed over in this same round still reaches the consumer first, and the
            # sampler's error comes with the next request, in the order torch raises them.
            self.todo.clear()
            self.sampler_failed = True
            self.close()
            self.sampler_error = error
        else:
            self.state, commands = step(self.state, IndexDrawn(index))
            self.todo.extend(commands)

    def _raise_sampler_error(self) -> None:
        error, self.sampler_error = self.sampler_error, None
        if error is not None:
            raise error

    def _hand_over(self, outcome: Command) -> Any:
        if type(outcome) is Deliver:
            return outcome.payload
        if type(outcome) is EndEpoch:
            raise StopIteration
        raise failure_exception(outcome.failure)  # type: ignore[attr-defined]


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
    raise InternalError(f"unknown failure {failure!r}")  # pragma: no cover


def death_message(death: WorkerDeath) -> str:
    """torch's sentence for a dead worker, which logs and alert rules match, then our detail."""
    who = f"pid {death.pid}" if death.pid is not None else f"thread {death.worker}"
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
    return (
        message + detail + "If this repeats, run with num_workers=0 to see the error in the "
        "main process."
    )
