"""The transition function: `step(state, event) -> Transition(state, commands)`.

Theory of operation
-------------------
A loader iterator lives through phases (see `Phase`). `ResetRequested` starts an epoch: from
IDLE the workers are fresh and the scheduler goes straight to RUNNING; later epochs exist only
with persistent workers, which must first acknowledge a `ResumeWorker` each (RESUMING), because
a task sent before a worker has reset its dataset iterator would be answered from the old epoch.
The consumer's `iter()` lasts (`resetting`) until those acknowledgements came and the first
tasks went out, as torch's does; a sampler failing meanwhile fails `iter()`.

While RUNNING the scheduler keeps workers busy up to the prefetch bound. It draws one index at a
time (`DrawIndex` -> `IndexDrawn`), choosing the worker *before* the draw so that a drawn index
always has a place to go: torch draws first and drops the index when no worker has room.
In order, workers take turns round-robin, torch's order, so the same batches come out in the
same order; out of order, the least-loaded worker with room gets the task, so one slow sample
holds up one worker's queue and not the whole epoch.

Answers arrive in any order. In order, an early answer waits in the window until every task
before it is resolved; out of order, it goes to the consumer as soon as one waits. A worker
whose iterable ran dry answers every task it holds as exhausted; those tasks are skipped. When
the sampler ends or every worker is dry, nothing more is sent (DRAINING), and the epoch is
FINISHED by the first request made once every task is resolved, as torch's is: the last batch
goes to the consumer before anything stops. Without persistent workers, finishing also shuts
the workers down.

A consumer may stop waiting without the loader failing (`Interrupted`: Ctrl-C, a signal handler
raising): whatever it waited for stays owed, answers keep arriving into the window, and the
next request picks up where it left off. An `iter()` interrupted while workers resume leaves
the reset half done; the next `iter()` starts it over with fresh `ResumeWorker`s, and the
acknowledgements of the abandoned round, which name their epoch, are dropped on arrival.

A worker's exception for one task is delivered in that task's turn and the epoch goes on. A
worker's death, a timeout, the sampler raising or the executor itself failing is not
recoverable: the scheduler emits the shutdown and moves to FAILED, where it re-raises the
failure on every request (a sampler's once: a consumer already handed a batch gets it with its
next request, and the request after that finds the end, as torch's spent sampler gives).
CLOSED refuses everything but another close, which does nothing.

How a step is made (h11's shape)
--------------------------------
1. The table, `TRANSITIONS` (statecore/_table.py, with the rules and echoes), names the one
   phase each legal move leads to; an event type missing under a phase is refused.
2. Named guards (`GUARDS`) refuse a legal event type that the state cannot take (a draw nobody
   asked for, a batch asked for twice): each names what is wrong.
3. The event's handler does the move's bookkeeping; the decisions it takes are the policies of
   `statecore._policy`, the one seam that models swap.
4. `_settle`, the finisher every move in a live phase ends in, applies the state-triggered
   rules (`RULES`: every acknowledgement in, no active worker left, the epoch over), serves a
   waiting consumer and keeps the workers busy.

A batch's three steps (its index drawn, its answer, the request for it) in a steady RUNNING
state (iter() returned, nothing retiring or joining) are made whole by the steady handlers
instead (see "the steady state"), which do what 2 to 4 do there with the rules that cannot fire
left out, and hand every other state to the general route; a test holds both routes equal on
every state the explorer reaches, and `check --bench` measures what they save.

Some events answer what the scheduler no longer waits for (`ECHOES`: an answer for a task of an
earlier epoch, an acknowledgement of an abandoned reset, the exit of a worker told to stop):
they are dropped, and the phase stays. Every refusal raises a `ProtocolError` naming the phase
and the event; since states are values, the caller still holds the old state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import attrs

from statecore import _policy
from statecore._commands import (
    DRAW_INDEX,
    END_EPOCH,
    SHUTDOWN,
    Command,
    Deliver,
    RaiseError,
    ReplaceWorker,
    ResumeWorker,
    SendTask,
    StopWorker,
)
from statecore._errors import ClosedError, ExecutorError, MisuseError, ProtocolError
from statecore._events import (
    CONSUMER_EVENTS,
    AddRequested,
    CloseRequested,
    Event,
    ExecutorFailed,
    IndexDrawn,
    Interrupted,
    NextRequested,
    PrefetchChangeRequested,
    ResetRequested,
    RetireRequested,
    SamplerExhausted,
    SamplerFailed,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
    WorkerStarted,
    WorkerStuck,
)
from statecore._progress import progress
from statecore._state import (
    RESOLVED,
    Cancelled,
    Config,
    ExecutorFailure,
    Failed,
    Failure,
    Lifecycle,
    Pending,
    Phase,
    Ready,
    SamplerFailure,
    Slot,
    State,
    TaskFailure,
    Timeout,
    WorkerDeath,
    WorkerHang,
    WorkerLoss,
    WorkerStatus,
)
from statecore._table import (
    CLOSED,
    DRAINING,
    FAILED,
    FINISHED,
    IDLE,
    RESUMING,
    RUNNING,
    TRANSITIONS,
)

__all__ = ["Transition", "can_restart", "step"]

ACTIVE = WorkerStatus.ACTIVE
EXHAUSTED = WorkerStatus.EXHAUSTED
STOPPED = WorkerStatus.STOPPED
STARTING = WorkerStatus.STARTING
RETIRING = WorkerStatus.RETIRING

_tuple_new = tuple.__new__
_DRAW = (DRAW_INDEX,)
# The fast constructors of the values a batch's steps build, bound once: a class method looked up
# on its class at each call is bound anew each time (a method object made and dropped).
_send_task = SendTask.fast
_ready = Ready.fast
_deliver = Deliver.fast


class Transition(NamedTuple):
    """What `step` returns: the next state and the commands to carry out, in order."""

    state: State
    commands: tuple[Command, ...]


_ANSWERS = (TaskCompleted, TaskFailed, WorkerExhausted)


def step(state: State, event: Event) -> Transition:
    """Apply `event` to `state`. Raises `ProtocolError` (and changes nothing) if it cannot."""
    # One lookup answers both "is this move legal?" and "who handles it, once which guards let
    # it through?" (see `_routes`).
    try:
        handler, guards = _ROUTES[state.life.phase][type(event)]
    except KeyError:
        handler, guards = _illegal, ()  # raises below, so the KeyError is not its context
    if guards:  # a batch's three steps have none: a loop over none still builds an iterator
        for guard in guards:
            reason = guard(state, event)
            if reason is not None:
                raise _refuse(state, event, reason)
    return handler(state, event)


def _target(state: State, event: Event) -> Phase:
    """The phase the table names for this move."""
    return TRANSITIONS[state.life.phase][type(event)]


# --- refusals ----------------------------------------------------------------------------------


def _illegal(state: State, event: Event) -> Transition:
    """The handler of every move that `TRANSITIONS` lacks."""
    raise _refuse(state, event, _why_not(state, event))


def _refuse(state: State, event: Event, reason: str) -> ProtocolError:
    phase = state.life.phase
    if type(event) in CONSUMER_EVENTS:
        if phase is CLOSED:
            return ClosedError(phase, event, reason)
        return MisuseError(phase, event, reason)
    return ExecutorError(phase, event, reason)


def _why_not(state: State, event: Event) -> str:
    phase = state.life.phase
    if phase is CLOSED:
        if type(event) in CONSUMER_EVENTS:
            return "the loader was closed; start a new iterator to load again"
        return "the loader was closed and its workers stopped; nothing is owed to an executor"
    if phase is FAILED:
        assert state.life.failure is not None
        return (
            f"the loader failed earlier ({state.life.failure.describe()}); "
            "close it and start a new iterator"
        )
    if phase is IDLE and isinstance(event, NextRequested):
        return "no epoch has started; start one with iter(loader) first"
    if isinstance(event, ExecutorFailed):
        return "the executor was given no command yet"
    if isinstance(event, WorkerResumed):
        return "no worker was asked to resume"
    if isinstance(event, WorkerStarted):
        return "no worker is being replaced"
    if isinstance(event, WorkerStuck):
        return "no consumer waits for a task, so no worker can be stuck on one"
    if isinstance(event, (IndexDrawn, SamplerExhausted, SamplerFailed)):
        return "no index was asked of the sampler"
    if isinstance(event, TimedOut):
        return "nothing was being waited for"
    if isinstance(event, (RetireRequested, AddRequested)):
        return (
            f"workers are retired and added only while an epoch runs, and the loader is "
            f"{phase.value}"
        )
    if isinstance(event, PrefetchChangeRequested):
        return (
            f"the prefetch bound changes only while an epoch runs, and the loader is "
            f"{phase.value}: a new iterator takes prefetch_factor from its loader"
        )
    if isinstance(event, _ANSWERS):
        return "no task is awaiting an answer"
    return f"{type(event).__name__} cannot happen while the loader is {phase.value}"


# --- guards --------------------------------------------------------------------------------------
# A legal event type that this state cannot take: each guard returns why, or None. `step` asks an
# event's guards, in order, before its handler.

Guard = Callable[[State, Event], "str | None"]


_AWAITED = "a batch is already awaited"
_NOT_RETURNED = (
    "iter() has not returned: its workers are still resuming or its first indices are still "
    "being drawn; carry out every command it gave first"
)


def _no_batch_awaited(state: State, event: Event) -> str | None:
    return _AWAITED if state.waiting else None


def _ready_for_a_request(state: State, event: Event) -> str | None:
    """No batch awaited, and iter() returned. One guard, not `_no_batch_awaited` and another:
    a request comes with every batch, and each guard asked is a call (0.08 us)."""
    if state.waiting:
        return _AWAITED
    return _NOT_RETURNED if state.life.resetting else None


def _index_asked(state: State, event: Event) -> str | None:
    return "no index was asked of the sampler" if state.drawing_for is None else None


def _no_draw_on_its_way(state: State, event: Event) -> str | None:
    if state.drawing_for is not None:
        return "an index is still being drawn from the previous sampler"
    return None


def _no_reset_half_done(state: State, event: Event) -> str | None:
    if state.life.resetting:
        return "the previous reset still waits for its workers to resume"
    return None


def _resumes_only_when_fresh(state: State, event: Event) -> str | None:
    assert isinstance(event, ResetRequested)
    if event.resume is not None and state.life.phase is not IDLE:
        return "only a fresh scheduler resumes an epoch from a checkpoint"
    return None


def _restarts_only_persistent(state: State, event: Event) -> str | None:
    if state.life.phase is not IDLE and not state.config.persistent_workers:
        return "without persistent workers a scheduler runs one epoch; build a new one"
    return None


def _turn_names_a_worker(state: State, event: Event) -> str | None:
    assert isinstance(event, ResetRequested)
    resume, n = event.resume, state.config.num_workers
    # A map-style epoch resumed on fewer workers starts with worker 0 (`_policy.resume_turn`).
    if resume is not None and state.config.iterable and resume.turn >= n:
        return (
            f"the checkpoint's next turn is worker {resume.turn}, and there are {n} "
            "workers: an iterable dataset resumes on as many workers as it was taken with"
        )
    return None


def _dry_workers_exist(state: State, event: Event) -> str | None:
    assert isinstance(event, ResetRequested)
    resume, n = event.resume, state.config.num_workers
    if resume is not None and resume.dry and (not state.config.iterable or max(resume.dry) >= n):
        return (
            f"the checkpoint's dry workers {sorted(resume.dry)} are not workers of an "
            f"iterable dataset's {n}"
        )
    return None


def _dataset_iterable(state: State, event: Event) -> str | None:
    return None if state.config.iterable else "a map-style dataset's worker cannot run dry"


def _known_worker(state: State, event: Event) -> str | None:
    assert isinstance(
        event,
        (WorkerResumed, WorkerDied, WorkerStarted, WorkerStuck, RetireRequested, AddRequested),
    )
    w = event.worker
    return None if 0 <= w < len(state.life.workers) else f"there is no worker {w}"


def _incarnation_started(state: State, event: Event) -> str | None:
    assert isinstance(event, (WorkerResumed, WorkerDied, WorkerStarted, WorkerStuck))
    current = state.life.incarnations[event.worker]
    if event.incarnation > current:
        return (
            f"worker {event.worker}'s incarnation {event.incarnation} was never started "
            f"(the scheduler started {current})"
        )
    return None


def _lost(state: State, event: WorkerResumed | WorkerDied | WorkerStarted) -> bool:
    """Whether `event` is late news of an incarnation already replaced: dropped."""
    return _policy.in_force.lost(event.incarnation, state.life.incarnations[event.worker])


def _asked_to_resume(state: State, event: Event) -> str | None:
    assert isinstance(event, WorkerResumed)
    life, w = state.life, event.worker
    if _policy.in_force.abandoned(event.epoch, life.epoch) or _lost(state, event):
        return None  # an echo, dropped by the handler
    if event.epoch > life.epoch or life.workers[w] is not WorkerStatus.RESUMING:
        return f"worker {w} was not asked to resume for epoch {event.epoch}, or already answered"
    return None


def _was_replacing(state: State, event: Event) -> str | None:
    assert isinstance(event, WorkerStarted)
    if _lost(state, event):
        return None  # an echo, dropped by the handler
    status = state.life.workers[event.worker]
    if status is STARTING or status is WorkerStatus.RESUMING or status is STOPPED:
        return None  # the last two: a reset or a shutdown came first; an echo
    return f"worker {event.worker}'s incarnation {event.incarnation} already started"


def _stuck_on_an_awaited_task(state: State, event: Event) -> str | None:
    assert isinstance(event, WorkerStuck)
    w, task = event.worker, event.task
    if event.incarnation != state.life.incarnations[w]:
        return f"worker {w}'s incarnation {event.incarnation} is not the one running"
    if not state.waiting:
        return "no consumer waits, so no worker holds it up"
    status = state.life.workers[w]
    if status is not ACTIVE and status is not RETIRING:
        return f"worker {w} is {status.value}, not running a task"
    i = task - state.rcvd_idx
    slot = state.window[i] if 0 <= i < len(state.window) else None
    if not (type(slot) is Pending and slot.worker == w):
        return f"task {task} is not awaiting an answer from worker {w}"
    return None


def _something_awaited(state: State, event: Event) -> str | None:
    if state.waiting or state.life.resetting:
        return None
    return "no consumer is waiting, so nothing can time out"


def _map_style(state: State, event: Event) -> str | None:
    if state.config.iterable:
        return (
            f"worker {event.worker} of an iterable dataset holds its own part of the data, "  # type: ignore[attr-defined]
            "which retiring it would lose: only a map-style dataset's workers can be retired"
        )
    return None


def _running(state: State, event: Event) -> str | None:
    assert isinstance(event, RetireRequested)
    status = state.life.workers[event.worker]
    if status is not ACTIVE:
        return f"worker {event.worker} is {status.value}, not running: only a running one retires"
    return None


def _not_drawn_for(state: State, event: Event) -> str | None:
    assert isinstance(event, RetireRequested)
    if state.drawing_for == event.worker:
        return (
            f"an index is being drawn for worker {event.worker}: carry out the DrawIndex "
            "first, then retire it"
        )
    return None


def _another_takes_tasks(state: State, event: Event) -> str | None:
    assert isinstance(event, RetireRequested)
    w = event.worker
    for other, status in enumerate(state.life.workers):
        if other != w and (status is ACTIVE or status is STARTING):
            return None
    return f"worker {w} is the last worker that can take a task: add another before retiring it"


def _retired(state: State, event: Event) -> str | None:
    assert isinstance(event, AddRequested)
    status = state.life.workers[event.worker]
    if status is not STOPPED:
        return f"worker {event.worker} is {status.value}, not retired: only a retired slot is added"
    return None


def _a_bound(state: State, event: Event) -> str | None:
    assert isinstance(event, PrefetchChangeRequested)
    n = event.prefetch_factor
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return f"prefetch_factor must be an integer of at least 1 (tasks per worker), got {n!r}"
    return None


def _prefetching(state: State, event: Event) -> str | None:
    if state.config.lazy:
        return (
            "this scheduler loads in the calling thread and draws an index only on request "
            "(lazy): it prefetches nothing, so it has no bound to change"
        )
    return None


def _a_change(state: State, event: Event) -> str | None:
    assert isinstance(event, PrefetchChangeRequested)
    if event.prefetch_factor == state.config.prefetch_factor:
        return f"prefetch_factor is {event.prefetch_factor} already"
    return None


def _room_for_the_draw(state: State, event: Event) -> str | None:
    assert isinstance(event, PrefetchChangeRequested)
    w, n = state.drawing_for, event.prefetch_factor
    if w is not None and state.loads[w] >= n:
        return (
            f"an index is being drawn for worker {w}, which holds {state.loads[w]} task(s): "
            f"with prefetch_factor={n} it would be sent one over the bound; carry out the "
            "DrawIndex first, then lower it"
        )
    return None


_DRAW_GUARDS: tuple[Guard, ...] = (_index_asked,)

GUARDS: Mapping[type[Event], tuple[Guard, ...]] = {
    ResetRequested: (
        _no_batch_awaited,
        _no_draw_on_its_way,
        _no_reset_half_done,
        _resumes_only_when_fresh,
        _restarts_only_persistent,
        _turn_names_a_worker,
        _dry_workers_exist,
    ),
    NextRequested: (_ready_for_a_request,),
    IndexDrawn: _DRAW_GUARDS,
    SamplerExhausted: _DRAW_GUARDS,
    SamplerFailed: _DRAW_GUARDS,
    TimedOut: (_something_awaited,),
    WorkerExhausted: (_dataset_iterable,),
    WorkerResumed: (_known_worker, _incarnation_started, _asked_to_resume),
    WorkerDied: (_known_worker, _incarnation_started),
    WorkerStarted: (_known_worker, _incarnation_started, _was_replacing),
    WorkerStuck: (_known_worker, _stuck_on_an_awaited_task),
    RetireRequested: (_known_worker, _map_style, _running, _not_drawn_for, _another_takes_tasks),
    AddRequested: (_known_worker, _retired),
    PrefetchChangeRequested: (_a_bound, _prefetching, _a_change, _room_for_the_draw),
}
"""Per event type, the guards asked before its handler, in order. The answers' own check (is
this task awaited from this worker?) is `_claim`'s, which finds the task's slot on the way."""


# --- helpers -------------------------------------------------------------------------------------


def _resolve(rcvd_idx: int, window: tuple[Slot, ...], i: int) -> tuple[int, tuple[Slot, ...]]:
    """Mark the slot at `i` resolved; the window then starts at the first unresolved task."""
    if i:
        return rcvd_idx, window[:i] + (RESOLVED,) + window[i + 1 :]
    rcvd_idx += 1
    window = window[1:]
    while window and window[0] is RESOLVED:
        rcvd_idx += 1
        window = window[1:]
    return rcvd_idx, window


# Pending slots are equal by value, so those of the first 256 workers are built once, at import,
# each already in the one-slot tuple that a send appends to the window: sending a task then
# builds neither (a `Pending` costs 0.4 us). Tuples, filled once: nothing the core keeps may
# change while loaders step, in however many threads.
_SHARED_PENDINGS = 256
_PENDING_TAILS = tuple((Pending(w),) for w in range(_SHARED_PENDINGS))


def _add(loads: tuple[int, ...], worker: int, delta: int) -> tuple[int, ...]:
    counts = [*loads]  # through a list: half the time of joining three slices
    counts[worker] += delta
    return tuple(counts)


def _with(
    workers: tuple[WorkerStatus, ...], w: int, status: WorkerStatus
) -> tuple[WorkerStatus, ...]:
    return workers[:w] + (status,) + workers[w + 1 :]


def _shutdown(workers: tuple[WorkerStatus, ...]) -> tuple[Command, ...]:
    """The shutdown run for every worker not yet stopped; nothing if all are."""
    stopping = tuple(StopWorker(w) for w, status in enumerate(workers) if status is not STOPPED)
    return (*stopping, SHUTDOWN) if stopping else ()


# --- the finisher --------------------------------------------------------------------------------


def _settle(
    config: Config,
    life: Lifecycle,
    rcvd_idx: int,
    window: tuple[Slot, ...],
    loads: tuple[int, ...],
    cursor: int,
    drawing_for: int | None,
    waiting: bool,
    out: tuple[Command, ...],
) -> Transition:
    """Finish a move in a live phase: apply `RULES`, serve a waiting consumer, keep workers busy.

    `out` holds the commands the handler already gave; the ones decided here follow them. Every
    step of an epoch ends here, so it is written for the common one (RUNNING, all set): the
    rules of RESUMING and DRAINING are asked only in their phase.
    """
    phase = life.phase
    # The rules, in the order of `RULES`: each may take on from the one before.
    if phase is RESUMING and _policy.in_force.resume_complete(life.workers):
        phase = RUNNING  # "every acknowledgement in"
        life = attrs.evolve(life, phase=phase)
    if phase is RUNNING and ACTIVE not in life.workers and STARTING not in life.workers:
        phase = DRAINING  # "no active worker left"; worker 0 is active, mostly
        life = attrs.evolve(life, phase=phase)
    if waiting and window:
        i = _policy.in_force.deliverable(window, config.in_order)
        if i is not None:
            slot = window[i]
            task = rcvd_idx + i
            if type(slot) is Ready:
                out += (_deliver(task, slot.worker, slot.payload),)
            else:
                assert type(slot) is Failed
                out += (RaiseError(TaskFailure(task, slot.worker, slot.error)),)
            counts = [*loads]  # `_add(loads, slot.worker, -1)`, less a call on every batch
            counts[slot.worker] -= 1
            loads = tuple(counts)
            rcvd_idx, window = _resolve(rcvd_idx, window, i)
            waiting = False
    if life.retiring:
        # The rule "retired": a retiring worker that holds no task any more is stopped.
        workers = life.workers
        for w, status in enumerate(workers):
            if status is RETIRING and not loads[w]:
                workers = _with(workers, w, STOPPED)
                out += (StopWorker(w),)
        if workers is not life.workers:
            life = attrs.evolve(life, workers=workers)
    if phase is RUNNING:
        if drawing_for is None and (not config.lazy or (waiting and not window)):
            workers = life.workers
            if life.joining:
                # Added slots still starting take no turn, as if still retired.
                workers = tuple(STOPPED if w in life.joining else s for w, s in enumerate(workers))
            drawing_for = _policy.in_force.pick_worker(config, workers, loads, cursor)
            if drawing_for is not None:
                out += _DRAW
    elif phase is DRAINING and _policy.in_force.epoch_over(window, drawing_for, waiting):
        # The last rule, "the epoch over". Stopping the workers is not charged to the last batch: it
        # comes with the request after it, before that request is told the end.
        workers, joining = life.workers, life.joining
        if not config.persistent_workers:
            out += _shutdown(workers)
            workers, joining = (STOPPED,) * len(workers), frozenset()
        if waiting:
            out += (END_EPOCH,)
            waiting = False
        life = attrs.evolve(life, phase=FINISHED, workers=workers, joining=joining)
    if life.resetting and drawing_for is None and life.phase is not RESUMING:
        # iter() returns here: every worker resumed and the first tasks went out.
        life = attrs.evolve(life, resetting=False)
    # tuple.__new__ skips the NamedTuple constructor's Python frame: 0.13 against 0.29 us a state.
    state = _tuple_new(State, (config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting))
    return _tuple_new(Transition, (state, out))


def _settle_same(
    state: State, life: Lifecycle, drawing_for: int | None, waiting: bool
) -> Transition:
    """`_settle` for a move that leaves the window, loads and cursor as they were."""
    return _settle(
        state.config,
        life,
        state.rcvd_idx,
        state.window,
        state.loads,
        state.cursor,
        drawing_for,
        waiting,
        (),
    )


def _abandon(
    state: State, phase: Phase, failure: Failure | None, raised: Failure | None
) -> Transition:
    """Shut everything down and drop the window, releasing the batches it held.

    `raised`, if any, goes to the consumer after the shutdown; the caller decides whether one
    waits for it. A consumer not told now gets `failure` with its next request.
    """
    life = state.life
    out = _shutdown(life.workers)
    if raised is not None:
        out += (RaiseError(raised),)
        reported = raised is failure
    else:
        reported = life.reported and failure is life.failure
    unresolved = sum(1 for slot in state.window if slot is not RESOLVED)
    life = attrs.evolve(
        life,
        left=progress(state),
        phase=phase,
        workers=(STOPPED,) * len(life.workers),
        stale=frozenset(),
        joining=frozenset(),
        failure=failure,
        dropped=life.dropped + unresolved,
        resetting=False,
        reported=reported,
    )
    n = state.config.num_workers
    new = State(state.config, life, state.send_idx, (), (0,) * n, state.cursor, None, False)
    return Transition(new, out)


def _awaited(state: State) -> bool:
    """A consumer waits in `next()` or `iter()`: a failure now is raised to it."""
    return state.waiting or state.life.resetting


def _fail(state: State, event: Event, failure: Failure) -> Transition:
    return _abandon(state, _target(state, event), failure, failure if _awaited(state) else None)


def _claim(state: State, event: Event, task: int, worker: int, incarnation: int) -> int | None:
    """The window position of the pending `task`, or None if it is an echo: of an old epoch,
    or of an incarnation of the worker already lost."""
    life = state.life
    if not 0 <= worker < len(life.workers):
        raise _refuse(state, event, f"there is no worker {worker}")
    current = life.incarnations[worker]
    if _policy.in_force.lost(incarnation, current):
        return None
    if incarnation > current:
        raise _refuse(
            state,
            event,
            f"worker {worker}'s incarnation {incarnation} was never started (the scheduler "
            f"started {current})",
        )
    i = task - state.rcvd_idx
    if 0 <= i < len(state.window):
        slot = state.window[i]
        if type(slot) is Pending:
            if slot.worker != worker:
                raise _refuse(
                    state, event, f"task {task} was sent to worker {slot.worker}, not {worker}"
                )
            if life.workers[worker] is STARTING:
                raise _refuse(
                    state, event, f"task {task} is held for worker {worker}, which has not started"
                )
            return i
    if (task, worker) in life.stale:
        return None
    raise _refuse(state, event, f"task {task} is not awaiting an answer")


def _drop_stale(state: State, task: int, worker: int, incarnation: int) -> Transition:
    stale = state.life.stale
    current = state.life.incarnations[worker]
    if (task, worker) not in stale or _policy.in_force.lost(incarnation, current):
        # A lost incarnation's answer. The pair, if any, is its replacement's: the task was
        # sent to it again before a new epoch began, and its answer is still to be dropped.
        return Transition(state, ())
    life = attrs.evolve(state.life, stale=stale - {(task, worker)})
    return Transition(state._replace(life=life), ())


# --- handlers, one per event type ---------------------------------------------------------------


def _on_reset(state: State, event: ResetRequested) -> Transition:
    config, life = state.config, state.life
    n = config.num_workers
    resume = event.resume
    phase = _target(state, event)
    if life.phase is IDLE:
        cursor = 0
        workers = life.workers
        if resume is not None:
            cursor = _policy.in_force.resume_turn(config, resume)
            if cursor != resume.turn:
                resume = attrs.evolve(resume, turn=cursor)
            # Found dry before the checkpoint, with every batch handed over: they stay dry.
            # When all of them were, every batch of the epoch was handed over but the consumer
            # was not yet told it ended (a state taken then, or by a call that failed or was
            # interrupted before its StopIteration): the resumed epoch ends with no batch, as a
            # map-style one resumed after its last batch does (rule "no active worker left").
            workers = tuple(EXHAUSTED if w in resume.dry else s for w, s in enumerate(workers))
        life = attrs.evolve(
            life,
            phase=phase,
            epoch=1,
            base=state.rcvd_idx,
            resetting=True,
            resumed=resume,
            workers=workers,
        )
        return _settle(config, life, state.rcvd_idx, (), state.loads, cursor, None, False, ())
    # Tasks still pending belong to the old epoch: their answers will be discarded. Those held
    # for a replacement that has not started were never sent to it: none will come.
    send_idx = state.send_idx
    stale = life.stale.union(
        (state.rcvd_idx + i, slot.worker)
        for i, slot in enumerate(state.window)
        if type(slot) is Pending and life.workers[slot.worker] is not STARTING
    )
    epoch = life.epoch + 1
    # A retired slot stays retired; one still retiring is retired now (its tasks are stale).
    out: tuple[Command, ...] = tuple(
        StopWorker(w) for w, status in enumerate(life.workers) if status is RETIRING
    )
    workers = tuple(
        STOPPED if status is STOPPED or status is RETIRING else WorkerStatus.RESUMING
        for status in life.workers
    )
    out += tuple(ResumeWorker(w, epoch, event.seed) for w in range(n) if workers[w] is not STOPPED)
    life = Lifecycle(
        phase=phase,
        epoch=epoch,
        base=send_idx,
        workers=workers,
        stale=stale,
        skipped=0,
        dropped=0,
        failure=None,
        resetting=True,
        incarnations=life.incarnations,
        replaced=life.replaced,
        added=life.added,
    )
    return _settle(config, life, send_idx, (), (0,) * n, 0, None, False, out)


def _on_next(state: State, event: NextRequested) -> Transition:
    config, life, rcvd_idx, window, loads, cursor, drawing_for, _ = state
    if life.phase is FINISHED:
        return Transition(state, (END_EPOCH,))
    if life.phase is FAILED:
        failure = life.failure
        assert failure is not None
        answer = _policy.in_force.failed_request(failure, life.reported)
        if not life.reported:
            state = state._replace(life=attrs.evolve(life, reported=True))
        return Transition(state, (answer,))
    return _settle(config, life, rcvd_idx, window, loads, cursor, drawing_for, True, ())


def _on_index(state: State, event: IndexDrawn) -> Transition:
    config, life, rcvd_idx, window, loads, cursor, w, waiting = state
    resumed = life.resumed
    if resumed is not None and resumed.also:
        # Handed over before the checkpoint: drawn again only because a sampler cannot skip.
        # The sampler yields every position from `resumed.done` on: this draw's is the count
        # of draws so far, kept (sent) and dropped.
        at = resumed.done + state.send_idx - life.base + life.passed
        if at in resumed.also:
            life = attrs.evolve(life, passed=life.passed + 1)
            return Transition(state._replace(life=life), _DRAW)
    assert w is not None  # `_index_asked`
    workers = life.workers
    status = workers[w]
    if status is not ACTIVE and status is not STARTING:
        # The worker ran dry while the index was drawn. Only iterable datasets have dry
        # workers, and their sampler yields placeholders, so nothing is lost by dropping it
        # when no other worker has room.
        w = _policy.in_force.pick_worker(config, workers, loads, cursor)
        if w is None:
            return _settle_same(state, life, None, waiting)
        status = workers[w]
    index = event.index
    counts = [*loads]  # `_add(loads, w, 1)`, less a call on every batch
    counts[w] += 1
    if config.restarts or status is not ACTIVE:
        # Kept to send again, should the worker be lost before it answers; or to send once a
        # slot started again (`AddRequested`) has started, which needs no restart.
        window += (Pending(w, index),)
    else:
        window += _PENDING_TAILS[w] if w < _SHARED_PENDINGS else (Pending(w),)
    cursor = (w + 1) % config.num_workers
    # A replacement still starting is sent its tasks once it has started (`_on_started`).
    if status is ACTIVE or _policy.in_force.sent_at_once(status):
        out: tuple[Command, ...] = (_send_task(w, rcvd_idx + len(window) - 1, index),)
    else:
        out = ()
    return _settle(config, life, rcvd_idx, window, tuple(counts), cursor, None, waiting, out)


def _on_sampler_exhausted(state: State, event: SamplerExhausted) -> Transition:
    life = state.life
    phase = _target(state, event)
    if phase is not life.phase:
        life = attrs.evolve(life, phase=phase)
    return _settle_same(state, life, None, state.waiting)


def _on_answer(state: State, event: TaskCompleted | TaskFailed) -> Transition:
    """A task's answer, data or the worker's error: serve it now or keep it in the window."""
    config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting = state
    task, worker = event.task, event.worker
    i = task - rcvd_idx
    slot = window[i] if 0 <= i < len(window) else None
    if not (
        type(slot) is Pending
        and slot.worker == worker
        and event.incarnation == life.incarnations[worker]
        and life.workers[worker] is not STARTING
    ):
        # Slow path: an echo, or impossible.
        claimed = _claim(state, event, task, worker, event.incarnation)
        if claimed is None:
            return _drop_stale(state, task, worker, event.incarnation)
        i = claimed
    if type(event) is TaskCompleted:
        arrived: Slot = _ready(worker, event.payload)
    else:
        arrived = Failed(worker, event.error)  # type: ignore[union-attr]
    slots = [*window]
    slots[i] = arrived
    window = tuple(slots)
    return _settle(config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting, ())


def _on_exhausted(state: State, event: WorkerExhausted) -> Transition:
    i = _claim(state, event, event.task, event.worker, event.incarnation)
    if i is None:
        return _drop_stale(state, event.task, event.worker, event.incarnation)
    life = state.life
    workers = life.workers
    if workers[event.worker] is ACTIVE:
        workers = _with(workers, event.worker, EXHAUSTED)
    life = attrs.evolve(life, workers=workers, skipped=life.skipped + 1)
    rcvd_idx, window = _resolve(state.rcvd_idx, state.window, i)
    return _settle(
        state.config,
        life,
        rcvd_idx,
        window,
        _add(state.loads, event.worker, -1),
        state.cursor,
        state.drawing_for,
        state.waiting,
        (),
    )


def _on_resumed(state: State, event: WorkerResumed) -> Transition:
    life = state.life
    if _policy.in_force.abandoned(event.epoch, life.epoch) or _lost(state, event):
        # The answer to a reset the consumer abandoned (an interrupted iter()): the worker
        # answers this epoch's resume next, since it answers in the order it was asked. Or a
        # lost incarnation's: its replacement is set up for the epoch it starts in.
        return Transition(state, ())
    life = attrs.evolve(life, workers=_with(life.workers, event.worker, ACTIVE))
    return _settle_same(state, life, state.drawing_for, state.waiting)


def _on_died(state: State, event: WorkerDied) -> Transition:
    if _lost(state, event):
        return Transition(state, ())  # an incarnation already replaced, dying late
    workers = state.life.workers
    if _policy.in_force.death_is_fatal(workers, event.worker):
        death = WorkerDeath(event.worker, event.pid, event.exitcode, event.reason)
        return _lose(state, event.worker, death)
    # An echo: the worker was told to stop, and its exit is expected.
    life = attrs.evolve(state.life, workers=_with(workers, event.worker, STOPPED))
    return Transition(state._replace(life=life), ())


def _on_stuck(state: State, event: WorkerStuck) -> Transition:
    hang = WorkerHang(
        event.worker, event.task, event.seconds, event.pid, event.stack, event.killable
    )
    return _lose(state, event.worker, hang)


def _lose(state: State, w: int, loss: WorkerLoss) -> Transition:
    """A worker lost mid-run (dead, or stuck): replaced in its slot while restarts are left,
    else the rule "restarts spent" fails the loader, naming every loss."""
    config, life = state.config, state.life
    if not _policy.in_force.may_replace(config.restarts, life.replaced, loss):
        failure = attrs.evolve(loss, earlier=life.replaced)
        return _abandon(state, FAILED, failure, failure if _awaited(state) else None)
    incarnation = life.incarnations[w] + 1
    life = attrs.evolve(
        life,
        # One lost while resuming for a new epoch too: its replacement is set up for the epoch
        # it starts in, so its start is its acknowledgement.
        workers=_with(life.workers, w, STARTING),
        incarnations=life.incarnations[:w] + (incarnation,) + life.incarnations[w + 1 :],
        # The lost incarnation's answers are dropped as such: none is owed any more.
        stale=frozenset(pair for pair in life.stale if pair[1] != w),
        replaced=(*life.replaced, loss),
    )
    out = (ReplaceWorker(w, incarnation, life.epoch),)
    return _settle(
        config,
        life,
        state.rcvd_idx,
        state.window,
        state.loads,
        state.cursor,
        state.drawing_for,
        state.waiting,
        out,
    )


def _on_started(state: State, event: WorkerStarted) -> Transition:
    """A replacement has started: it is sent, in order and under their own numbers, the tasks
    its slot holds (the lost worker's unanswered ones, and those given it while it started)."""
    w = event.worker
    life = state.life
    if _lost(state, event) or life.workers[w] is not STARTING:
        return Transition(state, ())  # see `_was_replacing`
    life = attrs.evolve(life, workers=_with(life.workers, w, ACTIVE))
    if w in life.joining:
        life = attrs.evolve(life, joining=life.joining - {w})
    rcvd_idx, window = state.rcvd_idx, state.window
    out = tuple(
        SendTask(w, rcvd_idx + i, window[i].index)  # type: ignore[union-attr]
        for i in _policy.in_force.resent(window, w)
    )
    return _settle(
        state.config,
        life,
        rcvd_idx,
        state.window,
        state.loads,
        state.cursor,
        state.drawing_for,
        state.waiting,
        out,
    )


def _on_retire(state: State, event: RetireRequested) -> Transition:
    """A worker retires: it is given no new task (`pick_worker` passes it by) and is stopped
    by the rule "retired" once it holds none, at once if it holds none now."""
    life = state.life
    life = attrs.evolve(life, workers=_with(life.workers, event.worker, RETIRING))
    return _settle_same(state, life, state.drawing_for, state.waiting)


def _on_add(state: State, event: AddRequested) -> Transition:
    """A retired slot is started again, as its next incarnation, set up as a replacement is;
    it takes no turn until it has started (`Lifecycle.joining`): a process takes long to
    start, and in order every batch after one given to it would wait for it."""
    w = event.worker
    life = state.life
    incarnation = life.incarnations[w] + 1
    life = attrs.evolve(
        life,
        workers=_with(life.workers, w, STARTING),
        incarnations=life.incarnations[:w] + (incarnation,) + life.incarnations[w + 1 :],
        # The retired incarnation's late answers are dropped as a lost one's: none is owed.
        stale=frozenset(pair for pair in life.stale if pair[1] != w),
        added=life.added + 1,
        joining=life.joining | {w},
    )
    out = (ReplaceWorker(w, incarnation, life.epoch),)
    return _settle(
        state.config,
        life,
        state.rcvd_idx,
        state.window,
        state.loads,
        state.cursor,
        state.drawing_for,
        state.waiting,
        out,
    )


def _on_prefetch(state: State, event: PrefetchChangeRequested) -> Transition:
    """The prefetch bound changes: raised, `_settle` draws for the workers with room now;
    lowered, nothing already sent is touched, and `pick_worker` passes over the workers at or
    over the new bound until they answer."""
    config, life = state.config, state.life
    if event.prefetch_factor < config.prefetch_factor:
        life = attrs.evolve(life, lowered_at=state.send_idx)
    config = attrs.evolve(config, prefetch_factor=event.prefetch_factor)
    return _settle(
        config,
        life,
        state.rcvd_idx,
        state.window,
        state.loads,
        state.cursor,
        state.drawing_for,
        state.waiting,
        (),
    )


def _on_timeout(state: State, event: TimedOut) -> Transition:
    return _fail(state, event, Timeout(event.seconds))


def _on_interrupted(state: State, event: Interrupted) -> Transition:
    return Transition(_policy.in_force.interrupt(state), ())


def _on_sampler_failed(state: State, event: SamplerFailed) -> Transition:
    # Nothing sensible can follow a sampler that raised: stop everything. A consumer served in
    # this same call keeps its batch and gets the error next, as in torch.
    failure = SamplerFailure(event.error)
    now = _policy.in_force.sampler_error_now(state.waiting, state.life.resetting)
    return _abandon(state, _target(state, event), failure, failure if now else None)


def _on_executor_failed(state: State, event: ExecutorFailed) -> Transition:
    failure = ExecutorFailure(event.error)
    raised = RaiseError(failure)
    if state.life.phase is CLOSED:
        return Transition(state, (raised,))
    # Nothing the executor owes will come. The call that met the failure raises it, whatever it
    # was about to return, and so does every later request, as torch's does once its pin thread
    # is gone.
    state, out = _abandon(state, _target(state, event), failure, None)
    life = attrs.evolve(state.life, reported=True)
    return Transition(state._replace(life=life), (*out, raised))


_CANCELLED = Cancelled()


def _on_close(state: State, event: CloseRequested) -> Transition:
    life = state.life
    if life.phase is CLOSED:
        return Transition(state, ())
    return _abandon(state, CLOSED, life.failure, _CANCELLED if _awaited(state) else None)


def can_restart(state: State) -> bool:
    """Whether `ResetRequested` may start another epoch on this scheduler's workers.

    A loader whose scheduler cannot (it failed, was closed, or runs its one epoch without
    persistent workers) starts the next epoch on a fresh scheduler and fresh workers.
    """
    life = state.life
    if ResetRequested not in TRANSITIONS[life.phase]:
        return False
    return life.phase is IDLE or state.config.persistent_workers


_Handler = Callable[[State, Event], Transition]


# --- the steady state ----------------------------------------------------------------------------
# Most steps of an epoch are a batch's three: its index drawn and sent, its answer arriving, the
# consumer asking for it. While RUNNING, with iter() returned and no worker retiring or joining,
# each of the three is made whole by one function below, routed in place of the general route
# (`_ROUTES`, RUNNING only): it checks first that the state is steady and the event the common
# one (which implies its guards pass), else hands the step to the general route
# (`_general_step`) before doing anything. Its finish is `_settle`'s for those states, with the
# rules that cannot fire there left out; whatever is less common (an error to raise, a slot out
# of order) it passes to `_settle` itself. The decisions are still the policies in force.
# tests/test_step_steady.py holds every step of these equal to the general route's, on every
# (state, event) that the explorer reaches; `check --bench` measures what they save.


def _steady_index(state: State, event: Event) -> Transition:
    config, life, rcvd_idx, window, loads, cursor, w, waiting = state
    if (
        w is None  # `_index_asked` refuses it
        or life.workers[w] is not ACTIVE
        or life.resetting
        or life.joining
        or (life.resumed is not None and life.resumed.also)
        or life.retiring
    ):
        return _general_step(state, event)
    index = event.index  # type: ignore[attr-defined]
    counts = [*loads]
    counts[w] += 1
    loads = tuple(counts)
    if config.restarts:
        window += (Pending(w, index),)
    else:
        window += _PENDING_TAILS[w] if w < _SHARED_PENDINGS else (Pending(w),)
    cursor = (w + 1) % config.num_workers
    out: tuple[Command, ...] = (_send_task(w, rcvd_idx + len(window) - 1, index),)
    policy = _policy.in_force
    if waiting and policy.deliverable(window, config.in_order) is not None:
        return _settle(config, life, rcvd_idx, window, loads, cursor, None, waiting, out)
    drawing_for = None
    if not config.lazy:  # a lazy scheduler draws for a waiting consumer's empty window only
        drawing_for = policy.pick_worker(config, life.workers, loads, cursor)
        if drawing_for is not None:
            out += _DRAW
    new = _tuple_new(State, (config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting))
    return _tuple_new(Transition, (new, out))


def _steady_answer(state: State, event: Event) -> Transition:
    config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting = state
    task, worker = event.task, event.worker  # type: ignore[attr-defined]
    i = task - rcvd_idx
    slot = window[i] if 0 <= i < len(window) else None
    if not (
        type(slot) is Pending
        and slot.worker == worker
        and event.incarnation == life.incarnations[worker]  # type: ignore[attr-defined]
        and life.workers[worker] is ACTIVE
        and not life.resetting
        and not life.joining
        and not life.retiring
    ):
        return _general_step(state, event)
    slots = [*window]
    slots[i] = _ready(worker, event.payload)  # type: ignore[attr-defined]
    window = tuple(slots)
    return _steady_finish(config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting)


def _steady_next(state: State, event: Event) -> Transition:
    config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting = state
    if (
        waiting  # `_ready_for_a_request` refuses these two
        or life.resetting
        or life.joining
        or ACTIVE not in life.workers
        or life.retiring
    ):
        return _general_step(state, event)
    return _steady_finish(config, life, rcvd_idx, window, loads, cursor, drawing_for, True)


def _steady_finish(
    config: Config,
    life: Lifecycle,
    rcvd_idx: int,
    window: tuple[Slot, ...],
    loads: tuple[int, ...],
    cursor: int,
    drawing_for: int | None,
    waiting: bool,
) -> Transition:
    """`_settle` for a steady RUNNING state with an active worker and nothing handed in."""
    out: tuple[Command, ...] = ()
    policy = _policy.in_force
    if waiting and window:
        i = policy.deliverable(window, config.in_order)
        if i is not None:
            slot = window[i]
            if type(slot) is not Ready:
                return _settle(config, life, rcvd_idx, window, loads, cursor, drawing_for, True, ())
            worker = slot.worker
            out = (_deliver(rcvd_idx + i, worker, slot.payload),)
            counts = [*loads]
            counts[worker] -= 1
            loads = tuple(counts)
            if i:
                rcvd_idx, window = _resolve(rcvd_idx, window, i)
            else:  # `_resolve(rcvd_idx, window, 0)`, less a call on every batch
                rcvd_idx += 1
                window = window[1:]
                while window and window[0] is RESOLVED:
                    rcvd_idx += 1
                    window = window[1:]
            waiting = False
    if drawing_for is None and (not config.lazy or (waiting and not window)):
        drawing_for = policy.pick_worker(config, life.workers, loads, cursor)
        if drawing_for is not None:
            out += _DRAW
    new = _tuple_new(State, (config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting))
    return _tuple_new(Transition, (new, out))


_STEADY: Mapping[type[Event], _Handler] = {
    IndexDrawn: _steady_index,
    TaskCompleted: _steady_answer,
    NextRequested: _steady_next,
}
"""The moves a steady RUNNING state makes whole in one function, routed in RUNNING in place of
the general route."""


_HANDLERS: Mapping[type[Event], _Handler] = {
    ResetRequested: _on_reset,  # type: ignore[dict-item]
    NextRequested: _on_next,  # type: ignore[dict-item]
    CloseRequested: _on_close,  # type: ignore[dict-item]
    IndexDrawn: _on_index,  # type: ignore[dict-item]
    SamplerExhausted: _on_sampler_exhausted,  # type: ignore[dict-item]
    SamplerFailed: _on_sampler_failed,  # type: ignore[dict-item]
    ExecutorFailed: _on_executor_failed,  # type: ignore[dict-item]
    TimedOut: _on_timeout,  # type: ignore[dict-item]
    Interrupted: _on_interrupted,  # type: ignore[dict-item]
    TaskCompleted: _on_answer,  # type: ignore[dict-item]
    TaskFailed: _on_answer,  # type: ignore[dict-item]
    WorkerExhausted: _on_exhausted,  # type: ignore[dict-item]
    WorkerResumed: _on_resumed,  # type: ignore[dict-item]
    WorkerDied: _on_died,  # type: ignore[dict-item]
    WorkerStuck: _on_stuck,  # type: ignore[dict-item]
    WorkerStarted: _on_started,  # type: ignore[dict-item]
    RetireRequested: _on_retire,  # type: ignore[dict-item]
    AddRequested: _on_add,  # type: ignore[dict-item]
    PrefetchChangeRequested: _on_prefetch,  # type: ignore[dict-item]
}


def _routes(steady: bool) -> dict[Phase, dict[type[Event], tuple[_Handler, tuple[Guard, ...]]]]:
    """`_HANDLERS` and `GUARDS` spread over `TRANSITIONS`: phase -> legal event type -> its
    handler and guards. `step` looks a move up here once per event; an event type missing under
    a phase is refused, as in `TRANSITIONS`. With `steady`, RUNNING's batch moves go to the
    steady handlers (`_STEADY`), which ask their guards' questions themselves."""
    routes = {
        phase: {event: (_HANDLERS[event], GUARDS.get(event, ())) for event in moves}
        for phase, moves in TRANSITIONS.items()
    }
    if steady:
        for event, handler in _STEADY.items():
            assert event in routes[RUNNING]
            routes[RUNNING][event] = (handler, ())
    return routes


_ROUTES = _routes(steady=True)
_GENERAL = _routes(steady=False)


def _general_step(state: State, event: Event) -> Transition:
    """`step` by the general route alone: the guards, the handler, `_settle`. What the steady
    handlers hand on, and what tests/test_step_steady.py holds them equal to."""
    try:
        handler, guards = _GENERAL[state.life.phase][type(event)]
    except KeyError:
        handler, guards = _illegal, ()
    for guard in guards:
        reason = guard(state, event)
        if reason is not None:
            raise _refuse(state, event, reason)
    return handler(state, event)
