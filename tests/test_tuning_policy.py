"""The tuning policy of `num_workers="auto"` (statecore._tuning), alone: traces of figures in,
decisions out, no loader and no clock. The traces come from a small model of a loader: each
worker takes `load` seconds a batch (sharing `cpus` cores where the work is CPU-bound), the
training loop `step` seconds; noise is drawn by Hypothesis."""

from __future__ import annotations

from collections.abc import Callable

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore._tuning import (
    LoadWindow,
    Tuner,
    Tuning,
    TuningDecision,
    TuningMove,
    WorkerBudget,
    decide_workers,
    tuning_change_bound,
)

BATCHES = 16
"""Batches per window, as the loader measures them."""


@attrs.frozen
class Workload:
    """A steady loader: a worker makes a batch in `load` seconds of its own work, the loop
    uses one in `step`; CPU-bound workers share `cpus` cores (None: they wait on I/O)."""

    load: float
    step: float
    cpus: int | None = None
    cpu_per_worker: float | None = None
    """Cores each running worker keeps busy, as the loader measures them (None: not measured)."""
    queued_per_worker: float | None = None
    """Cores' worth of time each running worker waits in the run queue (None: not measured)."""

    def window(
        self, running: int, batch: int, noise: tuple[float, float, float] = (0, 0, 0)
    ) -> LoadWindow:
        effective = running if self.cpus is None else min(running, self.cpus)
        rate = min(effective / self.load, 1 / self.step)
        seconds = BATCHES / rate
        waited = max(seconds - BATCHES * self.step, 0.0)
        busy = min(rate * self.load / effective, 1.0) * effective / running
        time_noise, wait_noise, busy_noise = noise
        return LoadWindow(
            batch=batch,
            batches=BATCHES,
            seconds=seconds * (1 + time_noise),
            waited=min(waited * (1 + wait_noise) + abs(wait_noise) * 0.01 * seconds, seconds),
            longest_gap=self.step,
            busy=min(max(busy * (1 + busy_noise), 0.0), 1.0),
            running=running,
            cpu=None if self.cpu_per_worker is None else self.cpu_per_worker * running,
            queued=None if self.queued_per_worker is None else self.queued_per_worker * running,
        )


@attrs.frozen
class Run:
    counts: list[int]
    """Workers running after each window."""
    decisions: list[TuningDecision]
    tuner: Tuner

    @property
    def changes(self) -> list[TuningDecision]:
        return [d for d in self.decisions if d.changes]

    @property
    def final(self) -> int:
        return self.counts[-1]


def run(
    workload: Callable[[int], Workload],
    budget: WorkerBudget,
    windows: int = 60,
    start: int = 2,
    noise: Callable[[int], tuple[float, float, float]] = lambda i: (0, 0, 0),
) -> Run:
    """Feed `decide_workers` a window at a time, carrying out its decisions as the loader would.
    `workload(i)` is the workload during window `i` (a slowdown changes it)."""
    tuner, running, batch = Tuner(), start, 0
    counts, decisions = [], []
    for i in range(windows):
        batch += BATCHES
        tuner, decision = decide_workers(
            tuner, workload(i).window(running, batch, noise(i)), budget
        )
        if decision.move is TuningMove.ADD:
            running += decision.workers
        elif decision.move is TuningMove.RETIRE:
            running -= decision.workers
        assert 1 <= running <= budget.slots
        counts.append(running)
        decisions.append(decision)
    return Run(counts, decisions, tuner)


def steady(workload: Workload) -> Callable[[int], Workload]:
    return lambda i: workload


def test_an_io_bound_loader_gets_workers_until_the_loop_stops_waiting() -> None:
    # Four workers keep up with the loop; the tuner starts with two.
    result = run(steady(Workload(load=0.4, step=0.1)), WorkerBudget(slots=16, cpus=2))
    assert result.final == 4
    assert result.tuner.settled
    assert all(d.move is TuningMove.HOLD for d in result.decisions[-20:])
    assert "waited" in result.changes[0].why


def test_a_worker_past_the_cores_that_does_not_speed_loading_is_retired() -> None:
    # CPU-bound work on two cores: a third worker makes batches no faster.
    result = run(steady(Workload(load=0.4, step=0.01, cpus=2)), WorkerBudget(slots=8, cpus=2))
    assert result.final == 2
    assert [d.move for d in result.changes] == [TuningMove.ADD, TuningMove.RETIRE]
    assert "did not pay" in result.changes[1].why
    assert result.tuner.ceiling == 2


