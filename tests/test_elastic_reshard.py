"""The pure resharding of a distributed epoch (statecore/_reshard.py): an epoch begun on N ranks
and finished on M consumes every sample once, in lock-step, as DistributedSampler would."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from statecore import Progress
from statecore._reshard import (
    EpochSplit,
    RankMergeError,
    RankPart,
    handed_positions,
    merge_ranks,
    received_samples,
    reshard,
)


def distributed_epoch(
    length: int, world: int, rank: int, shuffle: bool, seed: int, epoch: int, drop_last: bool
) -> list[int]:
    sampler = DistributedSampler(
        range(length),  # type: ignore[arg-type]
        num_replicas=world,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> tuple[int, ...]:
    """The epoch's order as DistributedSampler draws it: its one-rank epoch, unpadded."""
    return tuple(distributed_epoch(length, 1, 0, shuffle, seed, epoch, False))


@st.composite
def epochs(draw: Any) -> dict[str, Any]:
    return {
        "order": tuple(draw(st.permutations(range(draw(st.integers(0, 40)))))),
        "drop_last": draw(st.booleans()),
        "batch_size": draw(st.one_of(st.none(), st.integers(1, 5))),
        "drop_batch": draw(st.booleans()),
        "old": draw(st.integers(1, 6)),
        "new": draw(st.integers(1, 6)),
    }


def batch_count(samples: int, batch_size: int | None, drop_batch: bool) -> int:
    if batch_size is None:
        return samples
    return samples // batch_size if drop_batch else -(-samples // batch_size)


@st.composite
def progress_of(
    draw: Any, split: EpochSplit, batch_size: int | None, drop_batch: bool
) -> list[Any]:
    """Any pattern of positions handed over: ranks at different points, with holes."""
    count = batch_count(split.per_rank, batch_size, drop_batch)
    return [
        draw(st.frozensets(st.integers(0, count - 1) if count else st.nothing()))
        for _ in range(split.world_size)
    ]


def samples_at(share: tuple[int, ...], positions: Any, batch_size: int | None) -> list[int]:
    size = 1 if batch_size is None else batch_size
    return [i for p in sorted(positions) for i in share[p * size : (p + 1) * size]]


