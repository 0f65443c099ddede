"""Checkpoints of iterable datasets: each worker goes on with its own part of the dataset.

A worker's part is restored from the state its dataset (or the dataset's iterator) gave with
the last batch of that worker the consumer was handed, torchdata's `Stateful` protocol, or,
for a dataset without state, fast-forwarded over the batches handed over. The workers then take
turns from where they were, so the rest of the epoch is exactly what the original would have
yielded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _checkpoints import resumed_between_epochs, roundtrip, run_to_end, take
from _datasets import (
    CountsEpochs,
    CountsItems,
    DrawsAsItGoes,
    ItsOwnIterator,
    PerWorkerCounts,
    Positioned,
    Rewinding,
    RewindsWhenDry,
    ShardedRange,
    StatefulDataset,
    StatefulIterator,
    share_of_range,
)
from _side_by_side import WORKERS, as_lists
from torch.utils.data import IterableDataset, get_worker_info

from statecore import DataLoader, Event, WorkerExhausted
from statecore.executors import Executor, Launch, pinned
from statecore.executors._registry import lookup
from statecore.models.loader import Forwarding

RUNS = [
    pytest.param("inline", 0, id="inline"),
    pytest.param("thread", 2, id="thread-2"),
    pytest.param("mp", 2, id="mp-2"),
]


class SkipsAnError(IterableDataset[int]):
    """Raises for item 4 and goes on with the next, as a class-based iterator may."""

    def __iter__(self) -> Iterator[int]:
        return self.Items()

    class Items:
        def __init__(self) -> None:
            self.at = 0

        def __iter__(self) -> Iterator[int]:
            return self

        def __next__(self) -> int:
            self.at += 1
            if self.at > 8:
                raise StopIteration
            if self.at == 5:
                raise ValueError("item 4 is broken")
            return self.at - 1


class StateDictRaises(StatefulIterator):
    def __iter__(self) -> Positioned:
        return Broken(share_of_range(self.n))


class Broken(Positioned):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("no state today")


def loader(dataset: Any, **options: Any) -> DataLoader[Any]:
    options.setdefault("batch_size", 2)
    return DataLoader(dataset, **options)


def outcomes(iterator: Iterator[Any]) -> list[Any]:
    """Every batch to the end, and for each task that raised, its error's type and message."""
    got: list[Any] = []
    while True:
        try:
            got.append(as_lists(next(iterator)))
        except StopIteration:
            return got
        except Exception as error:
            got.append((type(error).__name__, str(error).splitlines()[-1]))


def resumed_run_to_end(dataset: Any, at: int, **options: Any) -> tuple[list[Any], list[Any]]:
    """(what the original yields after `at` batches, what a loader resumed there yields)."""
    original = loader(dataset, **options)
    iterator = iter(original)
    take(iterator, at)
    state = roundtrip(original.state_dict())
    after = run_to_end(iterator)
    fresh = loader(type(dataset)(*_arguments(dataset)), **options)
    fresh.load_state_dict(state)
    return after, run_to_end(iter(fresh))


def _arguments(dataset: Any) -> tuple[Any, ...]:
    if isinstance(dataset, PerWorkerCounts):
        return (dataset.counts,)
    n = getattr(dataset, "n", None)
    return () if n is None else (n,)


# --- exact continuation -------------------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
@pytest.mark.parametrize("dataset", [ShardedRange, StatefulIterator, StatefulDataset])
def test_an_iterable_epoch_resumed_mid_epoch_yields_exactly_the_run_to_end(
    executor: str, workers: int, dataset: type
) -> None:
    after, again = resumed_run_to_end(dataset(23), 5, executor=executor, num_workers=workers)
    assert again == after
    assert after  # something was left to resume


@WORKERS
@pytest.mark.parametrize("at", range(0, 12))
def test_workers_that_run_dry_at_different_times_take_the_same_turns_after_a_resume(
    at: int,
) -> None:
    # Worker 1 runs dry first, then 0; worker 2 goes on alone: every checkpoint of the epoch.
    dataset = PerWorkerCounts([5, 2, 9])
    after, again = resumed_run_to_end(dataset, at, executor="thread", num_workers=3, batch_size=1)
    assert again == after


@WORKERS
@pytest.mark.parametrize("at", [1, 4])
def test_processes_resume_the_turns_of_workers_that_ran_dry(at: int) -> None:
    dataset = PerWorkerCounts([5, 2])
    after, again = resumed_run_to_end(dataset, at, executor="mp", num_workers=2, batch_size=1)
    assert again == after


