"""The sampler of `shuffle=True`: torch's RandomSampler order without its list of ints.

`PermutationSampler` yields exactly what torch's `RandomSampler` yields for the same generator
or the same global seed, every branch (`num_samples` below, at and above the length,
replacement), and leaves the generators where torch's leaves them. It holds the permutation as
a tensor, never as millions of Python ints. `DataLoader(shuffle=True)` uses it, still a
`RandomSampler` to whoever checks, and its checkpoints are those of torch's sampler.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _checkpoints import run_to_end, take
from _datasets import Numbers, ShardedRange
from torch.utils.data import RandomSampler, SequentialSampler

from statecore import DataLoader
from statecore.executors._permutation import CHUNK, PermutationSampler

LENGTHS = [1, 2, 7, 100, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 300_000]
SEEDS = [0, 1, 12345]


def _both(
    make: Callable[[type[RandomSampler]], RandomSampler], reseed: Callable[[], None]
) -> tuple[list[list[int]], list[list[int]]]:
    """Two epochs of torch's sampler and of ours, each made by `make` after `reseed`."""
    epochs = []
    for kind in (RandomSampler, PermutationSampler):
        reseed()
        sampler = make(kind)
        epochs.append([list(sampler), list(sampler)])
    return epochs[0][0] + epochs[0][1], epochs[1][0] + epochs[1][1]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("seed", SEEDS)
def test_with_a_generator_it_yields_torchs_order(length: int, seed: int) -> None:
    generators: list[torch.Generator] = []

    def make(kind: type[RandomSampler]) -> RandomSampler:
        generators.append(torch.Generator().manual_seed(seed))
        return kind(range(length), generator=generators[-1])

    theirs, ours = _both(make, lambda: None)
    assert ours == theirs
    assert torch.equal(generators[0].get_state(), generators[1].get_state())


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("seed", SEEDS)
def test_without_a_generator_it_yields_torchs_order_from_the_global_seed(
    length: int, seed: int
) -> None:
    after = []

    def make(kind: type[RandomSampler]) -> RandomSampler:
        return kind(range(length))

    def reseed() -> None:
        after.append(torch.default_generator.get_state())
        torch.manual_seed(seed)

    theirs, ours = _both(make, reseed)
    after.append(torch.default_generator.get_state())
    assert ours == theirs
    # Each epoch drew its seed from the global generator, once, as torch's did.
    assert torch.equal(after[1], after[2])


@pytest.mark.parametrize("num_samples", [1, 5, 40, 41, 100, 2 * CHUNK + 3])
@pytest.mark.parametrize("replacement", [False, True])
def test_num_samples_and_replacement_draw_as_torchs(num_samples: int, replacement: bool) -> None:
    generators: list[torch.Generator] = []

    def make(kind: type[RandomSampler]) -> RandomSampler:
        generators.append(torch.Generator().manual_seed(3))
        return kind(
            range(40),
            replacement=replacement,
            num_samples=num_samples,
            generator=generators[-1],
        )

    theirs, ours = _both(make, lambda: None)
    assert ours == theirs
    assert len(ours) == 2 * num_samples
    assert torch.equal(generators[0].get_state(), generators[1].get_state())


def test_the_generator_moves_at_the_same_draws_as_torchs() -> None:
    # A generator shared with something else sees the draws when they happen: the first
    # index, and the end of each permutation (torch draws the next one then).
    states: list[list[torch.Tensor]] = []
    for kind in (RandomSampler, PermutationSampler):
        generator = torch.Generator().manual_seed(9)
        draws = iter(kind(range(CHUNK + 5), num_samples=2 * (CHUNK + 5) + 3, generator=generator))
        seen = [generator.get_state()]
        for _ in range(2 * (CHUNK + 5) + 3):
            next(draws)
            seen.append(generator.get_state())
        next(draws, None)
        seen.append(generator.get_state())
        states.append(seen)
    assert len(states[0]) == len(states[1])
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))


