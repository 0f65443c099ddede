"""Spawn and forkserver workers load datasets and collate functions that torch cannot pickle.

statecore pickles user code for spawn and forkserver workers with dill, so classes defined in
functions and lambdas work; torch pickles with the standard library, which refuses them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.data
from _side_by_side import QUIET, WORKERS
from torch.utils.data import Dataset

import statecore

pytestmark = QUIET


def _local_dataset_and_collate() -> tuple[Dataset, Callable[[list[int]], Any]]:  # type: ignore[type-arg]
    class Squares(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> int:
            return index * index

    return Squares(), lambda batch: ["collated", *batch]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@WORKERS
def test_local_dataset_and_lambda_collate_load_in_fresh_interpreters(context: str) -> None:
    dataset, collate = _local_dataset_and_collate()
    in_process = [
        batch for batch in torch.utils.data.DataLoader(dataset, batch_size=3, collate_fn=collate)
    ]
    loader = statecore.DataLoader(
        dataset, batch_size=3, collate_fn=collate, num_workers=2, multiprocessing_context=context
    )
    assert [batch for batch in loader] == in_process
    assert in_process[0] == ["collated", 0, 1, 4]


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@WORKERS
def test_torch_cannot_pickle_a_local_dataset_or_lambda_collate(context: str) -> None:
    dataset, collate = _local_dataset_and_collate()
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=3, collate_fn=collate, num_workers=2, multiprocessing_context=context
    )
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)) as raised:
        next(iter(loader))
    assert "pickle" in str(raised.value).lower()
