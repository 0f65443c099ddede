"""What cannot resume on another number of ranks is refused, naming what differs and what would
work: nothing resumes another stream of samples silently."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from _checkpoints import take
from _datasets import Numbers, StatefulIterator
from torch.utils.data import BatchSampler, DistributedSampler

from statecore import DataLoader
from statecore.executors import merge_state_dicts

LENGTH = 23


def sampler(world: int, rank: int, *, length: int = LENGTH, **options: Any) -> Any:
    chosen = {"seed": 5, "shuffle": True, "drop_last": False, **options}
    made = DistributedSampler(Numbers(length), num_replicas=world, rank=rank, **chosen)
    made.set_epoch(1)
    return made


def loader(world: int, rank: int, *, length: int = LENGTH, **options: Any) -> DataLoader[Any]:
    return DataLoader(
        Numbers(length), batch_size=2, sampler=sampler(world, rank, length=length, **options)
    )


def merged_state(world: int = 2) -> dict[str, Any]:
    """Every rank of `world` two batches into epoch 1, their states merged."""
    loaders = [loader(world, rank) for rank in range(world)]
    for each in loaders:
        take(iter(each), 2)
    return merge_state_dicts([each.state_dict() for each in loaders])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"seed": 6}, "DistributedSampler of seed=5, and this loader's has seed=6"),
        ({"shuffle": False}, "DistributedSampler of shuffle=True, and this loader's has shuffle"),
        ({"drop_last": True}, "of drop_last=False, and this loader's has drop_last=True"),
        ({"length": 30}, "dataset_length=23, and this loader has dataset_length=30"),
    ],
    ids=["seed", "shuffle", "drop_last", "length"],
)
def test_a_sampler_of_another_epoch_is_refused_naming_both_values(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        loader(3, 0, **options).load_state_dict(merged_state())


def test_one_ranks_state_is_refused_on_other_ranks_saying_how_to_gather_every_ranks() -> None:
    alone = loader(2, 0)
    take(iter(alone), 2)
    with pytest.raises(ValueError, match=r"rank 0 only, of 2 ranks.*merge_state_dicts"):
        loader(3, 1).load_state_dict(alone.state_dict())


def test_a_multi_rank_state_is_refused_by_a_loader_without_a_distributed_sampler() -> None:
    plain = DataLoader(Numbers(LENGTH), batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match=r"\(RandomSampler\) is not distributed-aware.*seed=5"):
        plain.load_state_dict(merged_state())


def test_a_distributed_state_is_refused_by_an_iterable_datasets_loader_as_any_map_state() -> None:
    # Not with advice to give an iterable dataset's loader a DistributedSampler.
    iterable = DataLoader(StatefulIterator(20), batch_size=2)
    with pytest.raises(ValueError, match="cannot load this DataLoader state") as refused:
        iterable.load_state_dict(merged_state())
    assert "DistributedSampler" not in str(refused.value)


class OwnSplit(DistributedSampler):  # type: ignore[type-arg]
    """A distributed sampler that splits the epoch its own way."""

    def __iter__(self) -> Iterator[Any]:
        return iter(list(super().__iter__())[::-1])


def test_a_distributed_sampler_that_splits_its_own_way_is_refused_on_other_ranks() -> None:
    own = OwnSplit(Numbers(LENGTH), num_replicas=3, rank=0, seed=5)
    own.set_epoch(1)
    with pytest.raises(ValueError, match=r"OwnSplit, draws its own split .*resume on the state's"):
        DataLoader(Numbers(LENGTH), batch_size=2, sampler=own).load_state_dict(merged_state())


class Pairs(BatchSampler):
    """Not torch's BatchSampler: its batches of a share are its own."""


def test_a_batch_sampler_other_than_torchs_is_refused_on_other_ranks() -> None:
    batches = Pairs(sampler(3, 0), batch_size=2, drop_last=False)
    with pytest.raises(ValueError, match=r"Pairs, is not torch's BatchSampler"):
        DataLoader(Numbers(LENGTH), batch_sampler=batches).load_state_dict(merged_state())


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A process group of this process alone."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_iterable_datasets_state_is_refused_on_another_number_of_ranks(
    one_rank_group: None,
) -> None:
    taken = DataLoader(StatefulIterator(20), batch_size=2)
    take(iter(taken), 2)
    state = taken.state_dict()
    assert state["process_group"] == {"rank": 0, "world_size": 1}
    state["process_group"] = {"rank": 0, "world_size": 2}  # as rank 0 of 2 would have saved it
    with pytest.raises(ValueError, match=r"iterable dataset's state taken on rank 0 of 2 .*"):
        DataLoader(StatefulIterator(20), batch_size=2).load_state_dict(state)


def test_with_a_process_group_state_dict_gathers_every_ranks_progress(
    one_rank_group: None,
) -> None:
    taken = loader(1, 0)
    take(iter(taken), 3)
    assert taken.state_dict()["distributed"]["ranks"] == [{"done": 3, "also": []}]


def test_state_dict_without_gathering_calls_no_collective_and_holds_its_own_rank_only(
    one_rank_group: None,
) -> None:
    taken = loader(1, 0)
    take(iter(taken), 3)
    state = taken.state_dict(gather=False)  # as code that saves on rank 0 alone calls it
    assert state["distributed"]["ranks"] is None
    assert state["progress"]["done"] == 3


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("rank", 2, r"distributed\.rank holds 2; expected an int from 0 to 1"),
        ("shuffle", 1, r"distributed\.shuffle holds 1; expected True or False"),
        ("ranks", [{"done": 1, "also": []}], r"distributed\.ranks holds .*one progress per rank"),
        ("earlier", [{"world_size": 0}], r"distributed\.earlier\[0\]\.world_size holds 0"),
    ],
    ids=["rank", "shuffle", "ranks", "earlier"],
)
def test_a_corrupted_distributed_entry_is_refused_naming_the_field(
    field: str, value: Any, named: str
) -> None:
    state = merged_state()
    state["distributed"][field] = value
    with pytest.raises(ValueError, match=named):
        loader(3, 0).load_state_dict(state)