@WORKERS
@pytest.mark.parametrize("in_order", [True, False], ids=["in-order", "out-of-order"])
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_a_worker_that_ran_dry_stays_dry_though_its_state_went_back_to_the_start(
    executor: str, workers: int, in_order: bool
) -> None:
    # Worker 0's shard ends with a short batch, after which its iterator's state is the
    # start's again; worker 1 goes on for three more batches. Loading in the main process,
    # the whole dataset ends so. Every checkpoint of the epoch resumes the rest of it.
    options = {"executor": executor, "num_workers": workers, "in_order": in_order}
    dataset = RewindsWhenDry([3, 6])
    batches = len(run_to_end(iter(loader(dataset, **options))))
    for at in range(batches + 1):
        after, again = resumed_run_to_end(dataset, at, **options)
        if in_order:
            assert again == after, f"resumed after {at} batches"
        else:
            assert sorted(again) == sorted(after), f"resumed after {at} batches"


@WORKERS
def test_a_worker_found_dry_before_the_checkpoint_is_not_asked_again_after_it() -> None:
    options = {"executor": "thread", "num_workers": 2}
    original = loader(RewindsWhenDry([3, 10]), **options)
    iterator = iter(original)
    # Batches 0-3, then worker 0's turn finds it dry, then batch 4 (worker 1's): past it.
    take(iterator, 5)
    state = roundtrip(original.state_dict())
    assert state["progress"]["dry"] == [0]
    after = run_to_end(iterator)
    Rewinding.read.clear()
    fresh = loader(RewindsWhenDry([3, 10]), **options)
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == after
    assert [item for item in Rewinding.read if item < 100] == []  # none of worker 0's part


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_batches_prefetched_at_the_checkpoint_are_produced_again(
    executor: str, workers: int
) -> None:
    options = {"executor": executor, "num_workers": workers}
    if workers:
        options["prefetch_factor"] = 4
    original = loader(ShardedRange(40), **options)
    iterator = iter(original)
    take(iterator, 3)  # the workers have loaded ahead of the consumer by now
    state = original.state_dict()
    after = run_to_end(iterator)
    fresh = loader(ShardedRange(40), **options)
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == after


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS[1:])
def test_out_of_order_the_rest_of_an_iterable_epoch_is_every_batch_not_yet_handed_over(
    executor: str, workers: int
) -> None:
    options = {"executor": executor, "num_workers": workers, "in_order": False}
    original = loader(StatefulIterator(30), **options)
    iterator = iter(original)
    before = take(iterator, 4)
    state = original.state_dict()
    run_to_end(iterator)
    fresh = loader(StatefulIterator(30), **options)
    fresh.load_state_dict(state)
    items = [x for batch in before + run_to_end(iter(fresh)) for x in batch]
    assert sorted(items) == list(range(30))


@WORKERS
def test_each_resume_of_an_iterable_epoch_goes_on_from_the_last() -> None:
    options = {"executor": "thread", "num_workers": 2, "batch_size": 1}
    whole = run_to_end(iter(loader(PerWorkerCounts([6, 3]), **options)))
    got: list[Any] = []
    state = None
    while True:
        current = loader(PerWorkerCounts([6, 3]), **options)
        if state is not None:
            current.load_state_dict(state)
        iterator = iter(current)
        step = take(iterator, 1) if len(got) < len(whole) else []
        if not step:
            break
        got += step
        state = current.state_dict()
        del iterator
    assert got == whole


def _pinned_on_cpu(batch: Any) -> Any:
    return batch.clone()  # what a pin stage hands on: a new batch, made in the stage's thread


@WORKERS
@pytest.mark.parametrize("inner", ["thread", "mp"])
def test_a_pin_stage_passes_each_batchs_worker_position_on(inner: str) -> None:
    options = {"num_workers": 2, "executor": pinned(inner, pin=_pinned_on_cpu)}
    after, again = resumed_run_to_end(StatefulIterator(30), 4, **options)
    assert again == after


# --- stateful datasets --------------------------------------------------------------------------


def test_a_stateful_iterator_is_restored_not_read_again() -> None:
    original = loader(StatefulIterator(20), batch_size=4)
    iterator = iter(original)
    take(iterator, 3)
    state = original.state_dict()
    assert state["workers"] == [{"since": 0, "state": {"iterator": {"at": 12}}}]
    Positioned.reads = 0
    fresh = loader(StatefulIterator(20), batch_size=4)
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == [[12, 13, 14, 15], [16, 17, 18, 19]]
    assert Positioned.reads == 8


