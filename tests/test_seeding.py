"""Seeding per batch: a map-style dataset's random draws do not depend on the workers.

With `seeding="per-batch"` every batch is made under a seed of its own, from the epoch's seed
and the batch's position in the epoch: the same batches come out with 0, 1, 3 or 8 workers, under
every executor, after a lost worker is replaced and after a resume under another `num_workers`.
`get_worker_info().seed` is that batch's seed while it is made. Loading in the calling thread, the
program's own generators are put back after each batch. `seeding="per-worker"` (and None) is
torch's seeding, unchanged.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import attrs
import hypothesis
import hypothesis.strategies as st
import numpy
import pytest
import torch
import torch.utils.data
from _datasets import Numbers, RandomDraws
from _side_by_side import QUIET, SEED, WORKERS, as_lists, kw, run
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import statecore
from statecore import Config, Progress, SendTask, WorkerStatus, initial_state
from statecore.executors._seeding import (
    BatchSeeds,
    batch_seed,
    epoch_seed,
    numpy_seed,
    seed_globals,
)

pytestmark = QUIET

N = 24
BATCH = 2


class Augmenting(Dataset):  # type: ignore[type-arg]
    """Item i: [i, a draw from `random`, one from torch, one from numpy], as a random
    augmentation draws. A worker thread draws from its own generators (`get_worker_info().rng`),
    as a dataset written for thread workers does: the process-wide ones are every thread's.

    With `dies_at` and a `marker` path, the first load of that index kills its process (the
    marker, which every process sees, makes it the only one), so a replacement loads it again.
    """

    def __init__(self, n: int = N, dies_at: int | None = None, marker: Path | None = None) -> None:
        self.n = n
        self.dies_at = dies_at
        self.marker = marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> list[Any]:
        if index == self.dies_at and self.marker is not None and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        info = get_worker_info()
        own = None if info is None else getattr(info, "rng", None)
        if own is not None:
            return [
                index,
                own.random_generator.random(),
                torch.rand(1, generator=own.torch_generator).item(),
                float(own.numpy_generator.random()),
            ]
        return [index, random.random(), torch.rand(1).item(), float(numpy.random.rand())]


class Seeds(Dataset):  # type: ignore[type-arg]
    """Item i: [i, the seed `get_worker_info()` reports while it is loaded]."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> list[int]:
        info = get_worker_info()
        return [index, -1 if info is None else info.seed]


def _batches(
    num_workers: int, executor: str | None = None, epochs: int = 2, **kwargs: Any
) -> list[list[Any]]:
    """The epochs of a shuffled per-batch-seeded loader over `Augmenting`, as lists."""
    dataset = kwargs.pop("dataset", None) or Augmenting()
    loader = statecore.DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
        num_workers=num_workers,
        executor=executor,
        seeding="per-batch",
        **kwargs,
    )
    return [[as_lists(batch) for batch in loader] for _ in range(epochs)]


def _first_base_seed() -> int:
    """The base seed the first iter() of a loader with `generator(SEED)` draws, as torch's."""
    source = torch.Generator().manual_seed(SEED)
    return int(torch.empty((), dtype=torch.int64).random_(generator=source).item())


# --- the argument --------------------------------------------------------------------------------


def test_a_seeding_other_than_per_worker_or_per_batch_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="'per-worker', 'per-batch'") as raised:
        statecore.DataLoader(Numbers(4), seeding="per-sample")
    assert "'per-sample'" in str(raised.value)


def test_per_batch_seeding_is_refused_for_an_iterable_dataset_saying_why() -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(4))

    with pytest.raises(ValueError, match=r"map-style dataset.*own stream"):
        statecore.DataLoader(Stream(), num_workers=2, seeding="per-batch")


def test_a_seeding_set_after_construction_is_checked_by_iter() -> None:
    # Frameworks rebuild loaders from their attributes, and programs set them.
    loader = statecore.DataLoader(Numbers(4))
    loader.seeding = "per-epoch"
    with pytest.raises(ValueError, match="'per-epoch'"):
        iter(loader)


@pytest.mark.parametrize("seed_epoch", [0, -1, True, 1.0, "2"])
def test_a_state_whose_seed_epoch_is_not_a_count_from_1_is_refused_by_name(
    seed_epoch: Any,
) -> None:
    taken = statecore.DataLoader(Numbers(8), batch_size=2, seeding="per-batch")
    iterator = iter(taken)
    next(iterator)
    state = {**taken.state_dict(), "seed_epoch": seed_epoch}
    with pytest.raises(ValueError, match="seed_epoch"):
        statecore.DataLoader(Numbers(8), batch_size=2, seeding="per-batch").load_state_dict(state)


# --- the same batches whatever the workers -------------------------------------------------------


