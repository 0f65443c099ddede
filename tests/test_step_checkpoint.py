"""Checkpoints: `progress(state)` records what was handed over, `ResetRequested(resume=)` goes on.

Positions count the sampler's draws from the start of the epoch. These tests drive the pure
core; the models (tests/test_models_checkpoint.py) check the same from every reachable state.
"""

from __future__ import annotations

import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    CloseRequested,
    Deliver,
    DrawIndex,
    IndexDrawn,
    MisuseError,
    NextRequested,
    Phase,
    Progress,
    ResetRequested,
    SamplerExhausted,
    SendTask,
    TaskCompleted,
    WorkerDied,
    WorkerExhausted,
    initial_state,
    progress,
)


def test_a_scheduler_that_has_not_started_has_handed_over_nothing() -> None:
    assert progress(initial_state(config())) == Progress()


def test_in_order_the_batches_handed_over_are_a_prefix_of_the_draws() -> None:
    state, _ = fill(start(config())[0])
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    state, _ = feed(state, NextRequested(), TaskCompleted(task=1, worker=1))
    assert progress(state) == Progress(done=2)


def test_a_batch_that_arrived_but_was_not_handed_over_is_not_recorded() -> None:
    state, _ = fill(start(config())[0])
    state, _ = feed(state, TaskCompleted(task=0, worker=0), TaskCompleted(task=1, worker=1))
    assert state.buffered == 2
    assert progress(state) == Progress(done=0)


def test_out_of_order_a_batch_handed_over_ahead_of_others_is_recorded_by_its_position() -> None:
    state, _ = fill(start(config(in_order=False))[0])
    state, _ = feed(state, NextRequested(), TaskCompleted(task=2, worker=0))
    assert progress(state) == Progress(done=0, also=frozenset({2}))


def test_an_epoch_whose_every_draw_was_handed_over_after_the_sampler_ran_out_has_ended() -> None:
    state, _ = start(config(1, prefetch_factor=1))
    state, _ = feed(state, IndexDrawn(0), NextRequested(), TaskCompleted(task=0, worker=0))
    state, _ = feed(state, SamplerExhausted())
    assert progress(state) == Progress(done=1, ended=True)
    state, _ = feed(state, NextRequested())
    assert progress(state) == Progress(done=1, ended=True)


def test_a_failed_loader_keeps_the_progress_it_had_when_it_dropped_its_window() -> None:
    state, _ = fill(start(config())[0])
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    state, _ = feed(state, TaskCompleted(task=1, worker=1), WorkerDied(worker=0))
    assert progress(state) == Progress(done=1, turn=1)
    state, _ = feed(state, CloseRequested())
    assert progress(state) == Progress(done=1, turn=1)


def test_a_resumed_epoch_drops_the_draws_handed_over_out_of_order_before_the_checkpoint() -> None:
    resume = Progress(done=3, also=frozenset({4}))
    fresh = initial_state(config(1, prefetch_factor=3))
    state, _ = feed(fresh, ResetRequested(resume=resume))
    # The sampler was positioned at 3 by the caller: draws are positions 3, 4, 5, ...
    state, commands = feed(state, IndexDrawn("p3"), IndexDrawn("p4"), IndexDrawn("p5"))
    assert [c.index for c in only(commands, SendTask)] == ["p3", "p5"]
    assert only(commands, DrawIndex)  # the dropped draw is made up for


def test_a_checkpoint_of_a_resumed_epoch_names_positions_of_the_whole_epoch() -> None:
    resume = Progress(done=3, also=frozenset({4, 6}))
    state, _ = feed(initial_state(config(1, prefetch_factor=1)), ResetRequested(resume=resume))
    state, commands = feed(state, IndexDrawn("p3"), NextRequested())
    state, commands = feed(state, TaskCompleted(task=0, worker=0))
    assert only(commands, Deliver)[0].payload is None  # position 3 handed over
    assert progress(state) == Progress(done=5, also=frozenset({6}))
    state, _ = feed(state, IndexDrawn("p4"), IndexDrawn("p5"), NextRequested())
    state, _ = feed(state, TaskCompleted(task=1, worker=0))
    assert progress(state) == Progress(done=7)


