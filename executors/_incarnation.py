"""What an executor that replaces workers (`Replacing`) gives a replacement, and its answers.

- `replacement_setup`: the setup a replacement starts from, so that it is set up as the worker
  it replaces was, at the epoch it starts in, its dataset restored through the path a resumed
  checkpoint takes (`WorkerSetup.resume`, and `WorkerSetup.ended` for what a persistent
  worker's dataset carried into a later epoch: `Carried`).
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

__all__ = ["Carried", "RanDry", "Standing", "replacement_setup", "restored", "stamped"]


@attrs.frozen
class Carried:
    """Where a persistent worker's iterable dataset stands in an epoch after its first, for its
    replacement: the dataset lived on from the epoch before, which a fresh copy of it did not.

    Told as a checkpoint taken in that epoch tells it (`WorkerSetup.ended`, `.ended_open` and
    `.resume`), and restored the same way: brought to `ended`, run dry (or, `open`, read only
    to it), `iter()` called again, which is where the worker stood as this epoch began; then
    to `mark`, if it answered in this epoch already.
    """

    ended: Mark | None
    """The mark of its last answer of the epoch before recorded (None: it had none)."""
    open: bool
    """The epoch before was left (a `break`) before this worker's part ran dry."""
    mark: Mark | None
    """The mark of its last answer of this epoch recorded (None: it answered nothing yet)."""


@attrs.frozen
class RanDry:
    """A lost worker whose iterable part had run dry in this epoch (its exhaustion recorded, or
    found by the checkpoint the epoch resumes), restored to `standing`.

    The scheduler may ask its replacement nothing more in the epoch (the epoch's end may be
    known already), and a part restored to its last batch has not run dry: so the replacement
    reads it to its end as its next epoch starts (`WorkerSetup.resume_dry`), as the lost
    worker's had been, unless a task of this epoch finds it dry first. A dataset that changes
    its state as its part runs dry (counting its epochs) then goes on as the lost one's would.
    """

    standing: Mark | Carried | None


Standing = Mark | Carried | RanDry | None
"""Where a lost worker's dataset stood, as the driver tells `Replacing.replace`: the mark of its
last answer of this epoch the main process recorded, None for where the executor started the
epoch, `Carried` for a persistent worker's iterable dataset in a later epoch, either wrapped in
`RanDry` where its part had run dry in this epoch."""

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
    setup: WorkerSetup, worker: int, mark: Standing, resumed: ResumeWorker | None
) -> WorkerSetup:
    """The setup of a replacement of `worker`, whose executor started from `setup`.

    `resumed` is the last `ResumeWorker` the slot was given (None: still the epoch the executor
    started in): the replacement starts in that epoch, a datapipe reseeded with its seed. Its
    dataset is restored as `restored` says.
    """
    if resumed is None:
        return restored(setup, worker, mark, later_epoch=False)
    seed = setup.shared_seed if resumed.seed is None else resumed.seed
    return attrs.evolve(restored(setup, worker, mark, later_epoch=True), shared_seed=seed)


def restored(setup: WorkerSetup, worker: int, mark: Standing, later_epoch: bool) -> WorkerSetup:
    """`setup` with `worker`'s dataset restored to `mark`, as a checkpoint's resume restores a
    worker: a mark goes where a checkpoint's per-worker position goes (`WorkerSetup.resume`),
    and a `Carried` also where a checkpoint's epoch before goes (`WorkerSetup.ended`).

    None is where the epoch began as the executor started it: in its first epoch that may be a
    checkpoint's position, and what carried over into it from the epoch before, which `setup`
    holds; in a `later_epoch` those are past, and the setup's dataset is the start. A `RanDry`
    also puts the worker where a checkpoint's dry workers go (`WorkerSetup.resume_dry`).
    """
    resume, ended, ended_open = setup.resume, setup.ended, setup.ended_open
    resume_dry = setup.resume_dry
    if later_epoch:
        resume, ended, ended_open, resume_dry = None, None, frozenset(), frozenset()
    if isinstance(mark, RanDry):
        resume_dry, mark = resume_dry | {worker}, mark.standing
    if isinstance(mark, Carried):
        ended = _placed(ended, worker, mark.ended, setup.num_workers)
        ended_open = ended_open | {worker} if mark.open else ended_open - {worker}
        mark = mark.mark
    if mark is not None:
        resume = _placed(resume, worker, mark, setup.num_workers)
    return attrs.evolve(
        setup, resume=resume, ended=ended, ended_open=ended_open, resume_dry=resume_dry
    )


def _placed(
    marks: tuple[Mark | None, ...] | None, worker: int, mark: Mark | None, workers: int
) -> tuple[Mark | None, ...]:
    """`marks` (None: none yet) with `worker`'s now `mark`, one per worker."""
    placed = list(marks or ())
    placed += [None] * (workers - len(placed))
    placed[worker] = mark
    return tuple(placed)
