"""statecore under HF accelerate: `prepare_with_accelerate` keeps statecore loading.

`accelerator.prepare(loader)` hands back accelerate's own wrapper around a plain torch loader
built from the original's arguments. `prepare_with_accelerate` prepares the same way, then
puts a statecore loader with the original's executor inside that wrapper. The batches must be
the ones accelerate gives for torch's loader, and statecore's worker threads must load them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _frameworks import ELSEWHERE, STATECORE_THREAD, Marked, MarkedStream
from _side_by_side import WORKERS
from accelerate import Accelerator

import statecore
from statecore.executors.frameworks import prepare_with_accelerate


@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    return Accelerator(cpu=True)


def two_epochs(loader: Any) -> tuple[list[list[int]], set[int]]:
    """The indices of every batch of two epochs, and who loaded their samples."""
    indices, marks = [], set()
    for _ in range(2):
        for batch in loader:
            indices.append(batch["index"].tolist())
            marks.update(batch["loader"].tolist())
    return indices, marks


def loaders(dataset: Any, **arguments: Any) -> tuple[Any, Any]:
    """A statecore loader with the thread executor, and torch's loader with the same arguments."""
    ours = statecore.DataLoader(
        dataset, generator=torch.Generator().manual_seed(3), executor="thread", **arguments
    )
    theirs = torch.utils.data.DataLoader(
        dataset, generator=torch.Generator().manual_seed(3), **arguments
    )
    return ours, theirs


@WORKERS
def test_a_prepared_loader_gets_torchs_batches_loaded_by_statecore(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(Marked(10), batch_size=3, shuffle=True, num_workers=2)
    model, prepared = prepare_with_accelerate(accelerator, torch.nn.Linear(1, 1), ours)
    reference = accelerator.prepare(theirs)
    assert isinstance(model, torch.nn.Module)  # the other objects are prepared as usual
    got, marks = two_epochs(prepared)
    expected, reference_marks = two_epochs(reference)
    assert got == expected
    assert marks == {STATECORE_THREAD}
    assert reference_marks == {ELSEWHERE}
    assert len(prepared) == len(reference) == 4


@WORKERS
def test_a_prepared_loader_stays_accelerates_wrapper_around_a_statecore_loader(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(Marked(10), batch_size=3, num_workers=2)
    prepared = prepare_with_accelerate(accelerator, ours)
    # type() sees through the wrapper, which claims its inner loader's class.
    assert type(prepared) is type(accelerator.prepare(theirs))
    assert isinstance(prepared, statecore.DataLoader)
    assert prepared.executor == "thread"
    for _ in prepared:
        pass
    assert prepared.end_of_dataloader  # accelerate's end-of-epoch bookkeeping still runs


@WORKERS
def test_a_prepared_loader_over_an_iterable_dataset_is_loaded_by_statecore(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(MarkedStream(11), batch_size=2, num_workers=2)
    got, marks = two_epochs(prepare_with_accelerate(accelerator, ours))
    assert got == two_epochs(accelerator.prepare(theirs))[0]
    assert marks == {STATECORE_THREAD}
