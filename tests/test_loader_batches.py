"""statecore.DataLoader yields what torch.utils.data.DataLoader yields, for the same arguments.

One epoch of each row of a matrix of datasets and loader arguments, loaded by both loaders
and compared (tests/_side_by_side.py says how): with worker processes, in the main process, and
with worker threads. tests/test_loader_epochs.py runs loaders for several epochs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _datasets import (
    EveryOtherBackwards,
    GrowingBatches,
    Numbers,
    PerWorkerCounts,
    Records,
    ShardedRange,
    Unsharded,
    sum_and_items,
    tag_sample,
)
from _side_by_side import (
    QUIET,
    WORKERS,
    Kwargs,
    assert_same_as_torch,
    assert_same_multiset_as_torch,
    kw,
    multiset,
    out_of_order,
    run,
    threaded,
    with_thread_workers,
)
from torch.utils.data import BatchSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

pytestmark = QUIET

# --- the matrix ----------------------------------------------------------------------------------
# Each row: dataset, loader arguments. Rows are chosen to cover every value of every dimension
# (batch size, drop_last, shuffle, workers, prefetch) and the interesting pairs, not the product.

MAP_STYLE = [
    pytest.param(Numbers(23), kw(), id="map-defaults"),
    pytest.param(Numbers(23), kw(batch_size=3, drop_last=True), id="map-b3-drop"),
    pytest.param(Numbers(23), kw(batch_size=None), id="map-unbatched"),
    pytest.param(Numbers(23), kw(batch_size=3, shuffle=True), id="map-b3-shuffle"),
    pytest.param(Numbers(23), kw(batch_size=3, num_workers=1, prefetch_factor=1), id="map-b3-w1"),
    pytest.param(Numbers(23), kw(batch_size=3, num_workers=2), id="map-b3-w2"),
    pytest.param(Numbers(23), kw(num_workers=2, prefetch_factor=4), id="map-b1-w2-p4"),
    pytest.param(
        Numbers(23),
        kw(batch_size=3, drop_last=True, num_workers=3, prefetch_factor=3),
        id="map-b3-drop-w3-p3",
    ),
    pytest.param(
        Numbers(23),
        kw(batch_size=3, shuffle=True, num_workers=4, prefetch_factor=1),
        id="map-b3-shuffle-w4-p1",
    ),
    pytest.param(
        Numbers(23), kw(batch_size=None, shuffle=True, num_workers=2), id="map-unbatched-shuffle-w2"
    ),
    pytest.param(
        Numbers(23),
        kw(batch_size=3, shuffle=True, drop_last=True, num_workers=3),
        id="map-b3-shuffle-drop-w3",
    ),
    pytest.param(
        Numbers(23), kw(batch_size=None, num_workers=4, prefetch_factor=4), id="map-unbatched-w4-p4"
    ),
    pytest.param(Numbers(2), kw(num_workers=4), id="map-fewer-items-than-workers"),
    pytest.param(Numbers(0), kw(batch_size=3, num_workers=2), id="map-empty-w2"),
    pytest.param(Numbers(0), kw(batch_size=3), id="map-empty"),
    pytest.param(Records(11), kw(batch_size=3, num_workers=2), id="records-b3-w2"),
    pytest.param(Records(11), kw(batch_size=None), id="records-unbatched"),
    pytest.param(Numbers(23), kw(batch_size=3, timeout=60, num_workers=2), id="map-timeout-w2"),
    pytest.param(Numbers(11), kw(batch_size=3, pin_memory=True), id="map-pin-memory"),
]

CUSTOM = [
    pytest.param(Numbers(23), kw(batch_size=3, collate_fn=sum_and_items), id="collate"),
    pytest.param(
        Numbers(23),
        kw(batch_size=3, collate_fn=sum_and_items, num_workers=2, prefetch_factor=3),
        id="collate-w2",
    ),
    pytest.param(
        Numbers(23), kw(batch_size=None, collate_fn=tag_sample, num_workers=3), id="collate-unb-w3"
    ),
    pytest.param(Numbers(23), kw(sampler=[5, 3, 3, 1, 0], num_workers=2), id="list-sampler-w2"),
    pytest.param(
        Numbers(23),
        kw(sampler=EveryOtherBackwards(23), batch_size=3, num_workers=3),
        id="sampler-b3-w3",
    ),
    pytest.param(
        Numbers(23),
        kw(sampler=EveryOtherBackwards(23), batch_size=3, drop_last=True),
        id="sampler-b3-drop",
    ),
    pytest.param(
        Numbers(23),
        lambda g: {
            "sampler": RandomSampler(Numbers(23), replacement=True, num_samples=17, generator=g),
            "batch_size": 4,
            "num_workers": 2,
        },
        id="random-sampler-replacement-w2",
    ),
    pytest.param(
        Numbers(23),
        lambda g: {
            "sampler": WeightedRandomSampler(
                [float(i % 5) for i in range(23)], 20, replacement=True, generator=g
            ),
            "batch_size": 3,
            "num_workers": 1,
        },
        id="weighted-sampler-w1",
    ),
    pytest.param(
        Numbers(23),
        lambda g: {
            "sampler": SubsetRandomSampler(range(3, 20, 2), generator=g),
            "batch_size": None,
            "num_workers": 2,
        },
        id="subset-sampler-unbatched-w2",
    ),
    pytest.param(Numbers(23), kw(batch_sampler=GrowingBatches(23)), id="batch-sampler"),
    pytest.param(
        Numbers(23),
        kw(batch_sampler=GrowingBatches(23), num_workers=2, prefetch_factor=1),
        id="batch-sampler-w2-p1",
    ),
    pytest.param(
        Numbers(23),
        kw(batch_sampler=GrowingBatches(23), num_workers=4, collate_fn=sum_and_items),
        id="batch-sampler-collate-w4",
    ),
    pytest.param(
        Numbers(23),
        lambda g: {
            "batch_sampler": BatchSampler(RandomSampler(Numbers(23), generator=g), 4, True),
            "num_workers": 3,
            "prefetch_factor": 2,
        },
        id="random-batch-sampler-w3",
    ),
]

ITERABLE = [
    pytest.param(ShardedRange(23), kw(batch_size=3), id="sharded-b3"),
    pytest.param(ShardedRange(23), kw(batch_size=3, num_workers=1), id="sharded-b3-w1"),
    pytest.param(ShardedRange(23), kw(batch_size=3, num_workers=2), id="sharded-b3-w2"),
    pytest.param(ShardedRange(23), kw(num_workers=3, prefetch_factor=1), id="sharded-b1-w3-p1"),
    pytest.param(
        ShardedRange(23),
        kw(batch_size=3, drop_last=True, num_workers=4, prefetch_factor=3),
        id="sharded-b3-drop-w4-p3",
    ),
    pytest.param(ShardedRange(23), kw(batch_size=None, num_workers=2), id="sharded-unbatched-w2"),
    pytest.param(
        ShardedRange(23),
        kw(batch_size=None, num_workers=3, prefetch_factor=4),
        id="sharded-unbatched-w3-p4",
    ),
    pytest.param(
        ShardedRange(23),
        kw(batch_size=3, collate_fn=sum_and_items, num_workers=2),
        id="sharded-collate-w2",
    ),
    pytest.param(Unsharded(5), kw(batch_size=2, num_workers=2), id="unsharded-b2-w2"),
    pytest.param(PerWorkerCounts([5, 0, 9, 2]), kw(batch_size=2), id="uneven-b2"),
    pytest.param(PerWorkerCounts([5, 0, 9, 2]), kw(batch_size=2, num_workers=4), id="uneven-b2-w4"),
    pytest.param(
        PerWorkerCounts([5, 0, 9, 2]),
        kw(batch_size=None, num_workers=4, prefetch_factor=1),
        id="uneven-unbatched-w4-p1",
    ),
    pytest.param(
        PerWorkerCounts([5, 0, 9, 2]),
        kw(batch_size=3, drop_last=True, num_workers=4, prefetch_factor=2),
        id="uneven-b3-drop-w4",
    ),
    pytest.param(PerWorkerCounts([0, 7]), kw(batch_size=2, num_workers=2), id="first-empty-w2"),
    pytest.param(
        PerWorkerCounts([7, 0]), kw(num_workers=2, prefetch_factor=3), id="second-empty-w2-p3"
    ),
    pytest.param(
        PerWorkerCounts([1, 12]), kw(batch_size=3, num_workers=2, prefetch_factor=4), id="1-12-p4"
    ),
    pytest.param(PerWorkerCounts([0, 0, 0]), kw(batch_size=2, num_workers=3), id="all-empty-w3"),
]


@pytest.mark.parametrize(("dataset", "kwargs"), MAP_STYLE)
@WORKERS
def test_map_style_batches_equal_torchs(dataset: Any, kwargs: Kwargs) -> None:
    assert_same_as_torch(dataset, kwargs)


@pytest.mark.parametrize(("dataset", "kwargs"), CUSTOM)
@WORKERS
def test_custom_sampler_and_collate_batches_equal_torchs(dataset: Any, kwargs: Kwargs) -> None:
    assert_same_as_torch(dataset, kwargs)


@pytest.mark.parametrize(("dataset", "kwargs"), ITERABLE)
@WORKERS
def test_iterable_batches_equal_torchs(dataset: Any, kwargs: Kwargs) -> None:
    assert_same_as_torch(dataset, kwargs)


OUT_OF_ORDER = [
    pytest.param(Numbers(23), kw(batch_size=3, num_workers=2), id="map-b3-w2"),
    pytest.param(
        Numbers(23),
        kw(batch_size=3, shuffle=True, drop_last=True, num_workers=4, prefetch_factor=1),
        id="map-b3-shuffle-drop-w4-p1",
    ),
    pytest.param(
        Numbers(23), kw(batch_size=None, num_workers=3, prefetch_factor=4), id="map-unb-w3-p4"
    ),
    pytest.param(
        Numbers(23),
        kw(batch_sampler=GrowingBatches(23), num_workers=2, collate_fn=sum_and_items),
        id="batch-sampler-collate-w2",
    ),
    pytest.param(Numbers(23), kw(batch_size=3), id="map-b3-in-process"),
    pytest.param(ShardedRange(23), kw(batch_size=3, num_workers=3), id="sharded-b3-w3"),
    pytest.param(
        PerWorkerCounts([5, 0, 9, 2]),
        kw(batch_size=2, num_workers=4, prefetch_factor=3),
        id="uneven-b2-w4-p3",
    ),
    pytest.param(
        PerWorkerCounts([0, 7]), kw(batch_size=None, num_workers=2), id="first-empty-unb-w2"
    ),
]


@pytest.mark.parametrize(("dataset", "kwargs"), OUT_OF_ORDER)
@WORKERS
def test_out_of_order_batches_are_torchs_in_some_order(dataset: Any, kwargs: Kwargs) -> None:
    assert_same_multiset_as_torch(dataset, out_of_order(kwargs))


def test_in_process_out_of_order_loading_keeps_the_sampler_order() -> None:
    # With nothing to wait for, there is nothing to reorder: torch yields sampler order too.
    assert_same_as_torch(Numbers(23), kw(batch_size=3, shuffle=True, in_order=False))


# --- the thread executor passes the same matrix ------------------------------------------------


@pytest.mark.parametrize(("dataset", "kwargs"), with_thread_workers(MAP_STYLE + CUSTOM + ITERABLE))
@WORKERS
def test_thread_workers_hand_over_torchs_batches(dataset: Any, kwargs: Kwargs) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs, epochs=2)
    assert run(threaded, dataset, kwargs, epochs=2) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("dataset", "kwargs"), with_thread_workers(OUT_OF_ORDER))
@WORKERS
def test_thread_workers_out_of_order_hand_over_torchs_batches_in_some_order(
    dataset: Any, kwargs: Kwargs
) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, out_of_order(kwargs))
    got = run(threaded, dataset, out_of_order(kwargs))  # type: ignore[arg-type]
    assert [multiset(epoch) for epoch in got] == [multiset(epoch) for epoch in expected]
