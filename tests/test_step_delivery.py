"""Delivery: which answer a waiting consumer gets, and when; the stats() snapshot."""

from __future__ import annotations

import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    CloseRequested,
    Command,
    Deliver,
    EndEpoch,
    Event,
    IndexDrawn,
    NextRequested,
    Phase,
    RaiseError,
    SamplerExhausted,
    State,
    TaskCompleted,
    TaskFailed,
    TaskFailure,
    WorkerDied,
    WorkerExhausted,
)


def _full(**flags: bool) -> State:
    """Two workers, two tasks each: tasks 0..3 went to workers 0, 1, 0, 1."""
    state, _ = fill(start(config(num_workers=2, prefetch_factor=2, **flags))[0])
    return state


def _delivered(commands: list[Command]) -> list[int]:
    return [command.task for command in only(commands, Deliver)]


# --- in order ----------------------------------------------------------------------------------


def test_in_order_buffers_an_early_answer_until_its_turn() -> None:
    state, commands = feed(_full(), NextRequested(), TaskCompleted(task=1, worker=1))
    assert only(commands, Deliver) == []
    assert state.waiting
    assert state.buffered == 1


def test_in_order_serves_a_waiting_consumer_as_soon_as_the_head_task_arrives() -> None:
    state, _ = feed(_full(), NextRequested(), TaskCompleted(task=1, worker=1, payload="b1"))
    state, commands = feed(state, TaskCompleted(task=0, worker=0, payload="b0"))
    delivered = only(commands, Deliver)
    assert delivered == [Deliver(task=0, worker=0)]
    assert delivered[0].payload == "b0"
    assert not state.waiting


def test_in_order_hands_over_a_buffered_answer_on_the_next_request() -> None:
    state, _ = feed(
        _full(),
        TaskCompleted(task=1, worker=1, payload="b1"),
        NextRequested(),
        TaskCompleted(task=0, worker=0, payload="b0"),
    )
    _, commands = feed(state, NextRequested())
    delivered = only(commands, Deliver)
    assert delivered == [Deliver(task=1, worker=1)]
    assert delivered[0].payload == "b1"


def test_in_order_delivers_by_task_number_whatever_the_arrival_order() -> None:
    state, _ = feed(
        _full(),
        TaskCompleted(task=3, worker=1, payload="b3"),
        TaskCompleted(task=1, worker=1, payload="b1"),
        TaskCompleted(task=2, worker=0, payload="b2"),
        TaskCompleted(task=0, worker=0, payload="b0"),
    )
    state, commands = feed(state, *[NextRequested()] * 4)
    assert [d.payload for d in only(commands, Deliver)] == ["b0", "b1", "b2", "b3"]


def test_in_order_answers_keep_their_worker_and_payload_until_delivered() -> None:
    payload = object()
    state, _ = feed(_full(), TaskCompleted(task=0, worker=0, payload=payload))
    _, commands = feed(state, NextRequested())
    assert only(commands, Deliver)[0].payload is payload


# --- out of order --------------------------------------------------------------------------------


def test_out_of_order_delivers_an_answer_on_arrival_to_a_waiting_consumer() -> None:
    state, _ = feed(_full(in_order=False), NextRequested())
    state, commands = feed(state, TaskCompleted(task=3, worker=1, payload="b3"))
    assert only(commands, Deliver) == [Deliver(task=3, worker=1)]
    assert not state.waiting


def test_out_of_order_hands_over_a_buffered_answer_at_once_on_request() -> None:
    state, _ = feed(_full(in_order=False), TaskCompleted(task=2, worker=0))
    _, commands = feed(state, NextRequested())
    assert _delivered(commands) == [2]


def test_out_of_order_hands_over_buffered_answers_lowest_task_first() -> None:
    state, _ = feed(
        _full(in_order=False), TaskCompleted(task=3, worker=1), TaskCompleted(task=1, worker=1)
    )
    _, commands = feed(state, NextRequested(), NextRequested())
    assert _delivered(commands) == [1, 3]


def test_out_of_order_an_early_delivery_leaves_earlier_tasks_due() -> None:
    state, _ = feed(_full(in_order=False), NextRequested(), TaskCompleted(task=1, worker=1))
    assert state.rcvd_idx == 0
    state, commands = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert _delivered(commands) == [0]
    assert state.rcvd_idx == 2  # task 1 was already resolved


# --- task failures -------------------------------------------------------------------------------


def test_a_task_failure_is_raised_in_its_turn() -> None:
    error = ValueError("bad sample")
    state, _ = feed(
        _full(), TaskFailed(task=1, worker=1, error=error), TaskCompleted(task=0, worker=0)
    )
    state, commands = feed(state, NextRequested())
    assert _delivered(commands) == [0]
    state, commands = feed(state, NextRequested())
    raised = only(commands, RaiseError)
    assert raised == [RaiseError(TaskFailure(task=1, worker=1))]
    assert raised[0].failure.error is error  # type: ignore[union-attr]


def test_a_task_failure_is_raised_at_once_to_a_consumer_waiting_for_it() -> None:
    state, _ = feed(_full(), NextRequested())
    _, commands = feed(state, TaskFailed(task=0, worker=0, error="boom"))
    assert only(commands, RaiseError) == [RaiseError(TaskFailure(task=0, worker=0))]


