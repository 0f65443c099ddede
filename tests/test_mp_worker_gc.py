"""A spawned worker freezes what it inherits, so that garbage collection never walks torch again.

Checked from inside real workers: the dataset's item is `gc.get_freeze_count()` in the worker
that loads it. A full collection over torch's objects costs a spawned worker about 90 ms of
its start-up; freezing them is for spawned workers only, since a user's main process decides
about its own garbage collector.
"""

from __future__ import annotations

import gc

import pytest
from torch.utils.data import Dataset

import statecore


class FrozenObjects(Dataset[int]):
    """Item: how many objects the garbage collector of the loading process has frozen."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        return gc.get_freeze_count()


def frozen_in_a_worker(context: str) -> int:
    loader = statecore.DataLoader(
        FrozenObjects(),
        batch_size=None,
        num_workers=1,
        executor="mp",
        multiprocessing_context=context,
    )
    (frozen,) = list(loader)
    return int(frozen)


@pytest.mark.timeout(180)
def test_a_spawned_worker_starts_with_the_objects_of_its_imports_frozen() -> None:
    assert frozen_in_a_worker("spawn") > 10_000  # torch alone makes far more objects than that


@pytest.mark.timeout(120)
def test_starting_workers_freezes_nothing_in_the_main_process() -> None:
    before = gc.get_freeze_count()
    frozen_in_a_worker("spawn")
    assert gc.get_freeze_count() == before


@pytest.mark.timeout(120)
def test_a_forked_worker_freezes_nothing_of_its_own() -> None:
    assert frozen_in_a_worker("fork") == gc.get_freeze_count()
