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


# --- defect 4: a sampler that yields more than its len() ---------------------------------------


class LongerThanItSays(torch.utils.data.Sampler[int]):
    """Yields 0..11 and says it has 5: torch iterates such a sampler to its end."""

    def __iter__(self) -> Any:
        return iter(range(12))

    def __len__(self) -> int:
        return 5


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_sampler_longer_than_its_len_resumes_what_it_has_left(
    executor: str, workers: int
) -> None:
    def build() -> DataLoader[Any]:
        return DataLoader(
            Numbers(20), sampler=LongerThanItSays(), executor=executor, num_workers=workers
        )

    original = build()
    iterator = iter(original)
    for _ in range(len(original)):  # every batch len() promised, and the sampler has more
        next(iterator)
    state = roundtrip(original.state_dict())
    assert state["complete"] is False
    resumed = build()
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == [[i] for i in range(5, 12)]


# --- torchdata's end of an epoch ----------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_state_taken_at_the_last_batch_ends_that_epoch_empty_with_a_warning(
    executor: str, workers: int
) -> None:
    original = shuffled(executor, workers)
    for _ in original:
        state = roundtrip(original.state_dict())  # the last one: after the last batch
    second = run_to_end(iter(original))

    resumed = shuffled(executor, workers, generator=seeded(1))
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="yields no batch"):
        assert run_to_end(iter(resumed)) == []
    assert run_to_end(iter(resumed)) == second


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_state_taken_after_the_for_loop_resumes_the_next_epoch_in_full(
    executor: str, workers: int
) -> None:
    original = shuffled(executor, workers)
    run_to_end(iter(original))
    state = roundtrip(original.state_dict())
    second = run_to_end(iter(original))
    resumed = shuffled(executor, workers, generator=seeded(1))
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == second
