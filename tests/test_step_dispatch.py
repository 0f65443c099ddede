"""Dispatch: which worker gets the next task, how far ahead, and how an epoch stops sending."""

from __future__ import annotations

from _drive import config, feed, fill, only, start

from statecore import (
    CloseRequested,
    Command,
    Deliver,
    DrawIndex,
    EndEpoch,
    IndexDrawn,
    NextRequested,
    Phase,
    RaiseError,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    SendTask,
    Shutdown,
    State,
    StopWorker,
    TaskCompleted,
    TaskFailed,
    WorkerStatus,
)


def test_the_first_reset_starts_epoch_one_and_draws_a_single_index() -> None:
    state, commands = start(config())
    assert state.phase is Phase.RUNNING
    assert state.life.epoch == 1
    assert commands == [DrawIndex()]


def test_the_worker_is_chosen_before_the_index_is_drawn() -> None:
    state, _ = start(config(num_workers=3))
    assert state.drawing_for == 0
    state, commands = feed(state, IndexDrawn("a"))
    assert commands[0] == SendTask(worker=0, task=0, index="a")
    assert state.drawing_for == 1


def test_a_drawn_index_goes_to_the_worker_chosen_for_it_with_the_next_task_number() -> None:
    state, _ = start(config(num_workers=3))
    state, _ = feed(state, IndexDrawn("a"), IndexDrawn("b"))
    _, commands = feed(state, IndexDrawn("c"))
    assert only(commands, SendTask) == [SendTask(worker=2, task=2, index="c")]


def test_only_one_index_is_drawn_at_a_time() -> None:
    state, _ = fill(start(config())[0])
    state, commands = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert only(commands, DrawIndex) == [DrawIndex()]
    _, commands = feed(state, TaskCompleted(task=1, worker=1))
    assert only(commands, DrawIndex) == []


def test_each_drawn_index_asks_for_at_most_one_more() -> None:
    state, _ = start(config(num_workers=3, prefetch_factor=2))
    for index in range(6):
        state, commands = feed(state, IndexDrawn(index))
        assert len(only(commands, DrawIndex)) <= 1


def test_in_order_dispatch_takes_workers_in_turn_as_torch_does() -> None:
    state, _ = start(config(num_workers=3, prefetch_factor=2))
    _, commands = fill(state)
    sends = only(commands, SendTask)
    assert [send.worker for send in sends] == [0, 1, 2, 0, 1, 2]
    assert [send.task for send in sends] == [0, 1, 2, 3, 4, 5]
    assert [send.index for send in sends] == [0, 1, 2, 3, 4, 5]


def test_dispatch_stops_once_every_worker_holds_prefetch_factor_tasks() -> None:
    state, _ = start(config(num_workers=2, prefetch_factor=3))
    state, commands = fill(state)
    assert len(only(commands, SendTask)) == 6
    assert state.loads == (3, 3)
    assert state.drawing_for is None
    assert commands[-1] == SendTask(worker=1, task=5, index=5)


def test_an_answered_but_undelivered_task_still_counts_against_prefetch() -> None:
    state, _ = fill(start(config(num_workers=2, prefetch_factor=2))[0])
    state, commands = feed(state, TaskCompleted(task=0, worker=0, payload="b0"))
    assert commands == []
    assert state.loads == (2, 2)
    assert state.drawing_for is None


def test_a_delivery_frees_room_and_draws_an_index_for_that_worker() -> None:
    state, _ = fill(start(config(num_workers=2, prefetch_factor=2))[0])
    state, _ = feed(state, TaskCompleted(task=0, worker=0, payload="b0"))
    state, commands = feed(state, NextRequested())
    assert commands[-1] == DrawIndex()
    assert state.drawing_for == 0
    assert state.loads == (1, 2)


def test_out_of_order_spreads_the_first_tasks_evenly_over_the_workers() -> None:
    state, _ = start(config(num_workers=3, prefetch_factor=2, in_order=False))
    _, commands = fill(state)
    assert [send.worker for send in only(commands, SendTask)] == [0, 1, 2, 0, 1, 2]


