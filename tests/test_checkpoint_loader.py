"""`state_dict()` / `load_state_dict()`: a fresh loader goes on exactly where the original was.

Each test runs an original loader, takes its state at some point, loads it into a fresh loader
(often with another executor or number of workers), and compares what the fresh loader yields
with what the original yielded after that point.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _checkpoints import resumed_between_epochs, roundtrip, run_to_end, take
from _datasets import Augmented, GlobalDraws, Numbers
from _side_by_side import WORKERS
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

import statecore
from statecore import DataLoader

Build = Callable[..., DataLoader[Any]]

# (executor, num_workers): the state does not depend on either.
RUNS = [
    pytest.param("inline", 0, id="inline"),
    pytest.param("thread", 2, id="thread-2"),
    pytest.param("mp", 2, id="mp-2"),
]


def loader(dataset: Any = None, **options: Any) -> DataLoader[Any]:
    options.setdefault("batch_size", 3)
    return DataLoader(Numbers(40) if dataset is None else dataset, **options)


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- exact continuation -------------------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
@pytest.mark.parametrize("at", [0, 1, 5, 13])
def test_a_loader_resumed_mid_epoch_yields_exactly_the_rest_of_the_epoch(
    executor: str, workers: int, at: int
) -> None:
    original = loader(shuffle=True, generator=seeded(), executor=executor, num_workers=workers)
    iterator = iter(original)
    before = take(iterator, at)
    state = roundtrip(original.state_dict())
    after = run_to_end(iterator)

    resumed = loader(shuffle=True, generator=seeded(99), executor=executor, num_workers=workers)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after
    assert sorted(item for batch in before + after for item in batch) == list(range(40))


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_shuffle_drawn_from_torchs_global_generator_resumes_exactly(
    executor: str, workers: int
) -> None:
    torch.manual_seed(3)
    original = loader(shuffle=True, executor=executor, num_workers=workers)
    iterator = iter(original)
    take(iterator, 4)
    state = original.state_dict()
    after = run_to_end(iterator)
    original_global = torch.get_rng_state()

    torch.manual_seed(12345)  # the resumed program's global generator is elsewhere
    resumed = loader(shuffle=True, executor=executor, num_workers=workers)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after
    # The replay drew from a copy, and the global generator was put back where the checkpoint
    # found it: the program goes on with the original's global stream.
    assert torch.equal(torch.get_rng_state(), original_global)


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_batches_in_flight_or_buffered_at_the_checkpoint_are_produced_again(
    executor: str, workers: int
) -> None:
    original = loader(executor=executor, num_workers=workers, prefetch_factor=None)
    iterator = iter(original)
    take(iterator, 2)
    state = original.state_dict()  # workers have prefetched ahead of the consumer by now
    assert state["progress"] == {"done": 2, "also": [], "ended": False, "turn": 0, "dry": []}
    resumed = loader()
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed))[0] == [6, 7, 8]


@WORKERS
@pytest.mark.parametrize(("first", "second"), [(0, 2), (2, 0), (2, 1)])
def test_a_map_style_epoch_resumes_under_any_number_of_workers(first: int, second: int) -> None:
    original = loader(shuffle=True, generator=seeded(), num_workers=first)
    iterator = iter(original)
    take(iterator, 6)
    state = original.state_dict()
    after = run_to_end(iterator)
    resumed = loader(shuffle=True, generator=seeded(), num_workers=second)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS[1:])
def test_out_of_order_the_rest_is_every_batch_not_yet_handed_over_each_once(
    executor: str, workers: int
) -> None:
    original = loader(executor=executor, num_workers=workers, in_order=False, shuffle=True)
    iterator = iter(original)
    before = take(iterator, 5)
    state = original.state_dict()
    resumed = loader(executor=executor, num_workers=workers, in_order=False, shuffle=True)
    resumed.load_state_dict(state)
    after = run_to_end(iter(resumed))
    everything = sorted(item for batch in before + after for item in batch)
    assert everything == list(range(40))


@WORKERS
def test_each_resume_goes_on_from_the_last_many_times_in_one_epoch() -> None:
    whole = run_to_end(iter(loader(shuffle=True, generator=seeded())))
    got: list[Any] = []
    current = loader(shuffle=True, generator=seeded())
    iterator = iter(current)
    for workers in (2, 0, 1, 2, 0):
        got += take(iterator, 2)
        state = roundtrip(current.state_dict())
        current = loader(shuffle=True, generator=seeded(5), num_workers=workers)
        current.load_state_dict(state)
        iterator = iter(current)
    got += run_to_end(iterator)
    assert got == whole


@WORKERS
def test_a_checkpoint_between_epochs_resumes_the_next_epoch_with_its_own_shuffle() -> None:
    original = loader(shuffle=True, generator=seeded(), num_workers=2)
    run_to_end(iter(original))
    state = original.state_dict()
    second_epoch = run_to_end(iter(original))

    resumed = loader(shuffle=True, generator=seeded(1), num_workers=2)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == second_epoch


@WORKERS
def test_a_resumed_loader_goes_on_to_the_same_later_epochs() -> None:
    original = loader(shuffle=True, generator=seeded(), num_workers=2, persistent_workers=True)
    iterator = iter(original)
    take(iterator, 3)
    state = original.state_dict()
    rest = run_to_end(iterator) + run_to_end(iter(original)) + run_to_end(iter(original))
    resumed = loader(shuffle=True, generator=seeded(2), num_workers=2, persistent_workers=True)
    resumed.load_state_dict(state)
    again = run_to_end(iter(resumed)) + run_to_end(iter(resumed)) + run_to_end(iter(resumed))
    assert again == rest


class Seeds(torch.utils.data.Dataset[tuple[int, int, int]]):
    """Item i: i, and the id and seed of the worker that loaded it."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        return index, info.id, info.seed


