"""The loader machine (statecore.models.loader) on the edges of dry iterable workers past a
resumed epoch: `dry_setups` draws persistent workers with one short part beside longer ones,
over datasets that count their epochs as their parts run dry or go back to their start, so that
a state taken with a worker dry, the resumed epoch, the epoch after it and a worker killed
after its part ran dry come within a few of the machine's steps.

The default tier replays the machine's steps to one such edge and draws a few examples over
threads; the exhaustive tier lets the machine draw more, over worker processes too (60
examples of those found the replaced worker one epoch count behind before `RanDry`; the same
budget passes now).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from statecore.models.loader import RESTARTS, Setup, dry_setups, loader_machine


@pytest.mark.timeout(300)
def test_a_worker_the_resumed_state_found_dry_killed_in_the_next_epoch_hands_the_run() -> None:
    # Worker 0's one batch is found dry before the third batch; the state saved there is
    # resumed, its epoch run out, and worker 0 killed as the next epoch starts: its
    # replacement must count the epoch its part ran through in the resumed one.
    setup = Setup(
        executor="mp",
        workers=2,
        dataset="counting-epochs",
        counts=(2, 7),
        batch_size=2,
        persistent=True,
        restarts=RESTARTS,
    )
    machine = loader_machine(replacing=True)()
    machine.start(setup)
    try:
        for _ in range(3):
            machine.asks_for_a_batch()
        machine.saves(through_json=False)
        machine.restarts_from_its_save()
        for _ in range(3):  # the resumed epoch's two batches left, and its end
            machine.asks_for_a_batch()
        machine.starts_an_epoch()
        machine.a_worker_is_killed_and_replaced(0, saves="never", resumes=False)
        for _ in range(11):  # the rest of that epoch and the next, with their ends
            machine.asks_for_a_batch()
        machine.handed_what_the_uninterrupted_run_hands()
        assert machine.record.ended == {0, 1, 2}
    finally:
        machine.teardown()


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_process_loaders_with_dry_workers_hand_the_uninterrupted_run() -> None:
    run_state_machine_as_test(
        loader_machine(dry_setups(), replacing=True),
        settings=settings(settings.get_profile("exhaustive"), max_examples=60),
    )


# Threads are cheap: a few examples in the default tier (about 3 s), more in the exhaustive.
@pytest.mark.timeout(300)
def test_thread_loaders_with_dry_workers_hand_the_uninterrupted_run() -> None:
    run_state_machine_as_test(
        loader_machine(dry_setups(executors=("thread",))),
        settings=settings(settings(), max_examples=15),
    )


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
def test_thread_loaders_with_dry_workers_hold_under_a_larger_budget() -> None:
    run_state_machine_as_test(
        loader_machine(dry_setups(executors=("thread",))),
        settings=settings(settings.get_profile("exhaustive"), max_examples=200),
    )
