"""statecore.DataLoader yields what torch.utils.data.DataLoader yields, for the same arguments.

Each test builds a torch loader and a statecore loader from the same arguments (with a fresh,
identically seeded generator each), runs both, and compares the batches as nested Python
lists: exactly, in order, for in_order=True; as a multiset for in_order=False.
"""

from __future__ import annotations

import os
import pickle
import random
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
import torch.utils.data
from _datasets import (
    BadSample,
    BlocksAt,
    BrokenSampler,
    EveryOtherBackwards,
    ExitsAt,
    FailsAt,
    GrowingBatches,
    InitDraws,
    LoggingSampler,
    Numbers,
    PerWorkerCounts,
    RaisesBadSample,
    RandomDraws,
    Records,
    ShardedRange,
    ThreadCounts,
    Unsharded,
    WorkerPids,
    failing_init,
    record_init_draws,
    sum_and_items,
    tag_sample,
)
from torch.utils.data import (
    BatchSampler,
    Dataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import statecore
from statecore.executors._loader import _Iterator as StatecoreIterator

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
    pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning"),
]

SEED = 20240611
WORKERS = pytest.mark.timeout(120)

Kwargs = Callable[[torch.Generator], dict[str, Any]]


# --- helpers -------------------------------------------------------------------------------------


