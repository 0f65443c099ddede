"""A DistributedSampler's epoch checkpointed on N ranks resumes on M, in one process.

Each rank is a loader with its own `DistributedSampler(num_replicas=N, rank=r)`; their states,
saved one per rank, are merged (`merge_state_dicts`) as a framework saving one file per rank
would; `tests/test_elastic_ddp.py` does the same with real processes and a process group.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from _checkpoints import roundtrip, run_to_end, take
from _datasets import Numbers
from torch.utils.data import DistributedSampler

from statecore import DataLoader
from statecore.executors import merge_state_dicts

LENGTH = 23
SEED = 5


def ranks(world: int, *, epoch: int = 1, drop_last: bool = False, **options: Any) -> list[Any]:
    loaders = []
    for rank in range(world):
        sampler = DistributedSampler(
            Numbers(LENGTH), num_replicas=world, rank=rank, seed=SEED, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        loaders.append(DataLoader(Numbers(LENGTH), batch_size=2, sampler=sampler, **options))
    return loaders


def samples(batches: list[Any]) -> list[int]:
    return [i for batch in batches for i in batch]


def interrupted(old: int, new: int, at: int, **options: Any) -> tuple[Counter[int], list[Any]]:
    """(the samples of one epoch begun on `old` ranks, `at` batches each, then finished on
    `new` ranks; the loaders of the new ranks, for their next epochs)."""
    before = ranks(old, **options)
    iterators = [iter(loader) for loader in before]
    seen = Counter(i for it in iterators for i in samples(take(it, at)))
    merged = roundtrip(merge_state_dicts([roundtrip(loader.state_dict()) for loader in before]))
    after = ranks(new, **options)
    for loader in after:
        loader.load_state_dict(merged)
    rest = [run_to_end(iter(loader)) for loader in after]
    assert len({len(batches) for batches in rest}) == 1, "the new ranks are not in lock-step"
    seen.update(i for batches in rest for i in samples(batches))
    return seen, after


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (2, 1), (1, 2)])
def test_every_sample_is_consumed_once_over_an_epoch_resumed_on_another_number_of_ranks(
    old: int, new: int
) -> None:
    seen, _ = interrupted(old, new, at=2)
    # Padding repeats at most new - 1 samples (the old ranks had theirs not handed over yet).
    assert set(seen) == set(range(LENGTH))
    assert sum(seen.values()) - LENGTH < new


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2)])
def test_the_next_epoch_is_distributed_samplers_own_for_the_new_ranks(old: int, new: int) -> None:
    _, after = interrupted(old, new, at=2)
    for loader in after:
        loader.sampler.set_epoch(2)
    uninterrupted = ranks(new, epoch=2)
    assert [run_to_end(iter(loader)) for loader in after] == [
        run_to_end(iter(loader)) for loader in uninterrupted
    ]


def test_with_drop_last_no_sample_is_consumed_twice() -> None:
    seen, _ = interrupted(3, 2, at=1, drop_last=True)
    assert max(seen.values()) == 1
    # The old ranks left out 23 % 3 = 2 samples, the new ones at most 1 of the rest.
    assert LENGTH - len(seen) <= 1


@pytest.mark.timeout(120)
def test_the_new_ranks_may_load_with_workers() -> None:
    seen, _ = interrupted(2, 3, at=2, num_workers=2, executor="thread")
    assert set(seen) == set(range(LENGTH))


def test_an_epoch_resumed_on_other_ranks_resumes_again_on_yet_others() -> None:
    before = ranks(2)
    iterators = [iter(loader) for loader in before]
    seen = Counter(i for it in iterators for i in samples(take(it, 2)))
    merged = merge_state_dicts([loader.state_dict() for loader in before])
    middle = ranks(3)
    for loader in middle:
        loader.load_state_dict(merged)
    iterators = [iter(loader) for loader in middle]
    seen.update(i for it in iterators for i in samples(take(it, 1)))
    merged = roundtrip(merge_state_dicts([loader.state_dict() for loader in middle]))
    after = ranks(2)
    for loader in after:
        loader.load_state_dict(merged)
    seen.update(i for loader in after for i in samples(run_to_end(iter(loader))))
    assert set(seen) == set(range(LENGTH))
    assert sum(seen.values()) - LENGTH < 3


@pytest.mark.parametrize("new", [2, 3])
def test_a_mid_epoch_state_resumes_its_own_epoch_before_set_epoch_is_called(new: int) -> None:
    # Lightning makes the resumed loader's iterator before it calls set_epoch.
    before = ranks(2, epoch=3)
    iterators = [iter(loader) for loader in before]
    got = {i for it in iterators for i in samples(take(it, 2))}
    merged = merge_state_dicts([loader.state_dict() for loader in before])
    rest = [run_to_end(it) for it in iterators]
    after = ranks(new, epoch=0)
    for loader in after:
        loader.load_state_dict(merged)
    resumed = [run_to_end(iter(loader)) for loader in after]
    if new == 2:
        assert resumed == rest
    else:
        # The same samples, shared out among 3; the old split's padding repeated one received.
        left = {i for r in rest for i in samples(r)} - got
        assert {i for r in resumed for i in samples(r)} == left


def test_len_of_a_loader_resumed_on_other_ranks_counts_its_batches_of_the_epoch() -> None:
    # 23 samples, 2 ranks, 2 batches of 2 each taken: 15 left, 5 per rank of 3: 3 batches.
    before = ranks(2)
    for loader in before:
        take(iter(loader), 2)
    merged = merge_state_dicts([loader.state_dict() for loader in before])
    resumed = ranks(3)[0]
    resumed.load_state_dict(merged)
    assert len(resumed) == 2 + 3  # those yielded before the checkpoint, and its share's
    iterator = iter(resumed)
    assert len(resumed) == 5
    assert len(run_to_end(iterator)) == 3
    resumed.sampler.set_epoch(2)  # type: ignore[attr-defined]
    iter(resumed)
    assert len(resumed) == 4  # DistributedSampler's 8 samples for each of 3 ranks


@pytest.mark.timeout(120)
def test_out_of_order_loading_on_the_old_ranks_still_finishes_the_epoch_exactly() -> None:
    seen, _ = interrupted(3, 2, at=3, num_workers=2, executor="thread", in_order=False)
    assert set(seen) == set(range(LENGTH))
    assert sum(seen.values()) - LENGTH < 3 + 2


def test_a_gathered_state_is_plain_data() -> None:
    state = merge_state_dicts([loader.state_dict() for loader in ranks(2)])
    assert json.loads(json.dumps(state["distributed"])) == {
        "world_size": 2,
        "rank": 0,
        "seed": SEED,
        "epoch": 1,
        "shuffle": True,
        "drop_last": False,
        "padding": 1,
        "earlier": [],
        "ranks": [{"done": 0, "also": []}, {"done": 0, "also": []}],
    }
