"""Random numbers in worker threads: torch's thread-worker API, and reseeding reported.

Worker threads share `random`'s, torch's and numpy's process-wide generators. Each worker
thread has generators of its own instead, as torch's thread workers will: `get_worker_info()`
says `worker_method="thread"` and carries them in `rng`, seeded from the worker's seed, and
`torch.thread_safe_generator()` returns the worker's torch generator; a dataset drawing from
them gets the samples it gets in worker processes. A dataset that reseeds a process-wide
generator per sample, as torchvision's FakeData does with `torch.manual_seed`, draws numbers
that depend on how the threads interleave: that is reported, once per loader.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy
import pytest
import torch
import torch.utils.data
import torch.utils.data._utils.worker as torch_worker
from _datasets import WorkerGeneratorDraws, WorkerMethodProbe, WorkerRngProbe
from _side_by_side import WORKERS, assert_same_as_torch, generator, kw, run, threaded
from torch.utils.data import Dataset

import statecore


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
    assert "torch.thread_safe_generator()" in message
    assert "get_worker_info().rng" in message
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


# --- torch's thread-worker API -----------------------------------------------------------------


def shuffled(executor: str, **options: Any) -> Any:
    return kw(num_workers=2, executor=executor, shuffle=True, batch_size=3, **options)


@WORKERS
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_draws_from_the_worker_generators_are_those_of_worker_processes(persistent: bool) -> None:
    dataset = WorkerGeneratorDraws(12)
    options = {"persistent_workers": persistent}
    under_threads = run(statecore.DataLoader, dataset, shuffled("thread", **options), epochs=2)
    under_processes = run(statecore.DataLoader, dataset, shuffled("mp", **options), epochs=2)
    under_torch = run(
        torch.utils.data.DataLoader,
        dataset,
        kw(num_workers=2, shuffle=True, batch_size=3, **options),
        epochs=2,
    )
    assert under_threads == under_processes == under_torch
    assert under_threads[0] != under_threads[1]


@pytest.mark.timeout(60)
def test_draws_from_the_worker_generators_are_the_same_run_after_run_under_threads() -> None:
    dataset = WorkerGeneratorDraws(12)
    first, second = (
        run(statecore.DataLoader, dataset, shuffled("thread"), epochs=2) for _ in range(2)
    )
    assert first == second


def thread_worker_infos(**options: Any) -> list[tuple[Any, Any]]:
    loader = threaded(WorkerRngProbe(), batch_size=None, generator=generator(), **options)
    found = list(loader)
    assert [info.id for info, _ in found] == [0, 1]
    return found


@pytest.mark.timeout(60)
def test_a_worker_thread_reports_worker_method_thread_and_generators_seeded_with_its_seed() -> None:
    for info, thread_safe in thread_worker_infos():
        assert info.worker_method == "thread"
        assert isinstance(info.rng, torch_worker._RNG)
        assert thread_safe is info.rng.torch_generator
        assert info.rng.torch_generator.initial_seed() == info.seed
        assert info.rng.random_generator.getstate() == random.Random(info.seed).getstate()
        base_seed = info.seed - info.id
        expected = numpy.random.default_rng(torch_worker._generate_state(base_seed, info.id))
        assert isinstance(info.rng.numpy_generator, numpy.random.Generator)
        assert info.rng.numpy_generator.bit_generator.state == expected.bit_generator.state


@pytest.mark.timeout(60)
def test_each_worker_thread_has_generators_of_its_own() -> None:
    (first, _), (second, _) = thread_worker_infos()
    assert first.rng.torch_generator is not second.rng.torch_generator
    assert first.rng.random_generator is not second.rng.random_generator
    assert first.rng.numpy_generator is not second.rng.numpy_generator


@pytest.mark.timeout(60)
def test_without_torch_s_generator_container_worker_threads_report_no_generators(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch before 2.13 has no `_RNG` and no `rng` field: its threads get what processes get.
    monkeypatch.delattr(torch_worker, "_RNG")
    for info, thread_safe in thread_worker_infos():
        assert info.rng is None
        assert thread_safe is None


@WORKERS
@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "processes"])
def test_outside_worker_threads_the_thread_worker_api_says_what_torch_s_does(
    num_workers: int,
) -> None:
    assert_same_as_torch(WorkerMethodProbe(), kw(num_workers=num_workers, batch_size=None))


@pytest.mark.timeout(60)
def test_loading_in_the_main_process_draws_from_the_process_wide_generators_as_torch() -> None:
    dataset = WorkerGeneratorDraws(6)
    options = kw(shuffle=True, batch_size=2)
    draws = []
    for loader_class in (torch.utils.data.DataLoader, statecore.DataLoader):
        random.seed(7)
        torch.manual_seed(7)
        draws.append(run(loader_class, dataset, options))
    assert draws[0] == draws[1]