def test_out_of_order_gives_room_to_whichever_worker_answered_first() -> None:
    state, _ = fill(start(config(num_workers=3, prefetch_factor=2, in_order=False))[0])
    state, commands = feed(state, NextRequested(), TaskCompleted(task=4, worker=1))
    assert commands[-1] == DrawIndex()
    assert state.drawing_for == 1
    _, commands = feed(state, IndexDrawn("x"))
    assert only(commands, SendTask) == [SendTask(worker=1, task=6, index="x")]


def test_out_of_order_prefers_the_least_loaded_worker_over_the_next_in_turn() -> None:
    state, _ = fill(start(config(num_workers=3, prefetch_factor=2, in_order=False))[0])
    # Tasks 0..5 went to workers 0, 1, 2, 0, 1, 2. While the index for worker 2 is drawn,
    # worker 0 delivers one task and worker 1 both of its own.
    state, _ = feed(state, NextRequested(), TaskCompleted(task=2, worker=2))
    assert state.drawing_for == 2
    state, _ = feed(
        state,
        NextRequested(),
        TaskCompleted(task=0, worker=0),
        NextRequested(),
        TaskCompleted(task=1, worker=1),
        NextRequested(),
        TaskCompleted(task=4, worker=1),
    )
    state, _ = feed(state, IndexDrawn("x"))
    assert state.loads == (1, 0, 2)
    assert state.cursor == 0  # worker 0 is next in turn and has room ...
    assert state.drawing_for == 1  # ... but worker 1 holds less


def test_in_order_never_lets_a_worker_exceed_prefetch_factor() -> None:
    state, _ = fill(start(config(num_workers=2, prefetch_factor=2))[0])
    for task in range(4):
        state, _ = feed(state, NextRequested(), TaskCompleted(task=task, worker=task % 2))
        state, _ = fill(state)
        assert max(state.loads) <= 2


def test_sampler_exhaustion_with_tasks_outstanding_moves_to_draining() -> None:
    state, _ = start(config(), IndexDrawn("a"))
    state, commands = feed(state, SamplerExhausted())
    assert state.phase is Phase.DRAINING
    assert commands == []
    assert state.drawing_for is None


def test_draining_sends_no_more_tasks_as_workers_get_room() -> None:
    state, _ = start(config(), IndexDrawn("a"), IndexDrawn("b"), SamplerExhausted())
    state, commands = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert state.phase is Phase.DRAINING
    assert only(commands, DrawIndex) == []


def test_draining_finishes_on_the_request_after_the_last_delivery() -> None:
    state, _ = start(config(), IndexDrawn("a"), SamplerExhausted())
    state, commands = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert state.phase is Phase.DRAINING
    assert only(commands, EndEpoch) == []  # the consumer got a batch, not the end
    state, commands = feed(state, NextRequested())
    assert state.phase is Phase.FINISHED
    assert commands[-1] == EndEpoch()


def test_an_epoch_with_nothing_to_load_finishes_only_when_the_consumer_asks() -> None:
    state, commands = start(config(), SamplerExhausted())
    assert state.phase is Phase.DRAINING
    assert only(commands, StopWorker) == []
    state, commands = feed(state, NextRequested())
    assert state.phase is Phase.FINISHED
    assert commands[-1] == EndEpoch()


def test_a_consumer_waiting_when_the_epoch_finishes_gets_end_epoch_after_the_shutdown() -> None:
    # Cleanup comes before the consumer is told, as on the failure path.
    state, _ = start(config(num_workers=3), IndexDrawn("a"), SamplerExhausted(), NextRequested())
    state, commands = feed(state, TaskCompleted(task=0, worker=0), NextRequested())
    assert state.phase is Phase.FINISHED
    assert commands[1:] == [StopWorker(0), StopWorker(1), StopWorker(2), Shutdown(), EndEpoch()]
    assert not state.waiting


