"""The values a batch's steps build cheaply: the `fast` class methods of the events, commands and
slots built for every batch give exactly what their constructors give.

Every step, the steady state's included, finishes in the one finisher (`_settle`), so no test
holds several finishers equal.
"""

from __future__ import annotations

from _drive import config, feed, fill, only, start

from statecore import (
    Deliver,
    DrawIndex,
    IndexDrawn,
    NextRequested,
    Pending,
    Ready,
    SendTask,
    TaskCompleted,
)
from statecore import _step as core


def _same_value(built: object, constructed: object) -> None:
    assert type(built) is type(constructed)
    assert built == constructed
    assert hash(built) == hash(constructed)
    assert repr(built) == repr(constructed)


def test_what_a_batch_builds_equals_what_the_constructors_build() -> None:
    state, commands = fill(start(config(num_workers=2))[0])  # fill answers with task numbers
    send = only(commands, SendTask)[0]
    state, _ = feed(state, TaskCompleted(0, 0, payload=["batch"]))
    ready = state.window[0]
    state, commands = feed(state, NextRequested())
    deliver = only(commands, Deliver)[0]
    _same_value(send, SendTask(0, 0, 0))
    _same_value(ready, Ready(0, ["batch"]))
    _same_value(deliver, Deliver(0, 0, ["batch"]))
    assert deliver.payload is ready.payload  # type: ignore[union-attr]
    assert only(commands, DrawIndex) == [DrawIndex()]


def test_the_shells_fast_events_equal_the_constructors_events() -> None:
    payload, mark, timing = ["batch"], object(), object()
    _same_value(IndexDrawn.fast([3, 4]), IndexDrawn([3, 4]))
    fast = TaskCompleted.fast(5, 1, payload, mark, timing)
    _same_value(fast, TaskCompleted(5, 1, payload, mark, timing))
    assert (fast.payload, fast.mark, fast.timing) == (payload, mark, timing)
    _same_value(TaskCompleted.fast(5, 1, payload), TaskCompleted(5, 1, payload))


def test_a_worker_past_the_shared_pending_slots_is_sent_tasks_like_any_other() -> None:
    workers = core._SHARED_PENDINGS + 3
    state, commands = fill(start(config(num_workers=workers, prefetch_factor=1))[0])
    assert [send.worker for send in only(commands, SendTask)] == list(range(workers))
    assert state.window == tuple(Pending(w) for w in range(workers))
    state, commands = feed(state, TaskCompleted(0, 0, "batch"), NextRequested())
    assert only(commands, Deliver) == [Deliver(0, 0, "batch")]
    assert state.drawing_for == 0
