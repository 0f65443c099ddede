"""A state taken in the epoch after a resumed one, where the checkpoint that epoch resumed had
found a worker's part of an iterable dataset dry.

The resumed epoch asks that worker nothing (`progress.dry`), so its driver never hears it
answer an exhaustion; its part still ran dry in that epoch, as the original's had. Persistent
workers carry their datasets into the next epoch, and a state taken there (before the worker's
first batch of it) records where each part stood as that epoch began, run dry or left open
(`carried_open`, after a `break`). A dry part counted as open would be resumed without being
run dry, and a dataset that counts its epochs as its part runs dry (`CountsEpochs` of the
loader machine: worker k's item j of epoch e is 1000 * e + 100 * k + j) would repeat the
count. The loaders here are compared with an uninterrupted run, batch for batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _checkpoints import roundtrip, run_to_end, take
from _side_by_side import WORKERS

from statecore import DataLoader
from statecore.models.loader import CountsEpochs

EXECUTORS = ["thread", "mp"]

COUNTS = (2, 12)
"""Worker 0's part is one batch, found dry by worker 0's second turn (before the third batch
is handed over); worker 1's six batches are more than its prefetched tasks reach after the
epoch's first four: a `break` there leaves its part open, whatever the workers' speed."""


def build(executor: str) -> DataLoader[Any]:
    return DataLoader(
        CountsEpochs(COUNTS),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        executor=executor,
    )


def found_dry(executor: str, batches: int) -> dict[str, Any]:
    """A state taken after `batches` of the first epoch, with worker 0 found dry."""
    original = build(executor)
    iterator = iter(original)
    take(iterator, batches)
    state = roundtrip(original.state_dict())
    assert state["progress"]["dry"] == [0]
    return state


def broken_after(iterator: Iterator[Any], batches: int) -> list[Any]:
    """The first `batches` of the epoch, then the loop is left."""
    return take(iterator, batches)


@WORKERS
@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_state_after_a_resumed_epoch_broken_out_of_keeps_the_dry_part_run_dry(
    executor: str,
) -> None:
    # The uninterrupted program takes 4 batches of the first epoch and breaks, then runs two
    # epochs. The interrupted one saves after 3 batches, resumes, takes the 4th and breaks,
    # saves as the next epoch starts, and resumes from that.
    uninterrupted = build(executor)
    broken_after(iter(uninterrupted), 4)
    expected = [run_to_end(iter(uninterrupted)) for _ in range(2)]
    resumed = build(executor)
    resumed.load_state_dict(found_dry(executor, 3))
    broken_after(iter(resumed), 1)
    following = iter(resumed)
    state = roundtrip(resumed.state_dict())
    del following
    again = build(executor)
    again.load_state_dict(state)
    assert [run_to_end(iter(again)) for _ in range(2)] == expected
    assert expected[0][0] == [1000, 1001]  # worker 0's part counts the first epoch
    assert 0 not in state.get("carried_open", [])  # its part ran dry: not left open


@WORKERS
@pytest.mark.parametrize("taken", [0, 1, 2])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_state_after_a_resumed_epoch_run_to_its_end_resumes_the_next_exactly(
    executor: str, taken: int
) -> None:
    # Holds without a break: the resumed epoch ended, and its state names every part as run
    # dry (its end), so the next epoch's state carries none open. `taken` 0 is before worker
    # 0's batch of that epoch, 1 and 2 after it and before worker 1's second.
    uninterrupted = build(executor)
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(3)]
    resumed = build(executor)
    resumed.load_state_dict(found_dry(executor, 3))
    assert run_to_end(iter(resumed)) == epochs[0][3:]
    following = iter(resumed)
    assert take(following, taken) == epochs[1][:taken]
    state = roundtrip(resumed.state_dict())
    del following
    again = build(executor)
    again.load_state_dict(state)
    assert [run_to_end(iter(again)) for _ in range(2)] == [epochs[1][taken:], epochs[2]]


@WORKERS
@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_state_taken_two_epochs_on_restores_a_part_that_never_took_a_state_of_its_own(
    executor: str,
) -> None:
    # Worker 1's part is one short batch: its iterator runs dry on every batch it gives, so it
    # never takes a state of its own, and its marks named the last state taken, of an epoch
    # before. In the third epoch, before worker 1's batch, its part stands where the second
    # left it (run dry, its count moved on twice); restored from that stale state it gave the
    # second epoch's batch again ([1100] for [2100]). Found by the dry-worker machine.
    def three_workers() -> DataLoader[Any]:
        return DataLoader(
            CountsEpochs((3, 1, 5)), batch_size=2, num_workers=3, persistent_workers=True,
            executor=executor,
        )  # fmt: skip

    uninterrupted = three_workers()
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(3)]
    original = three_workers()
    run_to_end(iter(original))
    run_to_end(iter(original))
    third = iter(original)
    assert take(third, 1) == epochs[2][:1]
    state = roundtrip(original.state_dict())
    del third
    resumed = three_workers()
    resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == epochs[2][1:]
    assert epochs[2][1] == [2100]
