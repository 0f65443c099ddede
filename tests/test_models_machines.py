"""The Hypothesis state machines check the real core, and take any step function."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from statecore import Config, Event, State, Transition, step
from statecore.models.machines import scenarios, scheduler_machine
from statecore.models.reference import IterableSpec, MapSpec
from statecore.models.world import Scenario

# The real core, under the profile's example budget (derandomized in CI).
TestSchedulerAgainstTheModels = scheduler_machine().TestCase


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_the_real_core_holds_under_the_exhaustive_budget() -> None:
    run_state_machine_as_test(scheduler_machine(), settings=settings.get_profile("exhaustive"))


def test_a_replacement_is_sent_again_the_tasks_its_worker_held_before_the_bound_was_lowered() -> (
    None
):
    # Found by the exhaustive budget: one worker holding two tasks under prefetch 2, the bound
    # lowered to 1 (nothing sent is cancelled), the worker dies; its replacement is sent both
    # lost tasks again. Both were sent under the old bound, so the world lets it hold them, as
    # the core's invariant does (`Lifecycle.lowered_at`); new tasks keep within the new bound.
    config = Config(num_workers=1, prefetch_factor=2, persistent_workers=True, restarts=1)
    scenario = Scenario(config, MapSpec(batches=2), deaths=1, prefetches=1)
    machine = scheduler_machine()()
    machine.start(scenario=scenario)
    machine.tuner_changes_the_prefetch_bound(choice=0)
    machine.worker_dies(choice=0)
    machine.consumer_asks()
    machine.worker_answers(choice=0)
    machine.teardown()


def test_the_machine_runs_a_step_function_it_is_given() -> None:
    calls: list[type] = []

    def counting(state: State, event: Event) -> Transition:
        calls.append(type(event))
        return step(state, event)

    one = Scenario(Config(num_workers=1), MapSpec(2))
    machine = scheduler_machine(st.just(one), step=counting)
    run_state_machine_as_test(machine, settings=settings(max_examples=3))
    assert calls  # every event of every run went through the given function


@given(scenarios())
def test_drawn_scenarios_are_consistent(scenario: Scenario) -> None:
    config = scenario.config
    assert config.iterable == isinstance(scenario.dataset, IterableSpec)
    if isinstance(scenario.dataset, IterableSpec):
        assert len(scenario.dataset.lengths) == config.num_workers
    else:
        assert isinstance(scenario.dataset, MapSpec)
    assert scenario.epochs == 1 or config.persistent_workers