@WORKERS
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_of_a_resumed_epoch_are_seeded_as_the_originals_were(persistent: bool) -> None:
    def seeds(generator: torch.Generator) -> DataLoader[Any]:
        return loader(
            Seeds(), batch_size=4, num_workers=2, generator=generator, persistent_workers=persistent
        )

    original = seeds(seeded())
    if persistent:
        run_to_end(iter(original))  # the workers' seeds date from the first epoch
    iterator = iter(original)
    take(iterator, 2)
    state = original.state_dict()
    after = run_to_end(iterator)
    resumed = seeds(seeded(8))
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after


@WORKERS
def test_a_state_taken_before_iter_resumes_the_first_epoch() -> None:
    original = loader(shuffle=True, generator=seeded())
    state = original.state_dict()
    first_epoch = run_to_end(iter(original))
    resumed = loader(shuffle=True, generator=seeded(4))
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == first_epoch


def test_drop_last_is_kept_through_a_resume() -> None:
    original = loader(batch_size=7, drop_last=True, shuffle=True, generator=seeded())
    iterator = iter(original)
    take(iterator, 2)
    state = original.state_dict()
    after = run_to_end(iterator)
    resumed = loader(batch_size=7, drop_last=True, shuffle=True, generator=seeded())
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after
    assert len(after) == 40 // 7 - 2


# --- samplers -----------------------------------------------------------------------------------


class Reversed(Sampler[int]):
    """A custom sampler without state: resumed by drawing it again and skipping ahead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class Counting(Sampler[int]):
    """A sampler with its own state, counting the draws it was asked for."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.at = 0
        self.draws = 0

    def __iter__(self) -> Iterator[int]:
        while self.at < self.n:
            self.draws += 1
            value = (self.at * 7) % self.n
            self.at += 1
            yield value
        self.at = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def test_a_custom_sampler_without_state_is_drawn_again_up_to_the_checkpoint() -> None:
    original = loader(sampler=Reversed(40), num_workers=0)
    iterator = iter(original)
    take(iterator, 3)
    state = original.state_dict()
    after = run_to_end(iterator)
    resumed = loader(sampler=Reversed(40))
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after


@WORKERS
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_with_its_own_state_is_restored_directly_not_drawn_again(workers: int) -> None:
    original = loader(sampler=Counting(40), num_workers=workers)
    iterator = iter(original)
    take(iterator, 4)
    state = original.state_dict()
    assert state["sampler"] == {"at": 12}  # after the 4th batch, whatever was prefetched
    after = run_to_end(iterator)
    sampler = Counting(40)
    resumed = loader(sampler=sampler, num_workers=workers)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after
    assert sampler.draws == 40 - 12


def test_a_batch_sampler_given_by_the_user_is_resumed() -> None:
    batches = BatchSampler(Reversed(40), batch_size=5, drop_last=False)
    original = DataLoader(Numbers(40), batch_sampler=batches)
    iterator = iter(original)
    take(iterator, 3)
    state = original.state_dict()
    after = run_to_end(iterator)
    resumed = DataLoader(Numbers(40), batch_sampler=batches)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after


# --- the state itself ---------------------------------------------------------------------------


def test_the_state_is_plain_data_json_and_torch_load_take() -> None:
    original = loader(shuffle=True, generator=seeded())
    iterator = iter(original)
    take(iterator, 2)
    state = original.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert roundtrip(state) == state


