"""Epoch after epoch, statecore.DataLoader yields what torch's yields for the same arguments.

Several epochs of one loader, with fresh or persistent workers, after an abandoned epoch, and
with a distributed sampler that reshuffles each epoch; compared as tests/_side_by_side.py says.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _datasets import Numbers, PerWorkerCounts, RandomDraws, ShardedRange
from _side_by_side import (
    QUIET,
    WORKERS,
    Kwargs,
    as_lists,
    assert_same_as_torch,
    assert_same_multiset_as_torch,
    kw,
    out_of_order,
    release,
    run,
    threaded,
    with_thread_workers,
)

import statecore

pytestmark = QUIET

EPOCHS = [
    pytest.param(
        Numbers(23),
        kw(batch_size=3, shuffle=True, num_workers=2, persistent_workers=True),
        id="map-shuffle-w2-persistent",
    ),
    pytest.param(
        Numbers(23),
        kw(batch_size=3, shuffle=True, num_workers=2),
        id="map-shuffle-w2-fresh-workers",
    ),
    pytest.param(Numbers(23), kw(batch_size=3, shuffle=True), id="map-shuffle-in-process"),
    pytest.param(
        ShardedRange(23),
        kw(batch_size=3, num_workers=3, prefetch_factor=1, persistent_workers=True),
        id="sharded-w3-p1-persistent",
    ),
    pytest.param(
        PerWorkerCounts([5, 0, 9, 2]),
        kw(batch_size=2, num_workers=4, persistent_workers=True),
        id="uneven-w4-persistent",
    ),
    pytest.param(
        RandomDraws(9),
        kw(batch_size=None, shuffle=True, num_workers=3, persistent_workers=True),
        id="random-draws-w3-persistent",
    ),
    pytest.param(
        RandomDraws(9),
        kw(batch_size=None, shuffle=True, num_workers=3),
        id="random-draws-w3-fresh-workers",
    ),
]


@pytest.mark.parametrize(("dataset", "kwargs"), EPOCHS)
@WORKERS
def test_three_epochs_equal_torchs(dataset: Any, kwargs: Kwargs) -> None:
    assert_same_as_torch(dataset, kwargs, epochs=3)


@pytest.mark.parametrize(
    ("dataset", "kwargs"),
    [
        pytest.param(
            Numbers(23),
            kw(batch_size=2, shuffle=True, num_workers=2, persistent_workers=True),
            id="map-shuffle-w2",
        ),
        pytest.param(
            PerWorkerCounts([5, 0, 9, 2]),
            kw(batch_size=2, num_workers=4, prefetch_factor=3, persistent_workers=True),
            id="uneven-w4-p3",
        ),
    ],
)
@WORKERS
def test_epochs_after_an_abandoned_epoch_equal_torchs(dataset: Any, kwargs: Kwargs) -> None:
    assert_same_as_torch(dataset, kwargs, epochs=3, stop_after={0: 2})


@pytest.mark.parametrize(
    ("dataset", "kwargs"),
    [
        pytest.param(
            Numbers(23),
            kw(batch_size=3, shuffle=True, num_workers=3, persistent_workers=True),
            id="map-shuffle-w3",
        ),
        pytest.param(
            PerWorkerCounts([5, 0, 9, 2]),
            kw(batch_size=2, num_workers=4, persistent_workers=True),
            id="uneven-w4",
        ),
    ],
)
@WORKERS
def test_out_of_order_persistent_epochs_are_torchs_in_some_order(
    dataset: Any, kwargs: Kwargs
) -> None:
    assert_same_multiset_as_torch(dataset, out_of_order(kwargs), epochs=3)


# --- distributed sampling ------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("workers", [0, 2])
@WORKERS
def test_a_distributed_sampler_shards_and_reshuffles_each_epoch_like_torchs(
    rank: int, workers: int
) -> None:
    def epochs(loader_class: type) -> list[list[Any]]:
        sampler = torch.utils.data.DistributedSampler(
            Numbers(23), num_replicas=2, rank=rank, shuffle=True, seed=7
        )
        loader = loader_class(
            Numbers(23),
            batch_size=3,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
        result = []
        try:
            for epoch in range(3):
                sampler.set_epoch(epoch)
                result.append([as_lists(batch) for batch in loader])
        finally:
            release(loader)
        return result

    expected = epochs(torch.utils.data.DataLoader)
    assert expected[0] != expected[1]  # set_epoch reshuffles
    assert epochs(statecore.DataLoader) == expected


# --- the thread executor passes the same epochs ------------------------------------------------


@pytest.mark.parametrize(("dataset", "kwargs"), with_thread_workers(EPOCHS))
@WORKERS
def test_thread_workers_hand_over_torchs_epochs(dataset: Any, kwargs: Kwargs) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs, epochs=2)
    assert run(threaded, dataset, kwargs, epochs=2) == expected  # type: ignore[arg-type]
