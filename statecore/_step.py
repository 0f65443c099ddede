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

Every event that the current state cannot accept raises a `ProtocolError` naming the phase and
the event; since states are values, the caller still holds the old state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import attrs

from statecore._commands import (
    DRAW_INDEX,
    END_EPOCH,
    SHUTDOWN,
    Command,
    Deliver,
    RaiseError,
    ResumeWorker,
    SendTask,
    StopWorker,
)
from statecore._errors import ClosedError, ExecutorError, MisuseError, ProtocolError
from statecore._events import (
    CONSUMER_EVENTS,
    CloseRequested,
    Event,
    ExecutorFailed,
    IndexDrawn,
    Interrupted,
    NextRequested,
    ResetRequested,
    SamplerExhausted,
    SamplerFailed,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
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
    WorkerStatus,
)

__all__ = ["TRANSITIONS", "Transition", "can_restart", "step"]

IDLE = Phase.IDLE
RESUMING = Phase.RESUMING
RUNNING = Phase.RUNNING
DRAINING = Phase.DRAINING
FINISHED = Phase.FINISHED
FAILED = Phase.FAILED
CLOSED = Phase.CLOSED

ACTIVE = WorkerStatus.ACTIVE
EXHAUSTED = WorkerStatus.EXHAUSTED
STOPPED = WorkerStatus.STOPPED


_tuple_new = tuple.__new__
_DRAW = (DRAW_INDEX,)


# Built for every batch, a `SendTask`, a `Ready` slot and a `Deliver` skip attrs' frozen __init__:
# an empty instance gets its slots set through these descriptors, 0.27 us against 0.37 for a
# `Ready`, 0.30 against 0.47 for a command. The handlers of the steady state (below) do it
# inline, which saves a call on every step; `_deliver` does it for `_settle`. Same values, same
# equality; tests/test_step_steady.py compares what `step` returns with the constructors' own.
_new = object.__new__
_ready_worker = Ready.__dict__["worker"].__set__
_ready_payload = Ready.__dict__["payload"].__set__
_deliver_task = Deliver.__dict__["task"].__set__
_deliver_worker = Deliver.__dict__["worker"].__set__
_deliver_payload = Deliver.__dict__["payload"].__set__
_send_worker = SendTask.__dict__["worker"].__set__
_send_task_number = SendTask.__dict__["task"].__set__
_send_index = SendTask.__dict__["index"].__set__


def _deliver(task: int, worker: int, payload: object) -> Deliver:
    command: Deliver = _new(Deliver)
    _deliver_task(command, task)
    _deliver_worker(command, worker)
    _deliver_payload(command, payload)
    return command


class Transition(NamedTuple):
    """What `step` returns: the next state and the commands to carry out, in order."""

    state: State
    commands: tuple[Command, ...]


def _table(entries: dict[type[Event], tuple[Phase, ...]]) -> Mapping[type[Event], frozenset[Phase]]:
    return {event: frozenset(targets) for event, targets in entries.items()}


_ANSWERS = (TaskCompleted, TaskFailed, WorkerExhausted)