def as_lists(value: Any) -> Any:
    """A batch as nested Python values: tensors and arrays become lists, tuples become lists."""
    if isinstance(value, torch.Tensor | numpy.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {key: as_lists(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [as_lists(item) for item in value]
    return value


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def run(
    loader_class: type[torch.utils.data.DataLoader],  # type: ignore[type-arg]
    dataset: Any,
    kwargs: Kwargs,
    epochs: int = 1,
    stop_after: dict[int, int] | None = None,
) -> list[list[Any]]:
    """Every epoch's batches as nested lists; `stop_after` maps an epoch to where it breaks off."""
    loader = loader_class(dataset, **kwargs(generator()))
    stop_after = stop_after or {}
    result = []
    try:
        for epoch in range(epochs):
            batches = []
            for batch in loader:
                batches.append(as_lists(batch))
                if len(batches) == stop_after.get(epoch):
                    break
            result.append(batches)
    finally:
        release(loader)
    return result


def release(loader: torch.utils.data.DataLoader) -> None:  # type: ignore[type-arg]
    """Stop a loader's persistent workers now rather than when the loader is collected."""
    if loader._iterator is not None:
        close(loader._iterator)


def close(iterator: Any) -> None:
    """Stop an iterator's workers now, for the tests that keep an iterator alive on purpose."""
    if isinstance(iterator, torch.utils.data.dataloader._MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()
    elif isinstance(iterator, StatecoreIterator):
        iterator._shutdown()


def multiset(batches: list[Any]) -> Counter[str]:
    return Counter(repr(batch) for batch in batches)


def kw(**fixed: Any) -> Kwargs:
    """Loader arguments; `shuffle=True` also passes the fresh generator."""

    def make(gen: torch.Generator) -> dict[str, Any]:
        made = dict(fixed)
        if made.get("shuffle"):
            made["generator"] = gen
        return made

    return make


def assert_same_as_torch(dataset: Any, kwargs: Kwargs, epochs: int = 1, **options: Any) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs, epochs, **options)
    got = run(statecore.DataLoader, dataset, kwargs, epochs, **options)
    assert got == expected


def assert_same_multiset_as_torch(dataset: Any, kwargs: Kwargs, epochs: int = 1) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs, epochs)
    got = run(statecore.DataLoader, dataset, kwargs, epochs)
    assert [multiset(epoch) for epoch in got] == [multiset(epoch) for epoch in expected]


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
    def unordered(gen: torch.Generator) -> dict[str, Any]:
        return {**kwargs(gen), "in_order": False}

    assert_same_multiset_as_torch(dataset, unordered)


def test_in_process_out_of_order_loading_keeps_the_sampler_order() -> None:
    # With nothing to wait for, there is nothing to reorder: torch yields sampler order too.
    assert_same_as_torch(Numbers(23), kw(batch_size=3, shuffle=True, in_order=False))


# --- epochs --------------------------------------------------------------------------------------

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
    def unordered(gen: torch.Generator) -> dict[str, Any]:
        return {**kwargs(gen), "in_order": False}

    assert_same_multiset_as_torch(dataset, unordered, epochs=3)


# --- seeding -------------------------------------------------------------------------------------
# A worker's seed is base_seed + worker id, where the base seed is drawn from the loader's
# generator (or torch's global RNG) when the iterator is made; random, torch and numpy are seeded
# from it before worker_init_fn runs.


@pytest.mark.parametrize("num_workers", [1, 3])
@WORKERS
def test_worker_rngs_and_info_follow_the_generator_like_torchs(num_workers: int) -> None:
    kwargs = kw(batch_size=None, shuffle=True, num_workers=num_workers)
    expected = run(torch.utils.data.DataLoader, RandomDraws(7), kwargs, epochs=2)
    got = run(statecore.DataLoader, RandomDraws(7), kwargs, epochs=2)
    assert got == expected
    seeds = {draw[3] for epoch in got for draw in epoch}
    assert len(seeds) == 2 * num_workers  # a new base seed each epoch, one seed per worker


@WORKERS
def test_worker_seeds_follow_the_global_torch_seed_without_a_generator() -> None:
    def draws(loader_class: type[torch.utils.data.DataLoader]) -> list[Any]:  # type: ignore[type-arg]
        torch.manual_seed(SEED)
        loader = loader_class(RandomDraws(6), batch_size=None, num_workers=2)
        return [as_lists(sample) for sample in loader]

    assert draws(statecore.DataLoader) == draws(torch.utils.data.DataLoader)


def test_in_process_loading_draws_from_the_main_process_rngs_like_torch() -> None:
    def draws(loader_class: type[torch.utils.data.DataLoader]) -> list[Any]:  # type: ignore[type-arg]
        random.seed(SEED)
        numpy.random.seed(SEED)
        torch.manual_seed(SEED)
        loader = loader_class(RandomDraws(5), batch_size=None)
        samples = [as_lists(sample) for sample in loader]
        return [*samples, random.random(), torch.rand(1).item(), numpy.random.rand()]

    assert draws(statecore.DataLoader) == draws(torch.utils.data.DataLoader)


@pytest.mark.parametrize("persistent_workers", [False, True])
@WORKERS
def test_worker_init_fn_runs_after_seeding_like_torchs(persistent_workers: bool) -> None:
    kwargs = kw(
        batch_size=None,
        num_workers=3,
        worker_init_fn=record_init_draws,
        persistent_workers=persistent_workers,
        shuffle=False,
    )

    def with_generator(gen: torch.Generator) -> dict[str, Any]:
        return {**kwargs(gen), "generator": gen}

    expected = run(torch.utils.data.DataLoader, InitDraws(), with_generator, epochs=2)
    got = run(statecore.DataLoader, InitDraws(), with_generator, epochs=2)
    assert got == expected
    worker_id, init_random, init_torch, _, info_id, _, seed, *_ = got[0][0]
    assert worker_id == info_id == 0
    assert init_random == random.Random(seed).random()
    assert init_torch == torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()
    # Fresh workers run worker_init_fn each epoch, with a new seed; persistent ones run it once.
    assert len({tuple(epoch[0][:4]) for epoch in got}) == (1 if persistent_workers else 2)


@WORKERS
def test_spawned_workers_are_seeded_like_torchs() -> None:
    kwargs = kw(
        batch_size=None, shuffle=True, num_workers=2, multiprocessing_context="spawn", timeout=60
    )
    expected = run(torch.utils.data.DataLoader, RandomDraws(4), kwargs)
    got = run(statecore.DataLoader, RandomDraws(4), kwargs)
    assert got == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="in-process"),
        pytest.param({"num_workers": 2}, id="w2"),
        pytest.param({"num_workers": 2, "persistent_workers": True}, id="w2-persistent"),
    ],
)
@WORKERS
def test_the_generator_is_left_as_torch_leaves_it(kwargs: dict[str, Any]) -> None:
    def state_after_two_epochs(loader_class: type) -> torch.Tensor:
        gen = generator()
        loader = loader_class(Numbers(10), batch_size=3, shuffle=True, generator=gen, **kwargs)
        for _ in range(2):
            for _ in loader:
                pass
        release(loader)
        return gen.get_state()

    expected = state_after_two_epochs(torch.utils.data.DataLoader)
    assert torch.equal(state_after_two_epochs(statecore.DataLoader), expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="in-process"),
        pytest.param({"num_workers": 2}, id="w2"),
    ],
)
@WORKERS
def test_iterators_sharing_a_generator_shuffle_like_torchs(kwargs: dict[str, Any]) -> None:
    def side_by_side(loader_class: type) -> list[Any]:
        gen = generator()
        loaders = [
            loader_class(Numbers(8), batch_size=2, shuffle=True, generator=gen, **kwargs)
            for _ in range(2)
        ]
        return [as_lists(pair) for pair in zip(*loaders, strict=True)]

    assert side_by_side(statecore.DataLoader) == side_by_side(torch.utils.data.DataLoader)


