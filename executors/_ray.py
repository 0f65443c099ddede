"""The Ray executor: each worker is a Ray actor, wherever the cluster places it.

`DataLoader(dataset, num_workers=N, executor="ray")`, or `executor=statecore.executors.ray(...)`
to choose the actors' resources and placement (`RayOptions`). Ray is imported when a loader
first starts its workers, never by `import statecore`.

The cluster is the one this process is connected to: Ray's own connection if `ray.init()` was
called already, else `ray.init()` as the user configured it (`RAY_ADDRESS`), which starts a
local instance when no address is set. An address that does not answer is refused at once
with an error saying what to do, rather than left to Ray's connection retries (a minute or
more of silence).

Each actor starts as a worker process does, through the one start-up path
(`executors._startup.start_worker`: seeding, worker info, datapipe sharding,
`worker_init_fn`, its `WorkerRuntime`), from the loader's `WorkerSetup`,
which is put in Ray's object store once and read once per node. A task or a resume is one call
of the actor's `answer` method. A single-threaded actor runs the calls of one caller in the
order they were made, which gives the protocol's "answers in the order given"; `poll` waits on
the oldest call owed by each worker only, so it also reads them in that order. The executor
decides nothing: it forwards the core's commands and returns the actors' answers.

Faults. An actor whose process dies (killed, crashed, its node lost) makes Ray fail the call
it was running and every call queued after it, with an `ActorDiedError`. `poll` reports that
once, as the worker's `WorkerDied` carrying Ray's text, and forgets the calls behind it. A
worker that dies while it owes nothing is noticed with the next call it is given. A stopped
worker's actor is killed at once (it owes nothing after `stop_worker`); `shutdown` kills every
actor and waits until Ray confirms each is dead. Dropping the calls' references frees their
results in the object store; a batch already handed to the consumer keeps its memory in the
store until the consumer lets go of it (see `_from_store`).

Workers that come and go (`DataLoader(worker_restarts=N)`). Ray's own actor restarts stay off
(`max_restarts=0`): a restarted actor would have lost its place in the epoch. The scheduler
replaces a lost worker instead (`replace`): the old actor is killed if it still runs (a stuck
one too: `kills_stuck_workers`), and its calls are forgotten, so nothing more is read from it;
a new actor is started in the slot from the setup a replacement gets
(`executors._incarnation.replacement_setup`: the same worker id and seed, `worker_init_fn`, the
slot's epoch, its dataset restored to the last mark the main process recorded), and says
`WorkerStarted` once its start-up is done (its first call, `placement`, answered). Every
answer is stamped with the incarnation of the actor the call went to. Asked about a stuck
worker (`report`), the executor gives its actor's pid if the actor ever started, and no stack:
Ray has no way to read the Python stack of an actor busy in a call without its dashboard and
py-spy, so the warning or error names the worker and pid only.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import threading
import time
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import attrs
import torch

from statecore import (
    Event,
    ReplaceWorker,
    ResumeWorker,
    SendTask,
    TaskCompleted,
    TaskFailed,
    WorkerDied,
    WorkerStarted,
)
from statecore.executors._confirm import Confirming
from statecore.executors._incarnation import Standing, replacement_setup, stamped
from statecore.executors._protocol import Capabilities, Launch, WorkerReport
from statecore.executors._registry import NEEDS
from statecore.executors._remote import RemoteError
from statecore.executors._signals import HeldSignals
from statecore.executors._startup import Seat, start_worker
from statecore.executors._timing import ClockSkew, TaskTiming
from statecore.executors._worker import WorkerSetup

__all__ = ["RayExecutor", "RayOptions", "RayUnavailableError", "ray"]

CONNECT_TIMEOUT = 5.0
"""How long a configured cluster address may take to accept a connection before it is refused."""
SHUTDOWN_TIMEOUT = 30.0
"""How long shutdown waits for Ray to confirm that the killed actors are dead."""


class RayUnavailableError(RuntimeError):
    """No Ray cluster could be reached (or Ray is not installed) for `executor="ray"`."""


def _ray_library() -> Any:
    """The `ray` package, imported now; an error saying how to install it if it is missing."""
    try:
        return importlib.import_module("ray")
    except ImportError as error:
        raise RayUnavailableError(
            f"executor='ray' needs Ray, which is not installed: {NEEDS['ray'][1]} in a "
            "statecore checkout (or pip install 'ray>=2.9'), or choose another executor such "
            "as executor='mp'."
        ) from error


def _probe(address: str) -> None:
    """Refuse `address` (host:port, as RAY_ADDRESS takes it) if nothing accepts a connection
    there within `CONNECT_TIMEOUT`: Ray itself would retry for a minute or more, silently."""
    if address in ("auto", "local") or ("://" in address and not address.startswith("ray://")):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # a form Ray resolves itself; let it report what it makes of it
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as error:
        raise RayUnavailableError(
            f"executor='ray' could not reach a Ray cluster at {address!r} ({error}). Start "
            "one there (ray start --head), point RAY_ADDRESS at a running cluster's head "
            "(host:6379), unset RAY_ADDRESS to start a local instance, or call ray.init(...) "
            "yourself before iterating the loader."
        ) from error


def _connect(options: RayOptions) -> Any:
    """The `ray` package, connected to a cluster: the process's connection if there is one."""
    library = _ray_library()
    if library.is_initialized():
        return library
    address = options.address or os.environ.get("RAY_ADDRESS")
    if address:
        _probe(address)
    try:
        library.init(address=options.address)
    except Exception as error:
        where = f"at {address!r}" if address else "(no RAY_ADDRESS set: a local instance)"
        raise RayUnavailableError(
            f"executor='ray' could not connect to a Ray cluster {where}: {error}. Start one "
            "(ray start --head), set RAY_ADDRESS to its head's address, or call ray.init(...) "
            "yourself before iterating the loader."
        ) from error
    return library


