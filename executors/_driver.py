"""The driver loop: feeds events to the scheduler and carries out its commands.

This is the only place where the pure core meets the world. The loop decides nothing. It
carries out commands in the order given, draws an index when told, waits on the executor only
when the scheduler has nothing to hand over, and turns the scheduler's failures into the
exceptions a torch user expects.
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

__all__ = ["Driver", "failure_exception"]

_NEXT = NextRequested()
_SAMPLER_EXHAUSTED = SamplerExhausted()
_CLOSE = CloseRequested()


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
        self.sampler_error: Exception | None = None
        self.broken: Exception | None = None
        """The executor's own failure (its poll raised): every later request raises it."""

    # --- the consumer's calls ----------------------------------------------------------------

    def start_epoch(self, seed: int | None = None) -> None:
        """Start an epoch; for a later epoch, return once every worker has resumed (as torch)."""
        self._feed(ResetRequested(seed))
        outcome = self._carry_out()
        while self.state.phase is Phase.RESUMING:
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
        try:
            event = self.executor.poll(self.timeout)
        except Exception as error:
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
        self.state, commands = step(self.state, event)  # _feed, inlined: once per batch
        self.todo.extend(commands)

    def _carry_out(self) -> Command | None:
        """Carry out every pending command; return the one telling what the consumer gets."""
        try:
            return self._carry_out_all()
        except Exception as error:
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
        while todo:
            command = todo.popleft()
            kind = type(command)
            if kind is SendTask:
                executor.dispatch(command)  # type: ignore[arg-type]
            elif kind is PullIndex:
                self._pull()
            elif kind is Deliver or kind is RaiseError or kind is EndEpoch:
                outcome = command
            elif kind is ResumeWorker:
                executor.resume(command)  # type: ignore[arg-type]
            elif kind is StopWorker:
                executor.stop_worker(command.worker)  # type: ignore[attr-defined]
            elif kind is Shutdown:
                executor.shutdown()
            else:  # pragma: no cover - the core emits no other command
                raise InternalError(f"the driver cannot carry out {command!r}")
        return outcome

    def _pull(self) -> None:
        try:
            index = self.draw()
        except StopIteration:
            self._feed(_SAMPLER_EXHAUSTED)
        except BaseException as error:
            # The sampler itself failed: nothing sensible can follow, so leave nothing behind.
            # A batch handed over in this same round still reaches the consumer first, and the
            # sampler's error comes with the next request, in the order torch raises them.
            self.todo.clear()
            self.sampler_failed = True
            self.close()
            if not isinstance(error, Exception):
                raise
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
        message = failure.describe()
        if failure.exitcode is not None and failure.exitcode < 0:
            with contextlib.suppress(ValueError):
                message += f" ({signal.Signals(-failure.exitcode).name})"
        return WorkerDiedError(
            message + ". It may have run out of memory or crashed in native code; "
            "if this repeats, try num_workers=0 to see the error in the main process.",
            failure.worker,
            failure.pid,
            failure.exitcode,
        )
    if isinstance(failure, Timeout):
        return LoaderTimeoutError(failure.describe())
    if isinstance(failure, Cancelled):
        return LoaderCancelledError(failure.describe())
    raise InternalError(f"unknown failure {failure!r}")  # pragma: no cover
