"""How the tuning policy adds workers once the cores are asked for in full, and how it judges
them: against every window measured at the count before (not the last alone, which may be a
starving loop's 16 batches), asking 6% of up to half as many again, and, where the workers
sleep while the cores given still idle, filling the gap with one worker asked the plain 4%.

The windows are recorded from `mixed` (each sample 2 ms asleep, then about 1 ms of a core) on
this project's 2-core machine with nothing else running (2026-11-28,
`python -m statecore bench --sweep --only mixed --batches 2400`): fixed, 6 workers made 431
batches/s, 8 made 479 and 9 made 475."""

from __future__ import annotations

import attrs
from _windows import one_window_later, recorded

from statecore._tuning import LoadWindow, Tuner, TuningMove, WorkerBudget, decide_workers

TWO_CORES = WorkerBudget(slots=16, cpus=2)


def mixed(
    batch: int,
    running: int,
    rate: float,
    cpu: float,
    queued: float,
    batches: int,
    busy: float = 0.98,
    wait: float = 0.99,
) -> LoadWindow:
    """A window of `mixed` as the loader measured it: the loop starving (waiting `wait`), the
    workers holding a task `busy` of the time."""
    return recorded(batch, running, rate, wait, cpu, queued, batches, busy)


# Seven workers over half a second: the cores given 1.80 of 2 (over the 85% that settles a
# loader computing on them), the workers asleep half of the time they held a task.
SEVEN = mixed(batch=297, running=7, rate=459.5, cpu=1.80, queued=1.63, batches=230)
# Six over half a second, the cores asked for in full (1.66 busy, 0.86 more queued) but not
# given: more workers are tried, half as many again.
SIX = mixed(batch=735, running=6, rate=451.2, cpu=1.66, queued=0.86, batches=228)
# A starving loop's 16 batches at six workers: faster than any fixed count ever ran.
SIX_OUTLIER = mixed(batch=300, running=6, rate=533.6, cpu=1.66, queued=0.86, batches=16)


def kept(batch: int) -> Tuner:
    """A tuner whose last add, at `batch`, was judged and kept."""
    return Tuner(changed_at=batch, last=TuningMove.ADD, judged=True, changes=2, added=1)


def test_a_starving_loop_s_short_window_measures_the_count_before_an_add_past_the_cores() -> None:
    tuner, decision = decide_workers(kept(250), SIX_OUTLIER, TWO_CORES)
    assert decision.move is TuningMove.HOLD
    assert "measuring 6 worker(s) over a longer window before trying more" in decision.why
    # The loader reads this and measures the next window over half a second.
    assert tuner.long_window and tuner.measuring


def test_an_add_is_judged_against_every_window_measured_at_the_count_before_it() -> None:
    tuner, _ = decide_workers(kept(250), SIX_OUTLIER, TWO_CORES)
    tuner, decision = decide_workers(tuner, SIX, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 3)
    assert "trying 3 more" in decision.why
    # Batches summed over seconds summed: 244 in 0.535 s, not the outlier's 533.6 a second.
    pooled = (SIX_OUTLIER.batches + SIX.batches) / (SIX_OUTLIER.seconds + SIX.seconds)
    assert tuner.rate_before == pooled and 450 < pooled < 460
    assert not tuner.measuring
    # Nine workers came at 490.5 a second: 8.5% over the pooled rate, kept. Against the outlier
    # alone they would have looked 8% slower, and been undone.
    nine = mixed(batch=1021, running=9, rate=490.5, cpu=1.85, queued=3.14, batches=247)
    tuner, decision = decide_workers(tuner, nine, TWO_CORES)
    assert decision.move is TuningMove.ADD and "did not pay" not in decision.why
    assert tuner.ceiling is None and tuner.reversals == 0


def test_half_as_many_again_past_the_cores_is_kept_for_the_six_percent_asked() -> None:
    # 6 -> 9 on the quiet machine brought 6.7% (461 -> 492 batches/s), which the 8% asked
    # before undid.
    tuner = Tuner(
        changed_at=735, last=TuningMove.ADD, judged=False, rate_before=461.0, added=3, changes=3
    )
    nine = mixed(batch=1021, running=9, rate=492.0, cpu=1.85, queued=3.14, batches=247)
    tuner, decision = decide_workers(tuner, nine, TWO_CORES)
    # Kept: the loop still starves, and the next worker fills the cores' idle gap.
    assert decision.move is TuningMove.ADD and "did not pay" not in decision.why
    assert tuner.ceiling is None and tuner.reversals == 0


