"""Later epochs: persistent workers resume; answers from an abandoned epoch are discarded."""

from __future__ import annotations

import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    Deliver,
    DrawIndex,
    ExecutorError,
    IndexDrawn,
    Interrupted,
    MisuseError,
    NextRequested,
    Phase,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    SendTask,
    State,
    TaskCompleted,
    TaskFailed,
    WorkerExhausted,
    WorkerResumed,
    WorkerStatus,
)


def _finished(num_workers: int = 2, **flags: bool) -> State:
    """A persistent scheduler whose first epoch sent task w to worker w, one each, and finished.

    The consumer asked once more after the last batch: that request finishes the epoch.
    """
    cfg = config(num_workers, prefetch_factor=1, persistent_workers=True, **flags)
    state, _ = fill(start(cfg)[0])
    state, _ = feed(state, NextRequested(), TaskCompleted(task=0, worker=0), SamplerExhausted())
    for w in range(1, num_workers):
        state, _ = feed(state, NextRequested(), TaskCompleted(task=w, worker=w))
    state, _ = feed(state, NextRequested())
    assert state.phase is Phase.FINISHED
    return state


def _abandoned(**flags: bool) -> State:
    """A persistent scheduler reset while tasks 0 (worker 0) and 1 (worker 1) were pending."""
    cfg = config(2, prefetch_factor=1, persistent_workers=True, **flags)
    state, _ = fill(start(cfg)[0])
    state, _ = feed(state, ResetRequested(seed=5))
    return state


def _resumed(state: State) -> State:
    state, _ = feed(
        state, *[WorkerResumed(w, state.life.epoch) for w in range(state.config.num_workers)]
    )
    return state  # iter() still draws the first indices


# --- resuming ------------------------------------------------------------------------------------


def test_the_first_epoch_of_persistent_workers_needs_no_resume() -> None:
    state, commands = start(config(persistent_workers=True))
    assert state.phase is Phase.RUNNING
    assert commands == [DrawIndex()]


def test_reset_after_a_finished_epoch_resumes_every_worker_with_the_new_epoch_and_seed() -> None:
    state, commands = feed(_finished(num_workers=3), ResetRequested(seed=7))
    assert commands == [ResumeWorker(0, 2, 7), ResumeWorker(1, 2, 7), ResumeWorker(2, 2, 7)]
    assert state.phase is Phase.RESUMING
    assert state.life.epoch == 2
    assert state.life.workers == (WorkerStatus.RESUMING,) * 3


def test_no_index_is_drawn_until_every_worker_has_resumed() -> None:
    state, _ = feed(_finished(num_workers=3), ResetRequested(seed=7))
    state, commands = feed(
        state, WorkerResumed(2, 2), Interrupted(), NextRequested(), WorkerResumed(0, 2)
    )
    assert commands == []
    assert state.phase is Phase.RESUMING
    assert state.drawing_for is None
    state, commands = feed(state, WorkerResumed(1, 2))
    assert commands == [DrawIndex()]
    assert state.phase is Phase.RUNNING


def test_after_an_interrupted_iter_a_consumer_may_wait_while_workers_resume() -> None:
    state, _ = feed(_finished(), ResetRequested(), Interrupted(), NextRequested())
    assert state.waiting
    state, _ = feed(state, WorkerResumed(0, 2), WorkerResumed(1, 2))
    state, _ = feed(state, IndexDrawn("a"))
    _, commands = feed(state, TaskCompleted(task=2, worker=0, payload="new"))
    assert only(commands, Deliver) == [Deliver(task=2, worker=0)]


def test_a_new_epoch_deals_from_worker_zero_and_continues_the_task_numbers() -> None:
    state = _resumed(feed(_finished(), ResetRequested())[0])
    assert state.life.base == 2
    _, commands = fill(state)
    assert only(commands, SendTask) == [SendTask(0, 2, 2), SendTask(1, 3, 3)]


def test_a_new_epoch_starts_its_counts_afresh() -> None:
    stats = feed(_finished(), ResetRequested())[0].stats()
    assert (stats.epoch, stats.delivered, stats.skipped, stats.in_flight) == (2, 0, 0, 0)
    assert stats.loads == (0, 0)


# --- stale answers -------------------------------------------------------------------------------


def test_a_reset_mid_epoch_marks_the_pending_tasks_stale_with_their_workers() -> None:
    state = _abandoned()
    assert state.phase is Phase.RESUMING
    assert state.life.stale == frozenset({(0, 0), (1, 1)})
    assert state.window == ()
    assert state.loads == (0, 0)
    assert state.life.dropped == 0  # a reset abandons nothing: the old tasks are still owed


def test_a_reset_marks_stale_only_the_tasks_still_pending() -> None:
    cfg = config(2, prefetch_factor=1, persistent_workers=True)
    state, _ = fill(start(cfg)[0])
    state, _ = feed(state, TaskCompleted(task=1, worker=1, payload="kept"), ResetRequested())
    assert state.life.stale == frozenset({(0, 0)})  # task 1 was answered: nothing more is owed
    assert state.send_idx == state.rcvd_idx == state.life.base == 2


def test_a_reset_mid_epoch_resumes_every_worker() -> None:
    cfg = config(2, prefetch_factor=1, persistent_workers=True)
    state, _ = fill(start(cfg)[0])
    _, commands = feed(state, ResetRequested(seed=5))
    assert commands == [ResumeWorker(0, 2, 5), ResumeWorker(1, 2, 5)]


