"""Worker slots that begin retired (`Config.started`): a loader that tunes its worker count
starts a few of its slots, and the others run only once `AddRequested` starts them."""

from __future__ import annotations

import pytest
from _drive import feed, fill, only, start

from statecore import (
    AddRequested,
    CloseRequested,
    Config,
    NextRequested,
    Phase,
    ReplaceWorker,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    SendTask,
    StopWorker,
    TaskCompleted,
    WorkerStarted,
    WorkerStatus,
    initial_state,
)

ACTIVE = WorkerStatus.ACTIVE
STOPPED = WorkerStatus.STOPPED
STARTING = WorkerStatus.STARTING


def _config(**flags: bool) -> Config:
    return Config(num_workers=4, prefetch_factor=1, started=2, **flags)


def test_the_slots_past_started_begin_retired() -> None:
    state = initial_state(_config())
    assert state.life.workers == (ACTIVE, ACTIVE, STOPPED, STOPPED)
    assert state.life.incarnations == (0, 0, 0, 0)


def test_without_started_every_slot_runs() -> None:
    state = initial_state(Config(num_workers=3))
    assert state.life.workers == (ACTIVE, ACTIVE, ACTIVE)


def test_tasks_go_only_to_the_slots_that_run() -> None:
    state, commands = start(_config())
    state, more = fill(state)
    assert {send.worker for send in only([*commands, *more], SendTask)} == {0, 1}
    assert state.loads == (1, 1, 0, 0)


def test_a_slot_that_began_retired_is_started_by_an_add_and_then_takes_its_turn() -> None:
    state, _ = start(_config())
    state, _ = fill(state)
    state, commands = feed(state, AddRequested(worker=2))
    assert commands[0] == ReplaceWorker(2, 1, 1)
    assert state.life.workers[2] is STARTING
    state, commands = feed(state, WorkerStarted(worker=2, incarnation=1))
    state, _ = feed(state, TaskCompleted(task=0, worker=0), NextRequested())
    state, more = fill(state)
    assert 2 in {send.worker for send in only([*commands, *more], SendTask)}


def test_closing_stops_only_the_slots_that_run() -> None:
    state, _ = start(_config())
    state, commands = feed(state, CloseRequested())
    assert only(commands, StopWorker) == [StopWorker(0), StopWorker(1)]


def test_a_persistent_epoch_resumes_only_the_slots_that_run() -> None:
    state, _ = start(_config(persistent_workers=True))
    state, _ = fill(state)  # task 0 on worker 0, task 1 on worker 1
    state, _ = feed(
        state,
        TaskCompleted(task=0, worker=0),
        NextRequested(),
        SamplerExhausted(),
        TaskCompleted(task=1, worker=1),
        NextRequested(),
        NextRequested(),
    )
    assert state.phase is Phase.FINISHED
    state, commands = feed(state, ResetRequested(seed=5))
    assert only(commands, ResumeWorker) == [ResumeWorker(0, 2, 5), ResumeWorker(1, 2, 5)]
    assert state.life.workers[2:] == (STOPPED, STOPPED)


@pytest.mark.parametrize("started", [0, 5, True, 1.5])
def test_started_must_name_from_one_to_every_slot(started: object) -> None:
    with pytest.raises(ValueError, match="started must be an integer from 1 to num_workers=4"):
        Config(num_workers=4, started=started)  # type: ignore[arg-type]


def test_an_iterable_dataset_starts_every_slot() -> None:
    with pytest.raises(ValueError, match="its own part of the data"):
        Config(num_workers=4, started=2, iterable=True)
    assert Config(num_workers=4, started=4, iterable=True).running_at_start == 4
