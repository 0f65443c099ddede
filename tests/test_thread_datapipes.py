"""Datapipes with a `sharding_filter` are sharded as torch shards them, by every executor.

torch's worker processes call `apply_sharding(datapipe, num_workers, worker_id)` on their copy
of the datapipe before `worker_init_fn`, and its single-process iterator shards the datapipe as
one instance. Without that, N workers each hand over every item. The thread workers need a
datapipe of their own as well: one datapipe allows one live iterator, and the sharding is state
inside its graph.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import IterDataPipe
from torch.utils.data.dataloader import _DatasetKind
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.graph_settings import apply_sharding

import statecore
from statecore.executors import _worker as worker_module
from statecore.executors._mp import wire as wire_module
from statecore.executors._mp.wire import Shipment, unpack_setup
from statecore.executors._thread import copies as copies_module
from statecore.executors._thread.copies import own_copy
from statecore.executors._worker import WorkerSetup, prepare_dataset

# IterDataPipe is deprecated in some torch versions; its warnings are not what is tested here.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def shuffled_and_sharded() -> Any:
    return IterableWrapper(range(23)).shuffle().sharding_filter()


def epochs(make: Any, datapipe: Any, count: int, **options: Any) -> list[list[list[int]]]:
    loader = make(datapipe, batch_size=3, generator=torch.Generator().manual_seed(7), **options)
    return [[batch.tolist() for batch in loader] for _ in range(count)]


def all_items(result: list[list[list[int]]]) -> list[int]:
    return sorted(item for epoch in result for batch in epoch for item in batch)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", ["mp", "thread"])
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_shard_a_datapipe_and_give_torchs_batches(executor: str, workers: int) -> None:
    expected = epochs(torch.utils.data.DataLoader, shuffled_and_sharded(), 2, num_workers=workers)
    assert all_items(expected) == sorted(list(range(23)) * 2)  # each item once per epoch
    got = epochs(
        statecore.DataLoader, shuffled_and_sharded(), 2, num_workers=workers, executor=executor
    )
    assert got == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", ["mp", "thread"])
def test_persistent_workers_keep_their_shards_after_a_resume(executor: str) -> None:
    options: dict[str, Any] = {"num_workers": 2, "persistent_workers": True}
    expected = epochs(torch.utils.data.DataLoader, shuffled_and_sharded(), 3, **options)
    got = epochs(statecore.DataLoader, shuffled_and_sharded(), 3, executor=executor, **options)
    assert got == expected


def test_a_datapipe_loaded_in_process_is_sharded_as_one_instance_as_torch() -> None:
    # torch's single-process iterator shards the datapipe as instance 0 of 1 (of the
    # distributed world), undoing a sharding applied to it before.
    # (Unshuffled: the shuffle order in process is another matter than sharding.)
    def sharded_by_hand() -> Any:
        datapipe = IterableWrapper(range(23)).sharding_filter()
        apply_sharding(datapipe, 2, 1)
        return datapipe

    expected = epochs(torch.utils.data.DataLoader, sharded_by_hand(), 1)
    assert all_items(expected) == list(range(23))
    assert epochs(statecore.DataLoader, sharded_by_hand(), 1) == expected


class _WatchedGraphLock:
    """The datapipe-graph lock, telling the test when a second thread has to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.waited_or_done = threading.Event()

    def __enter__(self) -> _WatchedGraphLock:
        if not self._lock.acquire(blocking=False):
            self.waited_or_done.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _HeldInsideAWalk(IterDataPipe):  # type: ignore[type-arg]
    """A datapipe whose walk, in the thread named "walker", stops midway until `gate` is set:
    torch's class-wide pickling hooks are in place for as long as it stops."""

    def __init__(self, gate: threading.Event, inside: threading.Event) -> None:
        self.source = IterableWrapper(range(5))
        self.gate = gate
        self.inside = inside

    def __iter__(self) -> Any:
        yield from self.source

    def __getstate__(self) -> Any:
        if threading.current_thread().name == "walker":
            self.inside.set()
            assert self.gate.wait(60), "the other thread neither waited nor finished"
        return super().__getstate__()


def _setup(dataset: Any) -> WorkerSetup:
    """What two workers of an iterable dataset are given, with a datapipe seed."""
    return WorkerSetup(
        dataset=dataset,
        dataset_kind=_DatasetKind.Iterable,
        auto_collation=False,
        collate_fn=None,
        drop_last=False,
        base_seed=0,
        num_workers=2,
        shared_seed=11,
    )


def _while_a_walk_is_held(monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], Any]) -> Any:
    """`meanwhile()`'s result, called while another thread reseeds a datapipe (a walk of its
    graph) and is held inside that walk until `meanwhile` has either finished or waited."""
    lock = _WatchedGraphLock()
    monkeypatch.setattr(worker_module, "DATAPIPE_GRAPH", lock)
    monkeypatch.setattr(copies_module, "DATAPIPE_GRAPH", lock)
    monkeypatch.setattr(wire_module, "DATAPIPE_GRAPH", lock)
    inside = threading.Event()
    walked = _HeldInsideAWalk(lock.waited_or_done, inside)
    setup = _setup(walked)
    walker = threading.Thread(target=prepare_dataset, args=(setup, 0, walked), name="walker")
    walker.start()
    try:
        assert inside.wait(60)
        outcome: list[Any] = []

        def other() -> None:
            try:
                outcome.append(meanwhile())
            except Exception as error:
                outcome.append(error)
            finally:
                lock.waited_or_done.set()

        second = threading.Thread(target=other)
        second.start()
        second.join(60)
    finally:
        lock.waited_or_done.set()
        walker.join(60)
    return outcome[0]


@pytest.mark.timeout(120)
def test_a_datapipe_copied_for_a_worker_during_another_workers_walk_is_a_true_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the lock, torch's hook turns the copy into the string "STUB", silently.
    copied = _while_a_walk_is_held(monkeypatch, lambda: own_copy(shuffled_and_sharded()))
    assert isinstance(copied, IterDataPipe)
    assert sorted(copied) == list(range(23))


@pytest.mark.timeout(120)
def test_two_worker_threads_reseed_their_datapipes_at_once_without_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the lock, the second walk raises "Attempt to override existing reduce_ex_hook".
    setup = _setup(None)
    prepared = _while_a_walk_is_held(
        monkeypatch, lambda: prepare_dataset(setup, 1, IterableWrapper(range(23)).sharding_filter())
    )
    assert isinstance(prepared, IterDataPipe)
    assert sorted(prepared) == list(range(1, 23, 2))


@pytest.mark.timeout(120)
def test_a_datapipe_packed_for_worker_processes_during_a_threads_walk_arrives_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread executor's workers may walk their datapipes while a process executor packs its
    # setup for spawned workers; without the lock the datapipe is packed as torch's stub.
    def packed_and_unpacked() -> Any:
        shipment = Shipment.pack(_setup(shuffled_and_sharded()))
        return unpack_setup(*shipment.for_worker()).dataset

    unpacked = _while_a_walk_is_held(monkeypatch, packed_and_unpacked)
    assert isinstance(unpacked, IterDataPipe)
    assert sorted(unpacked) == list(range(23))