def test_more_than_half_as_many_again_past_the_cores_is_asked_more_in_proportion() -> None:
    # 6 -> 12 is asked twice the 6%: the same 6.7% does not keep it.
    tuner = Tuner(
        changed_at=735, last=TuningMove.ADD, judged=False, rate_before=461.0, added=6, changes=3
    )
    twelve = mixed(batch=1021, running=12, rate=492.0, cpu=1.85, queued=4.5, batches=247)
    tuner, decision = decide_workers(tuner, twelve, TWO_CORES)
    assert decision.move is TuningMove.HOLD and tuner.second_look
    tuner, decision = decide_workers(tuner, one_window_later(twelve), TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.RETIRE, 6)
    assert "under the 12% gain asked" in decision.why
    assert tuner.ceiling == 6


def test_workers_that_sleep_fill_the_gap_the_cores_given_leave_idle_one_at_a_time() -> None:
    # Given 1.80 of the 2 cores, each worker taking 0.26 of one: the 0.2 idle is one worker's.
    assert SEVEN.asleep is not None and SEVEN.asleep > 0.4
    tuner, decision = decide_workers(kept(50), SEVEN, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 1)
    assert "its workers slept 49% of their time" in decision.why
    assert "kept 1.80 of 2 cores busy" in decision.why
    assert tuner.filling


def test_a_fill_that_brought_the_gain_asked_of_a_filling_worker_is_kept() -> None:
    tuner, _ = decide_workers(kept(50), SEVEN, TWO_CORES)
    # Eight: 3.2% faster (the sweep's 472.0 -> 487.3). Asked the 2% a worker that takes an
    # idle core's time can bring, not the 6% of one that competes for the cores.
    eight = mixed(batch=560, running=8, rate=SEVEN.rate * 1.032, cpu=1.84, queued=2.2, batches=240)
    tuner, decision = decide_workers(tuner, eight, TWO_CORES)
    assert decision.move is TuningMove.ADD and "did not pay" not in decision.why
    assert tuner.ceiling is None and tuner.reversals == 0


def test_the_same_gain_from_an_add_that_did_not_fill_idle_cores_is_undone() -> None:
    tuner, _ = decide_workers(kept(50), SEVEN, TWO_CORES)
    tuner = attrs.evolve(tuner, filling=False)
    eight = mixed(batch=560, running=8, rate=SEVEN.rate * 1.032, cpu=1.84, queued=2.2, batches=240)
    tuner, decision = decide_workers(tuner, eight, TWO_CORES)
    assert decision.move is TuningMove.HOLD and tuner.second_look
    tuner, decision = decide_workers(tuner, one_window_later(eight), TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.RETIRE, 1)
    assert "under the 6% gain asked" in decision.why


def test_a_fill_that_did_not_pay_is_undone_and_its_count_before_becomes_the_ceiling() -> None:
    eight = mixed(batch=560, running=8, rate=479.0, cpu=1.84, queued=2.2, batches=240)
    tuner, decision = decide_workers(kept(280), eight, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 1) and tuner.filling
    nine = mixed(batch=820, running=9, rate=475.3, cpu=1.87, queued=3.2, batches=240)
    tuner, decision = decide_workers(tuner, nine, TWO_CORES)
    assert decision.move is TuningMove.HOLD and tuner.second_look
    tuner, decision = decide_workers(tuner, one_window_later(nine), TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.RETIRE, 1)
    assert "worker 9 did not pay" in decision.why and "under the 2% gain asked" in decision.why
    assert tuner.ceiling == 8


def test_workers_that_compute_whenever_they_hold_a_task_still_settle_on_cores_given() -> None:
    # cpu-spin's two workers, quiet: given 1.81 cores and queued for 0.24 more; not asleep.
    spin = mixed(batch=300, running=2, rate=553.2, cpu=1.81, queued=0.24, batches=277)
    assert spin.asleep is not None and spin.asleep < 0.2
    tuner, decision = decide_workers(kept(0), spin, TWO_CORES)
    assert decision.move is TuningMove.HOLD and tuner.settled


def test_a_settled_tuner_that_wakes_forgets_the_windows_of_its_settled_stretch() -> None:
    calm = mixed(batch=400, running=7, rate=900.0, cpu=1.0, queued=0.1, batches=450, wait=0.0)
    tuner = attrs.evolve(kept(50), settled=True).pooled(calm)
    loud = attrs.evolve(SEVEN, batch=700)
    tuner, _ = decide_workers(tuner, loud, TWO_CORES)
    tuner, decision = decide_workers(tuner, attrs.evolve(SEVEN, batch=930), TWO_CORES)
    assert decision.move is TuningMove.ADD
    # Judged against the woken stretch (459.5 a second), not the calm one's 900.
    assert abs(tuner.rate_before - SEVEN.rate) < 1e-6