def test_a_loaded_state_not_yet_iterated_is_what_state_dict_returns() -> None:
    original = loader(shuffle=True, generator=seeded())
    iterator = iter(original)
    take(iterator, 2)
    state = original.state_dict()
    resumed = loader(shuffle=True, generator=seeded())
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dataset": Numbers(41)}, "dataset_length=40"),
        ({"batch_size": 4}, "batch_size=3"),
        ({"drop_last": True}, "drop_last=False"),
    ],
)
def test_a_state_from_another_dataset_or_batching_is_refused(
    change: dict[str, Any], message: str
) -> None:
    state = loader().state_dict()
    other = loader(**change)
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(state)


def test_a_state_of_an_unknown_format_version_is_refused() -> None:
    state = loader().state_dict()
    state["statecore"] = 99
    with pytest.raises(ValueError, match="format version 99"):
        loader().load_state_dict(state)


def test_something_that_is_not_a_loader_state_is_refused() -> None:
    with pytest.raises(ValueError, match="not a statecore DataLoader state_dict"):
        loader().load_state_dict({"model": 1})


@WORKERS
def test_loading_a_state_into_a_loader_with_persistent_workers_stops_them() -> None:
    persistent = loader(num_workers=2, persistent_workers=True)
    run_to_end(iter(persistent))
    kept = persistent._iterator
    persistent.load_state_dict(loader().state_dict())
    assert persistent._iterator is None
    assert kept is not None and kept._driver is None  # its workers were stopped
    assert len(run_to_end(iter(persistent))) == 14


# --- torchdata's names --------------------------------------------------------------------------


def test_stateful_data_loader_is_the_data_loader() -> None:
    assert statecore.StatefulDataLoader is statecore.DataLoader


@pytest.mark.parametrize("steps", [-1, 1.5, True])
def test_snapshot_every_n_steps_must_be_an_integer_of_at_least_0(steps: Any) -> None:
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        loader(snapshot_every_n_steps=steps)


def test_snapshot_every_n_steps_is_accepted_and_kept() -> None:
    assert loader(snapshot_every_n_steps=10).snapshot_every_n_steps == 10


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_of_a_distributed_sampler_resumes_its_own_share(rank: int) -> None:
    def ranked() -> DataLoader[Any]:
        share = DistributedSampler(Numbers(40), num_replicas=2, rank=rank, shuffle=True, seed=3)
        share.set_epoch(1)
        return loader(sampler=share, batch_size=2)

    original = ranked()
    iterator = iter(original)
    before = take(iterator, 3)
    state = original.state_dict()
    after = run_to_end(iterator)
    resumed = ranked()
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after
    assert len(before + after) == 10


# --- map-style datasets with a state --------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
@pytest.mark.parametrize("at", [1, 4, 9])
def test_a_map_style_dataset_state_per_worker_is_restored_and_draws_as_the_original(
    executor: str, workers: int, at: int
) -> None:
    def build() -> DataLoader[Any]:
        options = {"shuffle": True, "generator": seeded(), "num_workers": workers}
        return loader(Augmented(40), executor=executor, **options)

    original = build()
    iterator = iter(original)
    take(iterator, at)
    state = roundtrip(original.state_dict())
    after = run_to_end(iterator)
    resumed = build()
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == after


@WORKERS
@pytest.mark.parametrize(
    ("executor", "workers"),
    [
        pytest.param("thread", 2, id="thread-2-persistent"),
        pytest.param("mp", 2, id="mp-2-persistent"),
    ],
)
def test_a_map_style_state_between_epochs_goes_on_into_the_next_epoch_as_its_workers_did(
    executor: str, workers: int
) -> None:
    def build() -> DataLoader[Any]:
        options = {"generator": seeded(), "num_workers": workers}
        return loader(Augmented(12), executor=executor, persistent_workers=True, **options)

    second, resumed = resumed_between_epochs(build)
    assert resumed == second


LIVING_ON = [
    pytest.param("inline", 0, id="inline"),
    pytest.param("thread", 2, id="thread-2-persistent"),
    pytest.param("mp", 2, id="mp-2-persistent"),
]
"""Where a map-style dataset lives on from one epoch into the next: the main process's own
object, or persistent workers' copies."""


def _living_on(executor: str, workers: int) -> DataLoader[Any]:
    options = {"generator": seeded(), "num_workers": workers, "persistent_workers": workers > 0}
    return loader(Augmented(12), executor=executor, batch_size=2, **options)


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), LIVING_ON)
def test_a_map_style_state_between_epochs_carries_the_datasets_state_where_it_lives_on(
    executor: str, workers: int
) -> None:
    uninterrupted = _living_on(executor, workers)
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(3)]
    original = _living_on(executor, workers)
    run_to_end(iter(original))
    state = roundtrip(original.state_dict())
    resumed = _living_on(executor, workers)
    resumed.load_state_dict(state)
    assert [run_to_end(iter(resumed)) for _ in range(2)] == epochs[1:]