def test_a_stateful_dataset_is_loaded_before_its_iterator_is_made() -> None:
    original = loader(StatefulDataset(10), batch_size=3)
    iterator = iter(original)
    take(iterator, 2)
    state = original.state_dict()
    assert state["workers"] == [{"since": 0, "state": {"dataset": {"start": 6}}}]
    fresh = loader(StatefulDataset(10), batch_size=3)
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == [[6, 7, 8], [9]]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
@pytest.mark.parametrize("at", [4, 5])
def test_between_snapshots_a_worker_fast_forwards_from_its_last_state(
    executor: str, workers: int, at: int
) -> None:
    options = {"executor": executor, "num_workers": workers, "snapshot_every_n_steps": 3}
    original = loader(StatefulIterator(40), **options)
    iterator = iter(original)
    take(iterator, at)
    state = original.state_dict()
    after = run_to_end(iterator)
    marks = state["workers"]
    assert all(0 <= mark["since"] < 3 for mark in marks)
    fresh = loader(StatefulIterator(40), **options)
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == after


def test_a_dataset_without_state_is_fast_forwarded_over_the_batches_handed_over() -> None:
    original = loader(ShardedRange(9), batch_size=2)
    iterator = iter(original)
    take(iterator, 2)
    assert original.state_dict()["workers"] == [{"since": 2, "state": None}]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_an_error_handed_over_before_the_checkpoint_is_not_raised_again(
    executor: str, workers: int
) -> None:
    options = {"executor": executor, "num_workers": workers, "batch_size": 1}
    original = loader(SkipsAnError(), **options)
    iterator = iter(original)
    with pytest.raises(ValueError, match="item 4 is broken"):
        while True:
            next(iterator)
    state = original.state_dict()
    after = outcomes(iterator)
    fresh = loader(SkipsAnError(), **options)
    fresh.load_state_dict(state)
    assert outcomes(iter(fresh)) == after


def test_a_state_dict_that_raises_fails_that_batch_and_says_why() -> None:
    iterator = iter(loader(StateDictRaises(6)))
    with pytest.raises(RuntimeError, match="no state today") as caught:
        next(iterator)
    assert "state_dict" in "".join(caught.value.__notes__)
    # Every batch's state fails too: each batch raises in its turn, and the epoch still ends.
    assert outcomes(iterator) == [("RuntimeError", "no state today")] * 2


# --- epochs -------------------------------------------------------------------------------------


@WORKERS
def test_a_checkpoint_after_the_last_iterable_batch_resumes_the_next_epoch() -> None:
    original = loader(ShardedRange(6), num_workers=2, executor="thread")
    first = run_to_end(iter(original))
    state = original.state_dict()
    assert state["progress"]["ended"] is True
    fresh = loader(ShardedRange(6), num_workers=2, executor="thread")
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == first


class InterruptedOnceAllDry(Forwarding):
    """Raises KeyboardInterrupt in the first wait after every worker was found dry: a Ctrl-C in
    the `next()` that would have raised the epoch's StopIteration, with nothing left of it."""

    def __init__(self, inner: Executor, workers: int) -> None:
        super().__init__(inner)
        self.workers = workers
        self.dry: set[int] = set()
        self.fired = False

    def poll(self, timeout: float | None) -> Event | None:
        if len(self.dry) == self.workers and not self.fired:
            self.fired = True
            raise KeyboardInterrupt("interrupted after every worker ran dry")
        event = self.inner.poll(timeout)
        if isinstance(event, WorkerExhausted):
            self.dry.add(event.worker)
        return event


def interrupted_once_all_dry(name: str) -> Callable[[Launch], Executor]:
    inner, _ = lookup(name)
    return lambda launch: InterruptedOnceAllDry(inner(launch), launch.num_workers)