# A starving loop's jump, from `mixed`'s sweep (2026-11-28, quiet): four workers over 16
# batches, the cores with room, the workers asleep two thirds of their time: five more were
# added at once (`core_use`: nine keep 95% of the cores busy).
FOUR = mixed(batch=41, running=4, rate=298.8, cpu=1.04, queued=0.24, batches=16)


def _after_a_jump(rate: float) -> tuple[Tuner, LoadWindow]:
    tuner, decision = decide_workers(kept(17), FOUR, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 5) and tuner.jumped
    # Nine over half a second, the cores now asked for in full (past them: 6% asked of each
    # worker judged against a measured count).
    return tuner, mixed(batch=220, running=9, rate=rate, cpu=1.80, queued=2.9, batches=150)


def test_an_add_judged_against_a_starving_loop_s_16_batches_is_kept_unless_slower() -> None:
    # 298.8 -> 308.2 (3%), under the 6% asked past the cores, but the count before was
    # measured over 16 batches only: kept. (4 -> 5 so undone set the ceiling at 4, and the
    # tuner locked at 5 after waking where 16 workers were best: 327.6 batches/s to 464.8.)
    tuner, after = _after_a_jump(308.2)
    tuner, decision = decide_workers(tuner, after, TWO_CORES)
    assert decision.move is not TuningMove.RETIRE
    assert tuner.ceiling is None and tuner.reversals == 0


def test_an_add_judged_against_a_starving_loop_s_16_batches_is_undone_if_slower() -> None:
    tuner, after = _after_a_jump(298.8 * 0.9)
    tuner, decision = decide_workers(tuner, after, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.RETIRE, 5)
    assert "over the 4% loss allowed against a short window" in decision.why
    assert tuner.ceiling == 4


# Five workers of a starving `mixed` loop over half a second, quiet (2026-11-28): the cores
# asked for in full; their windows ran from 284 to 337 batches/s.
FIVE = mixed(batch=234, running=5, rate=336.4, cpu=1.64, queued=0.77, batches=170)


def _seven_after_five() -> Tuner:
    """The tuner just after 5 -> 7 workers (asked the plain 6% past the cores)."""
    tuner, decision = decide_workers(kept(50), FIVE, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.ADD, 2)
    return tuner


def test_an_add_one_window_says_came_slower_within_its_noise_is_judged_on_one_more() -> None:
    # Recorded: 336.4 -> 327.6, 2.6% slower, undone under the 6% asked, and the tuner settled
    # at 5 for the run (305.9 batches/s, where a run that kept 7 made 411).
    seven = mixed(batch=454, running=7, rate=327.6, cpu=1.85, queued=2.60, batches=165)
    tuner, decision = decide_workers(_seven_after_five(), seven, TWO_CORES)
    assert decision.move is TuningMove.HOLD
    assert "within one window's noise: judging it over one more window" in decision.why
    assert tuner.second_look and tuner.long_window and tuner.ceiling is None


def test_an_add_whose_two_windows_pooled_bring_the_gain_asked_is_kept() -> None:
    seven = mixed(batch=454, running=7, rate=327.6, cpu=1.85, queued=2.60, batches=165)
    tuner, _ = decide_workers(_seven_after_five(), seven, TWO_CORES)
    # The next half second at 420: pooled, 373.8 a second, 11% over the count before.
    faster = mixed(batch=664, running=7, rate=420.0, cpu=1.85, queued=2.6, batches=210)
    tuner, decision = decide_workers(tuner, faster, TWO_CORES)
    # Kept: the loop still starves, and the next worker fills the cores' idle gap.
    assert decision.move is TuningMove.ADD and "did not pay" not in decision.why
    assert tuner.ceiling is None and tuner.reversals == 0


def test_an_add_one_window_says_came_slower_beyond_its_noise_is_undone_at_once() -> None:
    # 336.4 -> 310.0, 7.8% slower: more than a window wobbles, so no second look.
    seven = mixed(batch=454, running=7, rate=310.0, cpu=1.85, queued=2.60, batches=155)
    tuner, decision = decide_workers(_seven_after_five(), seven, TWO_CORES)
    assert (decision.move, decision.workers) == (TuningMove.RETIRE, 2)
    assert "workers 6-7 did not pay: 336.4 -> 310.0" in decision.why
    assert tuner.ceiling == 5 and not tuner.second_look