def test_a_resume_of_a_resumed_epoch_goes_on_from_the_second_checkpoint() -> None:
    first = Progress(done=1, also=frozenset({3}))
    state, _ = feed(initial_state(config(2, in_order=False)), ResetRequested(resume=first))
    state, _ = fill(state)  # positions 1, 2, 4, 5 as tasks 0..3
    state, _ = feed(state, NextRequested(), TaskCompleted(task=3, worker=1))
    second = progress(state)
    assert second == Progress(done=1, also=frozenset({3, 5}))
    state, _ = feed(initial_state(config(1, prefetch_factor=3)), ResetRequested(resume=second))
    commands = []
    for draw in range(4):
        state, emitted = feed(state, IndexDrawn(draw))
        commands += emitted
    kept = [c.index for c in only(commands, SendTask)]
    assert kept == [0, 1, 3]  # draws 0..3 are positions 1, 2, 3, 4; 3 is dropped
    assert progress(state) == second


def test_an_iterable_checkpoint_names_the_worker_whose_batch_comes_next() -> None:
    state, _ = start(config(3, prefetch_factor=1, iterable=True))
    state, _ = fill(state)  # tasks 0, 1, 2 to workers 0, 1, 2
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert progress(state).turn == 1
    state, _ = feed(state, TaskCompleted(task=2, worker=2))  # early: still worker 1's turn
    assert progress(state).turn == 1


def test_an_iterable_checkpoint_with_nothing_in_flight_names_the_next_worker_to_get_a_task() -> (
    None
):
    state, _ = start(config(2, prefetch_factor=1, iterable=True, lazy=True))
    state, _ = feed(state, NextRequested(), IndexDrawn(None), TaskCompleted(task=0, worker=0))
    assert not state.window
    assert progress(state).turn == 1


def test_a_batch_the_consumer_never_got_gives_the_turn_back_to_its_worker() -> None:
    state, _ = start(config(2, prefetch_factor=1, iterable=True))
    state, _ = fill(state)
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert progress(state).turn == 1
    assert progress(state, unreceived=[(0, 0)]) == Progress(done=0, turn=0)


def test_a_map_style_checkpoint_names_the_worker_whose_batch_comes_next_too() -> None:
    # A map-style dataset may keep a state per worker (an augmentation's generator): the
    # resumed epoch's batches must go to the workers that loaded them.
    state, _ = start(config(2, prefetch_factor=1))
    state, _ = fill(state)
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert progress(state) == Progress(done=1, turn=1)


def test_a_map_style_epoch_resumes_with_the_turn_of_the_next_worker() -> None:
    resume = Progress(done=5, turn=1)
    state, commands = feed(initial_state(config(2)), ResetRequested(resume=resume))
    state, more = fill(state)
    assert [c.worker for c in only(commands + more, SendTask)] == [1, 0, 1, 0]


def test_a_map_style_epoch_resumed_on_fewer_workers_than_its_turn_starts_with_worker_zero() -> None:
    resume = Progress(done=5, turn=3)
    state, commands = feed(initial_state(config(2)), ResetRequested(resume=resume))
    state, more = fill(state)
    assert [c.worker for c in only(commands + more, SendTask)] == [0, 1, 0, 1]


def test_an_iterable_epoch_resumes_with_the_turn_of_the_next_worker() -> None:
    resume = Progress(done=5, turn=1)
    state, commands = feed(initial_state(config(2, iterable=True)), ResetRequested(resume=resume))
    state, more = fill(state)
    assert [c.worker for c in only(commands + more, SendTask)] == [1, 0, 1, 0]


def test_an_iterable_epoch_cannot_resume_at_the_turn_of_a_worker_it_does_not_have() -> None:
    with pytest.raises(MisuseError, match="worker 2, and there are 2 workers"):
        feed(initial_state(config(2, iterable=True)), ResetRequested(resume=Progress(turn=2)))


