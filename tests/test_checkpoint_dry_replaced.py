"""A persistent worker of an iterable dataset lost after its part ran dry, and replaced
(`worker_restarts`): the batches of the epochs after it are an uninterrupted run's.

The lost worker's part had run dry, and its dataset moved on as it did (`CountsEpochs` of the
loader machine counts its epochs as its part runs dry: worker k's item j of epoch e is
1000 * e + 100 * k + j). Its replacement is restored to the lost worker's last batch, which is
before that. The scheduler may ask it nothing more in the epoch (its end known already), so the
replacement reads its part to its end as its next epoch starts, as a worker the checkpoint
found dry does (`RanDry`, `WorkerSetup.resume_dry`). A worker that a resumed checkpoint had
found dry answers no exhaustion in the resumed epoch, and is dry all the same: lost between
that epoch and the next, it is brought to where it ran dry, not left open.
"""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import pytest
from _checkpoints import roundtrip, run_to_end, take
from _processes import wait_gone
from _side_by_side import WORKERS

from statecore import DataLoader, WorkerRestartedWarning
from statecore.models.loader import CountsEpochs, Switchboard

COUNTS = (2, 7)
"""Worker 0's part is one batch, found dry by its second turn (before the third batch is
handed over); worker 1's part is four batches, the last one short: five batches an epoch."""


def build(board: Switchboard) -> DataLoader[Any]:
    return DataLoader(
        CountsEpochs(COUNTS),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        worker_restarts=2,
        executor=board.factory("mp"),
    )


def kill(board: Switchboard, worker: int) -> None:
    """SIGKILL `worker`'s process, and wait until it is gone."""
    pid = board.executors[-1].inner.processes[worker].pid
    os.kill(pid, signal.SIGKILL)
    assert not wait_gone([pid], 30)


def uninterrupted(epochs: int) -> list[Any]:
    loader = build(Switchboard())
    return [run_to_end(iter(loader)) for _ in range(epochs)]


def resumed_with_worker_0_dry(board: Switchboard) -> DataLoader[Any]:
    """A loader resumed from a state taken after 3 batches, worker 0 found dry."""
    original = build(Switchboard())
    iterator = iter(original)
    take(iterator, 3)
    state = roundtrip(original.state_dict())
    assert state["progress"]["dry"] == [0]
    del iterator
    loader = build(board)
    loader.load_state_dict(state)
    return loader


@WORKERS
def test_a_worker_the_resumed_checkpoint_found_dry_lost_after_that_epoch_counts_epochs() -> None:
    # Lost between the resumed epoch and the next, and found dead as the next starts.
    expected = uninterrupted(3)
    board = Switchboard()
    loader = resumed_with_worker_0_dry(board)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run_to_end(iter(loader))
        kill(board, 0)
        later = [run_to_end(iter(loader)) for _ in range(2)]
    assert [first, *later] == [expected[0][3:], *expected[1:]]
    assert [w.category for w in caught].count(WorkerRestartedWarning) == 1


@WORKERS
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_a_worker_lost_after_its_part_ran_dry_in_an_epochs_last_batches_counts_its_epochs(
    resumed: bool,
) -> None:
    # In the second epoch, after its last batch: worker 0 was found dry, worker 1 handed its
    # short last batch. The death is found by the call that ends the epoch: its end is known
    # by then (each part found dry), and the replacement is asked nothing in it.
    expected = uninterrupted(3)
    board = Switchboard()
    loader = resumed_with_worker_0_dry(board) if resumed else build(board)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run_to_end(iter(loader))
        second = iter(loader)
        handed = take(second, len(expected[1]))
        kill(board, 0)
        handed += run_to_end(second)
        third = run_to_end(iter(loader))
    assert [first, handed, third] == [expected[0][3 if resumed else 0 :], *expected[1:]]
    assert [w.category for w in caught].count(WorkerRestartedWarning) == 1
