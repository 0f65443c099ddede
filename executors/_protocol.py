"""The executor protocol: what a driver loop needs from whatever does the loading.

An executor only moves data. It never decides which worker gets a task, how far to prefetch,
or in which order batches are handed over: the scheduler core decides that, and the driver
loop passes its commands on to the executor.

What an executor promises, and the models assume:

- every task sent to a worker is answered exactly once (`TaskCompleted`, `TaskFailed`, or, for
  an iterable dataset whose worker has run dry, `WorkerExhausted`), until the worker is stopped;
- a worker answers in the order it was given work, and answers a resume after every task sent
  before it (`WorkerResumed`);
- a worker that ends without being stopped is reported once with `WorkerDied`;
- every event of a worker names the incarnation that sent it (0 until its slot is replaced,
  then the `ReplaceWorker` command's number), so that the scheduler drops late news of a
  worker it has already replaced.

An executor that declares `replaces_workers` also carries out `ReplaceWorker` (`replace`): it
ends the lost incarnation if it still runs, starts a new one in the slot set up as the lost one
was, and answers `WorkerStarted` before anything else of the new incarnation.

This module holds the whole contract: the methods (`Executor`), what an executor is given to
start (`Launch`, `ExecutorFactory`), and what it declares beyond its methods (`Capabilities`,
read only through `capabilities_of`). Everything an executor may declare defaults to False,
which is what an executor that declares nothing gets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs

from statecore import Event, ReplaceWorker, ResumeWorker, SendTask
from statecore.executors._incarnation import Standing
from statecore.executors._worker import WorkerSetup

__all__ = [
    "Capabilities",
    "Declared",
    "Executor",
    "ExecutorFactory",
    "Launch",
    "Replacing",
    "WorkerReport",
    "capabilities_of",
    "confirmer_of",
    "replacer_of",
]


@runtime_checkable
class Executor(Protocol):
    """The small surface a driver loop drives."""

    def start(self) -> None:
        """Bring up the workers it was built for; they wait for tasks."""

    def dispatch(self, command: SendTask) -> None:
        """Give `command.worker` the task: produce the batch for `command.index`."""

    def resume(self, command: ResumeWorker) -> None:
        """Ask `command.worker` to start a new epoch with a fresh dataset iterator."""

    def poll(self, timeout: float | None) -> Event | None:
        """The next answer or death from any worker; None if none came within `timeout` seconds.

        `timeout=None` waits as long as it takes. An executor with nothing left to answer
        returns None at once.
        """

    def stop_worker(self, worker: int) -> None:
        """Tell `worker` to exit once it has read everything sent before."""

    def shutdown(self) -> None:
        """Release everything: join or terminate workers, close queues, free shared memory."""


@attrs.frozen
class WorkerReport:
    """What an executor can tell of one worker it is asked about (one found stuck)."""

    pid: int | None = None
    """Its process id; None for a thread."""
    stack: str | None = None
    """Its Python stack now, innermost call last, as a traceback prints it; None if unknown."""
    starting: bool = False
    """It has not finished starting (a process still importing, or in `worker_init_fn`): it is
    not stuck on the task yet, and the driver watches it again for another `worker_timeout`."""


@runtime_checkable
class Replacing(Protocol):
    """The methods of an executor that declares `Capabilities.replaces_workers`."""

    def replace(self, command: ReplaceWorker, mark: Standing) -> None:
        """End `command.worker`'s current incarnation if it still runs (kill it: it may be
        stuck) and start incarnation `command.incarnation` in its slot, set up as the lost one
        was (worker id, seed, `worker_init_fn`, the epoch `command.epoch` and its seed), its
        dataset restored to `mark` (the last answer the main process recorded from it; None:
        where it stood as the epoch began; a `Carried`, for a persistent worker's iterable
        dataset in a later epoch: both, which `executors._incarnation.replacement_setup`
        puts where a checkpoint would). Answer `WorkerStarted`, or `WorkerDied` with the
        new incarnation if it cannot start. It also starts a retired slot again (one told
        `stop_worker` earlier, which may have no worker left to end): a tuner's add."""

    def report(self, worker: int) -> WorkerReport:
        """The pid and the current Python stack of `worker` (asked of one found stuck, before
        the scheduler decides anything)."""


