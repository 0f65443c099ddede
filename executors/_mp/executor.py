"""The mp executor's parent side: it starts the workers, sends tasks, polls, shuts down.

Run by the main process (the loader's), from the driver's thread, and for `poll` from the pin
stage's thread when there is one (`Capabilities.poll_from_any_thread`).

Each worker has its own task pipe and its own result pipe. The parent waits on every result
pipe and every worker's process sentinel at once (one poll object, `watch`), so a worker
that dies is noticed the moment it dies, not after a polling interval. While it reads a
message it holds back Python signal handlers (`_signals`), since a message read in half is lost.

Each worker is started when the scheduler first gives it something to do (or the main process
first waits for answers), so the first worker loads its first batch while the others are
still being started, instead of every worker waiting for the last one to be started. Spawn
and forkserver workers read the pickled setup from a file (`_setup_message`), so a start returns
at once, and while one fewer than there are cores are still importing, the next waits
(`_importing`). Every start goes through `_launch`. Under forkserver the fork server
preloads the worker's module, and so torch, before it forks any worker (`preload_in_forkserver`).

A buffer of a worker's pool goes back to it with the next task it is sent, once the consumer
has let go of what was built on it (`leases`). What no task carried back within `LINGER` of
being let go of goes back on its own, from a thread of the executor's (`_give_back_lingering`),
and the worker shrinks its pool at once: a worker sent no more tasks (the consumer paused, or
persistent workers between epochs) would otherwise keep its pool, and this process its
mappings, as large as a consumer that kept many batches made them.

When forked workers end (shutdown), the buffers of theirs that nothing uses any more are kept
by this process (`leases.Kept`, bounded, released when unused for a while), and the next forked
workers, of this loader's next epoch or of a later loader, each adopt a share of them as they
start (`_kept_share`): their first batches then go into pages already faulted in.

Both picklers share tensors through the standard library's resource sharer, which
authenticates with `multiprocessing.current_process().authkey`. In a worker started by
`multiprocess` that key is not the parent's, so each worker takes the parent's key (`Home`)
before it unpickles anything. The sharer's sockets go in a directory of the executor's, which
shutdown removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as stdlib_multiprocessing
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
from typing import Any, ClassVar

import attrs
import multiprocess
import multiprocess.connection
import multiprocess.context
import multiprocess.util

from statecore import (
    Event,
    ReplaceWorker,
    ResumeWorker,
    SendTask,
    TaskCompleted,
    TaskFailed,
    WorkerDied,
)
from statecore.executors._confirm import Confirming
from statecore.executors._incarnation import Standing
from statecore.executors._mp import stacks
from statecore.executors._mp import worker as worker_module
from statecore.executors._mp.descriptors import explain_exhaustion
from statecore.executors._mp.handles import WorkerProcess
from statecore.executors._mp.leases import KEPT, BufferReceiver, HostRegister
from statecore.executors._mp.pool import BUFFERS_PER_WORKER
from statecore.executors._mp.taskpipe import TaskWriter
from statecore.executors._mp.watch import Watch
from statecore.executors._mp.wire import (
    BATCH,
    MARKED,
    NOTICE,
    TIMED,
    Shipment,
    decode,
    encode_returns,
    encode_task,
)
from statecore.executors._mp.worker import Home, Restart, worker_main
from statecore.executors._protocol import Capabilities, Launch, WorkerReport
from statecore.executors._remote import RemoteError
from statecore.executors._signals import HeldSignals
from statecore.executors._worker import WorkerSetup

__all__ = ["MultiprocessExecutor", "preload_in_forkserver", "resolve_context"]

# How long shutdown lets workers exit by themselves before terminating them. An idle worker
# exits at once; one still busy with a batch nobody will read is simply terminated.
SHUTDOWN_GRACE = 1.0
# How long to wait for a process that has ended, or was terminated, to be reaped.
JOIN_TIMEOUT = 5.0
# How long buffers the consumer has let go of wait for a task to carry them back to their worker
# before they go back on their own. While batches flow, the next task carries them, and nothing
# more is sent; this bounds how long a worker sent no task keeps a pool it no longer needs.
LINGER = 0.5
# How often `poll` looks whether a starting spawn or forkserver worker is done importing, while
# it holds the next ones back (`_importing`).
STARTING_CHECK = 0.01


def resolve_context(spec: object) -> multiprocess.context.BaseContext:
    """A multiprocess context from a start method name or a context object of either package."""
    if spec is None:
        return multiprocess.get_context()
    if isinstance(spec, str):
        return multiprocess.get_context(spec)
    if isinstance(spec, multiprocess.context.BaseContext):
        return spec
    if isinstance(spec, stdlib_multiprocessing.context.BaseContext):
        return multiprocess.get_context(spec.get_start_method())
    raise TypeError(
        "multiprocessing_context should be a start method name or a context object, "
        f"but got {spec!r}"
    )


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def preload_in_forkserver() -> None:
    """Have the fork server import the worker's module (and so torch) before it forks any worker.

    A worker forked from the server then starts with torch already imported, rather than each
    worker importing it anew: seconds per worker, and on few cores the workers queue for them.
    The server imports once, when it starts, and stays single-threaded, which is what makes
    forking from it safe. Only a server not yet started takes the hint; what its preload list
    already holds (by default `__main__`) stays.
    """
    from multiprocess import forkserver

    server = forkserver._forkserver
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    if worker_module.__name__ not in preload:
        forkserver.set_forkserver_preload([*preload, worker_module.__name__])


class MultiprocessExecutor(Confirming):
    """Runs each worker in its own process; see the package docstring for what crosses."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        confirms_answers=True, replaces_workers=True, kills_stuck_workers=True
    )

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.context = resolve_context(launch.multiprocessing_context)
        # Keyed by worker, for the workers started so far.
        self.processes: dict[int, Any] = {}
        self.tasks: dict[int, TaskWriter] = {}
        self.readers: dict[int, Any] = {}
        self.task_readers: dict[int, Any] = {}
        self.incarnations: dict[int, int] = {}
        """Per worker replaced so far, the incarnation its process runs (0 for the others):
        every answer read from its pipes is stamped with it."""
        self.resumed: dict[int, ResumeWorker] = {}
        """The last resume sent to each worker: a replacement starts in that epoch."""
        self.retired: list[Any] = []
        """Processes of lost incarnations that had not ended when they were replaced."""
        self.to_close: list[Any] = []
        """A lost incarnation's result pipe, task pipe end and process handle, closed by the
        next `poll` (or shutdown): the pin stage's thread may be waiting on them as the driver's
        replaces the worker, and a handle closed under a wait fails it."""
        self.unstartable: set[int] = set()
        """Workers whose replacement failed to start: none starts in their slot but by
        another `replace`."""
        self.held: dict[int, list[bytes]] = {}
        """Task messages for workers not started yet, written once each starts."""
        self.due: dict[int, Restart] = {}
        """Retired slots added back (`replace`) whose process is not started yet: `poll`
        starts them as it starts the first ones, while no answer waits."""
        # The pin stage polls from its own thread while the driver's thread dispatches.
        self.launching = threading.Lock()
        self.reading = threading.Lock()
        """Held while answers are read from the pipes, and while a worker's pipes are swapped
        for its replacement's: the pin stage may be reading them meanwhile."""
        self.shipped: WorkerSetup | None = None
        """The setup, given to forked workers as it is; None: sent pickled (`_setup_message`)."""
        self.shipment: Shipment | None = None
        self.setup_file: str | None = None
        """Where the shipment's pickle was written for the workers (`_setup_message`)."""
        self.start_together = max(1, _cores() - 1)
        """How many spawn or forkserver workers may import at once (`_importing`): a core is
        left to this process, which pickles the setup meanwhile, then takes the batches."""
        self.authkey = b""
        self.home: Home | None = None
        """Made when the first worker starts: a loader that starts none leaves no directory."""
        self.remove_tempdir: Any = None
        self.ready: list[Event] = []
        self.watch = Watch()
        """What `poll` waits on, registered once for as long as the same handles are watched."""
        self.signals_held = HeldSignals()
        self.stopping: set[int] = set()
        self.shutting_down: Any = None
        self.gone: set[int] = set()
        self.buffers = BufferReceiver()
        self.giving_back: threading.Thread | None = None
        """Gives back the buffers no task carries back (`_give_back_lingering`); started once
        the first message that uses a buffer arrives."""
        self.stop_giving_back = threading.Event()
        self.returning = threading.Lock()
        """Held from taking the buffers that go back to a worker to putting them in its pipe."""
        self.closed = False
        self.exit_codes: dict[int, int | None] = {}
        """The exit code of each worker process closed by `shutdown`, by pid: what its
        `WorkerProcess` handle (`worker_handles`) says once the process object is closed."""
        self.handles: dict[int, WorkerProcess] = {}
        """Per worker, the handle of its process (`worker_handles`), made while it was open."""

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Get ready to start the workers: the first starts with its first task (`_send`)."""
        ctx = self.context
        if ctx.get_start_method() == "forkserver":
            preload_in_forkserver()
        setup = self.launch.setup
        # Under spawn and forkserver the setup is pickled once the first worker has started,
        # while it imports its modules (`_setup_message`).
        self.shipped = setup if ctx.get_start_method() == "fork" else None
        self.authkey = bytes(stdlib_multiprocessing.current_process().authkey)
        # A raw shared flag, not an Event: an Event's lock would stay held for ever by a worker
        # killed while checking it, and shutdown would then block on it.
        self.shutting_down = ctx.RawValue(ctypes.c_bool, False)
        # Slots that begin retired start no process until `replace` starts one in them: taken
        # as stopped, they are passed over by every launch.
        self.stopping.update(range(self.launch.running_at_start, self.launch.num_workers))
        if self.launch.start_all_at_once:
            for worker in range(self.launch.num_workers):
                self._launch(worker)

    def _launch(self, worker: int) -> None:
        """Start `worker`'s process, unless it runs, was stopped, or shutdown has begun."""
        failure: BaseException | None = None
        restart: Restart | None = None
        # A fork cut short would leave a child nobody recorded: an interrupt is raised once the
        # worker is started and recorded, from the end of this block (see _signals).
        with self.signals_held, self.launching:
            if (
                worker in self.processes
                or worker in self.stopping
                or worker in self.unstartable
                or self.closed
            ):
                return
            restart = self.due.pop(worker, None)
            try:
                self._start_process(worker, restart)
            except BaseException as error:
                failure = explain_exhaustion(error)  # while the descriptors are still held
                if restart is not None:
                    self.unstartable.add(worker)
        if failure is not None:
            if restart is not None and isinstance(failure, Exception):
                # An added slot that cannot start is lost as a replacement is (see `replace`).
                reason = f"its replacement could not be started: {failure!r}"
                self.ready.append(WorkerDied(worker, None, None, reason, restart.incarnation))
                return
            self.shutdown()
            raise failure

    def _start_process(self, worker: int, restart: Restart | None = None) -> None:
        # Each worker's pipes are made just before it starts, and the writing end of its
        # result pipe is closed here just after: a worker started earlier does not hold it, so
        # EOF on a result pipe means that its worker is gone. (A worker forked later does
        # inherit this process's ends of earlier workers' pipes, and never uses them.)
        ctx = self.context
        home = self._home()
        shipped = self.shipped
        task_reader, task_writer = ctx.Pipe(duplex=False)
        reader, writer = ctx.Pipe(duplex=False)
        # A forked worker inherits the descriptors of the buffers kept from workers gone before
        # it (`leases.Kept`), and adopts its share of them; the others start with none.
        adopted = self.buffers.adopt(worker, self._kept_share()) if shipped is not None else ()
        try:
            tasks = TaskWriter(os.dup(task_writer.fileno()), f"statecore-tasks-{worker}")
        finally:
            task_writer.close()
        process = ctx.Process(
            target=worker_main,
            args=(
                shipped,
                worker,
                task_reader,
                writer,
                home,
                self.shutting_down,
                restart,
                adopted,
            ),
            name=f"statecore-worker-{worker}",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            for end in (task_reader, writer, reader):
                end.close()
            tasks.close()
            raise
        # This process keeps its copy of the task pipe's reading end: writing to the pipe of a
        # worker that died then fills the pipe rather than raising SIGPIPE, which would kill a
        # main process that restored the signal's default. The death is reported by its
        # sentinel.
        self.task_readers[worker] = task_reader
        writer.close()
        self.readers[worker], self.processes[worker] = reader, process
        if shipped is None:
            try:
                setup = self._setup_message(home)
            except BaseException:
                # Recorded, so that shutdown stops it: it waits for a setup that never comes.
                self.tasks[worker] = tasks
                raise
            tasks.put(setup)
        for message in self.held.pop(worker, ()):
            tasks.put(message)
        self.tasks[worker] = tasks  # last: from now on `_send` writes to it directly

    def _kept_share(self) -> int:
        """How many kept buffers the worker about to start takes: an even share among the
        workers not started yet, at most what a pool holds."""
        waiting = sum(
            worker not in self.processes and worker not in self.stopping
            for worker in range(self.launch.num_workers)
        )
        return min(BUFFERS_PER_WORKER, -(-len(KEPT) // max(1, waiting)))

    def _setup_message(self, home: Home) -> bytes:
        """The first message of a spawn or forkserver worker just started: the file holding
        the setup's pickle, and handles of its own for what was set aside (`wire.Shipment`).

        The setup is pickled once, when the first worker has started: while that worker imports
        torch (seconds), this process pickles the dataset and moves its tensors to shared memory,
        rather than before it. The pickle goes in a file of the executor's directory, written
        once, not in the process's arguments: spawn and forkserver write those to a pipe that
        the new process reads only once it has imported what they name, and until then the
        start blocks this process, so that with a pickle of megabytes the workers would start
        one after the other. Each start returns at once, and the workers start side by side.
        """
        if self.shipment is None:
            shipment = Shipment.pack(self.launch.setup)
            path = os.path.join(home.tempdir, "setup.pickle")
            with open(path, "wb") as file:
                file.write(shipment.setup)
            self.shipment, self.setup_file = shipment, path
        assert self.setup_file is not None
        return pickle.dumps((self.setup_file, self.shipment.for_worker()[1]))

    def _home(self) -> Home:
        if self.home is None:
            tempdir = tempfile.mkdtemp(prefix="statecore-")
            # Removed at shutdown; for a loader never shut down, at interpreter exit once its
            # workers are terminated (unlike weakref.finalize, not in a forked child's exit).
            self.remove_tempdir = multiprocess.util.Finalize(
                self, shutil.rmtree, args=(tempdir, True), exitpriority=-50
            )
            self.home = Home(pid=os.getpid(), authkey=self.authkey, tempdir=tempdir)
        return self.home

    def _next_to_launch(self) -> int | None:
        if self.closed or len(self.processes) == self.launch.num_workers:
            return None
        for worker in range(self.launch.num_workers):
            if (
                worker not in self.processes
                and worker not in self.stopping
                and worker not in self.unstartable
            ):
                return worker
        return None

    def _send(self, worker: int, command: SendTask | ResumeWorker) -> None:
        tasks = self.tasks.get(worker)
        if tasks is not None:
            # Buffers taken to go back are in the pipe before any taken after them, whichever
            # thread takes them (see `_give_back`): a worker shrinks its pool no later than
            # the first task it is sent after the consumer let go.
            with self.returning:
                tasks.put(encode_task(command, self.buffers.returns_for(worker)))
            return
        # Not started yet, so it lent nothing: no buffer goes back with this task.
        message = encode_task(command, ())
        with self.launching:
            started = worker in self.tasks
            if not started:
                if worker not in self.stopping and not self.closed:
                    self.held.setdefault(worker, []).append(message)
                first = not self.processes
        if started:
            self._send(worker, command)  # it started meanwhile
        elif first:
            # The first worker given a task starts at once; the others start while the main
            # process waits for answers (see `poll`).
            self._launch(worker)

    def dispatch(self, command: SendTask) -> None:
        self._send(command.worker, command)

    def resume(self, command: ResumeWorker) -> None:
        self.resumed[command.worker] = command
        self._send(command.worker, command)

    # --- lost workers ------------------------------------------------------------------------

    def replace(self, command: ReplaceWorker, mark: Standing) -> None:
        """Kill the worker's process if it still runs (it may be stuck), release what it held,
        and start incarnation `command.incarnation` in its slot (see `Restart`)."""
        worker, incarnation = command.worker, command.incarnation
        resumed = self.resumed.get(worker)
        later = resumed is not None and resumed.epoch == command.epoch
        seed = resumed.seed if later and resumed is not None else self.launch.setup.shared_seed
        restart = Restart(incarnation, seed, mark, later)
        failure: BaseException | None = None
        # As in `_launch`: a start cut short would leave a process nobody recorded.
        with self.signals_held, self.launching, self.reading:
            if self.closed:
                return
            # A slot told to stop and started again is a retired one added back (the core
            # orders a shutdown's stops after every replacement, never before one).
            added = worker in self.stopping
            self.stopping.discard(worker)
            self._retire(worker)
            self.incarnations[worker] = incarnation
            self.unstartable.discard(worker)
            if added:
                # Started by `poll`, one at a time while no answer waits, as the first workers
                # are: a fork copies the page tables of this whole process, and a tuner adding
                # several workers here at once would keep the batches of the running ones
                # waiting for all the forks (tens of milliseconds each on a busy machine).
                self.due[worker] = restart
                return
            try:
                self._start_process(worker, restart)
            except BaseException as error:
                self.unstartable.add(worker)
                failure = explain_exhaustion(error)
        if failure is not None:
            if not isinstance(failure, Exception):
                raise failure
            reason = f"its replacement could not be started: {failure!r}"
            self.ready.append(WorkerDied(worker, None, None, reason, incarnation))

    def _retire(self, worker: int) -> None:
        """End `worker`'s current process and close its pipes; with the locks held.

        Its answers not read yet go with its result pipe: the scheduler would drop them as a
        lost incarnation's. Its tasks not sent yet go too: the replacement is sent them again.
        The buffers it lent are forgotten, not given back: the replacement's pool is its own,
        and a batch the consumer still holds keeps its mapping of theirs until it is freed.
        """
        self.held.pop(worker, None)
        process = self.processes.pop(worker, None)
        if process is None:
            return  # never started
        if process.exitcode is None:
            process.kill()  # SIGKILL: a stuck worker may ignore anything gentler
        process.join(JOIN_TIMEOUT)
        if process.exitcode is None:
            self.retired.append(process)  # not reaped yet: shutdown joins it
        else:
            self.to_close.append(process)
        with self.returning:
            self.tasks.pop(worker).close()
        self.to_close += (self.readers.pop(worker), self.task_readers.pop(worker))
        self.gone.discard(worker)
        self.buffers.forget(worker)

    def worker_handles(self) -> list[WorkerProcess]:
        """The processes of the workers started so far, by slot, as torch's iterator lists its
        own in `_workers` (pid, `is_alive()`, `join()`, `exitcode`). A process closed before
        its handle was asked for has none (its pid went with it)."""
        for worker, process in self.processes.items():
            handle = self.handles.get(worker)
            if handle is None or not handle.of(process):
                try:
                    self.handles[worker] = WorkerProcess(process, self.exit_codes)
                except ValueError:  # closed already
                    self.handles.pop(worker, None)
        return [self.handles[w] for w in sorted(self.processes) if w in self.handles]

    def report(self, worker: int) -> WorkerReport:
        """The worker's pid and where its main thread is now (see `stacks`)."""
        process = self.processes.get(worker)
        if process is None or self.home is None:
            return WorkerReport()
        path = stacks.stack_file(self.home.tempdir, worker, self.incarnations.get(worker, 0))
        if not stacks.listening(path):
            return WorkerReport(process.pid, starting=True)
        return WorkerReport(process.pid, stacks.ask(path, process.pid))

    def stop_worker(self, worker: int) -> None:
        if worker in self.stopping:
            return
        with self.launching:
            self.stopping.add(worker)  # a worker not started yet never will be
            self.held.pop(worker, None)
            self.due.pop(worker, None)
        if worker in self.processes and worker not in self.gone:
            # At interpreter exit the pipe may already be closed; shutdown then terminates
            # the worker instead.
            with contextlib.suppress(ValueError, OSError):
                self.tasks[worker].put(b"")  # the stop message

    # --- answers -----------------------------------------------------------------------------

    def poll(self, timeout: float | None) -> Event | None:
        """The next answer from any worker, a death, or None once `timeout` seconds pass.

        Workers not started yet are started here, one at a time, and only while no answer is
        waiting to be read: starting one takes milliseconds (fork copies the page tables of
        the whole main process), which an answer already here should not wait for.
        """
        if self._unconfirmed is not None:
            return self._unconfirmed  # not confirmed yet: an interrupt cut the last poll short
        if self.ready:
            return self._hand_out(self.ready[0], self.ready)
        deadline = None
        added = False
        while not self.ready:
            if self.to_close:
                self._close_retired()
            watched = self._watched()
            starting = self._next_to_launch()
            busy = starting is not None and self._importing() >= self.start_together
            if starting is not None and not busy:
                fired = self.watch.wait(watched, 0) if watched else []
                # A slot added back starts even while answers wait, one per poll: answers
                # flowing from the others must not put it off for ever.
                due = starting in self.due and not added
                if not fired or due:
                    added = added or due
                    self._launch(starting)
                    continue
            else:
                if not watched:
                    return None
                # The timeout counts from here: starting workers is not waiting for them.
                if deadline is None and timeout is not None:
                    deadline = time.monotonic() + timeout
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if busy:
                    # Nothing fires when a starting worker is done importing: look again soon.
                    left = STARTING_CHECK if left is None else min(left, STARTING_CHECK)
                fired = self.watch.wait(watched, left)
                if not fired:
                    if busy and (deadline is None or time.monotonic() < deadline):
                        continue
                    return None
            # Reading a message is not interruptible without losing it (see _signals).
            with self.signals_held, self.reading:
                for handle in fired:
                    kind, worker, process = watched[handle]
                    # A worker replaced meanwhile (by the driver's thread, while the pin
                    # stage's waited): what fired was its lost process's, gone with it.
                    if self.processes.get(worker) is process:
                        self._collect(kind, worker)
        return self._hand_out(self.ready[0], self.ready)

    def _importing(self) -> int:
        """How many spawn or forkserver workers started are still importing their modules.

        A spawned worker imports torch, and every such worker unpickles the dataset: seconds of
        CPU each. Started all at once on fewer cores, they share the cores with each other and
        with this process, which pickles the setup meanwhile, and the worker that holds the
        first batch gets its share only: with 4 workers on 2 cores, a third of a core. `poll`
        starts no more of them while one fewer than there are cores are importing
        (`start_together`), so that the first worker has a core of its own, and the next ones
        start as it gets there: the first batch comes after one start, not after all of them,
        and the cores stay busy. A worker is importing until it listens for stack requests
        (`stacks.listening`), the first thing it does once its modules are imported. Forked
        workers import nothing: never.
        """
        home = self.home
        if self.shipped is not None or home is None:
            return 0
        return sum(
            not stacks.listening(
                stacks.stack_file(home.tempdir, worker, self.incarnations.get(worker, 0))
            )
            for worker, process in tuple(self.processes.items())
            if worker not in self.gone and process.exitcode is None
        )

    def _watched(self) -> dict[Any, tuple[str, int, Any]]:
        watched: dict[Any, tuple[str, int, Any]] = {}
        # A snapshot: another thread may start a worker meanwhile.
        for worker, process in tuple(self.processes.items()):
            if worker in self.gone:
                continue
            reader = self.readers.get(worker)
            if reader is None:
                continue  # being replaced
            watched[reader] = ("answer", worker, process)
            watched[process.sentinel] = ("exit", worker, process)
        return watched

    def _close_retired(self) -> None:
        with self.reading:
            closing, self.to_close = self.to_close, []
        for handle in closing:
            handle.close()

    def _collect(self, kind: str, worker: int) -> None:
        reader = self.readers[worker]
        if kind == "answer":
            try:
                message = reader.recv_bytes()
            except (EOFError, OSError):
                self._exited(worker)
            else:
                self._receive(worker, message)
            return
        # The process ended: first take whatever it sent before ending.
        try:
            while reader.poll(0):
                self._receive(worker, reader.recv_bytes())
        except (EOFError, OSError):
            pass
        self._exited(worker)

    def _receive(self, worker: int, message: bytes) -> None:
        task, lent, kind, payload = decode(message)
        if task == NOTICE:
            self.buffers.notice(worker, pickle.loads(payload))
            return
        if lent and self.giving_back is None:
            self._start_giving_back()
        self.ready.append(self._decode(worker, task, lent, payload, kind))

    def register_buffers(self, register: HostRegister) -> None:
        """Page-lock every buffer the workers announce from now on (`leases`' docstring says
        who may ask)."""
        self.buffers.register_with(register)

    # --- buffers no task carries back --------------------------------------------------------

    def _start_giving_back(self) -> None:
        with self.launching:
            if self.giving_back is not None or self.closed:
                return
            self.giving_back = threading.Thread(
                target=self._give_back_lingering, name="statecore-give-back", daemon=True
            )
            self.giving_back.start()

    def _give_back_lingering(self) -> None:
        """Give back, `LINGER` after the consumer let go of them, the buffers that no task has
        carried back since. Runs on a thread of its own until shutdown."""
        let_go, stop = self.buffers.let_go, self.stop_giving_back
        while True:
            worker = let_go.get()
            # One wait per LINGER, however many leases end meanwhile: while batches flow, this
            # thread wakes twice per LINGER, tasks have carried most buffers back by then, and
            # what it sends is one small message per worker at most.
            if worker is None or stop.wait(LINGER):
                return
            workers = {worker}
            with contextlib.suppress(queue.Empty):
                while True:
                    worker = let_go.get_nowait()
                    if worker is None:
                        return
                    workers.add(worker)
            for worker in workers:
                self._give_back(worker)

    def _give_back(self, worker: int) -> None:
        tasks = self.tasks.get(worker)
        if tasks is None or worker in self.stopping or worker in self.gone:
            return
        with self.returning:
            returned = self.buffers.returns_for(worker)
            if returned:
                with contextlib.suppress(ValueError, OSError):  # shutdown closed the pipe
                    tasks.put(encode_returns(returned))

    def _stop_giving_back(self) -> None:
        with self.launching:  # none starts from now on: `closed` is set
            thread = self.giving_back
        if thread is None:
            return
        self.stop_giving_back.set()
        self.buffers.let_go.put(None)
        thread.join()

    def _exited(self, worker: int) -> None:
        if worker in self.gone:
            return
        self.gone.add(worker)
        process = self.processes[worker]
        process.join(JOIN_TIMEOUT)
        if worker not in self.stopping:
            incarnation = self.incarnations.get(worker, 0)
            self.ready.append(
                WorkerDied(worker, process.pid, process.exitcode, incarnation=incarnation)
            )

    def _decode(
        self, worker: int, task: int, lent: tuple[int, ...], payload: memoryview, kind: int
    ) -> Event:
        try:
            content = self.buffers.loads(worker, lent, payload)
        except Exception as error:
            process = self.processes[worker]
            process.join(JOIN_TIMEOUT / 5)
            if not process.is_alive() and worker not in self.stopping:
                # Its tensors died with it (they are fetched from the worker on unpickling):
                # the death is the error to report, not the failed fetch.
                self.gone.add(worker)
                incarnation = self.incarnations.get(worker, 0)
                return WorkerDied(worker, process.pid, process.exitcode, incarnation=incarnation)
            failure = RemoteError.capture(
                error,
                worker=worker,
                pid=self.processes[worker].pid,
                index=None,
                where="while receiving a batch in the main process",
            )
            return TaskFailed(task, worker, failure, incarnation=self.incarnations.get(worker, 0))
        # A replacement's answers carry its incarnation: its pipe is its own, so whatever
        # comes by it is its. A worker never replaced costs one lookup.
        incarnation = self.incarnations.get(worker, 0) if self.incarnations else 0
        if kind == BATCH:
            return TaskCompleted.fast(task, worker, content, None, None, incarnation)
        if kind == MARKED:
            payload, mark = content
            return TaskCompleted.fast(task, worker, payload, mark, None, incarnation)
        if kind == TIMED:
            payload, mark, timing = content
            return TaskCompleted.fast(task, worker, payload, mark, timing, incarnation)
        assert isinstance(content, Event)
        if incarnation and getattr(content, "incarnation", incarnation) != incarnation:
            content = attrs.evolve(content, incarnation=incarnation)  # type: ignore[misc]
        return content

    # --- shutdown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker, terminate the ones that do not stop, release every handle."""
        if self.closed:
            return
        self.closed = True
        if self.shutting_down is not None:
            self.shutting_down.value = True
        with self.launching:  # no worker starts from now on: `closed` is set
            self.held.clear()
        self._stop_giving_back()
        for worker in range(self.launch.num_workers):
            self.stop_worker(worker)
        deadline = time.monotonic() + SHUTDOWN_GRACE
        running = {w for w, p in self.processes.items() if p.is_alive()}
        # A pipe at its end stays readable: watching it would spin while its worker exits.
        ended: set[int] = set()
        while running and time.monotonic() < deadline:
            # A worker blocked on sending a batch nobody will read exits once we drain it.
            handles = {self.readers[w]: w for w in running - ended}
            handles.update({self.processes[w].sentinel: w for w in running})
            for handle in multiprocess.connection.wait(
                list(handles), max(0.0, deadline - time.monotonic())
            ):
                worker = handles[handle]
                try:
                    while self.readers[worker].poll(0):
                        self.readers[worker].recv_bytes()
                except (EOFError, OSError):
                    ended.add(worker)
            running = {w for w in running if self.processes[w].is_alive()}
        self.worker_handles()  # made while the processes are open: they outlive the close
        for process in (*self.processes.values(), *self.retired):
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT)
            if process.is_alive():
                process.kill()
            process.join()
            self.exit_codes[process.pid] = process.exitcode
            process.close()
        for tasks in self.tasks.values():
            tasks.close()
        self._close_retired()
        for reader in (*self.readers.values(), *self.task_readers.values()):
            reader.close()
        self.ready.clear()
        self.confirm()
        # Every worker is gone: forked ones leave the buffers nothing uses to the next ones.
        self.buffers.close(keep=self.shipped is not None)
        if self.remove_tempdir is not None:
            self.remove_tempdir()  # every worker is gone: the sockets in it are dead