# The legal moves: phase -> event type -> the phases the event may lead to. An event type
# missing under a phase is refused. The models check every transition they see against this
# table, and docs/state-machine.md draws its diagram from it.
TRANSITIONS: Mapping[Phase, Mapping[type[Event], frozenset[Phase]]] = {
    IDLE: _table(
        {
            # Draining at once when a checkpoint's every worker is dry: its epoch has no batch left.
            ResetRequested: (RUNNING, DRAINING),
            WorkerDied: (FAILED,),
            Interrupted: (IDLE,),
            CloseRequested: (CLOSED,),
        }
    ),
    RESUMING: _table(
        {
            # Only after an interrupted iter(): a batch is asked for, or the reset starts over.
            NextRequested: (RESUMING,),
            ResetRequested: (RESUMING,),
            Interrupted: (RESUMING,),
            WorkerResumed: (RESUMING, RUNNING),
            **{answer: (RESUMING,) for answer in _ANSWERS},  # stale answers only
            WorkerDied: (FAILED,),
            TimedOut: (FAILED,),
            ExecutorFailed: (FAILED,),
            CloseRequested: (CLOSED,),
        }
    ),
    RUNNING: _table(
        {
            NextRequested: (RUNNING,),
            IndexDrawn: (RUNNING,),
            SamplerExhausted: (DRAINING, FINISHED),
            SamplerFailed: (FAILED,),
            TaskCompleted: (RUNNING,),
            TaskFailed: (RUNNING,),
            WorkerExhausted: (RUNNING, DRAINING, FINISHED),
            WorkerDied: (FAILED,),
            TimedOut: (FAILED,),
            ExecutorFailed: (FAILED,),
            Interrupted: (RUNNING,),
            ResetRequested: (RESUMING,),
            CloseRequested: (CLOSED,),
        }
    ),
    DRAINING: _table(
        {
            NextRequested: (DRAINING, FINISHED),
            # Finishes when every worker ran dry during the draw: the index has nowhere to go.
            IndexDrawn: (DRAINING, FINISHED),
            SamplerExhausted: (DRAINING, FINISHED),
            SamplerFailed: (FAILED,),
            # A batch or an error answers the waiting consumer; only a dry worker's answer ends it.
            TaskCompleted: (DRAINING,),
            TaskFailed: (DRAINING,),
            WorkerExhausted: (DRAINING, FINISHED),
            WorkerDied: (FAILED,),
            TimedOut: (FAILED,),
            ExecutorFailed: (FAILED,),
            Interrupted: (DRAINING,),
            ResetRequested: (RESUMING,),
            CloseRequested: (CLOSED,),
        }
    ),
    FINISHED: _table(
        {
            NextRequested: (FINISHED,),
            **{answer: (FINISHED,) for answer in _ANSWERS},  # stale answers only
            WorkerDied: (FINISHED, FAILED),
            # Stopping the workers at the end of the epoch failed.
            ExecutorFailed: (FAILED,),
            Interrupted: (FINISHED,),
            ResetRequested: (RESUMING,),
            CloseRequested: (CLOSED,),
        }
    ),
    FAILED: _table(
        {
            NextRequested: (FAILED,),
            WorkerDied: (FAILED,),  # every worker was stopped: a late report is ignored
            # Stopping the workers after the failure failed too.
            ExecutorFailed: (FAILED,),
            Interrupted: (FAILED,),
            CloseRequested: (CLOSED,),
        }
    ),
    CLOSED: _table(
        {
            WorkerDied: (CLOSED,),
            # Stopping the workers on close failed: the close call raises it.
            ExecutorFailed: (CLOSED,),
            Interrupted: (CLOSED,),
            CloseRequested: (CLOSED,),
        }
    ),
}


def step(state: State, event: Event) -> Transition:
    """Apply `event` to `state`. Raises `ProtocolError` (and changes nothing) if it cannot."""
    # One lookup answers both "is this move legal?" and "who handles it?" (see `_routes`).
    try:
        handler = _ROUTES[state.life.phase][type(event)]
    except KeyError:
        handler = _illegal  # raises out of this block, so the KeyError is not its context
    return handler(state, event)


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
    if isinstance(event, (IndexDrawn, SamplerExhausted, SamplerFailed)):
        return "no index was asked of the sampler"
    if isinstance(event, TimedOut):
        return "nothing was being waited for"
    if isinstance(event, _ANSWERS):
        return "no task is awaiting an answer"
    return f"{type(event).__name__} cannot happen while the loader is {phase.value}"


# --- policy --------------------------------------------------------------------------------------
# The decisions that torch spreads over `_try_put_index` and `_next_data`. The mutation tests in
# models/mutants.py replace these one at a time to show that the models notice.


def _pick_worker(
    config: Config, workers: tuple[WorkerStatus, ...], loads: tuple[int, ...], cursor: int
) -> int | None:
    """The worker the next task goes to, or None if it must wait for room."""
    if config.in_order:
        # Take turns strictly: waiting for a busy worker keeps torch's assignment of tasks.
        if workers[cursor] is ACTIVE:  # asked on nearly every step: the common case first
            return cursor if loads[cursor] < config.prefetch_factor else None
        limit = config.prefetch_factor
        n = config.num_workers
        for k in range(1, n):
            w = (cursor + k) % n
            if workers[w] is ACTIVE:
                return w if loads[w] < limit else None
        return None
    n = config.num_workers
    best = None
    best_load = config.prefetch_factor
    for k in range(n):
        w = (cursor + k) % n
        if workers[w] is ACTIVE and loads[w] < best_load:
            best, best_load = w, loads[w]
    return best