@attrs.frozen
class Capabilities:
    """What an executor declares beyond the protocol's methods.

    Declare it as a class attribute `capabilities` of the executor class (a class taking a
    `Launch` is its own factory; a subclass inherits it), or wrap a factory function in
    `Declared`, as the registry does for the built-in names. `in_process` and
    `poll_from_any_thread` are read from the factory, before any executor exists;
    `confirms_answers` is read from the executor the factory returned. Every field defaults to
    False: an executor declaring nothing loads in workers, is polled from the driver's thread
    only, and may lose an answer to an interrupt that lands as `poll` returns.
    """

    in_process: bool = False
    """It loads in the calling thread: it takes `num_workers=0` and is given one worker."""

    poll_from_any_thread: bool = False
    """`poll` may run in a thread of its own while the driver's thread calls `dispatch`,
    `resume` and `stop_worker` (it only reads pipes or a thread-safe queue). The pin-memory
    stage then polls from its own thread, and asks for `Launch.start_all_at_once`: an executor
    declaring this must start no worker from `poll` when that is set."""

    confirms_answers: bool = False
    """The executor keeps each answer until told it was recorded, so that an interrupt loses
    none. Ctrl-C may land just after `poll` took an answer from wherever it kept it, and the
    answer is then dropped along with `poll`'s return value. So `poll` keeps the answer it
    returns before it removes that answer from wherever it kept it, with no call in between,
    and returns it again from every later `poll` until its method `confirm()` is called; the
    driver calls it once the scheduler's state holds the answer (again, if an interrupt cut that
    call short). `statecore.executors._confirm.Confirming` is those steps."""

    replaces_workers: bool = False
    """The executor replaces a lost worker in its slot (`Replacing`): it may be given
    `ReplaceWorker`, so a loader with `worker_restarts` may use it. Read from the factory."""

    kills_stuck_workers: bool = False
    """A worker stuck in a task can be ended (a process is killed; a thread cannot be), so a
    stuck worker may be replaced rather than fail the loader. Read from the factory."""


def capabilities_of(declarer: object) -> Capabilities:
    """What `declarer` (an executor factory, or an executor) declares.

    Its `capabilities` attribute, if that is a `Capabilities`. An object without one is read
    the way the protocol was written before `Capabilities` existed, so that plug-ins written
    then keep working: a true `in_process` or `poll_from_any_thread` attribute declares that
    capability. (An attribute `unconfirmed` once declared `confirms_answers`, when the driver
    wrote it; it declares nothing now, and such an executor works as one that does not confirm.)
    """
    declared = getattr(declarer, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared
    return Capabilities(
        in_process=bool(getattr(declarer, "in_process", False)),
        poll_from_any_thread=bool(getattr(declarer, "poll_from_any_thread", False)),
    )


def replacer_of(executor: Executor) -> Replacing | None:
    """`executor` as a `Replacing` if it declares `replaces_workers`, else None. Raises
    TypeError for an executor that declares it and lacks the methods."""
    if not capabilities_of(executor).replaces_workers:
        return None
    if not isinstance(executor, Replacing):
        raise TypeError(
            f"the executor {executor!r} declares replaces_workers but lacks replace(command, "
            "mark) or report(worker); see docs/executors.md"
        )
    return executor


def confirmer_of(executor: Executor) -> Callable[[], None] | None:
    """`executor.confirm` if the executor confirms answers (`Capabilities.confirms_answers`),
    else None. Raises TypeError for an executor that declares it and has no `confirm`."""
    if not capabilities_of(executor).confirms_answers:
        return None
    confirm: Callable[[], None] | None = getattr(executor, "confirm", None)
    if not callable(confirm):
        raise TypeError(
            f"the executor {executor!r} declares confirms_answers but has no method confirm(): "
            "its poll() returns the answer it returned last again until the driver calls "
            "confirm() (the driver no longer reads and clears an attribute `unconfirmed`). "
            "Subclass statecore.executors.Confirming, or declare confirms_answers=False; see "
            "docs/executors.md"
        )
    return confirm


@attrs.frozen
class Launch:
    """Everything an executor needs: what each worker runs, and how many workers."""

    setup: WorkerSetup
    num_workers: int
    """Workers the scheduler addresses: the loader's num_workers, or 1 to load in-process."""
    multiprocessing_context: object = None
    """A start method name or a context object (stdlib or multiprocess), for process executors."""
    start_all_at_once: bool = False
    """Whether every worker must be started by the time `start()` returns.

    Asked of the executor, not declared by it. Executors may otherwise start workers as they
    are needed, from the thread that polls. A pin stage asks for this when its own thread
    polls (`Capabilities.poll_from_any_thread`): starting (forking) workers there would fork
    while the training loop runs, holding locks the children would inherit as held.
    """
    worker_restarts: int = 0
    """The loader's `worker_restarts`: how many lost workers it may replace (0: torch's
    behaviour, a lost worker fails the loader). Asked of the executor, for what it must report
    as a death: a thread ended by `SystemExit` goes on answering its tasks with that error
    without restarts, and is reported with `WorkerDied`, so that it is replaced, with them."""
    started: int | None = None
    """How many worker slots run from the start, the first ones (the scheduler's
    `Config.started`); None: all. The others begin retired: the executor starts no worker in
    them (not in `start()`, nor as tasks flow) until `replace` starts one there, which only an
    executor declaring `replaces_workers` is given (a loader with `num_workers="auto"`)."""

    @property
    def running_at_start(self) -> int:
        """The worker slots started from the start: `started`, or all of them."""
        return self.num_workers if self.started is None else self.started


ExecutorFactory = Callable[[Launch], Executor]


@attrs.frozen
class Declared:
    """An executor factory function together with the capabilities it declares.

    `Declared(make_executor, Capabilities(in_process=True))` is itself a factory. A class
    declares its `capabilities` as a class attribute instead, and needs no wrapper.
    """

    factory: ExecutorFactory
    capabilities: Capabilities

    def __call__(self, launch: Launch) -> Executor:
        return self.factory(launch)