def test_the_epoch_goes_on_after_a_task_failure() -> None:
    state, _ = feed(_full(), NextRequested(), TaskFailed(task=0, worker=0))
    assert state.phase is Phase.RUNNING
    assert state.life.failure is None
    state, commands = feed(state, NextRequested(), TaskCompleted(task=1, worker=1))
    assert _delivered(commands) == [1]


def test_a_raised_task_failure_frees_its_workers_room() -> None:
    state, _ = feed(_full(), NextRequested(), TaskFailed(task=0, worker=0))
    assert state.loads == (1, 2)
    assert state.drawing_for == 0


# --- after the epoch -----------------------------------------------------------------------------


def test_next_requested_after_the_epoch_finished_emits_end_epoch_again() -> None:
    state, _ = start(config(), SamplerExhausted(), NextRequested())
    assert state.phase is Phase.FINISHED
    after, commands = feed(state, NextRequested())
    assert commands == [EndEpoch()]
    after, commands = feed(after, NextRequested())
    assert commands == [EndEpoch()]
    assert after == state


# --- stats ---------------------------------------------------------------------------------------


def test_stats_of_a_fresh_epoch_count_nothing() -> None:
    stats = start(config())[0].stats()
    assert (stats.phase, stats.epoch) == (Phase.RUNNING, 1)
    assert (stats.in_flight, stats.buffered, stats.delivered, stats.skipped) == (0, 0, 0, 0)
    assert stats.loads == (0, 0)


def test_stats_count_tasks_in_flight_and_per_worker_loads() -> None:
    stats = _full().stats()
    assert stats.in_flight == 4
    assert stats.loads == (2, 2)


def test_stats_count_an_early_answer_as_buffered_not_in_flight() -> None:
    stats = feed(_full(), TaskCompleted(task=1, worker=1))[0].stats()
    assert (stats.in_flight, stats.buffered, stats.delivered) == (3, 1, 0)
    assert stats.loads == (2, 2)


def test_stats_count_a_delivery_and_free_its_workers_load() -> None:
    state, _ = feed(_full(), TaskCompleted(task=1, worker=1), NextRequested())
    state, _ = feed(state, TaskCompleted(task=0, worker=0))
    stats = state.stats()
    assert (stats.in_flight, stats.buffered, stats.delivered) == (2, 1, 1)
    assert stats.loads == (1, 2)


def test_stats_count_an_out_of_order_delivery_before_earlier_tasks_resolve() -> None:
    state, _ = feed(_full(in_order=False), NextRequested(), TaskCompleted(task=3, worker=1))
    stats = state.stats()
    assert (stats.in_flight, stats.buffered, stats.delivered) == (3, 0, 1)
    assert stats.loads == (2, 1)


def test_stats_count_a_raised_task_failure_as_delivered() -> None:
    state, _ = feed(_full(), NextRequested(), TaskFailed(task=0, worker=0))
    assert state.stats().delivered == 1


def test_stats_count_every_task_of_a_finished_epoch() -> None:
    state, _ = start(config(), IndexDrawn("a"), IndexDrawn("b"), SamplerExhausted())
    state, _ = feed(
        state,
        NextRequested(),
        TaskCompleted(task=0, worker=0),
        NextRequested(),
        TaskCompleted(task=1, worker=1),
        NextRequested(),
    )
    stats = state.stats()
    assert stats.phase is Phase.FINISHED
    assert (stats.in_flight, stats.buffered, stats.delivered) == (0, 0, 2)


_ENDS = [WorkerDied(worker=0), CloseRequested()]


@pytest.mark.parametrize("end", _ENDS, ids=["failed", "closed"])
def test_stats_keep_counting_what_was_delivered_after_the_loader_fails_or_closes(
    end: Event,
) -> None:
    state, _ = feed(_full(in_order=False), NextRequested(), TaskCompleted(task=3, worker=1))
    assert state.stats().delivered == 1
    assert (state.rcvd_idx, state.send_idx) == (0, 4)
    state, _ = feed(state, end)
    stats = state.stats()
    assert (stats.delivered, stats.skipped, stats.in_flight, stats.buffered) == (1, 0, 0, 0)
    assert state.life.dropped == 3  # tasks 0, 1 and 2, abandoned unresolved
    assert (state.rcvd_idx, state.send_idx, state.window) == (4, 4, ())


@pytest.mark.parametrize("end", _ENDS, ids=["failed", "closed"])
def test_an_answer_never_handed_over_counts_as_dropped_not_delivered(end: Event) -> None:
    state, _ = feed(_full(), TaskCompleted(task=0, worker=0), TaskFailed(task=1, worker=1))
    assert state.buffered == 2
    state, _ = feed(state, end)
    assert state.life.dropped == 4
    assert state.stats().delivered == 0


@pytest.mark.parametrize("end", _ENDS, ids=["failed", "closed"])
def test_skipped_and_dropped_tasks_are_not_counted_as_delivered(end: Event) -> None:
    state, _ = feed(_full(iterable=True), WorkerExhausted(task=1, worker=1))
    state, _ = feed(state, end)
    stats = state.stats()
    assert (stats.delivered, stats.skipped, state.life.dropped) == (0, 1, 3)


def test_close_after_a_failure_drops_nothing_more() -> None:
    state, _ = feed(_full(), NextRequested(), TaskCompleted(task=0, worker=0))
    state, _ = feed(state, WorkerDied(worker=1))
    assert (state.life.dropped, state.stats().delivered) == (3, 1)
    state, _ = feed(state, CloseRequested())
    assert (state.life.dropped, state.stats().delivered) == (3, 1)
    assert state.rcvd_idx == 4