@WORKERS
@pytest.mark.parametrize("executor", ["thread", "mp"])
def test_a_state_with_every_worker_dry_before_the_stop_iteration_resumes_an_empty_epoch(
    executor: str,
) -> None:
    # Each worker has one batch; the third task of each is still awaited once both ran dry
    # (prefetch 3), so the interrupt lands in the next() after the last batch.
    options = {"num_workers": 2, "prefetch_factor": 3}
    original = loader(
        PerWorkerCounts((2, 2)), executor=interrupted_once_all_dry(executor), **options
    )
    iterator = iter(original)
    first = take(iterator, 2)
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    state = roundtrip(original.state_dict())
    assert (state["progress"]["ended"], state["progress"]["dry"]) == (True, [0, 1])
    assert state["complete"] is False
    fresh = loader(PerWorkerCounts((2, 2)), executor=executor, **options)
    fresh.load_state_dict(state)
    with pytest.warns(UserWarning, match="yields no batch"):
        assert run_to_end(iter(fresh)) == []
    assert run_to_end(iter(fresh)) == first


@WORKERS
def test_a_checkpoint_in_a_later_epoch_of_persistent_workers_resumes_that_epoch() -> None:
    options = {"executor": "mp", "num_workers": 2, "persistent_workers": True}
    original = loader(StatefulIterator(16), **options)
    run_to_end(iter(original))
    iterator = iter(original)
    take(iterator, 3)
    state = original.state_dict()
    after = run_to_end(iterator)
    fresh = loader(StatefulIterator(16), **options)
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == after


class SeedProbe(IterableDataset[list[int]]):
    def __iter__(self) -> Iterator[list[int]]:
        info = get_worker_info()
        assert info is not None
        for k in range(4):
            yield [info.id, info.num_workers, info.seed % 1000, k]


@WORKERS
def test_resumed_workers_have_the_original_ids_and_seeds() -> None:
    original = loader(SeedProbe(), batch_size=None, num_workers=2, generator=_seeded(5))
    iterator = iter(original)
    take(iterator, 3)
    state = original.state_dict()
    after = run_to_end(iterator)
    fresh = loader(SeedProbe(), batch_size=None, num_workers=2, generator=_seeded(6))
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == after


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the state as data --------------------------------------------------------------------------


@WORKERS
def test_an_iterable_state_is_plain_data_json_and_torch_load_take() -> None:
    original = loader(StatefulIterator(20), num_workers=2)
    iterator = iter(original)
    take(iterator, 3)
    state = original.state_dict()
    assert json.loads(json.dumps(state)) == roundtrip(state)
    fresh = loader(StatefulIterator(20), num_workers=2)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert run_to_end(iter(fresh)) == run_to_end(iterator)


@pytest.mark.parametrize(("taken", "loaded"), [(2, 3), (0, 1), (2, 0)])
def test_an_iterable_state_under_another_num_workers_is_refused_naming_both(
    taken: int, loaded: int
) -> None:
    state = loader(ShardedRange(8), num_workers=taken).state_dict()
    fresh = loader(ShardedRange(8), num_workers=loaded)
    with pytest.raises(ValueError, match=f"num_workers={taken}.*num_workers={loaded}"):
        fresh.load_state_dict(state)


def test_a_state_taken_before_iter_resumes_the_first_iterable_epoch() -> None:
    original = loader(ShardedRange(5))
    state = original.state_dict()
    fresh = loader(ShardedRange(5))
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == run_to_end(iter(original))


CARRYING = [
    pytest.param("inline", 0, id="inline"),
    pytest.param("thread", 2, id="thread-2-persistent"),
    pytest.param("mp", 2, id="mp-2-persistent"),
]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), CARRYING)
def test_a_state_between_epochs_carries_each_datasets_own_state_into_the_next_epoch(
    executor: str, workers: int
) -> None:
    options = {"executor": executor, "num_workers": workers, "persistent_workers": workers > 0}
    uninterrupted = loader(CountsEpochs(8), **options)
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(3)]
    original = loader(CountsEpochs(8), **options)
    run_to_end(iter(original))
    state = roundtrip(original.state_dict())
    fresh = loader(CountsEpochs(8), **options)
    take(iter(fresh), 1)  # elsewhere in its own first epoch when the state is loaded
    fresh.load_state_dict(state)
    assert [run_to_end(iter(fresh)) for _ in range(2)] == epochs[1:]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), CARRYING)
