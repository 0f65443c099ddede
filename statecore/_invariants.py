"""The scheduler's own validity check: what must hold of every state `step` can produce.

`violations(state)` returns a list of broken rules, empty when the state is sound. The models
call it after every step; it is also cheap enough for an executor's debug mode.
"""

from __future__ import annotations

from statecore._state import RESOLVED, Failed, Pending, Phase, Ready, State, WorkerStatus

__all__ = ["violations"]

_WAITABLE = (Phase.RESUMING, Phase.RUNNING, Phase.DRAINING)


def violations(state: State) -> list[str]:
    """Every invariant that `state` breaks, as sentences; empty if none."""
    found: list[str] = []
    config, life, window = state.config, state.life, state.window
    n, limit = config.num_workers, config.prefetch_factor
    phase = life.phase

    if not life.base <= state.rcvd_idx <= state.send_idx:
        found.append(f"task counters out of order: base {life.base}, rcvd_idx {state.rcvd_idx}")
    if window and window[0] is RESOLVED:
        found.append("the window starts with a resolved task")
    if len(state.loads) != n or len(life.workers) != n or len(life.incarnations) != n:
        found.append("per-worker tuples do not have one entry per worker")
        return found
    if len(life.replaced) > config.restarts:
        found.append(
            f"{len(life.replaced)} lost workers replaced, over the {config.restarts} restarts"
        )
    if sum(life.incarnations) != len(life.replaced) + life.added:
        found.append(
            f"incarnations {life.incarnations} do not count the {len(life.replaced)} "
            f"replacements and {life.added} retired slots started again"
        )

    counted = [0] * n
    for slot in window:
        if slot is not RESOLVED:
            counted[slot.worker] += 1  # type: ignore[union-attr]
    if tuple(counted) != state.loads:
        found.append(f"loads {state.loads} do not match the window, which gives {tuple(counted)}")
    # Tasks sent since the bound was last lowered (all of them, if it never was) were sent
    # under it: a worker holds at most `limit` of them. Older ones may stay over it.
    since = [0] * n
    for i, slot in enumerate(window):
        if slot is not RESOLVED and state.rcvd_idx + i >= life.lowered_at:
            since[slot.worker] += 1  # type: ignore[union-attr]
    for w, load in enumerate(state.loads):
        if since[w] > limit:
            found.append(
                f"worker {w} holds {since[w]} unresolved tasks sent under prefetch {limit}, over it"
            )
        status = life.workers[w]
        if status is WorkerStatus.STOPPED and load:
            found.append(f"worker {w} was stopped and still holds {load} unresolved tasks")
        if status is WorkerStatus.RETIRING and not load:
            found.append(f"worker {w} retires holding no task, and was not stopped")
    for w in life.joining:
        if not 0 <= w < n or life.workers[w] is not WorkerStatus.STARTING:
            found.append(f"slot {w} is joining the turns, and is not starting")
        elif state.loads[w]:
            found.append(f"slot {w} is joining the turns, and was given a task before it started")
    if WorkerStatus.RETIRING in life.workers and phase not in (Phase.RUNNING, Phase.DRAINING):
        found.append(f"a worker retires while the loader is {phase.value}")
    if sum(since) > limit * n:
        found.append("more unresolved tasks sent under the bound than prefetch_factor x workers")
    if life.lowered_at > state.send_idx:
        found.append(f"the bound was lowered at task {life.lowered_at}, not sent yet")

    if any(task >= life.base for task, _ in life.stale):
        found.append("a task of the current epoch is marked stale")
    if state.drawing_for is not None:
        if phase not in (Phase.RUNNING, Phase.DRAINING):
            found.append(f"an index is being drawn while {phase.value}")
        elif not 0 <= state.drawing_for < n:
            found.append(f"an index is drawn for worker {state.drawing_for}, who does not exist")

    if config.lazy and state.drawing_for is not None and not state.waiting:
        found.append("a lazy scheduler draws an index with no consumer waiting")
    if config.lazy and len(window) > 1:
        found.append("a lazy scheduler holds more than one task")
    if state.waiting:
        if phase not in _WAITABLE:
            found.append(f"a consumer waits while the loader is {phase.value}")
        if any(type(slot) is Ready or type(slot) is Failed for slot in window) and (
            not config.in_order or type(window[0]) is not Pending
        ):
            found.append("a consumer waits although an answer is ready for it")
        resuming = WorkerStatus.RESUMING in life.workers
        starting = WorkerStatus.STARTING in life.workers
        if not (state.outstanding or state.drawing_for is not None or resuming or starting):
            found.append("a consumer waits but nothing is outstanding: it would wait forever")

    if life.resetting:
        if phase not in _WAITABLE:
            found.append(f"iter() has not returned while the loader is {phase.value}")
        elif phase is not Phase.RESUMING and state.drawing_for is None:
            found.append(
                "iter() has not returned although every worker resumed and no index is drawn"
            )
        if state.waiting:
            found.append("a batch is awaited while iter() has not returned")
    if phase is Phase.RESUMING and (window or state.drawing_for is not None):
        found.append("tasks exist before every worker acknowledged the resume")
    if phase is Phase.FINISHED and (window or state.waiting):
        found.append("the epoch finished with tasks unresolved or a consumer waiting")
    if phase in (Phase.FAILED, Phase.CLOSED):
        if any(status is not WorkerStatus.STOPPED for status in life.workers):
            found.append(f"workers are left running after the loader {phase.value}")
        if window:
            found.append(f"batches are still held after the loader {phase.value}")
    if phase is Phase.FAILED and life.failure is None:
        found.append("failed without a recorded failure")
    if life.failure is not None and phase not in (Phase.FAILED, Phase.CLOSED):
        found.append(f"a failure is recorded while {phase.value}")
    if life.reported and life.failure is None:
        found.append("a failure was reported, but none is recorded")
    if life.resumed is not None:
        if life.resumed.turn >= config.num_workers:
            found.append(
                f"resumed at worker {life.resumed.turn}'s turn, of {config.num_workers} workers"
            )
        if life.passed > len(life.resumed.also):
            found.append(
                f"{life.passed} draws dropped as handed over before the checkpoint, which "
                f"names only {len(life.resumed.also)}"
            )
    if life.left is not None and phase not in (Phase.FAILED, Phase.CLOSED):
        found.append(f"an abandoned epoch's progress is kept while {phase.value}")
    if (
        phase is Phase.RUNNING
        and WorkerStatus.ACTIVE not in life.workers
        and WorkerStatus.STARTING not in life.workers
    ):
        found.append("running with no active or starting worker: nothing could be sent")
    return found
