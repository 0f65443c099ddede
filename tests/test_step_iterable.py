"""Iterable datasets: a worker whose shard ran dry answers "exhausted" and drops out."""

from __future__ import annotations

import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    EDGES,
    RESOLVED,
    Deliver,
    EndEpoch,
    ExecutorError,
    IndexDrawn,
    NextRequested,
    Phase,
    SendTask,
    Shutdown,
    State,
    StopWorker,
    TaskCompleted,
    WorkerExhausted,
    WorkerStatus,
)

ACTIVE, EXHAUSTED = WorkerStatus.ACTIVE, WorkerStatus.EXHAUSTED


def _full(num_workers: int = 2, prefetch_factor: int = 2, **flags: bool) -> State:
    """An iterable epoch in which every worker holds `prefetch_factor` tasks, dealt in turn."""
    cfg = config(num_workers, prefetch_factor, iterable=True, **flags)
    state, _ = fill(start(cfg)[0])
    return state


def test_worker_exhausted_skips_the_task_without_delivering_it() -> None:
    state, commands = feed(_full(), NextRequested(), WorkerExhausted(task=1, worker=1))
    assert only(commands, Deliver) == []
    assert state.window[1] is RESOLVED
    assert state.stats().skipped == 1
    assert state.loads == (2, 1)


def test_worker_exhausted_marks_the_worker_exhausted() -> None:
    state, _ = feed(_full(), WorkerExhausted(task=1, worker=1))
    assert state.life.workers == (ACTIVE, EXHAUSTED)
    assert state.phase is Phase.RUNNING


def test_a_skipped_head_task_lets_the_next_answer_through() -> None:
    state, _ = feed(_full(), TaskCompleted(task=1, worker=1), NextRequested())
    state, commands = feed(state, WorkerExhausted(task=0, worker=0))
    assert [d.task for d in only(commands, Deliver)] == [1]


def test_later_tasks_of_other_workers_are_still_delivered() -> None:
    state, _ = feed(_full(), WorkerExhausted(task=1, worker=1))
    state, commands = feed(
        state,
        NextRequested(),
        TaskCompleted(task=0, worker=0),
        NextRequested(),
        TaskCompleted(task=2, worker=0),
        WorkerExhausted(task=3, worker=1),
    )
    assert [d.task for d in only(commands, Deliver)] == [0, 2]
    assert state.phase is Phase.RUNNING


def test_a_dry_worker_is_given_no_more_tasks() -> None:
    state, _ = feed(_full(), WorkerExhausted(task=1, worker=1), WorkerExhausted(task=3, worker=1))
    sends: list[SendTask] = []
    for task in (0, 2):
        state, commands = feed(state, NextRequested(), TaskCompleted(task=task, worker=0))
        state, more = fill(state)
        sends += only(commands + more, SendTask)
    assert [send.worker for send in sends] == [0, 0]


def test_round_robin_passes_over_a_dry_worker() -> None:
    state, _ = feed(_full(num_workers=3, prefetch_factor=1), WorkerExhausted(task=1, worker=1))
    sends: list[SendTask] = []
    for task, worker in ((0, 0), (2, 2)):
        state, commands = feed(state, NextRequested(), TaskCompleted(task=task, worker=worker))
        state, more = fill(state)
        sends += only(commands + more, SendTask)
    assert [(send.worker, send.task) for send in sends] == [(0, 3), (2, 4)]


def test_the_epoch_drains_when_every_worker_is_dry_while_answers_are_due() -> None:
    state, _ = feed(_full(), WorkerExhausted(task=1, worker=1), WorkerExhausted(task=2, worker=0))
    assert state.life.workers == (EXHAUSTED, EXHAUSTED)
    assert state.phase is Phase.DRAINING


def test_the_epoch_is_not_over_while_a_dry_worker_still_owes_an_answer() -> None:
    state, _ = feed(_full(), NextRequested(), TaskCompleted(task=0, worker=0))
    state, _ = fill(state)  # task 4 goes to worker 0
    state, commands = feed(
        state,
        WorkerExhausted(task=1, worker=1),
        WorkerExhausted(task=2, worker=0),
        WorkerExhausted(task=3, worker=1),
        NextRequested(),
    )
    assert state.phase is Phase.DRAINING
    assert state.waiting
    assert state.outstanding == 1  # task 4, held by worker 0
    assert only(commands, EndEpoch) == []


def test_the_epoch_ends_when_every_worker_is_dry_and_every_task_resolved() -> None:
    state, _ = feed(_full(), NextRequested(), TaskCompleted(task=0, worker=0))
    state, _ = fill(state)  # task 4 goes to worker 0
    state, _ = feed(
        state,
        WorkerExhausted(task=1, worker=1),
        WorkerExhausted(task=2, worker=0),
        WorkerExhausted(task=3, worker=1),
        NextRequested(),
    )
    assert state.phase is Phase.DRAINING
    state, commands = feed(state, WorkerExhausted(task=4, worker=0))
    assert state.phase is Phase.FINISHED
    assert commands == [StopWorker(0), StopWorker(1), Shutdown(), EndEpoch()]
    stats = state.stats()
    assert (stats.delivered, stats.skipped) == (1, 4)