def test_workers_the_loop_does_not_wait_for_are_retired() -> None:
    # One worker makes batches twice as fast as the loop uses them.
    result = run(steady(Workload(load=0.05, step=0.1)), WorkerBudget(slots=8, cpus=2))
    assert result.final == 1
    assert result.changes[0].move is TuningMove.RETIRE
    assert "busy" in result.changes[0].why
    assert result.tuner.settled


def test_a_retire_that_leaves_the_loop_waiting_is_undone_and_sets_a_floor() -> None:
    # Two workers idle most of the time, so one is retired; then loading gets slower, and one
    # worker alone leaves the loop waiting.
    def workload(i: int) -> Workload:
        return Workload(load=0.05 if i == 0 else 0.15, step=0.1)

    result = run(workload, WorkerBudget(slots=8, cpus=4))
    assert [d.move for d in result.changes] == [TuningMove.RETIRE, TuningMove.ADD]
    assert "with 1 worker(s) the training loop waited" in result.changes[1].why
    assert result.tuner.floor == 2
    assert result.final == 2


def test_the_memory_budget_caps_the_count() -> None:
    result = run(steady(Workload(load=0.6, step=0.1)), WorkerBudget(slots=16, cpus=8, memory=3))
    assert result.final == 3
    assert result.tuner.settled
    assert any("memory budget holds 3" in d.why for d in result.decisions[-4:])


def test_the_slot_count_caps_the_count() -> None:
    result = run(steady(Workload(load=0.6, step=0.1)), WorkerBudget(slots=4, cpus=8))
    assert result.final == 4
    assert result.changes[-1].move is TuningMove.ADD
    assert any("every one of the 4 worker slots runs" in d.why for d in result.decisions[-4:])


def test_once_the_loop_and_its_workers_fill_the_cores_an_add_is_only_tried() -> None:
    # The cores full, no jump for a starving loop: half as many workers again (one of two),
    # kept only if batches come faster (see the next test).
    busy = attrs.evolve(Workload(load=0.4, step=0.01).window(2, BATCHES), cpu=1.9)
    _, decision = decide_workers(Tuner(), busy, WorkerBudget(8, cpus=2))
    assert (decision.move, decision.workers) == (TuningMove.ADD, 1)
    assert "the CPU budget is spent (the loop and its workers kept 1.9 of 2 cores busy)" in (
        decision.why
    )
    idle = attrs.evolve(busy, cpu=0.5)  # samples that wait on I/O: cores to spare
    assert decide_workers(Tuner(), idle, WorkerBudget(8, cpus=2))[1].workers > 1


def test_a_tried_add_past_full_cores_that_did_not_pay_is_undone_and_the_tuner_settles() -> None:
    full = Workload(load=0.4, step=0.01, cpus=2, cpu_per_worker=0.95)
    result = run(steady(full), WorkerBudget(slots=16, cpus=2), windows=10)
    assert [(d.move, d.workers) for d in result.changes] == [
        (TuningMove.ADD, 1),
        (TuningMove.RETIRE, 1),
    ]
    assert result.final == 2
    assert result.tuner.settled and result.tuner.ceiling == 2


def test_tried_adds_past_full_cores_that_do_pay_are_kept_and_the_next_tried() -> None:
    # The cores asked for in full, yet batches come faster with each worker (samples that
    # also wait, or a shared machine's larger share): half as many again each time, to 16.
    shared = Workload(load=0.4, step=0.001, cpu_per_worker=0.95)
    result = run(steady(shared), WorkerBudget(slots=16, cpus=2), windows=12)
    assert [(d.move, d.workers) for d in result.changes] == [
        (TuningMove.ADD, 1),
        (TuningMove.ADD, 1),
        (TuningMove.ADD, 2),
        (TuningMove.ADD, 3),
        (TuningMove.ADD, 4),
        (TuningMove.ADD, 3),
    ]
    assert all("trying" in d.why for d in result.changes)
    assert result.final == 16


def test_a_worker_over_the_memory_budget_is_retired() -> None:
    _, decision = decide_workers(
        Tuner(), Workload(load=0.4, step=0.1).window(3, BATCHES), WorkerBudget(8, 8, memory=2)
    )
    assert decision.move is TuningMove.RETIRE
    assert "memory budget holds 2" in decision.why


