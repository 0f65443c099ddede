"""The loader-level machine: the real DataLoader, broken, saved, resumed, interrupted and
killed, hands exactly the batches of an uninterrupted run (statecore.models.loader)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from statecore.models.loader import loader_machine, setups


@pytest.mark.timeout(300)
def test_inline_and_thread_loaders_hand_the_uninterrupted_run() -> None:
    run_state_machine_as_test(loader_machine())


@pytest.mark.timeout(300)
def test_process_loaders_hand_the_uninterrupted_run_through_worker_deaths() -> None:
    run_state_machine_as_test(
        loader_machine(setups(executors=("mp",))),
        settings=settings(settings(), max_examples=settings().max_examples // 15),
    )
