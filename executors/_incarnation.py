"""What an executor that replaces workers (`Replacing`) gives a replacement, and its answers.

- `replacement_setup`: the setup a replacement starts from, so that it is set up as the worker
  it replaces was, at the epoch it starts in, its dataset restored through the path a resumed
  checkpoint takes (`WorkerSetup.resume`).
- `stamped`: a worker's runtime (`executors._worker.WorkerRuntime`) knows nothing of
  replacements, and its events say incarnation 0. The executor stamps each event of a
  replacement with the replacement's number before handing it out, so that the scheduler can
  tell late news of a lost incarnation from the answers of the one now in its slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from statecore import (
    Event,
    ResumeWorker,
    TaskCompleted,
    TaskFailed,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
)
from statecore.executors._worker import Mark, WorkerSetup

__all__ = ["replacement_setup", "stamped"]

_SLOTS: dict[type[Event], Callable[[Any, int], None]] = {
    kind: kind.__dict__["incarnation"].__set__
    for kind in (TaskCompleted, TaskFailed, WorkerExhausted, WorkerResumed, WorkerDied)
}
"""Each worker event's `incarnation` slot setter: the frozen value is filled in place, as
`TaskCompleted.fast` fills it, rather than copied (`attrs.evolve`) once per batch."""


def stamped(event: Event, incarnation: int) -> Event:
    """`event`, just made by a worker's runtime and held by nobody else yet, stamped with
    `incarnation` in place. Incarnation 0 is every event's default: nothing to do."""
    if incarnation:
        _SLOTS[type(event)](event, incarnation)
    return event


def replacement_setup(
    setup: WorkerSetup, worker: int, mark: Mark | None, resumed: ResumeWorker | None
) -> WorkerSetup:
    """The setup of a replacement of `worker`, whose executor started from `setup`.

    `resumed` is the last `ResumeWorker` the slot was given (None: still the epoch the executor
    started in): the replacement starts in that epoch, a datapipe reseeded with its seed. Its
    dataset is restored to `mark`, the last answer the main process recorded from the slot, as a
    checkpoint's resume restores a worker (None: where the epoch began; in the first epoch, that
    may be a checkpoint's position, and what carried over into it from the epoch before, which
    `setup` holds). A persistent worker's dataset that changed its own state in earlier epochs
    is restored only as far as this epoch's marks say.
    """
    marks: list[Mark | None] = [None] * setup.num_workers
    if resumed is None and setup.resume is not None:
        marks = list(setup.resume)
    if mark is not None:
        marks[worker] = mark
    if resumed is None:
        return attrs.evolve(setup, resume=tuple(marks))
    seed = setup.shared_seed if resumed.seed is None else resumed.seed
    return attrs.evolve(setup, resume=tuple(marks), ended=None, shared_seed=seed)