def test_an_epoch_holds_at_most_a_chunk_of_indices_as_python_objects() -> None:
    size = 1_000_000  # torch's list: 28 MB of ints and 8 MB of list
    draws: Iterator[int] = iter(PermutationSampler(range(size)))
    tracemalloc.start()
    try:
        next(draws)
        for _ in range(3 * CHUNK):
            next(draws)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * CHUNK * 40  # a chunk's ints and list, with room: not the epoch's


def test_a_shuffling_loader_uses_it_and_it_is_a_random_sampler() -> None:
    generator = torch.Generator().manual_seed(4)
    loader = DataLoader(Numbers(40), batch_size=3, shuffle=True, generator=generator)
    assert isinstance(loader.sampler, PermutationSampler)
    assert isinstance(loader.sampler, RandomSampler)
    assert loader.sampler.generator is generator
    assert loader.batch_sampler is not None and loader.batch_sampler.sampler is loader.sampler


@pytest.mark.parametrize(
    "options",
    [
        {"shuffle": False},
        {"shuffle": None},
        {"sampler": SequentialSampler(range(40))},
        {"sampler": RandomSampler(range(40))},
    ],
    ids=["shuffle-false", "shuffle-none", "sequential", "users-random-sampler"],
)
def test_a_loader_that_does_not_shuffle_by_itself_keeps_torchs_sampler(
    options: dict[str, Any],
) -> None:
    loader = DataLoader(Numbers(40), batch_size=3, **options)
    torch_loader = torch.utils.data.DataLoader(Numbers(40), batch_size=3, **options)
    assert type(loader.sampler) is type(torch_loader.sampler)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("batch_size", [1, 3, None])
def test_a_shuffling_loader_yields_torchs_batches(seed: int, batch_size: int | None) -> None:
    epochs = []
    for kind in (torch.utils.data.DataLoader, DataLoader):
        torch.manual_seed(seed)
        loader = kind(Numbers(50), batch_size=batch_size, shuffle=True)
        epochs.append([run_to_end(iter(loader)), run_to_end(iter(loader))])
    assert epochs[0] == epochs[1]


def test_passed_as_a_sampler_it_gives_the_batches_of_torchs_random_sampler() -> None:
    # Public, for a loader given its sampler (a batch sampler of the user's around it, say).
    from statecore.executors import PermutationSampler as Public

    epochs = []
    for kind in (RandomSampler, Public):
        sampler = kind(Numbers(50), generator=torch.Generator().manual_seed(3))  # type: ignore[arg-type]
        loader = DataLoader(Numbers(50), batch_size=4, sampler=sampler)
        epochs.append([run_to_end(iter(loader)), run_to_end(iter(loader))])
    assert epochs[0] == epochs[1]


@pytest.mark.parametrize(
    ("dataset", "options"),
    [
        ([], {}),  # torch's RandomSampler refuses an empty dataset
        ([], {"num_workers": -1}),  # and torch checks num_workers before that
        (ShardedRange(10), {}),  # an iterable dataset with shuffle=True
    ],
    ids=["empty", "empty-and-bad-workers", "iterable"],
)
def test_a_shuffling_loader_refuses_what_torchs_refuses_with_its_error(
    dataset: Any, options: dict[str, Any]
) -> None:
    with pytest.raises((ValueError, TypeError)) as theirs:
        torch.utils.data.DataLoader(dataset, shuffle=True, **options)
    with pytest.raises(type(theirs.value)) as ours:
        DataLoader(dataset, shuffle=True, **options)
    assert str(ours.value) == str(theirs.value)


def test_a_state_taken_with_torchs_random_sampler_resumes_a_shuffling_loader() -> None:
    # The fingerprint names torch's class for both: the order is the same, so a checkpoint of
    # either resumes the other (states taken before the sampler existed among them).
    def loader(**options: Any) -> DataLoader[Any]:
        return DataLoader(Numbers(40), batch_size=3, **options)

    torch.manual_seed(11)
    whole = run_to_end(iter(loader(sampler=RandomSampler(Numbers(40)))))
    torch.manual_seed(11)
    original = loader(sampler=RandomSampler(Numbers(40)))
    first = take(iter(original), 4)
    state = original.state_dict()
    resumed = loader(shuffle=True)
    resumed.load_state_dict(state)
    assert first + run_to_end(iter(resumed)) == whole
