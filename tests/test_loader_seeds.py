"""Workers' RNGs are seeded, and the loader's generator is drawn from, as torch does it.

Loaded by both loaders and compared as tests/_side_by_side.py says: the draws that samples make
from each RNG, what worker_init_fn sees, and the state the generator is left in.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy
import pytest
import torch
import torch.utils.data
from _datasets import InitDraws, Numbers, RandomDraws, record_init_draws
from _side_by_side import QUIET, SEED, WORKERS, as_lists, generator, kw, release, run

import statecore

pytestmark = QUIET

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


# --- datapipes -----------------------------------------------------------------------------------
# torch's single-process iterator draws a datapipe's shared seed once when it is built; drawing it
# again at the start of the epoch would move the loader's generator on.


def datapipe_epochs(loader_type: type, epochs: int) -> list[list[list[int]]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # datapipes are deprecated in torch
        from torch.utils.data.datapipes.iter import IterableWrapper

        pipe = IterableWrapper(range(10)).shuffle()
        loader = loader_type(pipe, batch_size=3, generator=torch.Generator().manual_seed(7))
        return [[batch.tolist() for batch in loader] for _ in range(epochs)]


def test_a_shuffled_datapipe_without_workers_comes_out_in_torchs_order() -> None:
    got = datapipe_epochs(statecore.DataLoader, 3)
    assert got == datapipe_epochs(torch.utils.data.DataLoader, 3)
