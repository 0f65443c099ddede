"""The driver loop (executors/_driver.py): what it gives the sampler, and its own state between
calls, taken and put back as one value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _launch import launch

from statecore import Config, State
from statecore.executors import Driver
from statecore.executors._inline import InlineExecutor


def _epoch(driver: Driver) -> list[int]:
    got = []
    while True:
        try:
            got.append(int(driver.next()))
        except StopIteration:
            return got


def _inline_driver(size: int, draw: Callable[[State], Any]) -> Driver:
    executor = InlineExecutor(launch(torch.arange(size), 1))
    executor.start()
    return Driver(Config(num_workers=1, prefetch_factor=1, lazy=True), executor, draw, timeout=0)


@pytest.mark.timeout(60)
def test_the_sampler_is_given_the_state_each_draw_is_asked_in() -> None:
    asked: list[State] = []
    indices = iter([[2], [0], [1]])

    def draw(state: State) -> Any:
        asked.append(state)
        return next(indices)

    driver = _inline_driver(3, draw)
    driver.start_epoch()
    assert _epoch(driver) == [2, 0, 1]
    # One state per draw, the last finding the sampler's end: each one asking for that draw.
    assert len(asked) == 4
    assert all(state.drawing_for is not None for state in asked)
    driver.close()
