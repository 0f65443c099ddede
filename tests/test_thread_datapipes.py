"""Datapipes with a `sharding_filter` are sharded as torch shards them, by every executor.

torch's worker processes call `apply_sharding(datapipe, num_workers, worker_id)` on their copy
of the datapipe before `worker_init_fn`, and its single-process iterator shards the datapipe as
one instance. Without that, N workers each hand over every item. The thread workers need a
datapipe of their own as well: one datapipe allows one live iterator, and the sharding is state
inside its graph.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.graph_settings import apply_sharding

import statecore

# IterDataPipe is deprecated in some torch versions; its warnings are not what is tested here.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def shuffled_and_sharded() -> Any:
    return IterableWrapper(range(23)).shuffle().sharding_filter()


def epochs(make: Any, datapipe: Any, count: int, **options: Any) -> list[list[list[int]]]:
    loader = make(datapipe, batch_size=3, generator=torch.Generator().manual_seed(7), **options)
    return [[batch.tolist() for batch in loader] for _ in range(count)]


def all_items(result: list[list[list[int]]]) -> list[int]:
    return sorted(item for epoch in result for batch in epoch for item in batch)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", ["mp", "thread"])
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_shard_a_datapipe_and_give_torchs_batches(executor: str, workers: int) -> None:
    expected = epochs(torch.utils.data.DataLoader, shuffled_and_sharded(), 2, num_workers=workers)
    assert all_items(expected) == sorted(list(range(23)) * 2)  # each item once per epoch
    got = epochs(
        statecore.DataLoader, shuffled_and_sharded(), 2, num_workers=workers, executor=executor
    )
    assert got == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", ["mp", "thread"])
def test_persistent_workers_keep_their_shards_after_a_resume(executor: str) -> None:
    options: dict[str, Any] = {"num_workers": 2, "persistent_workers": True}
    expected = epochs(torch.utils.data.DataLoader, shuffled_and_sharded(), 3, **options)
    got = epochs(statecore.DataLoader, shuffled_and_sharded(), 3, executor=executor, **options)
    assert got == expected


def test_a_datapipe_loaded_in_process_is_sharded_as_one_instance_as_torch() -> None:
    # torch's single-process iterator shards the datapipe as instance 0 of 1 (of the
    # distributed world), undoing a sharding applied to it before.
    # (Unshuffled: the shuffle order in process is another matter than sharding.)
    def sharded_by_hand() -> Any:
        datapipe = IterableWrapper(range(23)).sharding_filter()
        apply_sharding(datapipe, 2, 1)
        return datapipe

    expected = epochs(torch.utils.data.DataLoader, sharded_by_hand(), 1)
    assert all_items(expected) == list(range(23))
    assert epochs(statecore.DataLoader, sharded_by_hand(), 1) == expected