# --- what spawn can carry ------------------------------------------------------------------------
# statecore pickles user code for spawn and forkserver workers with dill, so classes defined in
# functions and lambdas work; torch pickles with the standard library, which refuses them.


def _local_dataset_and_collate() -> tuple[Dataset, Callable[[list[int]], Any]]:  # type: ignore[type-arg]
    class Squares(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> int:
            return index * index

    return Squares(), lambda batch: ["collated", *batch]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@WORKERS
def test_local_dataset_and_lambda_collate_load_in_fresh_interpreters(context: str) -> None:
    dataset, collate = _local_dataset_and_collate()
    in_process = [
        batch for batch in torch.utils.data.DataLoader(dataset, batch_size=3, collate_fn=collate)
    ]
    loader = statecore.DataLoader(
        dataset, batch_size=3, collate_fn=collate, num_workers=2, multiprocessing_context=context
    )
    assert [batch for batch in loader] == in_process
    assert in_process[0] == ["collated", 0, 1, 4]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@WORKERS
def test_torch_cannot_pickle_a_local_dataset_or_lambda_collate(context: str) -> None:
    dataset, collate = _local_dataset_and_collate()
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=3, collate_fn=collate, num_workers=2, multiprocessing_context=context
    )
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)) as raised:
        next(iter(loader))
    assert "pickle" in str(raised.value).lower()


# --- when the sampler is asked ------------------------------------------------------------------
# Samplers may have side effects or adapt to the training loop, so the loader must draw indices
# when torch does: without workers, one batch per next(); with workers, prefetch_factor batches
# per worker ahead.


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="in-process"),
        pytest.param({"num_workers": 1, "prefetch_factor": 1}, id="w1-p1"),
        pytest.param({"num_workers": 2}, id="w2"),
        pytest.param({"num_workers": 3, "prefetch_factor": 3}, id="w3-p3"),
    ],
)
@WORKERS
def test_the_sampler_is_drawn_from_when_torch_draws(kwargs: dict[str, Any]) -> None:
    def drawn_after_each_step(loader_class: type) -> list[int]:
        sampler = LoggingSampler(16)
        iterator = iter(loader_class(Numbers(16), sampler=sampler, batch_size=2, **kwargs))
        drawn = [len(sampler.drawn)]
        for _ in iterator:
            drawn.append(len(sampler.drawn))
        return drawn

    assert drawn_after_each_step(statecore.DataLoader) == drawn_after_each_step(
        torch.utils.data.DataLoader
    )


def steps(loader: Any, count: int) -> list[Any]:
    """`count` calls of next() on one iterator: batches, "end", or [error type, message]."""
    iterator = iter(loader)
    result: list[Any] = []
    for _ in range(count):
        try:
            result.append(as_lists(next(iterator)))
        except StopIteration:
            result.append("end")
        except Exception as error:
            result.append([type(error).__name__, str(error)])
    close(iterator)
    return result


def test_in_process_a_sampler_error_comes_in_its_turn_like_torchs() -> None:
    def run_with(loader_class: type) -> list[Any]:
        return steps(loader_class(Numbers(12), sampler=BrokenSampler(12, 5), batch_size=2), 4)

    expected = run_with(torch.utils.data.DataLoader)
    assert expected == [[0, 1], [2, 3], ["ValueError", "sampler failed at 5"], "end"]
    assert run_with(statecore.DataLoader) == expected


@pytest.mark.parametrize("fails_at", [3, 5])
@WORKERS
def test_with_workers_the_batch_in_hand_when_the_sampler_fails_is_still_delivered(
    fails_at: int,
) -> None:
    # torch draws the next batch's indices before handing over the batch in hand, and loses
    # that batch when the sampler raises; statecore hands it over, then raises, then ends.
    # (Batches still in flight on other workers are dropped, in both.)
    loader = statecore.DataLoader(
        Numbers(12),
        sampler=BrokenSampler(12, fails_at),
        batch_size=2,
        num_workers=1,
        prefetch_factor=1,
    )
    whole = [[i, i + 1] for i in range(0, fails_at - 1, 2)]
    assert steps(loader, len(whole) + 2) == [
        *whole,
        ["ValueError", f"sampler failed at {fails_at}"],
        "end",
    ]