@given(st.data(), epochs())
def test_each_remaining_sample_goes_to_exactly_one_new_rank_and_none_handed_over_again(
    data: Any, epoch: dict[str, Any]
) -> None:
    split = EpochSplit(epoch["order"], epoch["old"], epoch["drop_last"])
    size, drop_batch = epoch["batch_size"], epoch["drop_batch"]
    positions = data.draw(progress_of(split, size, drop_batch))
    before = {i for r, done in enumerate(positions) for i in samples_at(split.share(r), done, size)}
    after = reshard(split, positions, epoch["new"], size, drop_batch)
    remaining = [i for i in epoch["order"] if i not in before]
    later = Counter(i for share in after.shares() for i in share)
    assert not later.keys() & before
    if epoch["drop_last"]:
        # Cut to a multiple of the ranks: the remainder's last few are left out, none repeated.
        assert set(later) == set(remaining[: len(remaining) - len(remaining) % epoch["new"]])
        assert max(later.values(), default=1) == 1
    else:
        # Padded: every remaining sample, and up to M - 1 of the first repeated.
        assert set(later) == set(remaining)
        assert sum(later.values()) - len(remaining) == after.padding < epoch["new"]
        repeated = Counter(later) - Counter(remaining)
        cycle = remaining * (after.padding // max(len(remaining), 1) + 1)
        assert repeated == Counter(cycle[: after.padding])


@given(st.data(), epochs())
def test_every_new_rank_gets_as_many_samples_so_ddp_stays_in_lock_step(
    data: Any, epoch: dict[str, Any]
) -> None:
    split = EpochSplit(epoch["order"], epoch["old"], epoch["drop_last"])
    positions = data.draw(progress_of(split, epoch["batch_size"], epoch["drop_batch"]))
    after = reshard(split, positions, epoch["new"], epoch["batch_size"], epoch["drop_batch"])
    assert {len(share) for share in after.shares()} == {after.per_rank}


@given(
    length=st.integers(0, 40),
    old=st.integers(1, 6),
    new=st.integers(1, 6),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
    batch_size=st.one_of(st.none(), st.integers(1, 5)),
)
def test_with_nothing_handed_over_the_new_split_is_distributed_samplers_own_epoch(
    length: int,
    old: int,
    new: int,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    epoch: int,
    batch_size: int | None,
) -> None:
    order = epoch_order(length, shuffle, seed, epoch)
    split = EpochSplit(order, old, drop_last)
    after = reshard(split, [frozenset()] * old, new, batch_size)
    assert [list(share) for share in after.shares()] == [
        distributed_epoch(length, new, r, shuffle, seed, epoch, drop_last) for r in range(new)
    ]


@given(
    length=st.integers(0, 40),
    world=st.integers(1, 6),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_a_split_with_nothing_consumed_is_distributed_samplers_epoch(
    length: int, world: int, shuffle: bool, drop_last: bool, seed: int
) -> None:
    split = EpochSplit(epoch_order(length, shuffle, seed, 3), world, drop_last)
    assert [list(split.share(r)) for r in range(world)] == [
        distributed_epoch(length, world, r, shuffle, seed, 3, drop_last) for r in range(world)
    ]


@given(st.data(), epochs(), st.integers(1, 6))
def test_an_epoch_resharded_twice_still_consumes_each_sample_at_most_once_beyond_padding(
    data: Any, epoch: dict[str, Any], third: int
) -> None:
    size, drop_batch = epoch["batch_size"], epoch["drop_batch"]
    split = EpochSplit(epoch["order"], epoch["old"], epoch["drop_last"])
    consumed: Counter[int] = Counter()
    for world in (epoch["new"], third):
        positions = data.draw(progress_of(split, size, drop_batch))
        # Padding may repeat a sample within one split; one split never repeats another's.
        got = {
            i for r, done in enumerate(positions) for i in samples_at(split.share(r), done, size)
        }
        assert not got & set(consumed)
        consumed.update(got)
        split = reshard(split, positions, world, size, drop_batch)
    assert split.consumed == set(consumed)
    assert {len(share) for share in split.shares()} == {split.per_rank}


def test_received_maps_batch_positions_to_the_shares_indices() -> None:
    split = EpochSplit(tuple(range(10)), 2, False)  # rank 1: 1, 3, 5, 7, 9
    assert received_samples(split, 1, {0, 2}, batch_size=2) == {1, 3, 9}


def test_positions_beyond_a_ranks_batches_are_refused() -> None:
    split = EpochSplit(tuple(range(10)), 2, False)
    with pytest.raises(ValueError, match=r"rank 0 of 2 has 2 batches this epoch.*\[2\]"):
        received_samples(split, 0, {2}, batch_size=2, drop_batch=True)


def test_a_reshard_needs_every_old_ranks_progress() -> None:
    with pytest.raises(ValueError, match="split among 3 ranks, and progress is given for 2"):
        reshard(EpochSplit(tuple(range(9)), 3, False), [frozenset(), frozenset()], 2, None)


def test_handed_counts_the_positions_in_order_and_those_out_of_order() -> None:
    assert handed_positions(Progress(done=3, also=frozenset({5, 7}))) == {0, 1, 2, 5, 7}


def test_merge_orders_the_ranks_progress_by_rank() -> None:
    a, b = Progress(done=2), Progress(done=1, also=frozenset({3}))
    parts = [RankPart(1, 2, "e", b), RankPart(0, 2, "e", a)]
    assert merge_ranks(parts) == (a, b)


def part(rank: int, world: int, epoch: str = "e", done: int = 0) -> RankPart:
    return RankPart(rank, world, epoch, Progress(done=done))


@pytest.mark.parametrize(
    ("parts", "named"),
    [
        ([RankPart(0, 3, "e", Progress()), RankPart(2, 3, "e", Progress())], r"ranks \[1\] of 3"),
        ([RankPart(0, 2, "e", Progress()), RankPart(1, 3, "e", Progress())], "taken on 3 ranks"),
        (
            [RankPart(0, 2, "e", Progress()), RankPart(1, 2, "f", Progress())],
            "another epoch or split",
        ),
        ([RankPart(0, 1, "e", Progress()), RankPart(0, 1, "e", Progress(done=1))], "disagree"),
        ([], "no rank"),
    ],
    ids=["missing", "world-size", "epoch", "disagreeing", "empty"],
)
def test_merge_refuses_parts_that_are_not_one_epochs_naming_why(
    parts: list[RankPart], named: str
) -> None:
    with pytest.raises(RankMergeError, match=named):
        merge_ranks(parts)
