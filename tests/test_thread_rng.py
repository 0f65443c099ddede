"""A worker thread that reseeds a process-wide random generator is reported, once per loader.

Worker threads share `random`'s, torch's and numpy's process-wide generators. A dataset that
reseeds one per sample, as torchvision's FakeData does with `torch.manual_seed`, draws numbers
that depend on how the threads interleave: samples differ from torch's, silently.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy
import pytest
import torch
from _side_by_side import threaded
from torch.utils.data import Dataset


class ReseedsPerSample(Dataset):  # type: ignore[type-arg]
    """Like torchvision's FakeData: seed torch's generator with the index, draw, restore."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        saved = torch.get_rng_state()
        torch.manual_seed(index)
        label = int(torch.randint(0, 1000, ()))
        torch.set_rng_state(saved)
        return label


class OwnGenerator(Dataset):  # type: ignore[type-arg]
    """The remedy: a generator of its own per sample; the process-wide ones are left alone."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        generator = torch.Generator().manual_seed(index)
        return int(torch.randint(0, 1000, (), generator=generator))


def reseed_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "reseeded" in str(w.message)]


@pytest.mark.timeout(60)
def test_a_dataset_reseeding_torch_per_sample_is_warned_about_naming_cause_and_remedy() -> None:
    with pytest.warns(RuntimeWarning, match=r"reseeded .*torch\.manual_seed") as caught:
        list(threaded(ReseedsPerSample()))
    (message,) = reseed_warnings(list(caught))
    assert "ReseedsPerSample" in message
    assert "torch.Generator" in message
    assert 'executor="mp"' in message


@pytest.mark.timeout(60)
def test_a_dataset_with_its_own_generator_is_not_warned_about() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batches = [batch.item() for batch in threaded(OwnGenerator())]
    dataset = OwnGenerator()
    assert batches == [dataset[index] for index in range(len(dataset))]


@pytest.mark.timeout(60)
def test_the_warning_comes_once_per_loader_not_once_per_epoch() -> None:
    loader = threaded(ReseedsPerSample())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            list(loader)
    assert len(reseed_warnings(caught)) == 1


def seed_numpy_per_worker(worker_id: int) -> None:
    # A common recipe for worker processes; in threads every worker seeds the one generator.
    info = torch.utils.data.get_worker_info()
    assert info is not None
    numpy.random.seed(info.seed % 2**32)


def seed_random_per_worker(worker_id: int) -> None:
    random.seed(worker_id)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("init", "name"),
    [(seed_numpy_per_worker, "numpy.random.seed"), (seed_random_per_worker, "random.seed")],
)
def test_seeding_numpy_or_random_in_worker_init_fn_is_warned_about(init: Any, name: str) -> None:
    with pytest.warns(RuntimeWarning, match=rf"reseeded .*{name}.* in worker_init_fn"):
        list(threaded(OwnGenerator(), worker_init_fn=init))


@pytest.mark.timeout(60)
def test_the_main_thread_reseeding_while_loading_is_not_blamed_on_the_workers() -> None:
    loader = threaded(OwnGenerator(), persistent_workers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(2):
            torch.manual_seed(epoch)
            for _ in loader:
                torch.manual_seed(epoch)