# --- errors --------------------------------------------------------------------------------------
# A dataset's exception reaches the consumer in its batch's turn, with the dataset's exception
# type, and the epoch goes on with the next batch.


def outcomes(loader: Any) -> list[Any]:
    """Every batch of one epoch, with an error shown as [exception type name, first line]."""
    iterator = iter(loader)
    result: list[Any] = []
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return result
        except Exception as error:
            result.append([type(error).__name__, "bad index" in str(error)])
        else:
            result.append(as_lists(batch))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="in-process"),
        pytest.param({"num_workers": 2}, id="w2"),
        pytest.param({"num_workers": 3, "prefetch_factor": 1}, id="w3-p1"),
    ],
)
@WORKERS
def test_dataset_errors_come_in_their_turn_like_torchs(kwargs: dict[str, Any]) -> None:
    def run_with(loader_class: type) -> list[Any]:
        return outcomes(loader_class(FailsAt(13, [2, 5, 6]), batch_size=2, **kwargs))

    expected = run_with(torch.utils.data.DataLoader)
    assert run_with(statecore.DataLoader) == expected
    assert expected[1] == ["KeyError", True]


@WORKERS
def test_out_of_order_dataset_errors_are_torchs_in_some_order() -> None:
    def run_with(loader_class: type) -> Counter[str]:
        loader = loader_class(FailsAt(13, [2, 5]), batch_size=2, num_workers=2, in_order=False)
        return multiset(outcomes(loader))

    assert run_with(statecore.DataLoader) == run_with(torch.utils.data.DataLoader)


@WORKERS
def test_worker_init_fn_error_is_raised_with_its_type_like_torchs() -> None:
    def first_error(loader_class: type) -> tuple[type[BaseException], bool]:
        loader = loader_class(Numbers(6), num_workers=2, worker_init_fn=failing_init)
        iterator = iter(loader)
        try:
            next(iterator)
        except Exception as error:
            return type(error), "worker_init_fn failed in worker 0" in str(error)
        finally:
            close(iterator)
        raise AssertionError("worker_init_fn's error was not raised")

    expected = first_error(torch.utils.data.DataLoader)
    assert first_error(statecore.DataLoader) == expected
    assert expected == (RuntimeError, True)


@pytest.mark.parametrize(
    "loader_class",
    [
        pytest.param(torch.utils.data.DataLoader, id="torch"),
        pytest.param(
            statecore.DataLoader,
            id="statecore",
        ),
    ],
)
def test_in_process_loading_raises_the_datasets_own_exception(loader_class: type) -> None:
    loader = loader_class(RaisesBadSample(), batch_size=None)
    with pytest.raises(BadSample) as raised:
        next(iter(loader))
    assert raised.value.index == 0
    assert str(raised.value) == "bad sample 0"


# --- fatal failures ----------------------------------------------------------------------------


def first_failure(loader: Any) -> tuple[list[Any], BaseException]:
    """The batches loaded before the iterator failed, and its error."""
    iterator = iter(loader)
    batches: list[Any] = []
    try:
        for batch in iterator:
            batches.append(as_lists(batch))
    except Exception as error:
        return batches, error
    finally:
        close(iterator)
    raise AssertionError(f"the loader did not fail; it loaded {batches}")


def load_until_timeout(loader_class: type) -> tuple[list[Any], BaseException, float]:
    """Load until a worker stuck on index 2 makes the loader time out (timeout=0.5).

    Returns the batches before, the error, and the seconds from iter() to the error.
    """
    read, write = os.pipe()
    loader = loader_class(BlocksAt(8, 2, read), batch_size=None, num_workers=2, timeout=0.5)
    batches: list[Any] = []
    started = time.monotonic()
    iterator = iter(loader)
    try:
        for batch in iterator:
            batches.append(as_lists(batch))
    except Exception as error:
        return batches, error, time.monotonic() - started
    finally:
        os.write(write, b"xx")  # let the stuck worker go, if it is still there
        close(iterator)
        os.close(read)
        os.close(write)
    raise AssertionError(f"the loader did not time out; it loaded {batches}")


