"""Checkpoints at the edges of an iterator's life: after `break`, at an epoch's end, after a
resume, in a pickled loader.

Each test compares a resumed loader with an uninterrupted run of the same configuration.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _checkpoints import roundtrip, run_to_end
from _datasets import Numbers
from _side_by_side import WORKERS

from statecore import DataLoader

RUNS = [
    pytest.param("inline", 0, id="inline"),
    pytest.param("mp", 2, id="mp-2"),
]


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def shuffled(executor: str, workers: int, **options: Any) -> DataLoader[Any]:
    options.setdefault("generator", seeded())
    return DataLoader(
        Numbers(20), batch_size=2, shuffle=True, executor=executor, num_workers=workers, **options
    )


# --- defect 1: break, then save -----------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_state_taken_after_break_resumes_the_rest_of_the_epoch(
    executor: str, workers: int
) -> None:
    whole = run_to_end(iter(shuffled(executor, workers)))
    original = shuffled(executor, workers)
    for step, _ in enumerate(original):
        if step == 3:
            break
    # The for loop's iterator is unreferenced now; the state still describes its epoch.
    state = roundtrip(original.state_dict())
    resumed = shuffled(executor, workers, generator=seeded(99))
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == whole[4:]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_new_iter_replaces_the_dropped_iterators_position(executor: str, workers: int) -> None:
    original = shuffled(executor, workers)
    for step, _ in enumerate(original):
        if step == 3:
            break
    iterator = iter(original)
    next(iterator)
    assert original.state_dict()["progress"]["done"] == 1
