"""The scheduler's policies: the decisions of `step` that a wrong version could plausibly get wrong.

Each is a small pure function of values, and `Policy` gathers them in one frozen value; `step`
reads the one in force, `in_force`. Everything else in `statecore._step` is bookkeeping that
carries a decision out. The models prove the decisions by swapping one at a time for a
plausible wrong version (`statecore.models.mutants`, through `policy_replaced`) and showing that a
check fails: this is the only seam they patch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from statecore._commands import END_EPOCH, Command, RaiseError
from statecore._state import (
    Config,
    Failed,
    Failure,
    Pending,
    Progress,
    Ready,
    SamplerFailure,
    Slot,
    State,
    WorkerHang,
    WorkerLoss,
    WorkerStatus,
)

__all__ = ["DEFAULT_POLICY", "Policy", "policy_replaced"]

ACTIVE = WorkerStatus.ACTIVE
STARTING = WorkerStatus.STARTING


def pick_worker(
    config: Config, workers: tuple[WorkerStatus, ...], loads: tuple[int, ...], cursor: int
) -> int | None:
    """The worker the next task goes to, or None if it must wait for room.

    In order, a replacement still starting keeps its turn (its tasks wait for it in the
    window), so every task goes to the slot it would have gone to had no worker been lost: an
    iterable dataset's part stays with its slot, and the batches come in the same order.
    """
    if config.in_order:
        # Take turns strictly: waiting for a busy worker keeps torch's assignment of tasks.
        status = workers[cursor]
        if status is ACTIVE or status is STARTING:  # nearly every step: the common case first
            return cursor if loads[cursor] < config.prefetch_factor else None
        limit = config.prefetch_factor
        n = config.num_workers
        for k in range(1, n):
            w = (cursor + k) % n
            status = workers[w]
            if status is ACTIVE or status is STARTING:
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


def deliverable(window: tuple[Slot, ...], in_order: bool) -> int | None:
    """Position in the window of the answer a waiting consumer gets next, if there is one."""
    if in_order:
        return 0 if type(window[0]) is not Pending else None
    for i, slot in enumerate(window):
        kind = type(slot)
        if kind is Ready or kind is Failed:
            return i
    return None


def resume_complete(workers: tuple[WorkerStatus, ...]) -> bool:
    """Tasks may flow again only once every worker has acknowledged the new epoch."""
    return WorkerStatus.RESUMING not in workers


def abandoned(acknowledged: int, epoch: int) -> bool:
    """Whether an acknowledgement of `acknowledged` answers a reset the consumer abandoned
    (an interrupted iter()) rather than the current `epoch`'s: it is dropped."""
    return acknowledged < epoch


def epoch_over(window: tuple[Slot, ...], drawing_for: int | None, waiting: bool) -> bool:
    """Once draining, the epoch ends for a consumer's request made when every task is resolved
    and no index is on its way, as torch's: the last batch is handed over before anything stops,
    and stopping the workers is not charged to it."""
    return waiting and not window and drawing_for is None


def death_is_fatal(workers: tuple[WorkerStatus, ...], worker: int) -> bool:
    """Whether a worker's exit is a loss (replaced, or failing the loader once no restart is
    left): it is unless the worker was told to stop."""
    return workers[worker] is not WorkerStatus.STOPPED


def may_replace(restarts: int, replaced: tuple[WorkerLoss, ...], loss: WorkerLoss) -> bool:
    """Whether a lost worker is replaced: while fewer than `restarts` were, and only one that
    can be ended (a stuck thread cannot be killed, so its slot cannot be given to another)."""
    if type(loss) is WorkerHang and not loss.killable:
        return False
    return len(replaced) < restarts


def lost(incarnation: int, current: int) -> bool:
    """Whether an event of incarnation `incarnation` of a worker slot whose current incarnation
    is `current` is late news of a worker already lost (and replaced): dropped."""
    return incarnation < current


def sent_at_once(status: WorkerStatus) -> bool:
    """Whether a task given to a worker in `status` goes out at once. Only to one that runs: a
    replacement still starting is sent it once it has started (`resent`)."""
    return status is ACTIVE