def test_a_state_taken_as_the_next_epoch_starts_holds_what_the_last_one_left_in_each_dataset(
    executor: str, workers: int
) -> None:
    # After iter() and before any batch of the second epoch. (Not later: CountsEpochs's state
    # does not say where in an epoch it stands.)
    taken = 0
    options = {"executor": executor, "num_workers": workers, "persistent_workers": workers > 0}
    uninterrupted = loader(CountsEpochs(8), **options)
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(3)]
    original = loader(CountsEpochs(8), **options)
    run_to_end(iter(original))
    second = iter(original)
    take(second, taken)
    state = roundtrip(original.state_dict())
    fresh = loader(CountsEpochs(8), **options)
    fresh.load_state_dict(state)
    assert [run_to_end(iter(fresh)) for _ in range(2)] == [epochs[1][taken:], epochs[2]]


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), CARRYING)
def test_a_state_taken_before_any_epoch_carries_nothing_into_the_first(
    executor: str, workers: int
) -> None:
    # No epoch ended before it: no part is run dry first (CountsItems would count its items).
    options = {"executor": executor, "num_workers": workers, "persistent_workers": workers > 0}
    first = run_to_end(iter(loader(CountsItems(7), **options)))
    state = roundtrip(loader(CountsItems(7), **options).state_dict())
    resumed = loader(CountsItems(7), **options)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == first


@WORKERS
@pytest.mark.parametrize("taken", [0, 2])
@pytest.mark.parametrize(("executor", "workers"), CARRYING)
def test_a_state_taken_in_the_epoch_after_a_break_holds_where_each_part_was_left(
    executor: str, workers: int, taken: int
) -> None:
    # Persistent workers broken out of had loaded batches ahead, which their datasets count,
    # and left their parts before the end (not read further: worker 0's with `taken=0`),
    # except where a short last batch ran one dry (worker 1's 5 items, in twos). In the main
    # process the loader's own dataset was left at the last batch handed over. A resume
    # before the first batch of the next epoch counts on from there.
    options = {"executor": executor, "num_workers": workers, "persistent_workers": workers > 0}

    def after_a_break(loader_: DataLoader[Any]) -> Iterator[Any]:
        run_to_end(iter(loader_))
        broken = iter(loader_)
        take(broken, taken)
        del broken
        return iter(loader_)

    uninterrupted = loader(CountsItems(11), **options)
    following = run_to_end(after_a_break(uninterrupted))
    original = loader(CountsItems(11), **options)
    after_a_break(original)
    state = roundtrip(original.state_dict())
    resumed = loader(CountsItems(11), **options)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == following


@WORKERS
@pytest.mark.parametrize("executor", ["thread", "mp"])
def test_a_resumed_epoch_of_persistent_workers_resumes_again_before_every_worker_had_a_batch(
    executor: str,
) -> None:
    # The first resume's positions are of this same epoch, not what an epoch before left: a
    # worker without a batch since then goes on from its position, its part not run dry first
    # (CountsEpochs would count an epoch more). Positions by fast-forward: its state does not
    # hold them.
    options = {
        "executor": executor,
        "num_workers": 3,
        "persistent_workers": True,
        "snapshot_every_n_steps": None,
    }
    original = loader(CountsEpochs(36), **options)
    iterator = iter(original)
    take(iterator, 7)
    first = roundtrip(original.state_dict())
    resumed = loader(CountsEpochs(36), **options)
    resumed.load_state_dict(first)
    again = iter(resumed)
    take(again, 1)
    second = roundtrip(resumed.state_dict())
    after = run_to_end(again)
    twice = loader(CountsEpochs(36), **options)
    twice.load_state_dict(second)
    assert run_to_end(iter(twice)) == after


@WORKERS
def test_persistent_workers_resumed_between_epochs_go_on_with_their_random_streams() -> None:
    # The dataset has no state; its iterator's, restored at the last batch and run dry again,
    # puts each worker's generator where the original's epoch left it.
    def build() -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(4)
        options = {"num_workers": 2, "persistent_workers": True, "generator": generator}
        return loader(DrawsAsItGoes(10), executor="mp", **options)

    second, resumed = resumed_between_epochs(build)
    assert resumed == second


def test_a_state_taken_before_the_first_batch_resumes_a_reused_dataset_from_the_epochs_start() -> (
    None
):
    # In the main process the loader's dataset is the program's own object: one that is its
    # own iterator stands wherever the last run left it, here at its end.
    dataset = ItsOwnIterator(9)
    original = loader(dataset, executor="inline")
    iterator = iter(original)
    state = roundtrip(original.state_dict())
    after = run_to_end(iterator)
    fresh = loader(dataset, executor="inline")
    fresh.load_state_dict(state)
    assert run_to_end(iter(fresh)) == after
    assert after  # the whole epoch