def test_a_worker_found_dry_is_recorded_dry_once_its_batches_were_all_handed_over() -> None:
    state, _ = start(config(2, prefetch_factor=2, iterable=True))
    state, _ = fill(state)  # tasks 0, 2 to worker 0; 1, 3 to worker 1
    state, _ = feed(state, TaskCompleted(task=0, worker=0), WorkerExhausted(task=2, worker=0))
    assert progress(state).dry == frozenset()  # its batch of task 0 is still buffered
    state, _ = feed(state, NextRequested())
    assert progress(state).dry == frozenset({0})
    assert progress(state, unreceived=[(0, 0)]).dry == frozenset()


def test_a_map_style_checkpoint_has_no_dry_workers() -> None:
    state, _ = start(config(2, prefetch_factor=1))
    state, _ = fill(state)
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0))
    assert progress(state).dry == frozenset()


def test_a_worker_dry_at_the_checkpoint_is_never_given_a_task_after_the_resume() -> None:
    resume = Progress(done=4, turn=0, dry=frozenset({0}))
    state, commands = feed(initial_state(config(3, iterable=True)), ResetRequested(resume=resume))
    state, more = fill(state)
    assert {c.worker for c in only(commands + more, SendTask)} == {1, 2}
    assert progress(state).dry == frozenset({0})


def test_an_epoch_whose_workers_are_all_dry_has_ended_though_answers_are_awaited() -> None:
    state, _ = start(config(2, prefetch_factor=2, iterable=True))
    state, _ = fill(state)  # tasks 0, 2 to worker 0; 1, 3 to worker 1
    state, _ = feed(state, WorkerExhausted(task=0, worker=0), WorkerExhausted(task=1, worker=1))
    assert state.window  # tasks 2 and 3 still wait for their answers
    assert progress(state) == Progress(done=2, ended=True, turn=0, dry=frozenset({0, 1}))


def test_a_resume_with_every_worker_dry_ends_its_epoch_at_the_first_request_with_no_batch() -> None:
    resume = Progress(done=4, ended=True, dry=frozenset({0, 1}))
    state, commands = feed(initial_state(config(2, iterable=True)), ResetRequested(resume=resume))
    state, more = fill(state)
    assert only(commands + more, SendTask) == []
    state, commands = feed(state, NextRequested())
    assert only(commands, Deliver) == []
    assert state.phase is Phase.FINISHED


def test_dry_workers_must_be_workers_of_an_iterable_dataset() -> None:
    with pytest.raises(MisuseError, match=r"dry workers \[2\]"):
        feed(
            initial_state(config(2, iterable=True)),
            ResetRequested(resume=Progress(dry=frozenset({2}))),
        )
    with pytest.raises(MisuseError, match=r"dry workers \[0\]"):
        feed(initial_state(config(2)), ResetRequested(resume=Progress(dry=frozenset({0}))))


def test_a_turn_is_a_worker_number() -> None:
    with pytest.raises(ValueError, match="turn"):
        Progress(turn=-1)


def test_only_a_fresh_scheduler_resumes() -> None:
    cfg = config(1, prefetch_factor=1, persistent_workers=True)
    state, _ = start(cfg, IndexDrawn(0), NextRequested(), TaskCompleted(task=0, worker=0))
    state, _ = feed(state, SamplerExhausted(), NextRequested())
    with pytest.raises(MisuseError, match="fresh scheduler"):
        feed(state, ResetRequested(resume=Progress(done=1)))


def test_progress_refuses_positions_that_are_not_after_done() -> None:
    with pytest.raises(ValueError, match="after done=2"):
        Progress(done=2, also=frozenset({1}))


@pytest.mark.parametrize(
    ("recorded", "length", "complete"),
    [
        (Progress(done=4), 4, True),
        (Progress(done=3), 4, False),
        (Progress(done=4), None, False),
        (Progress(done=2, ended=True), None, True),
    ],
)
def test_an_epoch_is_complete_when_it_ended_or_every_position_of_a_known_length_was_handed_over(
    recorded: Progress, length: int | None, complete: bool
) -> None:
    assert recorded.complete(length) is complete