def _resume_complete(workers: tuple[WorkerStatus, ...]) -> bool:
    """Tasks may flow again only once every worker has acknowledged the new epoch."""
    return WorkerStatus.RESUMING not in workers


def _epoch_over(window: tuple[Slot, ...], drawing_for: int | None) -> bool:
    """Once draining, the epoch ends when every task is resolved and no index is on its way."""
    return not window and drawing_for is None


def _deliverable(window: tuple[Slot, ...], in_order: bool) -> int | None:
    """Position in the window of the answer a waiting consumer gets next, if there is one."""
    if in_order:
        return 0 if type(window[0]) is not Pending else None
    for i, slot in enumerate(window):
        kind = type(slot)
        if kind is Ready or kind is Failed:
            return i
    return None


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


def _shutdown(workers: tuple[WorkerStatus, ...]) -> tuple[Command, ...]:
    """The shutdown run for every worker not yet stopped; nothing if all are."""
    stopping = tuple(StopWorker(w) for w, status in enumerate(workers) if status is not STOPPED)
    return (*stopping, SHUTDOWN) if stopping else ()


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
    """Finish a transition: serve a waiting consumer, keep workers busy, notice the epoch end.

    `out` holds the commands the handler already gave; the ones decided here follow them. This
    is the reference for finishing a step; the handlers of a batch's three steps finish the
    steady state of an epoch themselves, in the same way (see "the steady state" below).
    """
    if waiting and window:
        i = _deliverable(window, config.in_order)
        if i is not None:
            slot = window[i]
            task = rcvd_idx + i
            if type(slot) is Ready:
                out += (_deliver(task, slot.worker, slot.payload),)
            else:
                assert type(slot) is Failed
                out += (RaiseError(TaskFailure(task, slot.worker, slot.error)),)
            loads = _add(loads, slot.worker, -1)
            rcvd_idx, window = _resolve(rcvd_idx, window, i)
            waiting = False
    phase = life.phase
    if phase is RUNNING:
        if drawing_for is None and (not config.lazy or (waiting and not window)):
            drawing_for = _pick_worker(config, life.workers, loads, cursor)
            if drawing_for is not None:
                out += _DRAW
    elif phase is DRAINING and waiting and _epoch_over(window, drawing_for):
        # Only a request after the last batch finishes the epoch, as in torch: the last batch
        # is handed over first, and stopping the workers is not charged to it.
        workers = life.workers
        if not config.persistent_workers:
            out += _shutdown(workers)
            workers = (STOPPED,) * len(workers)
        out += (END_EPOCH,)  # after the shutdown, as with errors: clean up, then tell
        waiting = False
        life = attrs.evolve(life, phase=FINISHED, workers=workers)
    if life.resetting and drawing_for is None and life.phase is not RESUMING:
        # iter() returns here: every worker resumed and the first tasks went out.
        life = attrs.evolve(life, resetting=False)
    # tuple.__new__ skips the NamedTuple constructor's Python frame: 0.13 against 0.29 us a state.
    state = _tuple_new(State, (config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting))
    return _tuple_new(Transition, (state, out))


