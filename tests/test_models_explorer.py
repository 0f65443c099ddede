"""The exhaustive explorer: it covers the default bounds cleanly and reports what it finds.

The default tier explores the representative scenarios; the exhaustive tier (`pytest -m
exhaustive`) explores every default scenario, as `python -m statecore check` does.
"""

from __future__ import annotations

import pytest

from statecore import (
    EDGES,
    CloseRequested,
    Config,
    DrawIndex,
    Event,
    IndexDrawn,
    Interrupted,
    Phase,
    ResetRequested,
    SamplerExhausted,
    SamplerFailed,
    State,
    TaskCompleted,
    TaskFailed,
    Transition,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
    WorkerStarted,
    step,
)
from statecore.models.explorer import (
    Report,
    default_scenarios,
    explore,
    explore_all,
    representative_scenarios,
)
from statecore.models.reference import IterableSpec, MapSpec
from statecore.models.world import Kill, Late, Next, Preempt, Scenario, Work, World, run_to_end

# Edges of the table that the simulated world does not produce, and why. The world answers
# DrawIndex at once, its workers answer first in, first out, and it starts the first epoch right
# away; the driver polls only in a wait, never once the workers are stopped, and tells the
# scheduler of a close only once; the world interrupts waits only. Real executors and signals
# may race in these ways, so tests/test_step_*.py cover these edges.
_LATE_REPORT = "a worker's exit or start reported when the driver no longer polls"
_INTERRUPT_ELSEWHERE = "an interrupt landing outside a wait"

NOT_IN_THE_WORLD = {
    (Phase.DRAINING, IndexDrawn, Phase.DRAINING): "every worker ran dry during a draw",
    (Phase.DRAINING, IndexDrawn, Phase.FINISHED): "every worker ran dry during a draw",
    (Phase.DRAINING, SamplerExhausted, Phase.DRAINING): "every worker ran dry during a draw",
    (Phase.DRAINING, SamplerExhausted, Phase.FINISHED): "every worker ran dry during a draw",
    (Phase.DRAINING, SamplerFailed, Phase.FAILED): "every worker ran dry during a draw",
    (Phase.FINISHED, WorkerDied, Phase.FINISHED): _LATE_REPORT,
    (Phase.FINISHED, WorkerDied, Phase.FAILED): _LATE_REPORT,
    (Phase.FAILED, WorkerDied, Phase.FAILED): _LATE_REPORT,
    (Phase.CLOSED, WorkerDied, Phase.CLOSED): _LATE_REPORT,
    (Phase.CLOSED, CloseRequested, Phase.CLOSED): "the driver tells the scheduler of one close",
    (Phase.IDLE, Interrupted, Phase.IDLE): _INTERRUPT_ELSEWHERE,
    (Phase.FINISHED, Interrupted, Phase.FINISHED): _INTERRUPT_ELSEWHERE,
    (Phase.FAILED, Interrupted, Phase.FAILED): _INTERRUPT_ELSEWHERE,
    (Phase.CLOSED, Interrupted, Phase.CLOSED): _INTERRUPT_ELSEWHERE,
    (Phase.FINISHED, TaskCompleted, Phase.FINISHED): "a stale answer overtook a resume",
    (Phase.FINISHED, TaskFailed, Phase.FINISHED): "a stale answer overtook a resume",
    (Phase.FINISHED, WorkerExhausted, Phase.FINISHED): "a stale answer overtook a resume",
    (Phase.IDLE, WorkerDied, Phase.FAILED): "a worker died before the first epoch",
    (Phase.IDLE, CloseRequested, Phase.CLOSED): "closed before the first epoch",
    # The world resumes a checkpoint whose epoch has ended as the next epoch; the loader does
    # so only once the consumer was told (`complete`), else it resumes the empty end.
    (Phase.IDLE, ResetRequested, Phase.DRAINING): "a resume with every worker dry",
    (Phase.IDLE, WorkerDied, Phase.IDLE): "a worker died before the first epoch",
    (Phase.IDLE, WorkerStarted, Phase.IDLE): "a worker died before the first epoch",
    (Phase.FAILED, WorkerStarted, Phase.FAILED): _LATE_REPORT,
    (Phase.CLOSED, WorkerStarted, Phase.CLOSED): _LATE_REPORT,
    # The driver waits in a finished epoch for nothing, so it polls none of these there.
    (Phase.FINISHED, WorkerResumed, Phase.FINISHED): "a lost worker's resume polled at the end",
    (Phase.FINISHED, WorkerStarted, Phase.FINISHED): "a replacement's start polled at the end",
}


