"""Executors launched with slots that begin retired (`Launch.started`): no worker runs in those
slots until the scheduler adds one (`replace`), and then it loads as the others do."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from _datasets import Numbers
from _launch import launch

from statecore import Config, State
from statecore.executors import Executor, Launch
from statecore.executors._driver import Driver
from statecore.executors._mp.executor import MultiprocessExecutor
from statecore.executors._thread.executor import ThreadExecutor

pytestmark = pytest.mark.timeout(120)


def _mp(start: Launch) -> MultiprocessExecutor:
    return MultiprocessExecutor(attrs.evolve(start, multiprocessing_context="fork"))


FACTORIES: list[Callable[[Launch], Executor]] = [_mp, ThreadExecutor]


def _draws(n: int) -> Callable[[State], Any]:
    indices = iter([[i] for i in range(n)])
    return lambda state: next(indices)


def _running(executor: Any) -> set[int]:
    """The slots with a live worker."""
    if isinstance(executor, MultiprocessExecutor):
        return {w for w, process in executor.processes.items() if process.is_alive()}
    return {w for w, thread in enumerate(executor.threads) if thread.is_alive()}


@pytest.mark.parametrize("factory", FACTORIES, ids=["mp", "thread"])
def test_only_the_slots_started_run_until_one_is_added(
    factory: Callable[[Launch], Executor],
) -> None:
    executor = factory(attrs.evolve(launch(Numbers(30), 3), started=1))
    executor.start()
    driver = Driver(
        Config(num_workers=3, prefetch_factor=2, started=1), executor, _draws(30), timeout=0
    )
    try:
        driver.start_epoch()
        got = [int(driver.next()) for _ in range(10)]
        assert _running(executor) == {0}
        driver.add(2)
        # An added slot takes no turn until it has started: the answers of worker 0 are taken
        # in (and kept for the consumer) until the start comes.
        while driver.state.life.workers[2].value != "active":
            driver.wait()
        assert _running(executor) == {0, 2}
        got += [int(batch) for batch in _rest(driver)]
        assert got == list(range(30))
    finally:
        driver.close()


def _rest(driver: Driver) -> list[torch.Tensor]:
    batches = []
    while True:
        try:
            batches.append(driver.next())
        except StopIteration:
            return batches


def test_a_process_executor_starts_no_process_for_a_slot_that_begins_retired() -> None:
    executor = _mp(attrs.evolve(launch(Numbers(4), 3), started=2, start_all_at_once=True))
    executor.start()
    try:
        assert set(executor.processes) == {0, 1}
        assert all(process.pid != os.getpid() for process in executor.processes.values())
    finally:
        executor.shutdown()
