"""`statecore.SharedSequence`: a read-only sequence kept pickled in one buffer workers share.

It behaves as a tuple of its items would (indices, negative indices, slices, iteration, the
IndexError past either end), survives pickling, refuses to be changed, and loads in worker
processes under fork, forkserver and spawn (spawn in the exhaustive tier), where a worker that
was sent it maps the main process's buffer rather than receiving a copy of it.
"""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any

import pytest
import torch
from test_mp_dataset_tensors import backing
from torch.utils.data import Dataset

import statecore
from statecore import SharedSequence

ITEMS: list[Any] = [
    {"id": 0, "path": "images/0.jpg", "label": 3},
    "a string",
    (1, 2.5, None),
    [],
    {"nested": {"deep": [1, 2, 3]}},
    b"\x00bytes",
    12345678901234567890,
]


def test_it_holds_the_items_it_was_given_in_order() -> None:
    shared = SharedSequence(ITEMS)
    assert len(shared) == len(ITEMS)
    assert [shared[i] for i in range(len(ITEMS))] == ITEMS
    assert list(shared) == ITEMS


def test_it_can_be_built_from_a_generator_without_a_list() -> None:
    shared = SharedSequence({"id": i} for i in range(1000))
    assert len(shared) == 1000
    assert shared[999] == {"id": 999}


def test_an_object_held_by_several_items_is_stored_whole_in_each() -> None:
    common = {"shared": [1, 2]}
    items = [common, [common, common], ("again", common)]
    shared = SharedSequence(items)
    assert [shared[2], shared[1], shared[0]] == items[::-1]  # each one unpickles on its own


def test_an_empty_one_has_no_items() -> None:
    shared: SharedSequence[int] = SharedSequence([])
    assert len(shared) == 0 and list(shared) == []
    with pytest.raises(IndexError):
        shared[0]


@pytest.mark.parametrize("index", range(-len(ITEMS), 0))
def test_negative_indices_count_from_the_end(index: int) -> None:
    assert SharedSequence(ITEMS)[index] == ITEMS[index]


@pytest.mark.parametrize("index", [len(ITEMS), len(ITEMS) + 5, -len(ITEMS) - 1])
def test_an_index_out_of_range_raises_index_error_as_a_list_does(index: int) -> None:
    with pytest.raises(IndexError):
        ITEMS[index]
    with pytest.raises(IndexError, match=f"index {index} out of range for {len(ITEMS)} items"):
        SharedSequence(ITEMS)[index]


def test_an_index_that_is_not_an_integer_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="must be integers or slices, not str"):
        SharedSequence(ITEMS)["0"]  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "part",
    [slice(2, 5), slice(None, None, 2), slice(-3, None), slice(None, None, -1), slice(5, 2)],
    ids=repr,
)
def test_a_slice_holds_what_the_lists_slice_holds_and_shares_the_buffer(part: slice) -> None:
    shared = SharedSequence(ITEMS)
    sliced = shared[part]
    assert isinstance(sliced, SharedSequence)
    assert list(sliced) == ITEMS[part]
    assert sliced.nbytes == shared.nbytes  # the same buffer, not a copy of the slice's items


def test_iteration_membership_and_index_work_as_for_a_sequence() -> None:
    shared = SharedSequence(ITEMS)
    assert "a string" in shared and "absent" not in shared
    assert shared.index((1, 2.5, None)) == 2
    assert list(reversed(shared)) == ITEMS[::-1]


def test_each_access_returns_a_fresh_copy_so_changing_it_changes_nothing_stored() -> None:
    shared = SharedSequence([{"label": 1}])
    first = shared[0]
    first["label"] = 2
    assert shared[0] == {"label": 1}


@pytest.mark.parametrize("pickling", ["pickle", "copy", "deepcopy"])
def test_it_survives_pickling_and_copying(pickling: str) -> None:
    shared = SharedSequence(ITEMS)
    twin = {
        "pickle": lambda: pickle.loads(pickle.dumps(shared)),
        "copy": lambda: copy.copy(shared),
        "deepcopy": lambda: copy.deepcopy(shared),
    }[pickling]()
    assert isinstance(twin, SharedSequence)
    assert list(twin) == ITEMS


def test_a_pickled_slice_keeps_only_its_items() -> None:
    sliced = SharedSequence(ITEMS)[1:4]
    assert list(pickle.loads(pickle.dumps(sliced))) == ITEMS[1:4]


def test_assigning_or_deleting_an_item_is_refused_as_read_only() -> None:
    shared = SharedSequence(ITEMS)
    with pytest.raises(TypeError, match=r"read-only.*SharedSequence\(items\)"):
        shared[0] = "changed"  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        del shared[0]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="read-only"):
        shared.extra = 1  # type: ignore[attr-defined]
    assert list(shared) == ITEMS


def test_an_item_that_cannot_be_pickled_is_named_by_its_position() -> None:
    with pytest.raises(TypeError, match=r"item 1 \(function\) cannot be pickled"):
        SharedSequence([1, lambda: None, 3])


def test_the_repr_says_how_many_items_and_how_large() -> None:
    assert repr(SharedSequence(range(3))).startswith("<SharedSequence of 3 items, ")


# --- in worker processes -------------------------------------------------------------------------


class Records(Dataset):  # type: ignore[type-arg]
    """Item i: record i of a SharedSequence of dicts, with the pid of the worker that read it."""

    def __init__(self, n: int) -> None:
        self.records = SharedSequence({"id": i, "label": i % 7} for i in range(n))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[dict[str, int], int]:
        return self.records[index], os.getpid()


# Pickled to the workers under spawn; the forkserver test below pickles it in every tier.
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("loader", ["statecore", "torch"])
def test_it_loads_in_worker_processes(method: str, loader: str) -> None:
    n = 40
    kind = statecore.DataLoader if loader == "statecore" else torch.utils.data.DataLoader
    items = list(kind(Records(n), batch_size=None, num_workers=2, multiprocessing_context=method))
    assert [record for record, _ in items] == [{"id": i, "label": i % 7} for i in range(n)]
    assert len({pid for _, pid in items}) == 2 and os.getpid() not in {pid for _, pid in items}


class BufferBacking(Dataset):  # type: ignore[type-arg]
    """Holds a SharedSequence; item i: item i, and what backs its buffer in the worker."""

    def __init__(self, shared: SharedSequence[int]) -> None:
        self.shared = shared

    def __len__(self) -> int:
        return len(self.shared)

    def __getitem__(self, index: int) -> tuple[int, tuple[str, int, str], int]:
        buffer = self.shared._data  # the pickled items (private: what backs it is the point)
        return self.shared[index], backing(buffer.data_ptr()), os.getpid()


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")
@pytest.mark.parametrize(
    "method", ["forkserver", pytest.param("spawn", marks=pytest.mark.exhaustive)]
)
def test_a_spawned_worker_maps_the_main_processs_buffer_not_a_copy(method: str) -> None:
    shared = SharedSequence(range(1000, 1008))
    loader = statecore.DataLoader(
        BufferBacking(shared), batch_size=None, num_workers=2, multiprocessing_context=method
    )
    items: list[Any] = list(loader)
    assert [item for item, _, _ in items] == list(range(1000, 1008))
    assert len({pid for _, _, pid in items}) == 2
    # Sending it moved the buffer into a shared-memory file, once, in this process...
    ours = backing(shared._data.data_ptr())
    assert ours[1] != 0, f"not file-backed shared memory: {ours}"
    # ...and every worker maps that same file, and still reads the items from it.
    assert {tuple(mapping) for _, mapping, _ in items} == {ours}
    assert list(shared) == list(range(1000, 1008))