def test_a_sudden_slowdown_wakes_a_settled_tuner() -> None:
    def workload(i: int) -> Workload:
        return Workload(load=0.2 if i < 20 else 0.6, step=0.1)

    result = run(workload, WorkerBudget(slots=16, cpus=8))
    assert result.counts[19] == 2  # settled at two before the slowdown
    assert result.decisions[19].move is TuningMove.HOLD and "settled" in result.decisions[19].why
    assert result.final == 6


def test_a_loop_that_stops_asking_retires_nothing() -> None:
    # The loop paused (an evaluation) for most of the window: the idle workers say nothing.
    window = attrs.evolve(
        Workload(load=0.2, step=0.1).window(2, BATCHES), seconds=60.0, longest_gap=58.0
    )
    tuner, decision = decide_workers(Tuner(), window, WorkerBudget(8, 8))
    assert decision.move is TuningMove.HOLD and "paused" in decision.why
    assert tuner == Tuner()


def test_no_decision_is_taken_on_a_window_that_began_within_the_cooldown() -> None:
    waiting = Workload(load=0.4, step=0.1)
    tuner, decision = decide_workers(Tuner(), waiting.window(2, 32), WorkerBudget(8, 8))
    assert decision.move is TuningMove.ADD
    cooldown = Tuning().cooldown
    for first in (30, 32, 32 + cooldown - 1):  # began before the change, or within the cool-down
        later = waiting.window(3, first + BATCHES)
        _, decision = decide_workers(tuner, later, WorkerBudget(8, 8))
        assert decision.why == "cooling down after the last change"
    _, decision = decide_workers(
        tuner, waiting.window(3, 32 + cooldown + BATCHES), WorkerBudget(8, 8)
    )
    assert decision.why != "cooling down after the last change"


def test_a_steady_loader_at_the_right_count_is_left_alone() -> None:
    result = run(steady(Workload(load=0.2, step=0.1)), WorkerBudget(slots=8, cpus=8))
    assert result.changes == []


# --- noise ------------------------------------------------------------------------------------

IO_WAIT = Workload(load=0.4, step=0.02, cpu_per_worker=0.05)
"""Samples that wait on I/O: twenty workers would keep up with the loop, and each takes a
twentieth of a core."""


def test_a_starving_io_bound_loop_jumps_to_the_count_its_waiting_calls_for() -> None:
    # Waiting 90% of its time, the loop calls for ten times the workers; the cores have room
    # for them (a twentieth of a core each): from 2 to the 16 slots in one add.
    result = run(steady(IO_WAIT), WorkerBudget(slots=16, cpus=2), windows=8)
    assert [d.workers for d in result.changes] == [14]
    assert result.final == 16


def test_a_starving_loop_is_given_no_more_workers_than_the_cores_have_room_for() -> None:
    # Each worker takes 0.3 of a core: two take 0.6, and 1.2 of the 1.8 cores allowed are
    # left, room for four more, though the waiting calls for eighteen.
    busy = attrs.evolve(IO_WAIT, cpu_per_worker=0.3)
    _, decision = decide_workers(Tuner(), busy.window(2, BATCHES), WorkerBudget(16, 2))
    assert (decision.move, decision.workers) == (TuningMove.ADD, 4)


def test_where_the_cores_are_not_measured_a_starving_loop_doubles_its_workers() -> None:
    unmeasured = attrs.evolve(IO_WAIT, cpu_per_worker=None)
    result = run(steady(unmeasured), WorkerBudget(slots=16, cpus=2), windows=8)
    assert [d.workers for d in result.changes] == [2, 4, 8]
    assert result.final == 16


def test_a_loop_waiting_a_little_gets_one_worker_at_a_time() -> None:
    # Three workers keep up: the loop waits a third of its time with two, not over half.
    result = run(steady(Workload(load=0.3, step=0.1)), WorkerBudget(slots=16, cpus=8))
    assert [(d.move, d.workers) for d in result.changes] == [(TuningMove.ADD, 1)]
    assert result.final == 3


def test_an_undone_add_of_several_workers_retires_them_all() -> None:
    # CPU-bound on two cores, the loop starving: two workers added at once make batches no
    # faster, and both go.
    result = run(steady(Workload(load=0.4, step=0.01, cpus=2)), WorkerBudget(slots=8, cpus=2))
    assert [(d.move, d.workers) for d in result.changes] == [
        (TuningMove.ADD, 2),
        (TuningMove.RETIRE, 2),
    ]
    assert "workers 3-4 did not pay" in result.changes[1].why