def test_a_late_answer_of_a_stale_task_is_dropped_with_no_commands() -> None:
    state, commands = feed(_abandoned(), TaskCompleted(task=0, worker=0, payload="old"))
    assert commands == []
    assert state.life.stale == frozenset({(1, 1)})
    assert state.phase is Phase.RESUMING


@pytest.mark.parametrize(
    "answer",
    [TaskCompleted(task=1, worker=1), TaskFailed(task=1, worker=1), WorkerExhausted(1, 1)],
)
def test_every_kind_of_stale_answer_is_dropped(
    answer: TaskCompleted | TaskFailed | WorkerExhausted,
) -> None:
    state, commands = feed(_abandoned(iterable=True), answer)
    assert commands == []
    assert state.life.stale == frozenset({(0, 0)})
    assert state.life.workers == (WorkerStatus.RESUMING,) * 2


@pytest.mark.parametrize(
    "answer",
    [TaskCompleted(task=1, worker=0), TaskFailed(task=1, worker=0), WorkerExhausted(1, 0)],
)
def test_a_stale_task_number_answered_by_the_wrong_worker_is_an_executor_error(
    answer: TaskCompleted | TaskFailed | WorkerExhausted,
) -> None:
    # Task 1 went to worker 1. Worker 0 owes task 0, not 1: the pair must match.
    state = _abandoned(iterable=True)
    with pytest.raises(ExecutorError, match="task 1 is not awaiting an answer") as caught:
        feed(state, answer)
    assert caught.value.phase is Phase.RESUMING
    assert caught.value.event == answer
    assert state == _abandoned(iterable=True)
    assert state.life.stale == frozenset({(0, 0), (1, 1)})


def test_a_stale_answer_by_the_wrong_worker_is_refused_in_the_new_epoch_too() -> None:
    state, _ = fill(_resumed(_abandoned()))  # tasks 2 and 3 of the new epoch
    assert state.phase is Phase.RUNNING
    with pytest.raises(ExecutorError):
        feed(state, TaskCompleted(task=0, worker=1))
    state, commands = feed(state, TaskCompleted(task=0, worker=0))
    assert commands == []
    assert state.life.stale == frozenset({(1, 1)})


def test_a_stale_answer_is_accepted_only_once() -> None:
    state, _ = feed(_abandoned(), TaskCompleted(task=0, worker=0))
    with pytest.raises(ExecutorError, match="task 0 is not awaiting an answer"):
        feed(state, TaskCompleted(task=0, worker=0))


def test_a_stale_answer_arriving_in_the_new_epoch_is_never_delivered() -> None:
    state, _ = feed(fill(_resumed(_abandoned()))[0], NextRequested())
    state, commands = feed(state, TaskCompleted(task=1, worker=1, payload="old"))
    assert commands == []
    assert state.waiting
    _, commands = feed(state, TaskCompleted(task=2, worker=0, payload="new"))
    delivered = only(commands, Deliver)
    assert [d.payload for d in delivered] == ["new"]


def test_a_stale_answer_does_not_free_room_in_the_new_epoch() -> None:
    state, _ = fill(_resumed(_abandoned()))
    loads = state.loads
    state, commands = feed(state, TaskCompleted(task=0, worker=0))
    assert commands == []
    assert state.loads == loads


def test_a_stale_answer_after_the_new_epoch_finished_is_dropped() -> None:
    state, _ = feed(_resumed(_abandoned()), SamplerExhausted(), NextRequested())
    assert state.phase is Phase.FINISHED
    with pytest.raises(ExecutorError):
        feed(state, TaskCompleted(task=1, worker=0))
    state, commands = feed(state, TaskCompleted(task=0, worker=0))
    assert commands == []
    assert state.life.stale == frozenset({(1, 1)})
    assert state.phase is Phase.FINISHED


def test_stale_tasks_of_several_abandoned_epochs_are_all_remembered() -> None:
    state, _ = fill(_resumed(_abandoned()))  # tasks 2 and 3
    state, _ = feed(state, ResetRequested())
    assert state.life.stale == frozenset({(0, 0), (1, 1), (2, 0), (3, 1)})
    assert state.life.epoch == 3


# --- refusals ------------------------------------------------------------------------------------


def test_reset_on_a_non_persistent_scheduler_after_its_epoch_is_refused_with_misuse() -> None:
    state, _ = start(config(), SamplerExhausted(), NextRequested())
    assert state.phase is Phase.FINISHED
    with pytest.raises(MisuseError, match="persistent"):
        feed(state, ResetRequested())


def test_reset_on_a_non_persistent_scheduler_mid_epoch_is_refused_with_misuse() -> None:
    state, _ = fill(start(config())[0])
    with pytest.raises(MisuseError, match="persistent"):
        feed(state, ResetRequested())


def test_reset_while_an_index_is_being_drawn_is_refused_with_misuse() -> None:
    state, _ = start(config(persistent_workers=True))
    with pytest.raises(MisuseError, match="index"):
        feed(state, ResetRequested())


def test_reset_while_workers_are_still_resuming_is_refused_with_misuse() -> None:
    state, _ = feed(_finished(), ResetRequested())
    with pytest.raises(MisuseError, match="still waits for its workers"):
        feed(state, ResetRequested())