@pytest.fixture(scope="module")
def reports() -> list[Report]:
    return explore_all(representative_scenarios(), processes=2)


@pytest.fixture(scope="module")
def every_report() -> list[Report]:
    return explore_all(default_scenarios(), processes=2)


def _table() -> set[tuple[Phase, type, Phase]]:
    return {
        (phase, event, target)
        for phase, moves in EDGES.items()
        for event, targets in moves.items()
        for target in targets
    }


@pytest.mark.timeout(600)
def test_representative_bounds_have_no_violation(reports: list[Report]) -> None:
    failures = [report.describe() for report in reports if not report.ok]
    assert failures == []


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_default_bounds_have_no_violation(every_report: list[Report]) -> None:
    failures = [report.describe() for report in every_report if not report.ok]
    assert failures == []


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_default_bounds_reach_at_least_ten_thousand_distinct_states(
    every_report: list[Report],
) -> None:
    states = frozenset().union(*(report.states for report in every_report))
    assert len(states) >= 10_000


@pytest.mark.timeout(600)
def test_every_edge_of_the_table_is_explored_or_needs_a_racing_executor(
    reports: list[Report],
) -> None:
    # The representative scenarios alone reach every edge the world can produce.
    seen = frozenset().union(*(report.edges for report in reports))
    unexplained = _table() - seen - set(NOT_IN_THE_WORLD)
    assert unexplained == set()
    assert seen <= _table()  # the world itself checks this on every step


@pytest.mark.timeout(600)
def test_no_edge_the_world_reaches_is_listed_as_out_of_it(reports: list[Report]) -> None:
    seen = frozenset().union(*(report.edges for report in reports))
    assert seen & set(NOT_IN_THE_WORLD) == set()


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_the_default_bounds_reach_no_edge_the_representative_scenarios_miss(
    every_report: list[Report],
) -> None:
    # The representative scenarios' reports are among these (exploring is deterministic), so
    # they are not explored a second time.
    chosen = set(representative_scenarios())
    representative = frozenset().union(
        *(report.edges for report in every_report if report.scenario in chosen)
    )
    every = frozenset().union(*(report.edges for report in every_report))
    assert every - representative == set()


@pytest.mark.timeout(600)
def test_representative_bounds_cover_both_dataset_kinds_orders_and_persistence(
    reports: list[Report],
) -> None:
    configs = {report.scenario.config for report in reports}
    assert {c.num_workers for c in configs} == {1, 2, 3}
    assert {c.prefetch_factor for c in configs} == {1, 2}
    assert {(c.iterable, c.in_order, c.persistent_workers) for c in configs} == {
        (i, o, p) for i in (False, True) for o in (False, True) for p in (False, True)
    }


@pytest.mark.timeout(600)
def test_representative_bounds_let_workers_come_and_go(reports: list[Report]) -> None:
    # Restarts 0 to 2 on one to three workers, in order and not, map-style and iterable.
    lost = [r.scenario for r in reports if r.scenario.deaths and r.scenario.hangs]
    assert {s.config.restarts for s in lost} == {0, 1, 2}
    assert {s.config.num_workers for s in lost if s.config.restarts} == {1, 2, 3}
    assert {(s.config.iterable, s.config.in_order) for s in lost if s.config.restarts} == {
        (i, o) for i in (False, True) for o in (False, True)
    }
    assert any(s.config.persistent_workers for s in lost if s.config.restarts)
    assert any(not s.killable for s in lost)