@WORKERS
@pytest.mark.parametrize("num_workers", [1, 3, pytest.param(8, marks=pytest.mark.exhaustive)])
def test_worker_processes_give_the_batches_of_loading_in_the_calling_thread(
    num_workers: int,
) -> None:
    expected = _batches(0)
    assert expected[0] != expected[1]  # each epoch draws afresh
    assert _batches(num_workers, "mp") == expected


@WORKERS
@pytest.mark.parametrize("num_workers", [3, pytest.param(8, marks=pytest.mark.exhaustive)])
def test_worker_threads_give_the_same_batches_whatever_their_number(num_workers: int) -> None:
    expected = _batches(1, "thread")
    assert _batches(num_workers, "thread") == expected
    # Their own generators draw what the process-wide ones draw for random and torch (numpy's
    # own generator is another algorithm than its global functions'), seeded alike.
    columns = [[batch[:3] for batch in epoch] for epoch in _batches(0)]
    assert [[batch[:3] for batch in epoch] for epoch in expected] == columns


@WORKERS
def test_the_pinned_stage_over_processes_gives_the_same_batches() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no accelerator: the stage passes batches through
        assert _batches(2, "mp", pin_memory=True) == _batches(0)


@WORKERS
def test_per_worker_seeding_makes_the_batches_depend_on_the_workers_as_torchs_do() -> None:
    # What per-batch seeding changes: this dataset's batches are worker-dependent otherwise.
    def per_worker(num_workers: int) -> list[Any]:
        loader = statecore.DataLoader(
            Augmenting(),
            batch_size=BATCH,
            generator=torch.Generator().manual_seed(SEED),
            num_workers=num_workers,
            seeding="per-worker",
        )
        return [as_lists(batch) for batch in loader]

    assert per_worker(1) != per_worker(3)


# --- a replaced worker, a resumed epoch ----------------------------------------------------------


