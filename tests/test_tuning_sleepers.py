"""How far a starving loop's jump goes where its workers sleep part of each task.

Workers that alternate a sleep (a read) and a computation keep the cores busy on average once
their CPU adds up to the cores, but the cores idle whenever too many sleep at once. The jump
is sized by `core_use`, the machine-repairman model of such workers, from the sleep and the
CPU measured over the window. The windows are `mixed`'s (each sample 2 ms asleep, then about
1 ms of a core) on this project's 2-core machine, quiet (2026-11-28)."""

from __future__ import annotations

import attrs
import pytest
from _windows import recorded

from statecore._tuning import (
    LoadWindow,
    Tuner,
    TuningMove,
    WorkerBudget,
    core_use,
    decide_workers,
)

TWO_CORES = WorkerBudget(slots=16, cpus=2)

# The first 16 batches of `mixed` under auto: two workers, the loop starving, the workers
# asleep 64% of the time they held a task, each computing on a third of a core.
TWO = recorded(batch=17, running=2, rate=158.0, wait=0.99, cpu=0.66, queued=0.02, busy=0.98)

# The same loader's first 16 batches where the samples compute whenever a worker holds one
# (`cpu-spin`): asleep 5% of the time, the cores with room for one more worker.
SPINNING = recorded(batch=17, running=2, rate=400.0, wait=0.99, cpu=1.2, queued=0.1, busy=0.7)


def test_core_use_matches_the_shares_of_mixed_s_fixed_counts() -> None:
    # `bench --sweep --only mixed`, quiet (2026-11-28): 1, 2 and 4 fixed workers made 81.4,
    # 157.9 and 299.9 batches/s, where the best count made 475.3.
    for workers, rate in ((1, 81.4), (2, 157.9), (4, 299.9)):
        assert core_use(workers, 2.0, 2) == pytest.approx(rate / 475.3, abs=0.01)


def test_workers_that_never_sleep_keep_as_many_cores_busy_as_there_are_workers() -> None:
    assert core_use(1, 0.0, 2) == 0.5
    assert core_use(3, 0.0, 2) == 1.0


def test_each_worker_more_keeps_the_cores_busier_up_to_all_of_them() -> None:
    uses = [core_use(workers, 2.0, 2) for workers in range(1, 17)]
    assert uses == sorted(uses) and len(set(uses)) == len(uses)
    assert 0.99 < uses[-1] <= 1.0


def test_core_use_stays_a_share_for_hundreds_of_workers() -> None:
    assert core_use(400, 0.05, 2) == pytest.approx(1.0)
    assert core_use(400, 1e6, 2) == pytest.approx(400 / 1e6 / 2, rel=0.01)


def test_no_workers_or_no_cores_keep_nothing_busy() -> None:
    assert core_use(0, 2.0, 2) == 0.0
    assert core_use(4, 2.0, 0) == 0.0


def test_a_starving_loop_whose_workers_sleep_jumps_to_the_count_keeping_the_cores_busy() -> None:
    # The room the cores have left, as if each worker used its third of a core all the time,
    # is three more; `core_use` says eight keep 95% of 1.8 cores busy.
    tuner, decision = decide_workers(Tuner(), TWO, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 6)
    assert "slept 64% of their time: 8 would keep the cores busy" in decision.why
    assert tuner.jumped


def test_the_sleepers_jump_goes_no_further_than_the_waiting_calls_for() -> None:
    # Waiting 60% of its time, the loop is fed by 2.5 times the loading: three more workers.
    waiting = attrs.evolve(TWO, waited=0.6 * TWO.seconds)
    _, decision = decide_workers(Tuner(), waiting, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 3)


@pytest.mark.parametrize(
    ("budget", "ceiling", "added"),
    [
        (WorkerBudget(slots=5, cpus=2), None, 3),
        (WorkerBudget(slots=16, cpus=2, memory=6), None, 4),
        (TWO_CORES, 5, 3),
    ],
    ids=["slots", "memory", "ceiling"],
)
def test_the_sleepers_jump_stays_within_the_budget_and_the_ceiling(
    budget: WorkerBudget, ceiling: int | None, added: int
) -> None:
    _, decision = decide_workers(Tuner(ceiling=ceiling), TWO, budget)
    assert (decision.move, decision.workers) == (TuningMove.ADD, added)


def test_workers_that_compute_whenever_they_hold_a_task_jump_only_into_the_cores_room() -> None:
    assert SPINNING.asleep is not None and SPINNING.asleep < 0.2
    _, decision = decide_workers(Tuner(), SPINNING, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 1)
    assert "slept" not in decision.why


def test_where_the_run_queue_is_not_measured_the_jump_is_the_cores_room_alone() -> None:
    unmeasured: LoadWindow = attrs.evolve(TWO, queued=None)
    _, decision = decide_workers(Tuner(), unmeasured, TWO_CORES)
    assert decision.move is TuningMove.ADD
    # The cores' room alone: 1.8 of them, each worker a third, 0.68 taken.
    assert decision.workers == 3 and "slept" not in decision.why


def test_on_a_machine_shared_with_other_work_the_jump_is_the_cores_room_alone() -> None:
    # `mixed`'s first 16 batches with other sessions taking about one core (2026-11-27): the
    # loader's processes waited for 0.39 cores' worth in the run queue, where two workers that
    # sleep as these did would wait for one another hardly at all.
    shared = recorded(batch=17, running=2, rate=174.4, wait=0.99, cpu=0.44, queued=0.39)
    assert shared.asleep is not None and shared.asleep > 0.5
    _, decision = decide_workers(Tuner(), shared, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 2)
    assert "slept" not in decision.why
