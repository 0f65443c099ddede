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


# Both start methods pickle the process the same way (with dill); spawn also starts each worker's
# interpreter afresh (torch imported in each), so the default tier runs forkserver alone.
@pytest.mark.parametrize(
    "context", [pytest.param("spawn", marks=pytest.mark.exhaustive), "forkserver"]
)
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


# --- a used loader pickles, as torch's does ------------------------------------------------------

USED = [
    pytest.param({}, id="inline"),
    pytest.param({"num_workers": 2}, id="mp-2"),
    pytest.param({"trace": True}, id="inline-traced"),
    pytest.param({"num_workers": 2, "trace": True}, id="mp-2-traced"),
]


def _used(options: dict[str, Any]) -> statecore.DataLoader[Any]:
    """A loader whose epoch was left after two batches, with its iterator still alive."""
    loader = statecore.DataLoader(
        list(range(20)),
        batch_size=3,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        **options,
    )
    for step, _ in enumerate(loader):
        if step == 1:
            break
    return loader


@WORKERS
@pytest.mark.parametrize("options", USED)
def test_a_used_loader_pickles_and_its_copy_iterates_the_same_batches(
    options: dict[str, Any],
) -> None:
    loader = _used(options)
    copy = pickle.loads(pickle.dumps(loader))
    assert [batch.tolist() for batch in copy] == [batch.tolist() for batch in loader]


@WORKERS
def test_a_pickled_loader_keeps_the_position_its_state_dict_describes() -> None:
    loader = _used({"num_workers": 2})
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.state_dict() == loader.state_dict()


@WORKERS
def test_a_loader_with_persistent_workers_refuses_to_pickle_once_iterated_as_torchs() -> None:
    # torch keeps the persistent iterator on its loader, and an iterator does not pickle.
    for cls in (torch.utils.data.DataLoader, statecore.DataLoader):
        loader = cls(list(range(6)), batch_size=2, num_workers=2, persistent_workers=True)
        list(loader)
        with pytest.raises(NotImplementedError, match="cannot be pickled"):
            pickle.dumps(loader)


def _batches_of(loader: statecore.DataLoader[Any]) -> list[Any]:
    return [batch.tolist() for batch in loader]


@WORKERS
def test_a_used_loader_travels_to_a_spawned_process() -> None:
    import multiprocessing

    loader = _used({})
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_batches_of, (loader,)) == _batches_of(loader)