@WORKERS
def test_a_timeout_raises_torchs_error() -> None:
    batches, error, _ = load_until_timeout(statecore.DataLoader)
    expected_batches, expected, _ = load_until_timeout(torch.utils.data.DataLoader)
    assert batches == expected_batches
    assert isinstance(error, type(expected))
    assert str(error) == str(expected) == "DataLoader timed out after 0.5 seconds"


@pytest.mark.parametrize(
    "loader_class",
    [
        pytest.param(torch.utils.data.DataLoader, id="torch"),
        pytest.param(
            statecore.DataLoader,
            id="statecore",
        ),
    ],
)
@WORKERS
def test_a_timeout_is_raised_without_waiting_for_the_stuck_worker(loader_class: type) -> None:
    _, error, waited = load_until_timeout(loader_class)
    assert "timed out" in str(error)
    assert waited < 3.0  # torch raises after about 0.5 s; the bound leaves room for a busy host


@WORKERS
def test_a_dead_worker_raises_a_runtime_error_like_torch() -> None:
    for loader_class in (torch.utils.data.DataLoader, statecore.DataLoader):
        batches, error = first_failure(loader_class(ExitsAt(8, 3), batch_size=None, num_workers=2))
        assert isinstance(error, RuntimeError)
        assert "exited unexpectedly" in str(error)
        assert batches == [0, 1, 2][: len(batches)]  # what came before the death, in order


# --- worker lifetime -----------------------------------------------------------------------------
# Torch stops a loader's workers as soon as its iterator is dropped (by reference counting), so
# `next(iter(loader))` or breaking out of a loop leaves no process behind.


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    "loader_class",
    [
        pytest.param(torch.utils.data.DataLoader, id="torch"),
        pytest.param(
            statecore.DataLoader,
            id="statecore",
        ),
    ],
)
@pytest.mark.parametrize("persistent_workers", [False, True], ids=["fresh", "persistent"])
@WORKERS
def test_dropping_a_loader_stops_its_workers_at_once(
    loader_class: type, persistent_workers: bool
) -> None:
    loader = loader_class(
        WorkerPids(), batch_size=None, num_workers=2, persistent_workers=persistent_workers
    )
    iterator = iter(loader)
    pids = {next(iterator), next(iterator)}
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    dropped = weakref.ref(iterator)
    del iterator, loader
    try:
        assert dropped() is None
        assert not any(alive(pid) for pid in pids)
    finally:
        # Clean up without the garbage collector, which would wait 5 s for the workers.
        leftover = dropped()
        if leftover is not None:
            close(leftover)
            del leftover


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


@WORKERS
def test_workers_run_torch_on_one_thread_like_torchs() -> None:
    expected = run(torch.utils.data.DataLoader, ThreadCounts(), kw(num_workers=2))
    assert expected == [[[1], [1], [1], [1]]]
    assert run(statecore.DataLoader, ThreadCounts(), kw(num_workers=2)) == expected


# --- the thread executor passes the same matrix -----------------------------------------------


def threaded(dataset: Any, **options: Any) -> Any:
    """statecore's DataLoader with worker threads."""
    return statecore.DataLoader(dataset, executor="thread", **options)


def _rows_with_workers(rows: list[Any]) -> list[Any]:
    """The rows that load in workers: the thread executor needs num_workers > 0.

    Rows whose samples draw from the process-wide RNGs are left out: threads share those
    generators, so they cannot be seeded per worker (docs/architecture.md says so).
    """
    return [
        pytest.param(*row.values, id=f"thread-{row.id}")
        for row in rows
        if row.values[1](torch.Generator()).get("num_workers", 0) > 0
        and not isinstance(row.values[0], RandomDraws)
    ]


@pytest.mark.parametrize(
    ("dataset", "kwargs"), _rows_with_workers(MAP_STYLE + CUSTOM + ITERABLE + EPOCHS)
)
@WORKERS
def test_thread_workers_hand_over_torchs_batches(dataset: Any, kwargs: Kwargs) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs, epochs=2)
    assert run(threaded, dataset, kwargs, epochs=2) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("dataset", "kwargs"), _rows_with_workers(OUT_OF_ORDER))
@WORKERS
def test_thread_workers_out_of_order_hand_over_torchs_batches_in_some_order(
    dataset: Any, kwargs: Kwargs
) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs)
    got = run(threaded, dataset, kwargs)  # type: ignore[arg-type]
    assert [multiset(epoch) for epoch in got] == [multiset(epoch) for epoch in expected]
