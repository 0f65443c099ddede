"""The loader-level machine: the real DataLoader, broken, saved, resumed, interrupted and
killed, hands exactly the batches of an uninterrupted run (statecore.models.loader)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from statecore.models.loader import RESTARTS, Setup, loader_machine, setups


@pytest.mark.timeout(300)
def test_inline_and_thread_loaders_hand_the_uninterrupted_run() -> None:
    run_state_machine_as_test(loader_machine())


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_inline_and_thread_loaders_hold_under_the_exhaustive_budget() -> None:
    run_state_machine_as_test(loader_machine(), settings=settings.get_profile("exhaustive"))


# Each example starts and kills worker processes: the default tier draws 5 (a thirtieth of the
# ci profile's budget), the exhaustive tier 15 (a twentieth of its profile's).
@pytest.mark.timeout(300)
def test_process_loaders_hand_the_uninterrupted_run_through_worker_deaths() -> None:
    run_state_machine_as_test(
        loader_machine(setups(executors=("mp",)), replacing=True),
        settings=settings(settings(), max_examples=settings().max_examples // 30),
    )


@pytest.mark.exhaustive
@pytest.mark.timeout(600)
def test_process_loaders_hold_through_worker_deaths_under_a_larger_budget() -> None:
    exhaustive = settings.get_profile("exhaustive")
    run_state_machine_as_test(
        loader_machine(setups(executors=("mp",)), replacing=True),
        settings=settings(exhaustive, max_examples=exhaustive.max_examples // 20),
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


@pytest.mark.timeout(300)
def test_a_persistent_worker_killed_between_epochs_is_replaced_with_its_state() -> None:
    # The machine's kill-and-restart rule, once: a stateful map-style dataset's worker killed
    # after the epoch's last batch was handed over, found dead as the next epoch begins, before
    # answering anything of it. Its replacement draws on from where the lost worker's state
    # stood, and a state taken right after the kill resumes the same. Whichever epoch notices
    # the death, the batches are the uninterrupted run's.
    setup = Setup(
        executor="mp",
        workers=2,
        dataset="stateful-map",
        counts=(6,),
        batch_size=1,
        persistent=True,
        restarts=RESTARTS,
    )
    machine = loader_machine(replacing=True)()
    machine.start(setup)
    try:
        for _ in range(6):
            machine.asks_for_a_batch()
        machine.a_worker_is_killed_and_replaced(0, saves="killed", resumes=False)
        for _ in range(7):
            machine.asks_for_a_batch()
        machine.handed_what_the_uninterrupted_run_hands()
        assert machine.record.ended == {0, 1}
        machine.restarts_from_its_save()
        # The state was taken before the first epoch's StopIteration: that comes first.
        for _ in range(8):
            machine.asks_for_a_batch()
        machine.handed_what_the_uninterrupted_run_hands()
        assert machine.record.ended == {0, 1}
    finally:
        machine.teardown()