def _settle_same(
    state: State, life: Lifecycle, drawing_for: int | None, waiting: bool
) -> Transition:
    """`_settle` for a transition that leaves the window, loads and cursor as they were."""
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

    `raised` goes to a consumer waiting in `next()` or `iter()`, after the shutdown. A consumer
    not waiting holds the batch it was just handed, and gets the failure with its next request.
    """
    life = state.life
    out = _shutdown(life.workers)
    workers = (STOPPED,) * len(life.workers)
    if (state.waiting or life.resetting) and raised is not None:
        out += (RaiseError(raised),)
        reported = raised is failure
    else:
        reported = life.reported and failure is life.failure
    unresolved = sum(1 for slot in state.window if slot is not RESOLVED)
    life = attrs.evolve(
        life,
        left=progress(state),
        phase=phase,
        workers=workers,
        stale=frozenset(),
        failure=failure,
        dropped=life.dropped + unresolved,
        resetting=False,
        reported=reported,
    )
    n = state.config.num_workers
    new = State(state.config, life, state.send_idx, (), (0,) * n, state.cursor, None, False)
    return Transition(new, out)


def _fail(state: State, failure: Failure) -> Transition:
    return _abandon(state, FAILED, failure, failure)


def _claim(state: State, event: Event, task: int, worker: int) -> int | None:
    """The window position of the pending `task`, or None if it is a stale task of an old epoch."""
    i = task - state.rcvd_idx
    if 0 <= i < len(state.window):
        slot = state.window[i]
        if type(slot) is Pending:
            if slot.worker != worker:
                raise _refuse(
                    state, event, f"task {task} was sent to worker {slot.worker}, not {worker}"
                )
            return i
    if (task, worker) in state.life.stale:
        return None
    raise _refuse(state, event, f"task {task} is not awaiting an answer")


def _drop_stale(state: State, task: int, worker: int) -> Transition:
    life = attrs.evolve(state.life, stale=state.life.stale - {(task, worker)})
    return Transition(state._replace(life=life), ())


# --- handlers, one per event type -------------------------------------------------------------


def _on_reset(state: State, event: ResetRequested) -> Transition:
    config = state.config
    life = state.life
    n = config.num_workers
    if state.waiting:
        raise _refuse(state, event, "a batch is still awaited")
    if state.drawing_for is not None:
        raise _refuse(state, event, "an index is still being drawn from the previous sampler")
    if life.resetting:
        raise _refuse(state, event, "the previous reset still waits for its workers to resume")
    resume = event.resume
    if life.phase is IDLE:
        cursor = 0
        if resume is not None and config.iterable:
            # Each worker goes on with its own part of the dataset (its executor restored it),
            # so the turns go on where they were: the same batches, in the same order.
            if resume.turn >= n:
                raise _refuse(
                    state,
                    event,
                    f"the checkpoint's next turn is worker {resume.turn}, and there are {n} "
                    "workers: an iterable dataset resumes on as many workers as it was taken with",
                )
            cursor = resume.turn
        elif resume is not None:
            # A map-style epoch: the same worker loads the same batch when there are as many.
            if resume.turn >= n:
                resume = attrs.evolve(resume, turn=0)
            cursor = resume.turn
        workers = life.workers
        if resume is not None and resume.dry:
            if not config.iterable or max(resume.dry) >= n:
                raise _refuse(
                    state,
                    event,
                    f"the checkpoint's dry workers {sorted(resume.dry)} are not workers of an "
                    f"iterable dataset's {n}",
                )
            # Found dry before the checkpoint, with every batch handed over: they stay dry.
            # When all of them were, every batch of the epoch was handed over but the consumer
            # was not yet told it ended (a state taken then, or by a call that failed or was
            # interrupted before its StopIteration): the resumed epoch ends with no batch, as a
            # map-style one resumed after its last batch does.
            workers = tuple(
                EXHAUSTED if w in resume.dry else status for w, status in enumerate(workers)
            )
        life = attrs.evolve(
            life,
            phase=RUNNING if ACTIVE in workers else DRAINING,
            epoch=1,
            base=state.rcvd_idx,
            resetting=True,
            resumed=resume,
            workers=workers,
        )
        return _settle(config, life, state.rcvd_idx, (), state.loads, cursor, None, False, ())
    if resume is not None:
        raise _refuse(state, event, "only a fresh scheduler resumes an epoch from a checkpoint")
    if not config.persistent_workers:
        raise _refuse(
            state, event, "without persistent workers a scheduler runs one epoch; build a new one"
        )
    # Tasks still pending belong to the old epoch: their answers will be discarded.
    send_idx = state.send_idx
    stale = life.stale.union(
        (state.rcvd_idx + i, slot.worker)
        for i, slot in enumerate(state.window)
        if type(slot) is Pending
    )
    epoch = life.epoch + 1
    out = tuple(ResumeWorker(w, epoch, event.seed) for w in range(n))
    life = Lifecycle(
        phase=RESUMING,
        epoch=epoch,
        base=send_idx,
        workers=(WorkerStatus.RESUMING,) * n,
        stale=stale,
        skipped=0,
        dropped=0,
        failure=None,
        resetting=True,
    )
    new = State(config, life, send_idx, (), (0,) * n, 0, None, False)
    return Transition(new, out)


# --- the steady state ---------------------------------------------------------------------------
# Most steps of an epoch are a batch's three: its index drawn and sent, its answer arriving, the
# consumer asking for it. While RUNNING, with iter() returned and the sampler read ahead, the
# three handlers below finish their step themselves: serve the waiting consumer the answer that
# `_deliverable` names, if any, and draw an index for the worker that `_pick_worker` names, if
# none is on its way. That is what `_settle` would do, less a call and the checks that do not
# apply; every other case and phase goes through `_settle`, and tests/test_step_steady.py checks
# that both agree. The policies are still asked by name, so that models/mutants.py can swap
# them. Each handler reads the state in one unpacking, less than half the time of reading its
# eight fields one by one.


def _on_next(state: State, event: NextRequested) -> Transition:
    config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting = state
    if waiting:
        raise _refuse(state, event, "a batch is already awaited")
    if life.resetting:
        raise _refuse(
            state,
            event,
            "iter() has not returned: its workers are still resuming or its first indices are "
            "still being drawn; carry out every command it gave first",
        )
    if life.phase is not RUNNING or config.lazy:
        return _next_off_steady(state)
    i = _deliverable(window, config.in_order) if window else None
    if i is not None and (i or type(window[0]) is Failed):  # out of order, or an error
        return _settle(config, life, rcvd_idx, window, loads, cursor, drawing_for, True, ())
    if i is None:
        commands: tuple[Command, ...] = ()
        waiting = True  # for the answer: it arrives into the window and is served then
    else:  # the oldest task's batch: hand it over, and pass those behind it handed over already
        slot: Ready = window[0]  # type: ignore[assignment]
        worker = slot.worker
        deliver: Deliver = _new(Deliver)  # `_deliver(rcvd_idx, worker, slot.payload)`
        _deliver_task(deliver, rcvd_idx)
        _deliver_worker(deliver, worker)
        _deliver_payload(deliver, slot.payload)
        commands = (deliver,)
        counts = [*loads]
        counts[worker] -= 1
        loads = tuple(counts)
        rcvd_idx += 1
        window = window[1:]
        while window and window[0] is RESOLVED:
            rcvd_idx += 1
            window = window[1:]
    if drawing_for is None:
        drawing_for = _pick_worker(config, life.workers, loads, cursor)
        if drawing_for is not None:
            commands += _DRAW
    new = _tuple_new(State, (config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting))
    return _tuple_new(Transition, (new, commands))


def _next_off_steady(state: State) -> Transition:
    """A request while the epoch drains, ended or failed, or from a lazy scheduler."""
    life = state.life
    if life.phase is FINISHED:
        return Transition(state, (END_EPOCH,))
    if life.phase is FAILED:
        failure = life.failure
        assert failure is not None
        if life.reported and type(failure) is SamplerFailure:
            # As torch's: a sampler that raised is spent, and the next request finds the end.
            return Transition(state, (END_EPOCH,))
        if not life.reported:
            state = state._replace(life=attrs.evolve(life, reported=True))
        return Transition(state, (RaiseError(failure),))
    return _settle_same(state, life, state.drawing_for, True)


def _on_index(state: State, event: IndexDrawn) -> Transition:
    config, life, rcvd_idx, window, loads, cursor, w, waiting = state
    if w is None:
        raise _refuse(state, event, "no index was asked of the sampler")
    resumed = life.resumed
    if resumed is not None and resumed.also:
        # Handed over before the checkpoint: drawn again only because a sampler cannot skip.
        # The sampler yields every position from `resumed.done` on: this draw's is the count
        # of draws so far, kept (sent) and dropped.
        at = resumed.done + state.send_idx - life.base + life.passed
        if at in resumed.also:
            life = attrs.evolve(life, passed=life.passed + 1)
            return Transition(state._replace(life=life), (DRAW_INDEX,))
    if life.workers[w] is not ACTIVE:
        # The worker ran dry while the index was drawn. Only iterable datasets have dry
        # workers, and their sampler yields placeholders, so nothing is lost by dropping it
        # when no other worker has room.
        w = _pick_worker(config, life.workers, loads, cursor)
        if w is None:
            return _settle_same(state, life, None, waiting)
    send: SendTask = _new(SendTask)  # `SendTask(w, rcvd_idx + len(window), event.index)`
    _send_worker(send, w)
    _send_task_number(send, rcvd_idx + len(window))
    _send_index(send, event.index)
    counts = [*loads]
    counts[w] += 1
    loads = tuple(counts)
    window += _PENDING_TAILS[w] if w < _SHARED_PENDINGS else (Pending(w),)
    cursor = (w + 1) % config.num_workers
    if waiting or life.phase is not RUNNING or life.resetting or config.lazy:
        return _settle(config, life, rcvd_idx, window, loads, cursor, None, waiting, (send,))
    # No consumer waits, so nothing is served: only the next draw is decided.
    w = _pick_worker(config, life.workers, loads, cursor)
    new = _tuple_new(State, (config, life, rcvd_idx, window, loads, cursor, w, False))
    return _tuple_new(Transition, (new, (send,) if w is None else (send, DRAW_INDEX)))


def _on_sampler_exhausted(state: State, event: SamplerExhausted) -> Transition:
    if state.drawing_for is None:
        raise _refuse(state, event, "no index was asked of the sampler")
    life = state.life
    if life.phase is RUNNING:
        life = attrs.evolve(life, phase=DRAINING)
    return _settle_same(state, life, None, state.waiting)


def _on_answer(state: State, event: TaskCompleted | TaskFailed) -> Transition:
    """A task's answer, data or the worker's error: serve it now or keep it in the window."""
    config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting = state
    task, worker = event.task, event.worker
    i = task - rcvd_idx
    slot = window[i] if 0 <= i < len(window) else None
    if not (type(slot) is Pending and slot.worker == worker):
        claimed = _claim(state, event, task, worker)  # slow path: stale, or impossible
        if claimed is None:
            return _drop_stale(state, task, worker)
        i = claimed
    if type(event) is TaskCompleted:
        arrived: Slot = _new(Ready)  # `Ready(worker, event.payload)`
        _ready_worker(arrived, worker)
        _ready_payload(arrived, event.payload)
    else:
        arrived = Failed(worker, event.error)  # type: ignore[union-attr]
    slots = [*window]
    slots[i] = arrived
    window = tuple(slots)
    if (
        life.phase is not RUNNING
        or life.resetting
        or config.lazy
        or (waiting and _deliverable(window, config.in_order) is not None)
    ):
        return _settle(config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting, ())
    # Nothing to serve yet (in order, an answer ahead of its turn): only a draw is decided.
    commands: tuple[Command, ...] = ()
    if drawing_for is None:
        drawing_for = _pick_worker(config, life.workers, loads, cursor)
        if drawing_for is not None:
            commands = _DRAW
    new = _tuple_new(State, (config, life, rcvd_idx, window, loads, cursor, drawing_for, waiting))
    return _tuple_new(Transition, (new, commands))


def _on_exhausted(state: State, event: WorkerExhausted) -> Transition:
    if not state.config.iterable:
        raise _refuse(state, event, "a map-style dataset's worker cannot run dry")
    i = _claim(state, event, event.task, event.worker)
    if i is None:
        return _drop_stale(state, event.task, event.worker)
    life = state.life
    workers = life.workers
    if workers[event.worker] is ACTIVE:
        workers = workers[: event.worker] + (EXHAUSTED,) + workers[event.worker + 1 :]
    phase = life.phase
    if phase is RUNNING and ACTIVE not in workers:
        phase = DRAINING
    life = attrs.evolve(life, phase=phase, workers=workers, skipped=life.skipped + 1)
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
    w = event.worker
    if not 0 <= w < len(life.workers):
        raise _refuse(state, event, f"there is no worker {w}")
    if event.epoch < life.epoch:
        # The answer to a reset the consumer abandoned (an interrupted iter()): the worker
        # answers this epoch's resume next, since it answers in the order it was asked.
        return Transition(state, ())
    if event.epoch > life.epoch or life.workers[w] is not WorkerStatus.RESUMING:
        raise _refuse(
            state,
            event,
            f"worker {w} was not asked to resume for epoch {event.epoch}, or already answered",
        )
    workers = life.workers[:w] + (ACTIVE,) + life.workers[w + 1 :]
    if _resume_complete(workers):
        life = attrs.evolve(life, phase=RUNNING, workers=workers)
    else:
        life = attrs.evolve(life, workers=workers)
    return _settle_same(state, life, state.drawing_for, state.waiting)


def _on_died(state: State, event: WorkerDied) -> Transition:
    workers = state.life.workers
    if not 0 <= event.worker < len(workers):
        raise _refuse(state, event, f"there is no worker {event.worker}")
    if workers[event.worker] is STOPPED:
        return Transition(state, ())  # it was told to stop: its exit is expected
    return _fail(state, WorkerDeath(event.worker, event.pid, event.exitcode, event.reason))


def _on_timeout(state: State, event: TimedOut) -> Transition:
    if not (state.waiting or state.life.resetting):
        raise _refuse(state, event, "no consumer is waiting, so nothing can time out")
    return _fail(state, Timeout(event.seconds))


def _on_interrupted(state: State, event: Interrupted) -> Transition:
    # An interrupt may land anywhere, so it is never refused: with nothing awaited, nothing changes.
    life = state.life
    if state.drawing_for is not None:
        # The sampler was cut short mid-draw: whatever it yields next goes to a later request.
        state = state._replace(drawing_for=None)
    # A half-done reset stays half done, and the next iter() starts it over (see `_on_reset`);
    # what a request waited for stays owed and arrives into the window for the next request.
    if life.resetting:
        state = state._replace(life=attrs.evolve(life, resetting=False))
    return Transition(state._replace(waiting=False), ())


def _on_sampler_failed(state: State, event: SamplerFailed) -> Transition:
    if state.drawing_for is None:
        raise _refuse(state, event, "no index was asked of the sampler")
    # Nothing sensible can follow a sampler that raised: stop everything. A consumer served in
    # this same call keeps its batch and gets the error next (see `_abandon`), as in torch.
    failure = SamplerFailure(event.error)
    return _abandon(state, FAILED, failure, failure)


def _on_executor_failed(state: State, event: ExecutorFailed) -> Transition:
    failure = ExecutorFailure(event.error)
    raised = RaiseError(failure)
    if state.life.phase is CLOSED:
        return Transition(state, (raised,))
    # Nothing the executor owes will come. The call that met the failure raises it, whatever it
    # was about to return, and so does every later request, as torch's does once its pin thread
    # is gone.
    state, out = _abandon(state, FAILED, failure, None)
    life = attrs.evolve(state.life, reported=True)
    return Transition(state._replace(life=life), (*out, raised))


_CANCELLED = Cancelled()


def _on_close(state: State, event: CloseRequested) -> Transition:
    life = state.life
    if life.phase is CLOSED:
        return Transition(state, ())
    return _abandon(state, CLOSED, life.failure, _CANCELLED)


def can_restart(state: State) -> bool:
    """Whether `ResetRequested` may start another epoch on this scheduler's workers.

    A loader whose scheduler cannot (it failed, was closed, or runs its one epoch without
    persistent workers) starts the next epoch on a fresh scheduler and fresh workers.
    """
    life = state.life
    if ResetRequested not in TRANSITIONS[life.phase]:
        return False
    return life.phase is IDLE or state.config.persistent_workers


_HANDLERS: dict[type[Event], Callable[[State, Event], Transition]] = {
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
}

_Handler = Callable[[State, Event], Transition]


def _routes() -> dict[Phase, dict[type[Event], _Handler]]:
    """`_HANDLERS` spread over `TRANSITIONS`: phase -> legal event type -> its handler.

    `step` looks a move up here once per event; an event type missing under a phase is refused,
    as in `TRANSITIONS`. Derived, never edited: whoever swaps a handler (models/mutants.py)
    builds the routes again.
    """
    return {
        phase: {event: _HANDLERS[event] for event in moves} for phase, moves in TRANSITIONS.items()
    }


_ROUTES = _routes()
