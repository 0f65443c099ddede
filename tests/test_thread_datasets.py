"""Each worker thread has a dataset object of its own, as each of torch's worker processes has.

The thread executor gives every worker a shallow copy of the dataset, made when the loader's
iterator is created: what a worker sets on its dataset stays its own, what the main process
rebinds afterwards is not seen, and the arrays and tensors the dataset points to stay shared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _side_by_side import as_lists, threaded
from torch.utils.data import Dataset, get_worker_info

import statecore


class RemembersItsWorker(Dataset):  # type: ignore[type-arg]
    """Each sample is the worker id that `remember_worker` stored on the dataset."""

    worker_id = -1

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return self.worker_id


def remember_worker(worker_id: int) -> None:
    # The recipe of torch's documentation: configure the worker's dataset through its WorkerInfo.
    info = get_worker_info()
    assert info is not None
    info.dataset.worker_id = worker_id


@pytest.mark.timeout(120)
def test_what_worker_init_fn_stores_on_its_dataset_stays_that_workers() -> None:
    options: dict[str, Any] = {"num_workers": 2, "worker_init_fn": remember_worker}
    expected = [
        batch.tolist() for batch in torch.utils.data.DataLoader(RemembersItsWorker(), **options)
    ]
    assert expected == [[0], [1]] * 4
    loader = statecore.DataLoader(RemembersItsWorker(), executor="thread", **options)
    assert [batch.tolist() for batch in loader] == expected


class KnowsItself(Dataset):  # type: ignore[type-arg]
    """Each sample tells who loads it: (worker id, this object, WorkerInfo.dataset, the data)."""

    def __init__(self) -> None:
        self.data = torch.arange(6)

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> tuple[int, int, int, int]:
        info = get_worker_info()
        assert info is not None
        return info.id, id(self), id(info.dataset), id(self.data)


@pytest.mark.timeout(60)
def test_each_worker_loads_from_its_own_copy_which_its_worker_info_names() -> None:
    dataset = KnowsItself()
    samples = [s for batch in threaded(dataset, collate_fn=as_lists) for s in batch]
    copies = {worker: own for worker, own, _, _ in samples}
    assert sorted(copies) == [0, 1]
    assert len(set(copies.values())) == 2
    assert id(dataset) not in copies.values()
    assert all(own == named for _, own, named, _ in samples)


@pytest.mark.timeout(60)
def test_the_copies_share_the_tensors_the_dataset_points_to() -> None:
    dataset = KnowsItself()
    samples = [s for batch in threaded(dataset, collate_fn=as_lists) for s in batch]
    assert {data for _, _, _, data in samples} == {id(dataset.data)}


class Shifted(Dataset):  # type: ignore[type-arg]
    """The numbers 0..5 plus `shift`."""

    def __init__(self) -> None:
        self.shift = 0

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> int:
        return index + self.shift


@pytest.mark.timeout(60)
def test_persistent_workers_do_not_see_what_the_main_process_rebinds_after_iter() -> None:
    # As with torch's worker processes, which copied the dataset when they started.
    dataset = Shifted()
    loader = threaded(dataset, batch_size=3, persistent_workers=True)
    first = [batch.tolist() for batch in loader]
    dataset.shift = 100
    second = [batch.tolist() for batch in loader]
    assert first == second == [[0, 1, 2], [3, 4, 5]]


class Uncopyable(Dataset):  # type: ignore[type-arg]
    """A dataset that refuses to be copied."""

    def __copy__(self) -> Uncopyable:
        raise TypeError("Uncopyable cannot be copied")

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.timeout(60)
def test_a_dataset_that_cannot_be_copied_is_shared_with_a_warning() -> None:
    with pytest.warns(RuntimeWarning, match="Uncopyable cannot be copied.*share"):
        batches = [batch.tolist() for batch in threaded(Uncopyable(), batch_size=2)]
    assert batches == [[0, 1], [2, 3]]


class InitsItself(Dataset[int]):
    """Stores the worker id through a method of its own, given as worker_init_fn."""

    def __init__(self) -> None:
        self.worker_id = -1

    def init(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def tagged(self, batch: list[int]) -> list[int]:
        return [self.worker_id for _ in batch]

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return self.worker_id


@pytest.mark.timeout(60)
def test_a_worker_init_fn_bound_to_the_dataset_sets_the_workers_own_copy() -> None:
    dataset = InitsItself()
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "worker_init_fn": dataset.init}
    expected = [b.tolist() for b in torch.utils.data.DataLoader(dataset, **kwargs)]
    got = [b.tolist() for b in statecore.DataLoader(dataset, executor="thread", **kwargs)]
    assert got == expected == [[0, 0], [1, 1], [0, 0], [1, 1]]
    assert dataset.worker_id == -1


@pytest.mark.timeout(60)
def test_a_collate_fn_bound_to_the_dataset_runs_on_the_workers_own_copy() -> None:
    dataset = InitsItself()
    loader = statecore.DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        worker_init_fn=dataset.init,
        collate_fn=dataset.tagged,
        executor="thread",
    )
    assert list(loader) == [[0, 0], [1, 1], [0, 0], [1, 1]]