def test_a_slower_window_while_the_loop_starves_with_cores_to_spare_keeps_the_add() -> None:
    # A shared machine: the window after the add ran 30% slower, though the loop still waited
    # most of its time and the workers used a fraction of the cores. That is noise, not an
    # add that did not pay: the add stays, and no ceiling is set.
    def noise(i: int) -> tuple[float, float, float]:
        return (9.0, 0.0, 0.0) if i == 1 else (0.0, 0.0, 0.0)

    # Sixteen workers would still leave this loop starving; the window after the add ran ten
    # times slower than the model says, slower than the one before it.
    slow = attrs.evolve(IO_WAIT, load=4.0)
    result = run(steady(slow), WorkerBudget(slots=16, cpus=2), windows=2, noise=noise)
    assert [d.move for d in result.changes] == [TuningMove.ADD]
    assert result.tuner.ceiling is None
    assert result.final == 16


def test_a_ceiling_set_on_noise_expires_when_the_loop_starves_with_cores_to_spare() -> None:
    # Settled under a ceiling of two (an add judged on a noisy window), the loop waiting most
    # of its time, the cores nearly idle: the tuner wakes past the ceiling.
    tuner = Tuner(
        changes=2, changed_at=0, ceiling=2, settled=True, reversals=1, last=TuningMove.RETIRE
    )
    budget = WorkerBudget(slots=16, cpus=2)
    decisions = []
    for i in range(1, 1 + Tuning().wake_windows):
        tuner, decision = decide_workers(tuner, IO_WAIT.window(2, 100 + i * BATCHES), budget)
        decisions.append(decision)
    assert decisions[-1].move is TuningMove.ADD
    assert tuner.ceiling is None


def test_a_ceiling_holds_where_the_cores_are_not_measured() -> None:
    tuner = Tuner(changes=2, ceiling=2, settled=True, reversals=1, last=TuningMove.RETIRE)
    unmeasured = attrs.evolve(IO_WAIT, cpu_per_worker=None)
    for i in range(1, 1 + 2 * Tuning().wake_windows):
        tuner, decision = decide_workers(
            tuner, unmeasured.window(2, 100 + i * BATCHES), WorkerBudget(slots=16, cpus=2)
        )
        assert decision.move is TuningMove.HOLD
    assert tuner.ceiling == 2


NOISE = st.tuples(st.floats(-0.2, 0.2), st.floats(-0.3, 0.3), st.floats(-0.3, 0.3))
"""Within 20% on a window's time, 30% on the waiting and on the workers' busy share."""


@settings(max_examples=60, deadline=None)
@given(
    noises=st.lists(NOISE, min_size=80, max_size=80),
    load=st.floats(0.01, 1.0),
    step=st.floats(0.01, 0.3),
    cpus=st.one_of(st.none(), st.integers(1, 8)),
    slots=st.integers(1, 16),
    cpu_per_worker=st.one_of(st.none(), st.floats(0.0, 1.0)),
    queued_per_worker=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_under_any_bounded_noise_the_number_of_changes_is_bounded(
    noises: list[tuple[float, float, float]],
    load: float,
    step: float,
    cpus: int | None,
    slots: int,
    cpu_per_worker: float | None,
    queued_per_worker: float | None,
) -> None:
    # With the run queue measured, workers that sleep are added to while the cores given idle,
    # kept unless slower: the bound holds all the same.
    result = run(
        steady(Workload(load, step, cpus, cpu_per_worker, queued_per_worker)),
        WorkerBudget(slots=slots, cpus=cpus or 8),
        windows=len(noises),
        start=min(2, slots),
        noise=lambda i: noises[i],
    )
    assert len(result.changes) <= tuning_change_bound(slots)
    assert result.tuner.reversals <= Tuning().max_reversals


@settings(max_examples=60, deadline=None)
@given(noises=st.lists(NOISE, min_size=80, max_size=80))
def test_noise_around_a_well_served_loop_changes_nothing(
    noises: list[tuple[float, float, float]],
) -> None:
    # Two workers, each busy all the time, keep the loop from waiting: noise within bounds
    # neither adds (waiting stays far under 10%) nor retires (they stay far over 60% busy).
    result = run(
        steady(Workload(load=0.2, step=0.1)),
        WorkerBudget(slots=8, cpus=8),
        windows=len(noises),
        noise=lambda i: noises[i],
    )
    assert result.changes == []