def test_the_representative_scenarios_are_default_scenarios() -> None:
    every = list(default_scenarios())
    representative = list(representative_scenarios())
    assert set(representative) < set(every)
    assert representative == [s for s in every if s in set(representative)]  # in their order


def _small(in_order: bool = True) -> Scenario:
    return Scenario(Config(num_workers=2, prefetch_factor=1, in_order=in_order), MapSpec(3))


def test_a_correct_scheduler_explores_cleanly_and_counts_what_it_saw() -> None:
    report = explore(_small())
    assert report.ok
    assert report.worlds > 1 and report.transitions >= report.worlds - 1
    assert all(isinstance(state, State) for state in report.states)


def _without_draws(state: State, event: Event) -> Transition:
    """A broken driver contract: the scheduler's requests for indices are never carried out."""
    transition = step(state, event)
    kept = tuple(c for c in transition.commands if not isinstance(c, DrawIndex))
    return Transition(transition.state, kept)


def test_a_consumer_left_waiting_forever_is_reported_as_a_deadlock() -> None:
    report = explore(_small(), step=_without_draws)
    assert not report.ok
    assert report.violation is not None and "deadlock" in report.violation
    # iter() returns once its first indices were drawn: without draws, iter() itself waits.
    assert report.trace == ()


def _in_order_ignored(state: State, event: Event) -> Transition:
    return step(
        state._replace(config=Config(num_workers=2, prefetch_factor=1, in_order=False)), event
    )


def test_a_violation_comes_with_a_shortest_trace() -> None:
    # Without checkpoints: a resumed run from the very start would meet the bug first.
    report = explore(_small(), step=_in_order_ignored, checkpoints=False)
    assert not report.ok
    # Ask, then let the second worker answer first: the shortest way to see an early delivery.
    assert report.trace == (Next(), Work(worker=1))
    assert "handed over before task 0" in (report.violation or "")


def test_describe_prints_the_trace_as_python() -> None:
    report = explore(_small(), step=_in_order_ignored, checkpoints=False)
    text = report.describe()
    assert "Next()" in text and "Work(worker=1)" in text


def test_scenarios_refuse_a_dataset_that_does_not_match_the_config() -> None:
    with pytest.raises(ValueError, match="iterable"):
        Scenario(Config(num_workers=1, iterable=True), MapSpec(2))
    with pytest.raises(ValueError, match="one shard length per worker"):
        Scenario(Config(num_workers=2, iterable=True), IterableSpec((1,)))
    with pytest.raises(ValueError, match="persistent"):
        Scenario(Config(num_workers=1), MapSpec(2), epochs=2)


def test_a_replacement_of_a_replacement_is_restored_to_what_was_recorded_only() -> None:
    # Worker 0 dies holding task 0; the answer it had sent arrives after its death was told;
    # its replacement dies before it starts; the next one must still produce batch 0, though
    # the late answer's mark says the part stood past it.
    scenario = Scenario(
        Config(num_workers=2, prefetch_factor=1, iterable=True, restarts=2),
        IterableSpec((3, 0), frozenset({(0, 1)})),
        deaths=2,
    )
    world = World.start(scenario)
    for action in (Next(), Kill(0), Late(0), Kill(0), Work(0)):
        world = world.apply(action)
    run_to_end(world)  # the reference epoch, batch 0 first


def test_a_violation_in_a_resumed_run_ends_its_trace_with_the_checkpoint() -> None:
    report = explore(_small(), step=_in_order_ignored)
    assert not report.ok
    assert report.trace == (Preempt(workers=2),)
    assert "resumed from a checkpoint with 2 workers" in (report.violation or "")