def resent(window: tuple[Slot, ...], worker: int) -> tuple[int, ...]:
    """The window positions whose tasks a replacement of `worker` is sent once it has started,
    in order: every task its slot holds unanswered (those the lost worker was sent and never
    answered, and those given to the slot while the replacement started), each once."""
    return tuple(
        i for i, slot in enumerate(window) if type(slot) is Pending and slot.worker == worker
    )


def sampler_error_now(waiting: bool, resetting: bool) -> bool:
    """Whether the sampler's error goes to the consumer in the call that met it: it does if the
    consumer waits in `next()` or `iter()`; one that was handed a batch gets it next time."""
    return waiting or resetting


def failed_request(failure: Failure, reported: bool) -> Command:
    """What a request gets once the loader failed: the failure again, except that a sampler's
    error is given once and then the end, as torch's spent sampler gives StopIteration."""
    if reported and type(failure) is SamplerFailure:
        return END_EPOCH
    return RaiseError(failure)


def interrupt(state: State) -> State:
    """What a consumer's interrupted call leaves: its wait ends, and nothing else.

    An interrupt may land anywhere, so it is never refused. What a request waited for stays
    owed and arrives into the window for the next request; a sampler cut short mid-draw yields
    its next index to a later request; a half-done reset stays half done, and the next iter()
    starts it over.
    """
    life = state.life
    if life.resetting:
        state = state._replace(life=attrs.evolve(life, resetting=False))
    return state._replace(drawing_for=None, waiting=False)


def resume_turn(config: Config, resume: Progress) -> int:
    """The worker whose turn comes first in an epoch resumed from `resume`.

    An iterable dataset's workers each go on with their own part (their executor restored it),
    so the turns go on where they were: the same batches, in the same order. A map-style epoch
    does so when there are as many workers, so the same worker loads the same batch; with fewer,
    worker 0 starts.
    """
    if config.iterable or resume.turn < config.num_workers:
        return resume.turn
    return 0


@attrs.frozen
class Policy:
    """The decisions `step` takes, one function each (the module-level functions of the same
    names are the right ones)."""

    pick_worker: Callable[[Config, tuple[WorkerStatus, ...], tuple[int, ...], int], int | None]
    deliverable: Callable[[tuple[Slot, ...], bool], int | None]
    resume_complete: Callable[[tuple[WorkerStatus, ...]], bool]
    abandoned: Callable[[int, int], bool]
    epoch_over: Callable[[tuple[Slot, ...], int | None, bool], bool]
    death_is_fatal: Callable[[tuple[WorkerStatus, ...], int], bool]
    may_replace: Callable[[int, tuple[WorkerLoss, ...], WorkerLoss], bool]
    lost: Callable[[int, int], bool]
    sent_at_once: Callable[[WorkerStatus], bool]
    resent: Callable[[tuple[Slot, ...], int], tuple[int, ...]]
    sampler_error_now: Callable[[bool, bool], bool]
    failed_request: Callable[[Failure, bool], Command]
    interrupt: Callable[[State], State]
    resume_turn: Callable[[Config, Progress], int]


DEFAULT_POLICY = Policy(
    pick_worker=pick_worker,
    deliverable=deliverable,
    resume_complete=resume_complete,
    abandoned=abandoned,
    epoch_over=epoch_over,
    death_is_fatal=death_is_fatal,
    may_replace=may_replace,
    lost=lost,
    sent_at_once=sent_at_once,
    resent=resent,
    sampler_error_now=sampler_error_now,
    failed_request=failed_request,
    interrupt=interrupt,
    resume_turn=resume_turn,
)
"""The scheduler's policies."""

in_force = DEFAULT_POLICY
"""The policies `step` uses now: `DEFAULT_POLICY`, unless a model replaced some. One value for the
whole process, read on every step: a model swaps it only around runs of its own (`policy_replaced`),
never while loaders step in other threads."""


@contextmanager
def policy_replaced(**changes: Any) -> Iterator[Policy]:
    """Have `step` use the policies in force with `changes` (field name -> function) while the
    block runs."""
    global in_force
    saved = in_force
    in_force = attrs.evolve(saved, **changes)
    try:
        yield in_force
    finally:
        in_force = saved
