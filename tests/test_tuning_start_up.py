"""The batches an epoch's start-up loaded ahead: a starving loop's first window is decided on
from its second batch, but the batches the workers loaded while the first waited for their
start-up come at once, and are left out of the rate a change is judged against
(`LoadWindow.ahead`).

The windows are recorded from `mixed` (each sample 2 ms asleep, then about 1 ms of a core)
in the sweep's runs on this project's 2-core machine, with a thread of the training process
reading every worker's page tables every 5 ms (2026-11-28, `python -m statecore bench
--sweep`'s old memory sampler): 8 fixed workers made 401 batches/s. Counted whole, the first
window said 2 workers made 295.5 batches/s; without the 4 batches loaded ahead, 154.7. The
jump to 4 workers, at 274.7 over half a second, was undone against the first figure, and the
tuner locked at 4 (268 to 305 batches/s in 2 runs of 3)."""

from __future__ import annotations

import attrs
import pytest
from _windows import recorded

from statecore._tuning import LoadWindow, Tuner, TuningMove, WorkerBudget, decide_workers

TWO_CORES = WorkerBudget(slots=16, cpus=2)

# The first window: 8 batches in 27.1 ms, the first 4 of them handed over in 1.2 ms.
FIRST = LoadWindow(
    batch=9,
    batches=8,
    seconds=0.0271,
    waited=0.99 * 0.0271,
    longest_gap=0.0004,
    busy=1.0,
    running=2,
    cpu=1.25,
    queued=0.23,
    ahead=4,
    ahead_seconds=0.0271 - 4 / 154.7,
    ahead_waited=0.0005,
)
# Four workers over half a second, after the jump: the loop still starving.
FOUR = recorded(batch=171, running=4, rate=274.7, wait=1.0, cpu=1.65, queued=0.97, batches=140)


def test_the_batches_loaded_ahead_are_left_out_of_the_windows_rate() -> None:
    assert FIRST.loading_batches == 4
    assert FIRST.rate == pytest.approx(154.7)
    assert FIRST.batches / FIRST.seconds == pytest.approx(295.2, abs=0.1)


def test_the_waiting_that_decides_is_the_whole_windows() -> None:
    assert FIRST.wait_share == pytest.approx(0.99)


def test_a_window_without_batches_loaded_ahead_has_its_plain_rate() -> None:
    assert FOUR.ahead == 0
    assert FOUR.rate == pytest.approx(274.7)


def test_a_window_whose_every_batch_was_loaded_ahead_has_no_rate() -> None:
    window = attrs.evolve(FIRST, ahead=8, ahead_seconds=FIRST.seconds, ahead_waited=FIRST.waited)
    assert window.loading_batches == 0
    assert window.rate == 0.0


def test_the_windows_pooled_at_a_count_leave_the_batches_loaded_ahead_out() -> None:
    tuner = Tuner().pooled(FIRST).pooled(FOUR)
    assert tuner.seen_batches == 4 + 140
    assert tuner.seen_seconds == pytest.approx(4 / 154.7 + 140 / 274.7)
    assert tuner.seen_waited == pytest.approx(FIRST.waited - 0.0005 + FOUR.waited)


def _jumped() -> Tuner:
    tuner, decision = decide_workers(Tuner(), FIRST, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 2) and tuner.jumped
    return tuner


def test_a_starving_loops_jump_is_judged_against_the_rate_its_workers_loaded_at() -> None:
    tuner = _jumped()
    assert tuner.rate_before == pytest.approx(154.7)
    tuner, decision = decide_workers(tuner, FOUR, TWO_CORES)
    assert decision.move is not TuningMove.RETIRE
    assert tuner.ceiling is None and tuner.reversals == 0


def test_counted_whole_the_first_window_would_undo_the_jump() -> None:
    # What the loader did before it marked the batches loaded ahead: 295.5 -> 274.7 is a
    # loss past the 4% allowed against a short window.
    whole = attrs.evolve(FIRST, ahead=0, ahead_seconds=0.0, ahead_waited=0.0)
    tuner, decision = decide_workers(Tuner(), whole, TWO_CORES)
    assert decision.move is TuningMove.ADD
    tuner, decision = decide_workers(tuner, FOUR, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.RETIRE, 2)
    assert tuner.ceiling == 2


def test_an_add_is_not_judged_on_a_window_whose_every_batch_was_loaded_ahead() -> None:
    # The next epoch's first window, say, all of it in flight as its first batch came.
    tuner = _jumped()
    loaded = attrs.evolve(FOUR, batches=8, seconds=0.002, waited=0.0, ahead=8, ahead_seconds=0.002)
    after, decision = decide_workers(tuner, loaded, TWO_CORES)
    assert decision.move is TuningMove.HOLD
    assert "loaded before it" in decision.why
    assert not after.judged


def test_an_add_with_no_rate_measured_before_it_is_kept() -> None:
    # Every batch of the window it was made on had been loaded ahead: the add was made on the
    # loop's waiting, and there is no rate to judge it against.
    only_ahead = attrs.evolve(FIRST, ahead=8, ahead_seconds=FIRST.seconds, ahead_waited=0.0)
    tuner, decision = decide_workers(Tuner(), only_ahead, TWO_CORES)
    assert decision.move is TuningMove.ADD and tuner.rate_before == 0.0
    slower = attrs.evolve(FOUR, seconds=FOUR.seconds * 10, waited=FOUR.seconds * 10)
    tuner, decision = decide_workers(tuner, slower, TWO_CORES)
    assert decision.move is not TuningMove.RETIRE
    assert tuner.ceiling is None and tuner.reversals == 0