def test_a_failed_last_task_is_raised_alone_and_the_next_request_ends_the_epoch() -> None:
    state, _ = start(config(), IndexDrawn("a"), IndexDrawn("b"), SamplerExhausted())
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    # The consumer waits for task 1; it fails instead, and is raised, not the end.
    state, commands = feed(state, NextRequested(), TaskFailed(task=1, worker=1))
    assert [type(c) for c in commands] == [RaiseError]
    assert state.phase is Phase.DRAINING
    state, commands = feed(state, NextRequested())
    assert commands == [StopWorker(0), StopWorker(1), Shutdown(), EndEpoch()]
    assert state.phase is Phase.FINISHED


def test_a_persistent_finish_tells_a_waiting_consumer_with_end_epoch_alone() -> None:
    state, _ = start(config(persistent_workers=True), IndexDrawn("a"), SamplerExhausted())
    state, commands = feed(state, NextRequested(), TaskCompleted(task=0, worker=0), NextRequested())
    assert state.phase is Phase.FINISHED
    assert commands[1:] == [EndEpoch()]


def _delivered_the_last_batch(**flags: bool) -> tuple[State, list[Command]]:
    """Three workers; the only task, 0, was just handed over and the sampler has run out."""
    return start(
        config(num_workers=3, **flags),
        IndexDrawn("a"),
        SamplerExhausted(),
        NextRequested(),
        TaskCompleted(task=0, worker=0),
    )


def test_the_last_delivery_of_a_non_persistent_epoch_comes_alone() -> None:
    state, _ = start(config(num_workers=3), IndexDrawn("a"), SamplerExhausted())
    state, commands = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    # Stopping the workers is left to the next request, so it cannot delay the last batch.
    assert commands == [Deliver(task=0, worker=0)]
    assert state.phase is Phase.DRAINING
    assert state.life.workers == (WorkerStatus.ACTIVE,) * 3


def test_a_non_persistent_finish_stops_every_worker_then_shuts_down() -> None:
    state, _ = _delivered_the_last_batch()
    state, commands = feed(state, NextRequested())
    assert commands == [StopWorker(0), StopWorker(1), StopWorker(2), Shutdown(), EndEpoch()]
    assert state.phase is Phase.FINISHED
    assert state.life.workers == (WorkerStatus.STOPPED,) * 3


def test_a_close_right_after_the_last_delivery_shuts_the_workers_down_once() -> None:
    # The consumer broke out of its loop after the last batch, before asking past it.
    state, commands = _delivered_the_last_batch()
    _, closing = feed(state, CloseRequested(), CloseRequested())
    assert closing == [StopWorker(0), StopWorker(1), StopWorker(2), Shutdown()]
    assert only(commands + closing, Shutdown) == [Shutdown()]


def test_a_reset_right_after_the_last_delivery_starts_the_next_epoch() -> None:
    # A persistent loader's next `iter()` may come without a request past the last batch.
    state, _ = _delivered_the_last_batch(persistent_workers=True)
    after, commands = feed(state, ResetRequested(seed=7))
    assert commands == [ResumeWorker(0, 2, 7), ResumeWorker(1, 2, 7), ResumeWorker(2, 2, 7)]
    assert after.phase is Phase.RESUMING
    assert (after.life.stale, after.life.dropped) == (frozenset(), 0)  # nothing was abandoned
    # Exactly as if the consumer had first been told the epoch ended.
    finished, _ = feed(state, NextRequested())
    assert feed(finished, ResetRequested(seed=7)) == (after, commands)


def test_a_persistent_finish_keeps_the_workers() -> None:
    state, commands = start(config(persistent_workers=True), SamplerExhausted(), NextRequested())
    assert state.phase is Phase.FINISHED
    assert only(commands, StopWorker) == []
    assert only(commands, Shutdown) == []
    assert state.life.workers == (WorkerStatus.ACTIVE,) * 2