@WORKERS
@pytest.mark.parametrize("taken", [0, 1])
@pytest.mark.parametrize(("executor", "workers"), LIVING_ON)
def test_a_map_style_state_taken_early_in_the_next_epoch_holds_what_the_last_one_left(
    executor: str, workers: int, taken: int
) -> None:
    # After iter() and before any batch of the second epoch (or one: worker 1 has none yet).
    uninterrupted = _living_on(executor, workers)
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(2)]
    original = _living_on(executor, workers)
    run_to_end(iter(original))
    second = iter(original)
    take(second, taken)
    state = roundtrip(original.state_dict())
    resumed = _living_on(executor, workers)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == epochs[1][taken:]


def _next_epoch_after_a_break(original: DataLoader[Any], taken: int) -> Iterator[Any]:
    """The next epoch's iterator, after the program broke out of this one after `taken`
    batches: persistent workers had loaded batches ahead that no one received."""
    broken = iter(original)
    take(broken, taken)
    del broken
    return iter(original)


@WORKERS
@pytest.mark.parametrize("taken", [0, 3])
@pytest.mark.parametrize(("executor", "workers"), LIVING_ON)
def test_a_map_style_state_taken_in_the_epoch_after_a_break_holds_what_was_loaded_ahead(
    executor: str, workers: int, taken: int
) -> None:
    # The workers load the batches they were sent before the break, and then the next epoch,
    # from where those left their datasets: a resume before their first batch of it starts
    # them there too.
    uninterrupted = _living_on(executor, workers)
    following = run_to_end(_next_epoch_after_a_break(uninterrupted, taken))
    original = _living_on(executor, workers)
    _next_epoch_after_a_break(original, taken)
    state = roundtrip(original.state_dict())
    resumed = _living_on(executor, workers)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == following


def test_a_resumed_epoch_in_the_main_process_broken_out_of_at_once_leaves_its_state() -> None:
    original = _living_on("inline", 0)
    first = iter(original)
    take(first, 2)
    state = roundtrip(original.state_dict())
    del first  # broken out of
    following = run_to_end(iter(original))
    resumed = _living_on("inline", 0)
    resumed.load_state_dict(state)
    iter(resumed)  # the resumed epoch, broken out of before its first batch
    assert run_to_end(iter(resumed)) == following


@pytest.mark.parametrize("taken", [0, 2])
def test_a_main_process_dataset_whose_state_is_the_global_generator_resumes_its_draws(
    taken: int,
) -> None:
    # Its state at the checkpoint is the generator's as the checkpoint found it (after
    # iter()'s draws and the program's), not as the last batch, or the epoch before, left it.
    def build() -> DataLoader[Any]:
        return loader(GlobalDraws(8), executor="inline", shuffle=True, batch_size=2)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        original = build()
        run_to_end(iter(original))
        iterator = iter(original)
        if take(iterator, taken):
            torch.rand(5)  # the program draws between its last batch and its checkpoint
        state = roundtrip(original.state_dict())
        rng = torch.get_rng_state()
        after = run_to_end(iterator)
        resumed = build()
        torch.set_rng_state(rng)  # restored beside the loader, as a framework does
        resumed.load_state_dict(state)
        assert run_to_end(iter(resumed)) == after


def test_a_map_style_dataset_state_is_kept_as_of_the_last_batch_handed_over() -> None:
    original = loader(Augmented(40), num_workers=2, executor="thread", prefetch_factor=4)
    iterator = iter(original)
    take(iterator, 3)  # worker 0 loaded batches 0 and 2 and has loaded ahead since
    state = original.state_dict()
    assert state["progress"]["turn"] == 1
    mark = state["workers"][0]
    again = Augmented(40)
    again.load_state_dict(mark["state"]["dataset"])
    expected = Augmented(40)
    for _ in range(2 * 3):  # the draws of worker 0's two batches of three
        expected[0]
    assert torch.equal(again._drawn_from().get_state(), expected._drawn_from().get_state())


def test_a_map_style_dataset_state_resumes_under_another_number_of_workers_with_a_warning() -> None:
    original = loader(Augmented(40), shuffle=True, generator=seeded())
    iterator = iter(original)
    take(iterator, 4)
    state = original.state_dict()
    after = run_to_end(iterator)
    resumed = loader(Augmented(40), shuffle=True, generator=seeded(), num_workers=2)
    with pytest.warns(UserWarning, match="each of 1 workers, and this loader has 2"):
        resumed.load_state_dict(state)
    again = run_to_end(iter(resumed))
    assert [batch[0] for batch in again] == [batch[0] for batch in after]
