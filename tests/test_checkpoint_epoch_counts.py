"""Checkpoints of an iterable dataset whose own state changes between epochs (`CountsEpochs`
counts them as its iterator runs dry; the loader machine's `CountingParts`, with a given number
of items per worker, too): a resumed loader's epochs carry the count the uninterrupted run's
do, however the epochs before the checkpoint were left."""

from __future__ import annotations

from typing import Any

import pytest
from _checkpoints import roundtrip, run_to_end
from _datasets import CountsEpochs
from _side_by_side import WORKERS, as_lists

from statecore import DataLoader
from statecore.models.loader import CountsEpochs as CountingParts

RUNS = [
    pytest.param("inline", 0, id="inline"),
    pytest.param("thread", 1, id="thread-1-persistent"),
    pytest.param("mp", 1, id="mp-1-persistent"),
]


def loader(executor: str, workers: int) -> DataLoader[Any]:
    return DataLoader(
        CountsEpochs(2),
        batch_size=1,
        executor=executor,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


@WORKERS
@pytest.mark.parametrize("ended", [0, 1], ids=["first-epoch-broken", "after-an-epoch"])
@pytest.mark.parametrize(("executor", "workers"), RUNS)
def test_an_epoch_broken_off_before_its_first_batch_counts_no_epoch_on_resume(
    executor: str, workers: int, ended: int
) -> None:
    # The broken epoch's part was never read, so it did not run dry: the dataset still counts
    # the epochs that ended before it as the next epoch starts, and a state taken there
    # resumes with that count, not one more.
    original = loader(executor, workers)
    for _ in range(ended):
        run_to_end(iter(original))
    broken = iter(original)
    del broken
    following = iter(original)
    state = roundtrip(original.state_dict())
    expected = run_to_end(following)
    resumed = loader(executor, workers)
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == expected == [[[0], [ended]], [[1], [ended]]]


@WORKERS
@pytest.mark.parametrize("executor", ["thread", "mp"])
def test_a_part_found_dry_before_the_checkpoint_counts_its_epoch_in_persistent_workers(
    executor: str,
) -> None:
    # Worker 0's one item is its short first batch; worker 1's four come in two batches, the
    # second handed over only once worker 0 was found dry (in order, its turn comes first). The
    # resumed epoch asks worker 0 nothing more, yet its part ran dry in the original, which
    # counted that epoch: the persistent worker's next epochs must count it too.
    def build() -> DataLoader[Any]:
        return DataLoader(
            CountingParts((1, 4)),
            batch_size=2,
            num_workers=2,
            persistent_workers=True,
            executor=executor,
        )

    uninterrupted = build()
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(3)]
    original = build()
    first = iter(original)
    handed = [next(first) for _ in range(3)]
    state = roundtrip(original.state_dict())
    assert 0 in state["progress"]["dry"]
    resumed = build()
    resumed.load_state_dict(state)
    rest = [run_to_end(iter(resumed)) for _ in range(3)]
    assert [as_lists(handed) + rest[0], *rest[1:]] == epochs
    assert epochs[2] == [[2000], [2100, 2101], [2102, 2103]]