def test_the_epoch_ends_with_a_buffered_answer_handed_over_first() -> None:
    state, _ = feed(
        _full(),
        TaskCompleted(task=0, worker=0),
        WorkerExhausted(task=1, worker=1),
        WorkerExhausted(task=2, worker=0),
        WorkerExhausted(task=3, worker=1),
    )
    assert state.phase is Phase.DRAINING  # task 0 waits for the consumer
    state, commands = feed(state, NextRequested())
    assert commands == [Deliver(task=0, worker=0)]
    assert state.phase is Phase.DRAINING
    state, commands = feed(state, NextRequested())
    assert commands[-1] == EndEpoch()
    assert state.phase is Phase.FINISHED


def test_worker_exhausted_for_a_map_style_dataset_is_refused_with_executor_error() -> None:
    state, _ = fill(start(config())[0])
    with pytest.raises(ExecutorError, match="map-style") as caught:
        feed(state, WorkerExhausted(task=0, worker=0))
    assert caught.value.phase is Phase.RUNNING
    assert caught.value.event == WorkerExhausted(task=0, worker=0)


# --- an index drawn for a worker that ran dry between DrawIndex and IndexDrawn ------------------


def test_an_index_drawn_for_a_worker_that_ran_dry_goes_to_the_next_worker_in_turn() -> None:
    state, _ = feed(
        _full(),
        NextRequested(),
        TaskCompleted(task=0, worker=0),
        NextRequested(),
        TaskCompleted(task=1, worker=1),
    )
    assert state.drawing_for == 0
    assert state.loads == (1, 1)
    state, _ = feed(state, WorkerExhausted(task=2, worker=0))  # before the sampler answers
    state, commands = feed(state, IndexDrawn(None))
    assert commands == [SendTask(worker=1, task=4, index=None)]
    assert state.loads == (0, 2)
    assert state.phase is Phase.RUNNING
    assert state.drawing_for is None  # worker 1 is full and worker 0 dry: nothing more to draw


def test_out_of_order_an_index_drawn_for_a_dry_worker_goes_to_the_least_loaded_one() -> None:
    # Tasks 0..5 went to workers 0, 1, 2, 0, 1, 2; the index is drawn for worker 2.
    state, _ = feed(_full(3, 2, in_order=False), NextRequested(), TaskCompleted(task=5, worker=2))
    assert state.drawing_for == 2
    state, _ = feed(
        state,
        NextRequested(),
        TaskCompleted(task=0, worker=0),
        NextRequested(),
        TaskCompleted(task=1, worker=1),
        NextRequested(),
        TaskCompleted(task=4, worker=1),
        WorkerExhausted(task=2, worker=2),
    )
    assert state.loads == (1, 0, 0)
    assert state.cursor == 0  # worker 0 is next in turn and has room ...
    state, commands = feed(state, IndexDrawn("x"))
    assert commands[0] == SendTask(worker=1, task=6, index="x")  # ... but worker 1 holds less
    assert state.life.workers == (ACTIVE, ACTIVE, EXHAUSTED)


def test_an_index_drawn_for_a_dry_worker_is_dropped_when_no_worker_has_room() -> None:
    state, _ = feed(_full(), NextRequested(), TaskCompleted(task=0, worker=0))
    assert state.drawing_for == 0
    state, _ = feed(state, WorkerExhausted(task=2, worker=0))  # before the sampler answers
    assert state.loads == (0, 2)
    before = state
    state, commands = feed(state, IndexDrawn(None))
    assert commands == []
    assert state.send_idx == before.send_idx  # no task number was used up
    assert state.loads == (0, 2)
    assert state.drawing_for is None
    assert state.phase is Phase.RUNNING
    # Once worker 1 has room again, the next index goes to it.
    state, commands = feed(state, NextRequested(), TaskCompleted(task=1, worker=1))
    assert state.drawing_for == 1
    _, commands = feed(state, IndexDrawn(None))
    assert only(commands, SendTask) == [SendTask(worker=1, task=4, index=None)]


def _dry_while_drawing(waiting: bool) -> State:
    """Every worker ran dry and every task is resolved while an index is drawn for worker 0."""
    state, _ = feed(_full(), NextRequested(), TaskCompleted(task=0, worker=0))
    assert state.drawing_for == 0
    state, _ = feed(
        state,
        WorkerExhausted(task=1, worker=1),
        WorkerExhausted(task=2, worker=0),
        WorkerExhausted(task=3, worker=1),
        *([NextRequested()] if waiting else []),
    )
    assert state.phase is Phase.DRAINING
    assert state.window == ()
    assert state.drawing_for == 0
    return state


def test_an_index_dropped_when_every_worker_is_dry_ends_the_epoch_of_a_waiting_consumer() -> None:
    state, commands = feed(_dry_while_drawing(waiting=True), IndexDrawn(None))
    assert state.phase is Phase.FINISHED
    assert commands == [StopWorker(0), StopWorker(1), Shutdown(), EndEpoch()]
    assert not state.waiting
    assert (state.stats().delivered, state.stats().skipped) == (1, 3)


def test_an_index_dropped_when_every_worker_is_dry_leaves_the_end_to_the_next_request() -> None:
    state, commands = feed(_dry_while_drawing(waiting=False), IndexDrawn(None))
    assert (state.phase, state.drawing_for, commands) == (Phase.DRAINING, None, [])
    state, commands = feed(state, NextRequested())
    assert state.phase is Phase.FINISHED
    assert commands == [StopWorker(0), StopWorker(1), Shutdown(), EndEpoch()]


def test_the_transition_table_allows_an_index_drawn_to_finish_a_draining_epoch() -> None:
    assert Phase.FINISHED in EDGES[Phase.DRAINING][IndexDrawn]
    feed(_dry_while_drawing(waiting=True), IndexDrawn(None))
