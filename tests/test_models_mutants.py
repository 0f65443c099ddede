"""The checkers can fail: every deliberate bug is caught by the explorer and by Hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from statecore import Config, step
from statecore.models.explorer import default_scenarios, explore
from statecore.models.machines import scheduler_machine
from statecore.models.mutants import MUTANTS, Mutant
from statecore.models.reference import MapSpec
from statecore.models.world import Scenario, Violation


def test_there_are_at_least_five_deliberate_bugs() -> None:
    assert len(MUTANTS) >= 5
    assert len({mutant.name for mutant in MUTANTS}) == len(MUTANTS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_explorer_catches(mutant: Mutant) -> None:
    with mutant.applied():
        caught = next(
            (report for report in map(explore, default_scenarios()) if not report.ok), None
        )
    assert caught is not None, f"the explorer missed: {mutant.description}"
    assert caught.violation


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_hypothesis_machine_catches(mutant: Mutant) -> None:
    # Finding the bug is the point here; shrinking it to the smallest example is not. Random
    # search finds each of these within a few hundred runs (measured over many seeds), so a
    # budget of thousands keeps the test independent of the Hypothesis version's choices.
    no_shrinking = settings(settings(), max_examples=3000, phases=[Phase.explicit, Phase.generate])
    with mutant.applied(), pytest.raises((Violation, ExceptionGroup)) as caught:
        run_state_machine_as_test(scheduler_machine(), settings=no_shrinking)
    if isinstance(caught.value, ExceptionGroup):
        assert all(isinstance(e, Violation) for e in caught.value.exceptions)


def test_a_mutant_is_removed_when_its_block_ends() -> None:
    before = step.__code__
    scenario = Scenario(Config(num_workers=2, prefetch_factor=1), MapSpec(4))
    for mutant in MUTANTS:
        with mutant.applied():
            pass
    assert explore(scenario).ok
    assert step.__code__ is before
