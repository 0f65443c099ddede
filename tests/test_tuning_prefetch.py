"""The prefetch policy of `prefetch_factor="auto"` (statecore._tuning.decide_prefetch), alone:
traces of figures in, decisions out, no loader and no clock. The traces come from a small model
of an in-order loader behind slow batches: with a shallow bound the workers answer what they
hold and sit idle while the loop waits on the slow one; each task more per worker covers more
of the wait."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore._tuning import (
    LoadWindow,
    PrefetchBudget,
    PrefetchDecision,
    PrefetchTuner,
    TuningMove,
    decide_prefetch,
    prefetch_change_bound,
)

BATCHES = 16
RAISE, LOWER, HOLD = TuningMove.RAISE_PREFETCH, TuningMove.LOWER_PREFETCH, TuningMove.HOLD


@attrs.frozen
class Stragglers:
    """Workers that make a batch in `load` seconds but sit idle behind slow batches until the
    bound reaches `covers` tasks per worker; the loop uses a batch in `step` seconds."""

    load: float = 0.004
    step: float = 0.001
    running: int = 4
    covers: int = 8

    def window(self, prefetch: int, batch: int, noise: float = 0.0) -> LoadWindow:
        busy = min(prefetch / self.covers, 1.0)
        rate = min(self.running / self.load * busy, 1 / self.step)
        seconds = BATCHES / rate * (1 + noise)
        return LoadWindow(
            batch=batch,
            batches=BATCHES,
            seconds=seconds,
            waited=max(seconds - BATCHES * self.step, 0.0),
            longest_gap=self.step,
            busy=busy,
            running=self.running,
        )


def _window(wait: float, busy: float, batch: int = 100, seconds: float = 1.0) -> LoadWindow:
    return LoadWindow(
        batch=batch,
        batches=BATCHES,
        seconds=seconds,
        waited=wait * seconds,
        longest_gap=0.01,
        busy=busy,
        running=4,
    )


START = PrefetchTuner(2)


def _decide(
    window: LoadWindow, tuner: PrefetchTuner = START, most: int = 16, **budget: bool
) -> tuple[PrefetchTuner, PrefetchDecision]:
    return decide_prefetch(tuner, window, PrefetchBudget(most, **budget))


def _run(
    model: Stragglers, windows: int = 30, most: int = 16, noise: list[float] | None = None
) -> list[int]:
    """The bound after each window, starting from 2."""
    tuner, bounds, batch = PrefetchTuner(2), [], 0
    for i in range(windows):
        batch += BATCHES + 8  # each window begins after any cool-down, as the loader's does
        jitter = noise[i % len(noise)] if noise else 0.0
        tuner, _ = decide_prefetch(
            tuner, model.window(tuner.prefetch, batch, jitter), PrefetchBudget(most)
        )
        bounds.append(tuner.prefetch)
    return bounds


def test_a_starving_loop_with_idle_workers_doubles_the_bound() -> None:
    _, decision = _decide(_window(wait=0.8, busy=0.3))
    assert (decision.move, decision.prefetch) == (RAISE, 4)


def test_a_loop_waiting_a_little_with_idle_workers_gets_one_task_more_per_worker() -> None:
    _, decision = _decide(_window(wait=0.3, busy=0.3))
    assert (decision.move, decision.prefetch) == (RAISE, 3)


def test_no_raise_while_the_workers_are_busy() -> None:
    # The loop waits on workers that are working: more room would not make them faster.
    _, decision = _decide(_window(wait=0.8, busy=0.9))
    assert decision.move is HOLD and "busy 90%" in decision.why


def test_no_raise_while_the_loop_does_not_wait() -> None:
    _, decision = _decide(_window(wait=0.05, busy=0.1))
    assert decision.move is HOLD


def test_the_bound_is_never_raised_past_the_deepest_allowed() -> None:
    _, decision = _decide(_window(wait=0.8, busy=0.1), PrefetchTuner(6), most=8)
    assert decision.prefetch == 8
    _, decision = _decide(_window(wait=0.8, busy=0.1), PrefetchTuner(8), most=8)
    assert decision.move is HOLD


def test_a_raise_that_did_not_pay_while_the_loop_waits_is_the_last() -> None:
    tuner, _ = _decide(_window(wait=0.8, busy=0.3, batch=100))
    # As fast as before, still waiting: 4 becomes the ceiling, and no raise follows.
    tuner, decision = _decide(_window(wait=0.8, busy=0.3, batch=200), tuner)
    assert (decision.move, tuner.ceiling) == (HOLD, 4)
    assert "did not pay" in decision.why
    _, decision = _decide(_window(wait=0.8, busy=0.3, batch=300), tuner)
    assert decision.move is HOLD


def test_a_raise_that_made_batches_faster_is_followed_by_another() -> None:
    tuner, _ = _decide(_window(wait=0.8, busy=0.3, batch=100, seconds=1.0))
    tuner, decision = _decide(_window(wait=0.6, busy=0.3, batch=200, seconds=0.5), tuner)
    assert (decision.move, decision.prefetch) == (RAISE, 8)


def test_memory_as_the_budget_lowers_the_bound_by_one() -> None:
    tuner, decision = _decide(_window(wait=0.8, busy=0.3), PrefetchTuner(4), memory_spent=True)
    assert (decision.move, decision.prefetch, tuner.ceiling) == (LOWER, 3, 3)


def test_a_bound_lowered_for_memory_is_not_raised_again() -> None:
    tuner, _ = _decide(_window(wait=0.8, busy=0.3), PrefetchTuner(4), memory_spent=True)
    tuner, decision = _decide(_window(wait=0.8, busy=0.3, batch=200), tuner)
    assert decision.move is HOLD and tuner.prefetch == 3


def test_memory_as_the_budget_leaves_a_bound_of_one_alone() -> None:
    _, decision = _decide(_window(wait=0.8, busy=0.3), PrefetchTuner(1), memory_spent=True)
    assert decision.move is HOLD


def test_no_decision_is_taken_on_a_window_that_began_within_the_cooldown() -> None:
    tuner, _ = _decide(_window(wait=0.8, busy=0.3, batch=100))
    # Began at batch 104 (120 - 16), within 8 batches of the change at 100.
    _, decision = _decide(_window(wait=0.8, busy=0.3, batch=120), tuner)
    assert decision.move is HOLD and "cooling down" in decision.why


def test_a_window_in_which_the_loop_paused_changes_nothing() -> None:
    paused = attrs.evolve(_window(wait=0.8, busy=0.3), longest_gap=0.9)
    _, decision = _decide(paused)
    assert decision.move is HOLD and "paused" in decision.why


def test_a_loop_behind_slow_batches_gets_the_depth_that_covers_them_and_keeps_it() -> None:
    bounds = _run(Stragglers(covers=8))
    assert bounds[-1] == 8
    assert bounds[-10:] == [8] * 10


def test_a_loop_with_busy_workers_keeps_the_bound_it_started_with() -> None:
    # Covered from the start (the workers are busy at 2): the workers, not the room, are short.
    assert set(_run(Stragglers(covers=2, running=1))) == {2}


@settings(max_examples=60, deadline=None)
@given(
    noise=st.lists(st.floats(-0.3, 0.3), min_size=1, max_size=8),
    covers=st.integers(1, 20),
    most=st.integers(1, 12),
)
def test_under_any_bounded_noise_the_number_of_changes_is_bounded(
    noise: list[float], covers: int, most: int
) -> None:
    tuner, batch = PrefetchTuner(min(2, most)), 0
    model = Stragglers(covers=covers)
    for i in range(200):
        batch += BATCHES + 8
        spent = i % 7 == 3  # memory comes and goes
        window = model.window(tuner.prefetch, batch, noise[i % len(noise)])
        tuner, _ = decide_prefetch(tuner, window, PrefetchBudget(most, spent))
        assert 1 <= tuner.prefetch <= max(most, 2)
    assert tuner.changes <= prefetch_change_bound(max(most, 2))
