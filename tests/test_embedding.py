"""docs/embedding.md's asyncio driver works as written: the scheduler without our DataLoader."""

from __future__ import annotations

import asyncio
import random
import re
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


@pytest.fixture(scope="module")
def driver() -> types.ModuleType:
    code = re.search(r"```python\n(\"\"\"An asyncio driver.*?)```", GUIDE.read_text(), re.S)
    assert code is not None, "the guide's driver is missing"
    module = types.ModuleType("embedding_example")
    exec(compile(code.group(1), str(GUIDE), "exec"), module.__dict__)
    return module


def shuffled_fetch(seed: int, failing: object = None) -> Callable[[object], Awaitable[object]]:
    """Fetches that finish in a seeded random order: each yields to the loop a few times."""
    rng = random.Random(seed)

    async def fetch(index: object) -> object:
        for _ in range(rng.randrange(6)):
            await asyncio.sleep(0)
        if index == failing:
            raise LookupError(f"no sample {index}")
        return index

    return fetch


def collect(driver: types.ModuleType, fetch: Any, **options: Any) -> list[object]:
    async def run() -> list[object]:
        return [batch async for batch in driver.stream(fetch, range(30), **options)]

    return asyncio.run(run())


@pytest.mark.parametrize("seed", range(5))
def test_in_order_results_come_in_sampler_order(driver: types.ModuleType, seed: int) -> None:
    assert collect(driver, shuffled_fetch(seed), slots=3, prefetch=2) == list(range(30))


@pytest.mark.parametrize("seed", range(5))
def test_out_of_order_results_are_each_index_once(driver: types.ModuleType, seed: int) -> None:
    got = collect(driver, shuffled_fetch(seed), slots=3, prefetch=2, in_order=False)
    assert sorted(got) == list(range(30))  # type: ignore[type-var]


def test_at_most_slots_times_prefetch_fetches_are_in_flight(driver: types.ModuleType) -> None:
    in_flight, most = 0, 0

    async def fetch(index: object) -> object:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        for _ in range(3):
            await asyncio.sleep(0)
        in_flight -= 1
        return index

    assert collect(driver, fetch, slots=3, prefetch=2) == list(range(30))
    assert most <= 6


def test_a_failed_fetch_raises_its_own_error_in_its_turn(driver: types.ModuleType) -> None:
    got: list[object] = []

    async def run() -> None:
        async for batch in driver.stream(shuffled_fetch(1, failing=7), range(30), slots=3):
            got.append(batch)

    with pytest.raises(LookupError, match="no sample 7"):
        asyncio.run(run())
    assert got == list(range(7))


def test_breaking_out_cancels_the_fetches_in_flight(driver: types.ModuleType) -> None:
    async def run() -> int:
        batches = driver.stream(shuffled_fetch(2), range(30), slots=3)
        async for batch in batches:
            if batch == 4:
                break
        await batches.aclose()
        await asyncio.sleep(0)
        return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

    assert asyncio.run(run()) == 0
