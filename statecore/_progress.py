"""What a checkpoint records of the scheduler: the consumer's progress through the epoch.

A checkpoint must let a fresh loader, with any number of workers, produce exactly what the
original had not handed over yet: nothing handed over is produced again, and nothing that was
only in flight or buffered is lost. The scheduler's window says which tasks were handed over;
this module turns that into positions of the sampler's draws (`Progress`), which mean the same
to any scheduler, and maps a resumed run's tasks back to the positions of the first run, so a
checkpoint of a resumed run is again a checkpoint of the epoch.
"""

from __future__ import annotations

from collections.abc import Collection

from statecore._state import RESOLVED, Failed, Phase, Progress, Ready, State, WorkerStatus

__all__ = ["progress"]


def _position(resumed: Progress | None, offset: int) -> int:
    """The epoch position of this run's `offset`-th draw (0 first).

    A run resumed from `resumed` draws from `resumed.done` on and drops the positions in
    `resumed.also` (see `_step._on_index`), so its draws are the positions not yet handed over,
    in order.
    """
    if resumed is None:
        return offset
    at = resumed.done + offset
    for handed in sorted(resumed.also):
        if handed > at:
            break
        at += 1
    return at


def progress(state: State, unreceived: Collection[tuple[int, int]] = ()) -> Progress:
    """The progress to record in a checkpoint of `state`. Pure, like `step`.

    `unreceived` are (task, worker) the scheduler handed over that never reached the consumer:
    an interrupt (Ctrl-C) cut the call short and the driver keeps them for the next request, or
    the executor failed and the call raised that instead. A checkpoint taken then (a Ctrl-C
    handler saving one, say) must produce them again.
    """
    life = state.life
    lost = {_position(life.resumed, task - life.base): worker for task, worker in unreceived}
    if life.left is not None:
        # Failed or closed: the window was dropped, and with it what was handed over.
        recorded = life.left
    elif life.phase is Phase.IDLE:
        recorded = Progress()
    else:
        recorded = _recorded(state)
    if not lost:
        return recorded
    first = min(lost)
    done = min(first, recorded.done)
    also = (set(range(done + 1, recorded.done)) | recorded.also) - lost.keys()
    turn = lost[first]
    # A worker whose batch the consumer did not get still owes it.
    dry = recorded.dry - set(lost.values())
    return Progress(done, frozenset(also), ended=False, turn=turn, dry=dry)


def _recorded(state: State) -> Progress:
    life = state.life
    resumed = life.resumed
    handed = state.rcvd_idx - life.base  # this run's draws before the window: all handed over
    done = _position(resumed, handed)
    # Out of order, an answer handed over before those ahead of it stays in the window, resolved.
    also = {
        _position(resumed, handed + i) for i, slot in enumerate(state.window) if slot is RESOLVED
    }
    if resumed is not None:
        also.update(p for p in resumed.also if p > done)
    ended = life.phase is Phase.FINISHED or (
        life.phase is Phase.DRAINING and not state.window and state.drawing_for is None
    )
    if not state.config.iterable:
        return Progress(done, frozenset(also), ended, _turn(state))
    dry = _dry(state)
    # Every worker dry with all its batches handed over: nothing of the epoch remains, though
    # tasks given before a worker was found dry may still wait for their answer of "dry".
    ended = ended or len(dry) == state.config.num_workers
    return Progress(done, frozenset(also), ended, _turn(state), dry)


def _dry(state: State) -> frozenset[int]:
    """The workers found dry whose batches were all handed over: none of theirs is waiting in
    the window (a worker answers its tasks in the order it was given them, so its tasks still
    pending there came after the one it was found dry in, and will be answered dry too)."""
    owing = {slot.worker for slot in state.window if type(slot) is Ready or type(slot) is Failed}
    return frozenset(
        w
        for w, status in enumerate(state.life.workers)
        if status is WorkerStatus.EXHAUSTED and w not in owing
    )


def _turn(state: State) -> int:
    """The worker whose batch the consumer gets next, in order: the oldest task's, or else the
    worker the next task goes to. An iterable dataset's workers each yield their own part; a
    dry worker in its turn is found dry again, and skipped. A map-style dataset with a state
    per worker (an augmentation's generator, say) draws from the worker that loads the batch.
    """
    if state.window:
        return state.window[0].worker  # type: ignore[union-attr]  # never RESOLVED at the head
    if state.drawing_for is not None:
        return state.drawing_for
    return state.cursor