@attrs.frozen
class RayOptions:
    """How each worker's actor is placed: Ray's actor options, passed on as they are.

    Left out, an option is Ray's default; in particular an actor without `num_cpus` needs a
    CPU to be placed but holds none once running, so any number of workers starts on any
    cluster. On a cluster, reserve what a worker uses (`num_cpus=1` or more) so that Ray
    spreads the actors over nodes with free cores, and consider `scheduling_strategy="SPREAD"`.
    """

    num_cpus: float | None = None
    """CPUs each actor reserves."""
    num_gpus: float | None = None
    """GPUs each actor reserves (a dataset that decodes on a GPU)."""
    memory: float | None = None
    """Bytes of memory each actor reserves, for Ray's scheduling."""
    resources: Mapping[str, float] | None = attrs.field(default=None, eq=False)
    """Custom resources each actor needs, e.g. {"preprocessing": 1} for nodes started with
    `ray start --resources='{"preprocessing": 8}'`."""
    scheduling_strategy: Any = attrs.field(default=None, eq=False)
    """Ray's scheduling strategy: "SPREAD", a `PlacementGroupSchedulingStrategy`, a
    `NodeAffinitySchedulingStrategy`, ..."""
    runtime_env: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    """Ray's runtime environment for the actors (pip packages, a working_dir, env_vars)."""
    address: str | None = None
    """The cluster to connect to when this process is not connected yet (ray.init(address));
    left out, Ray reads RAY_ADDRESS or starts a local instance."""

    def actor_options(self) -> dict[str, Any]:
        """The options given to each actor: those set, and no restarts or retries, since a
        restarted worker would have lost its place in the epoch (the core fails the loader
        instead, as for a dead worker process, or replaces it where `worker_restarts` allow)."""
        chosen: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
        for name in ("num_cpus", "num_gpus", "memory", "resources", "scheduling_strategy"):
            value = getattr(self, name)
            if value is not None:
                chosen[name] = dict(value) if name == "resources" else value
        if self.runtime_env is not None:
            chosen["runtime_env"] = dict(self.runtime_env)
        return chosen


