"""The loader-level machine: the real DataLoader, broken, saved, resumed, interrupted and
killed, hands exactly the batches of an uninterrupted run (statecore.models.loader)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from statecore.models.loader import Setup, loader_machine, setups


@pytest.mark.timeout(300)
def test_inline_and_thread_loaders_hand_the_uninterrupted_run() -> None:
    run_state_machine_as_test(loader_machine())


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_inline_and_thread_loaders_hold_under_the_exhaustive_budget() -> None:
    run_state_machine_as_test(loader_machine(), settings=settings.get_profile("exhaustive"))


@pytest.mark.timeout(300)
def test_process_loaders_hand_the_uninterrupted_run_through_worker_deaths() -> None:
    run_state_machine_as_test(
        loader_machine(setups(executors=("mp",))),
        settings=settings(settings(), max_examples=settings().max_examples // 15),
    )


@pytest.mark.timeout(300)
def test_a_worker_killed_once_every_iterable_worker_ran_dry_leaves_a_state_that_loads() -> None:
    # The example the machine found (whether the death is noticed before the StopIteration
    # depends on timing, so it is replayed a few times); the deterministic reproductions are in
    # tests/test_checkpoint_iterable.py and tests/test_step_checkpoint.py.
    setup = Setup(
        executor="mp",
        workers=2,
        dataset="iterable",
        counts=(5, 0),
        batch_size=3,
        generator=True,
        persistent=True,
        in_order=False,
        seed=297,
    )
    for _ in range(3):
        machine = loader_machine()()
        machine.start(setup)
        try:
            machine.starts_an_epoch()
            machine.loses_a_worker(1)
            machine.starts_an_epoch()
            machine.is_interrupted_in_next()
            machine.loses_a_worker(2)
            assert machine.record.seen == (([0, 1, 2], [3, 4]), ([0, 1, 2], [3, 4]), ())
        finally:
            machine.teardown()