@WORKERS
def test_a_worker_killed_mid_epoch_and_replaced_leaves_the_batches_as_they_were(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "killed"
    dataset = Augmenting(dies_at=9, marker=marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", statecore.WorkerRestartedWarning)
        got = _batches(2, "mp", dataset=dataset, worker_restarts=1)
    assert marker.exists()  # a worker was killed, and replaced
    assert got == _batches(2, "mp")


@WORKERS
@pytest.mark.parametrize("executor", ["mp", "thread"])
def test_a_worker_retired_then_added_back_mid_epoch_leaves_the_batches_as_they_were(
    executor: str,
) -> None:
    # What a tuner does (`num_workers="auto"`): fewer workers for a while, then more again.
    loader = statecore.DataLoader(
        Augmenting(),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
        num_workers=3,
        executor=executor,
        seeding="per-batch",
    )
    iterator = iter(loader)
    driver = iterator._driver  # type: ignore[attr-defined]
    got = [as_lists(next(iterator)) for _ in range(2)]
    driver.retire(1)
    while driver.state.life.workers[1] is not WorkerStatus.STOPPED:
        got.append(as_lists(next(iterator)))
    got += [as_lists(next(iterator)) for _ in range(2)]
    driver.add(1)
    got += [as_lists(batch) for batch in iterator]
    assert driver.state.life.added == 1
    assert got == _batches(1, executor, epochs=1)[0]


def _resumed(taken_with: int, resumed_with: int, after: int, **kwargs: Any) -> list[Any]:
    """The first epoch of a loader with `taken_with` workers, its state taken after `after`
    batches and loaded into a fresh loader with `resumed_with` workers, which goes on.

    The fresh loader's generator is seeded otherwise: what it draws again comes from the state.
    """

    def loader(num_workers: int, seed: int = SEED) -> statecore.DataLoader[Any]:
        return statecore.DataLoader(
            Augmenting(),
            batch_size=BATCH,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
            num_workers=num_workers,
            seeding="per-batch",
            **kwargs,
        )

    first = loader(taken_with)
    iterator = iter(first)
    head = [as_lists(next(iterator)) for _ in range(after)]
    state = first.state_dict()
    del iterator
    second = loader(resumed_with, seed=SEED + 1)
    second.load_state_dict(state)
    return head + [as_lists(batch) for batch in second]


@WORKERS
def test_an_epoch_resumed_under_another_num_workers_goes_on_with_the_same_batches() -> None:
    assert _resumed(2, 3, after=5) == _batches(0, epochs=1)[0]


@WORKERS
def test_a_checkpoint_taken_loading_in_the_calling_thread_carries_its_base_seed() -> None:
    # Seeded per batch, loading in the calling thread seeds from the base seed: the state
    # keeps it (torch's single-process loading seeds nothing, and the state holds none).
    assert _resumed(0, 2, after=4) == _batches(0, epochs=1)[0]


@WORKERS
def test_a_persistent_loaders_later_epoch_resumes_with_that_epochs_seeds() -> None:
    # Persistent workers keep the base seed of their iterator's first epoch, as torch's do: the
    # count of epochs, which the state carries, tells the epochs' seeds apart.
    def loader(num_workers: int, seed: int = SEED) -> statecore.DataLoader[Any]:
        return statecore.DataLoader(
            Augmenting(),
            batch_size=BATCH,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
            num_workers=num_workers,
            persistent_workers=True,
            seeding="per-batch",
        )

    unbroken = loader(2)
    expected = [[as_lists(batch) for batch in unbroken] for _ in range(2)]
    assert expected[0] != expected[1]
    first = loader(2)
    list(first)
    iterator = iter(first)
    head = [as_lists(next(iterator)) for _ in range(3)]
    state = first.state_dict()
    assert state["seed_epoch"] == 2
    del iterator
    first._iterator._shutdown()  # type: ignore[attr-defined]
    second = loader(3, seed=SEED + 1)
    second.load_state_dict(state)
    assert head + [as_lists(batch) for batch in second] == expected[1]


@WORKERS
def test_persistent_workers_seed_each_epoch_afresh() -> None:
    # They keep their iterator's base seed (torch draws none for a later epoch): the epoch's
    # count makes another epoch's seeds.
    loader = statecore.DataLoader(
        Seeds(),
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(SEED),
        num_workers=2,
        persistent_workers=True,
        seeding="per-batch",
    )
    epochs = [{as_lists(batch)[1][0] for batch in loader} for _ in range(2)]
    assert len(epochs[0]) == len(epochs[1]) == N // BATCH
    assert not epochs[0] & epochs[1]


@WORKERS
def test_out_of_order_resumed_under_another_num_workers_gives_the_same_batches() -> None:
    # in_order=False: a batch may be handed over before those ahead of it, and a checkpoint
    # then records positions handed over beyond `done`; each batch is still seeded by its own.
    got = _resumed(3, 2, after=5, in_order=False)
    assert sorted(got) == sorted(_batches(0, epochs=1)[0])


# --- the seed a batch is made under --------------------------------------------------------------


def test_a_resumed_epochs_tasks_are_seeded_for_the_positions_they_stand_for() -> None:
    # Resumed after position 2, with position 3 handed over out of order before the checkpoint:
    # the resumed run numbers its tasks from its own base, and skips position 3.
    life = attrs.evolve(
        initial_state(Config(num_workers=2)).life, base=10, resumed=Progress(2, frozenset({3}))
    )
    seeds = BatchSeeds.of(_first_base_seed(), 1)
    sent = [seeds.task(SendTask(0, task, [task]), life) for task in (10, 11, 12)]
    assert [task.seed for task in sent] == [batch_seed(seeds.epoch_seed, p) for p in (2, 4, 5)]
    assert [(task.worker, task.task, task.index) for task in sent] == [
        (0, 10, [10]),
        (0, 11, [11]),
        (0, 12, [12]),
    ]


@WORKERS
@pytest.mark.parametrize("executor", ["mp", "thread"])
def test_worker_info_seed_is_the_seed_of_the_batch_being_made(executor: str) -> None:
    loader = statecore.DataLoader(
        Seeds(),
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(SEED),
        num_workers=2,
        executor=executor,
        seeding="per-batch",
    )
    batches = [as_lists(batch) for batch in loader]
    of_epoch = epoch_seed(_first_base_seed(), 1)
    assert [batch[1] for batch in batches] == [
        [batch_seed(of_epoch, position)] * BATCH for position in range(N // BATCH)
    ]


def test_numpy_is_seeded_as_numpy_seeds_its_own_32_bit_word_of_the_seed() -> None:
    seed = batch_seed(epoch_seed(SEED, 1), 0)
    numpy.random.standard_normal()  # a normal kept for the next draw: seeding drops it
    seed_globals(seed)
    expected = numpy.random.RandomState(numpy_seed(seed)).get_state()
    got = numpy.random.get_state()
    assert got[0] == expected[0] and got[2:] == expected[2:]
    assert got[1].tolist() == expected[1].tolist()


def test_numpys_draws_for_a_batch_are_not_randoms() -> None:
    # `random` and numpy's global functions are the same algorithm (MT19937): numpy seeded
    # from the seed's own words would draw what `random` draws.
    seed_globals(batch_seed(epoch_seed(SEED, 1), 0))
    from_random = [random.getrandbits(32) for _ in range(8)]
    from_numpy = numpy.random.randint(0, 2**32, size=8, dtype=numpy.uint64).tolist()
    assert from_numpy != from_random


def test_numpys_draws_for_a_batch_are_not_torchs() -> None:
    # numpy's scalar seeding and torch's are the same MT19937 initialisation from 32 bits:
    # numpy seeded with the word torch keeps would draw torch's words.
    seed_globals(batch_seed(epoch_seed(SEED, 1), 0))
    from_torch = torch.randint(0, 2**31, (8,), dtype=torch.int64).tolist()
    from_numpy = numpy.random.randint(0, 2**31, size=8).tolist()
    assert from_numpy != from_torch


def test_torchs_generator_keeps_only_the_low_32_bits_of_a_seed() -> None:
    # Why `batch_seed` makes its low word, not the whole seed, unique within an epoch.
    generator = torch.Generator()
    draws = []
    for seed in (5, 5 + 2**32):
        generator.manual_seed(seed)
        draws.append(torch.rand(4, generator=generator).tolist())
    assert draws[0] == draws[1]


@hypothesis.given(
    seed_of_epoch=st.integers(0, 2**64 - 1),
    positions=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=2, unique=True),
)
def test_no_two_batches_of_an_epoch_share_torchs_or_numpys_seed(
    seed_of_epoch: int, positions: list[int]
) -> None:
    first, second = (batch_seed(seed_of_epoch, position) for position in positions)
    assert first & (2**32 - 1) != second & (2**32 - 1)
    assert numpy_seed(first) != numpy_seed(second)


def test_a_long_epochs_batches_draw_apart_from_torch_and_numpy() -> None:
    # 2e5 batches: 32 hashed bits would give about 5 pairs of batches drawing alike.
    seeds = [batch_seed(epoch_seed(SEED, 1), position) for position in range(200_000)]
    assert len({seed & (2**32 - 1) for seed in seeds}) == len(seeds)
    assert len({numpy_seed(seed) for seed in seeds}) == len(seeds)


@hypothesis.given(seed_of_epoch=st.integers(0, 2**64 - 1), position=st.integers(0, 2**40))
def test_a_batch_seed_is_a_non_negative_int64(seed_of_epoch: int, position: int) -> None:
    assert 0 <= batch_seed(seed_of_epoch, position) < 2**63


def test_seeding_a_batch_runs_no_pure_python_state_generation() -> None:
    # After a batch's work, every Python call costs several times what it does back to back:
    # torch's per-worker numpy seed (`_generate_state`, 30 calls of pure Python) took 25 us
    # there.
    calls: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append((frame.f_code.co_name, frame.f_code.co_filename))

    seed = batch_seed(epoch_seed(SEED, 1), 0)
    seed_globals(seed)  # its imports done
    sys.setprofile(profile)
    try:
        seed_globals(seed)
    finally:
        sys.setprofile(None)
    torchs = os.path.dirname(torch.__file__)
    assert [name for name, file in calls if file.startswith(torchs)] == []


# --- torch's seeding, and the program's generators -----------------------------------------------


@WORKERS
@pytest.mark.parametrize("seeding", [None, "per-worker"])
def test_per_worker_seeding_is_torchs(seeding: str | None) -> None:
    kwargs = kw(batch_size=None, shuffle=True, num_workers=2)
    expected = run(torch.utils.data.DataLoader, RandomDraws(7), kwargs, epochs=2)

    def seeded(generator: torch.Generator) -> dict[str, Any]:
        return {**kwargs(generator), "seeding": seeding}

    assert run(statecore.DataLoader, RandomDraws(7), seeded, epochs=2) == expected


def test_loading_in_the_calling_thread_leaves_the_programs_generators_as_they_were() -> None:
    # The training loop draws between batches: it draws what it would beside torch's loader
    # over a dataset that draws nothing (iter() itself draws the base seed, as torch's does).
    def loop(loader_class: type[Any], dataset: Any, **kwargs: Any) -> list[Any]:
        random.seed(SEED)
        numpy.random.seed(SEED)
        torch.manual_seed(SEED)
        drawn = []
        for _ in loader_class(dataset, batch_size=BATCH, **kwargs):
            drawn.append((random.random(), torch.rand(1).item(), float(numpy.random.rand())))
        return drawn

    expected = loop(torch.utils.data.DataLoader, Numbers(N))
    assert loop(statecore.DataLoader, Augmenting(), seeding="per-batch") == expected


# --- its cost, measured by the benchmark ---------------------------------------------------------


def test_the_benchmarks_per_batch_workload_seeds_statecores_loaders_only() -> None:
    from statecore.tools.workloads import measure, select

    (workload,) = select(["processes-b64-per-batch"])
    small = attrs.evolve(workload, num_workers=0, batches=3)
    assert small.ours == {"seeding": "per-batch"}
    # torch's loader takes no `seeding`: it gets the workload's common arguments only.
    assert measure(small, torch.utils.data.DataLoader).work == 2
    assert measure(small, statecore.DataLoader).work == 2