def ray(
    *,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    memory: float | None = None,
    resources: Mapping[str, float] | None = None,
    scheduling_strategy: Any = None,
    runtime_env: Mapping[str, Any] | None = None,
    address: str | None = None,
) -> RayFactory:
    """The Ray executor with these actor options: `DataLoader(..., executor=ray(num_cpus=1))`.

    Every option is Ray's own (`RayOptions`); `executor="ray"` is `ray()`. See
    docs/distributed.md.
    """
    return RayFactory(
        RayOptions(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            memory=memory,
            resources=resources,
            scheduling_strategy=scheduling_strategy,
            runtime_env=runtime_env,
            address=address,
        )
    )


# The actor side. Everything below `_Worker` runs in the actor's process.


def _plain_storages() -> None:
    """In this (actor) process, storages torch's collate asks for in shared memory are
    ordinary ones.

    The worker's start-up sets torch's worker info, so that `get_worker_info()` works in
    datasets; torch's collate then builds each batch in shared memory, for a pipe to a parent
    process. A batch from an actor crosses through Ray's object store instead, and a
    shared-memory storage would cost a file and a descriptor per batch for nothing. Only
    collate (`UntypedStorage._new_shared`) is redirected, and only in the actor's process,
    which runs nothing but this worker; `share_memory_()` still shares.
    """

    def new_plain(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
        return torch.UntypedStorage(size, device=device)  # type: ignore[no-untyped-call]

    torch.UntypedStorage._new_shared = classmethod(new_plain)  # type: ignore[assignment,method-assign]


def _to_store(tensor: torch.Tensor) -> tuple[Any, ...]:
    """How a tensor of a batch goes into Ray's object store (registered in the actor).

    Measured on this project's 2-core machine, a 64x3x224x224 float batch (38 MB) took 272 ms
    from actor to consumer as torch pickles tensors (its storage saved into bytes, then copied
    again into the store and out), and 44 ms as here, where the tensor's bytes go as a numpy
    view: pickle's out-of-band buffers, which Ray writes once into the store and the consumer
    maps without copying (`_from_store`). Copying the mapped batch out in the consumer, to free
    the store at once, brought it to 104 ms. Tensors Ray cannot map (on a device, sparse,
    needing grad, quantized) are pickled as torch pickles them.
    """
    if (
        tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        return (raw, tensor.dtype, tuple(tensor.shape))
    rebuild, arguments = tensor.__reduce_ex__(2)[:2]  # type: ignore[no-untyped-call]
    return (rebuild, arguments)


def _from_store(packed: tuple[Any, ...]) -> torch.Tensor:
    """The tensor `_to_store` packed, in the consumer: a view of the object store's copy.

    No copy: the tensor's memory is the store's, kept there until the tensor is let go of.
    Ray marks the mapping read-only for numpy, but the object is this batch's alone (no other
    reader gets it), so the tensor stays writable as torch's batches are; torch's warning about
    a read-only array is silenced for that reason.
    """
    if len(packed) == 2:
        rebuild, arguments = packed
        rebuilt: torch.Tensor = rebuild(*arguments)
        return rebuilt
    raw, dtype, shape = packed
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        flat = torch.from_numpy(raw)
    return flat.view(dtype).reshape(shape)


def _this_node(library: Any) -> str:
    """The Ray node this process runs on."""
    node: str = library.get_runtime_context().get_node_id()
    return node


class _Worker:
    """One worker, in an actor's process: its `WorkerRuntime` and nothing else."""

    def __init__(self, setup: WorkerSetup, worker_id: int) -> None:
        library = importlib.import_module("ray")
        # Exact type only (Ray dispatches on it): a tensor subclass is pickled as torch does.
        library.util.register_serializer(
            torch.Tensor, serializer=_to_store, deserializer=_from_store
        )
        _plain_storages()
        self.pid = os.getpid()
        self.node = _this_node(library)
        self.runtime = start_worker(setup, worker_id, Seat.process(self.pid))

    def placement(self) -> tuple[int, str]:
        """The pid of this actor's process, for the error that reports its death, and its
        node, which says whether its clock is the training process's (see `ClockSkew`)."""
        return self.pid, self.node

    def answer(self, command: SendTask | ResumeWorker) -> Event:
        return self.runtime.answer(command)


_ACTOR_CLASS: list[Any] = []
"""`ray.remote(_Worker)`, made once per process: made again for every loader, Ray would export
the class to the cluster again every time."""
_ACTOR_LOCK = threading.Lock()


def _actor_class(library: Any) -> Any:
    with _ACTOR_LOCK:
        if not _ACTOR_CLASS:
            _ACTOR_CLASS.append(library.remote(_Worker))
        return _ACTOR_CLASS[0]


# The caller's side.


@attrs.frozen
class _Call:
    """A call owed by an actor: its result's reference, the command it answers, and the
    incarnation of the worker the actor is. A `ReplaceWorker` call is the new actor's
    `placement`, answered once it has started."""

    reference: Any = attrs.field(eq=False)
    command: SendTask | ResumeWorker | ReplaceWorker
    incarnation: int = 0


class RayExecutor(Confirming):
    """`launch.num_workers` Ray actors, answering in the order they were given work."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        confirms_answers=True, replaces_workers=True, kills_stuck_workers=True
    )

    def __init__(self, launch: Launch, options: RayOptions | None = None) -> None:
        self.launch = launch
        self.options = options or RayOptions()
        self.library: Any = None
        self.actors: list[Any] = []
        self.placements: list[Any] = []
        """Per worker, the reference to its actor's (pid, node), there once it has started."""
        self.skews: dict[int, ClockSkew | None] = {}
        """For a traced loader, per worker once known: None if its actor shares this process's
        node (and so its clock), else the skew of its node's clock."""
        self.node: str | None = None
        self.owed: list[deque[_Call]] = []
        self.gone: set[int] = set()
        """Workers stopped or reported dead: nothing more is read from them."""
        self.ready: list[Event] = []
        self.incarnations: list[int] = []
        """Per worker slot, the incarnation of its current actor."""
        self.resumed: list[ResumeWorker | None] = []
        """Per worker slot, the last `ResumeWorker` it was given: a replacement's epoch."""
        self.lost: list[Any] = []
        """The actors of replaced incarnations, killed: shutdown waits for Ray to confirm it."""
        self.signals_held = HeldSignals()
        self.closed = False

    def start(self) -> None:
        library = self.library = _connect(self.options)
        self.node = _this_node(library)
        # One copy of the setup (the dataset above all) in the store, read once per node,
        # rather than one pickled into each actor's creation call. Our reference goes when
        # this returns; Ray keeps the object until every actor has read it.
        setup = library.put(self.launch.setup)
        running = self.launch.running_at_start
        for worker in range(self.launch.num_workers):
            # A slot that begins retired has no actor until `replace` starts its first.
            actor = self._new_actor(setup, worker) if worker < running else None
            self.actors.append(actor)
            self.placements.append(None if actor is None else actor.placement.remote())
            if actor is None:
                self.gone.add(worker)
            self.owed.append(deque())
            self.incarnations.append(0)
            self.resumed.append(None)

    def _new_actor(self, setup: Any, worker: int) -> Any:
        """An actor starting as worker `worker` from `setup` (a `WorkerSetup` or its reference
        in the store), placed as the options say."""
        options = self.options.actor_options()
        return _actor_class(self.library).options(**options).remote(setup, worker)

    def replace(self, command: ReplaceWorker, mark: Standing) -> None:
        """Kill `command.worker`'s actor if it still runs, forget its calls, and start a new
        actor in its slot (see the module docstring); its start is told as `WorkerStarted`."""
        worker, incarnation = command.worker, command.incarnation
        self._kill(worker)
        if self.actors[worker] is not None:  # not a slot that began retired
            self.lost.append(self.actors[worker])
        self.gone.discard(worker)
        self.owed[worker].clear()
        self.incarnations[worker] = incarnation
        setup = replacement_setup(self.launch.setup, worker, mark, self.resumed[worker])
        actor = self.actors[worker] = self._new_actor(setup, worker)
        placement = self.placements[worker] = actor.placement.remote()
        self.skews.pop(worker, None)
        self.owed[worker].append(_Call(placement, command, incarnation))

    def worker_handles(self) -> list[Any]:
        """The actors of the workers started so far, by slot: what torch's iterator lists as
        its worker processes in `_workers`. Ray's actor handles, not processes: they may run on
        other nodes, and have no `pid`, `is_alive()` or `join()` (`ray.kill` ends one)."""
        return [actor for actor in self.actors if actor is not None]

    def report(self, worker: int) -> WorkerReport:
        """The pid of the worker's actor, and whether it is still starting (its first call,
        `placement`, not answered yet: a process importing torch and the dataset's modules);
        no stack (see the module docstring)."""
        placed = self._placement(worker)
        return WorkerReport(
            pid=None if placed is None else int(placed[0]), stack=None, starting=placed is None
        )

    def dispatch(self, command: SendTask) -> None:
        self._call(command)

    def resume(self, command: ResumeWorker) -> None:
        self._call(command)

    def _call(self, command: SendTask | ResumeWorker) -> None:
        worker = command.worker
        if worker in self.gone:
            return  # the core hears of its death, or stopped it: nothing is owed
        if type(command) is ResumeWorker:
            self.resumed[worker] = command
        reference = self.actors[worker].answer.remote(command)
        self.owed[worker].append(_Call(reference, command, self.incarnations[worker]))

    def poll(self, timeout: float | None) -> Event | None:
        if self._unconfirmed is not None:
            return self._unconfirmed  # not confirmed yet: an interrupt cut the last poll short
        if self.ready:
            return self._hand_out(self.ready[0], self.ready)
        # Only the oldest call of each worker: an actor answers in order, so must we.
        oldest = {owed[0].reference: worker for worker, owed in enumerate(self.owed) if owed}
        if not oldest:
            return None
        done, _ = self.library.wait(list(oldest), num_returns=1, timeout=timeout)
        if not done:
            return None
        worker = oldest[done[0]]
        event = self._read(worker, self.owed[worker][0])
        # Stored, then taken off what is owed, with no signal handler in between: an interrupt
        # can neither lose the answer nor leave it to be read twice.
        with self.signals_held:
            self.ready.append(event)
            if event.__class__ is WorkerDied:
                self.owed[worker].clear()
            else:
                self.owed[worker].popleft()
        return self._hand_out(self.ready[0], self.ready)

    def _read(self, worker: int, call: _Call) -> Event:
        """The answer to `call`, now done: the actor's event, or the worker's death."""
        library = self.library
        incarnation = call.incarnation
        try:
            answer: Event = library.get(call.reference)
        except library.exceptions.RayActorError as error:
            return self._died(worker, error, incarnation)
        except library.exceptions.RayError as error:
            # The actor lives, but its answer could not be made or read (a batch Ray could
            # not serialize, say): that task fails in its turn; a resume cannot fail.
            if not isinstance(call.command, SendTask):
                return self._died(worker, error, incarnation)
            failed = RemoteError.capture(
                error,
                worker=worker,
                pid=self._pid(worker),
                index=call.command.index,
                where="while Ray moved the batch to the main process",
            )
            return TaskFailed(call.command.task, worker, failed, incarnation=incarnation)
        if type(call.command) is ReplaceWorker:
            return WorkerStarted(worker, incarnation)  # its start-up is done: it answered
        # Unpickled just now, and held by nobody else: stamped in place.
        answer = stamped(answer, incarnation)
        if self.launch.setup.trace:
            return self._on_this_clock(worker, answer)
        return answer

    def _on_this_clock(self, worker: int, answer: Event) -> Event:
        """`answer` with its timing on this process's clock: an actor on another node reads
        its node's clock (see `ClockSkew`)."""
        if not isinstance(answer, (TaskCompleted, TaskFailed)) or answer.timing is None:
            return answer
        timing = cast(TaskTiming, answer.timing)  # what a traced worker's runtime measured
        arrived = time.perf_counter()
        if worker not in self.skews:
            placed = self._placement(worker)
            if placed is None:
                return answer  # the actor answered, so it has started: not reached
            self.skews[worker] = None if placed[1] == self.node else ClockSkew()
        skew = self.skews[worker]
        if skew is None:
            return answer
        return attrs.evolve(answer, timing=skew.shifted(timing, arrived))

    def _died(self, worker: int, error: BaseException, incarnation: int) -> WorkerDied:
        self.gone.add(worker)
        pid = self._pid(worker)
        self._kill(worker)  # an actor Ray calls unavailable may come back: it must not
        return WorkerDied(
            worker, pid, None, reason=f"Ray reported: {error}", incarnation=incarnation
        )

    def _pid(self, worker: int) -> int | None:
        """The worker's pid, if its actor ever started."""
        placed = self._placement(worker)
        return None if placed is None else int(placed[0])

    def _placement(self, worker: int) -> tuple[int, str] | None:
        """The worker's actor's (pid, node), if it ever started; asked once, at its start."""
        try:
            placed: tuple[int, str] = self.library.get(self.placements[worker], timeout=0)
        except Exception:
            return None
        return placed

    def _connected(self) -> bool:
        """Whether Ray is still connected. Once it is not (`ray.shutdown()`, or interpreter
        exit), the actors went with the connection, and calling Ray now would start a new
        local instance (Ray initialises itself on first use), from a finaliser perhaps."""
        return self.library is not None and bool(self.library.is_initialized())

    def _kill(self, worker: int) -> None:
        if not self._connected():
            return
        with contextlib.suppress(Exception):  # already dead, or Ray is shutting down
            self.library.kill(self.actors[worker], no_restart=True)

    def stop_worker(self, worker: int) -> None:
        if worker in self.gone or worker >= len(self.actors):
            return
        # It owes nothing after this, so it need not finish what it was given: its results
        # are dropped with their references.
        self.gone.add(worker)
        self.owed[worker].clear()
        self._kill(worker)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for worker in range(len(self.actors)):
            self.stop_worker(worker)
        library = self.library
        actors = [actor for actor in (*self.actors, *self.lost) if actor is not None]
        if actors and self._connected():
            # A call made after the kill fails as soon as Ray knows the actor is dead: waiting
            # for those failures is waiting for Ray to confirm that no actor is left.
            with contextlib.suppress(Exception):
                confirms = [actor.__ray_ready__.remote() for actor in actors]
                library.wait(confirms, num_returns=len(confirms), timeout=SHUTDOWN_TIMEOUT)
        self.actors = []
        self.lost = []
        self.placements = []
        self.owed = []
        self.ready.clear()
        self.confirm()


@attrs.frozen
class RayFactory:
    """An executor factory: Ray actors with these `options` (see `ray`)."""

    options: RayOptions = attrs.field(factory=RayOptions)
    capabilities: ClassVar[Capabilities] = RayExecutor.capabilities

    def __call__(self, launch: Launch) -> RayExecutor:
        return RayExecutor(launch, self.options)
