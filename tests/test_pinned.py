"""The pinned executor: a pin-memory stage over any executor, with torch's pin semantics.

There is no accelerator on the CI machine, so most tests inject the pin function (or make
`Tensor.pin_memory` a copy, so that torch's own pin function runs). The tests at the end need
CUDA, skip cleanly without it, and run on a GPU machine.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
import torch.utils.data
from _datasets import BlocksAt, ExitsAt
from _processes import children
from _side_by_side import WORKERS
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

import statecore
from statecore import LoaderTimeoutError, WorkerDiedError
from statecore.executors import Capabilities, Declared, Launch, PinnedExecutor, pinned
from statecore.executors._thread.executor import ThreadExecutor

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
STAGE = "statecore-pin"
NO_ACCELERATOR = "ignore:'pin_memory' argument is set as true:UserWarning"


def batches(loader: Any) -> list[Any]:
    return list(loader)


_EARLIER: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _stages_of_earlier_tests() -> None:
    # Each test answers for the stage threads it starts. One left by another test (seen, rarely,
    # after the conformance kit's pinned-over-thread run in a full suite) is that test's to
    # answer for, not a failure of every test here.
    _EARLIER.clear()
    _EARLIER.update(thread for thread in threading.enumerate() if thread.name == STAGE)


def stage_threads() -> list[str]:
    """The stage threads this test started that are still running."""
    return [
        thread.name
        for thread in threading.enumerate()
        if thread.name == STAGE and thread not in _EARLIER
    ]


class Marked:
    """What the injected pin function makes of a batch: the batch, and the thread it ran in."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.thread = threading.current_thread().name


def mark(batch: Any) -> Marked:
    return Marked(batch)


@pytest.fixture
def pinning_clones(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """`Tensor.pin_memory` as a copy whose storage is recorded: torch's pin function runs."""
    pinned_storages: set[int] = set()

    def fake_pin(self: torch.Tensor, *_: Any) -> torch.Tensor:
        copy = self.clone()
        pinned_storages.add(copy.untyped_storage().data_ptr())
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    return pinned_storages


@pytest.fixture
def an_accelerator(monkeypatch: pytest.MonkeyPatch, pinning_clones: set[int]) -> set[int]:
    """torch believes a CUDA accelerator is there; pinning copies, as above."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    return pinning_clones


# --- the stage's pipeline ----------------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize(("inner", "workers"), [("inline", 0), ("mp", 2), ("thread", 3)])
def test_every_batch_is_pinned_and_handed_over_in_torchs_order(inner: str, workers: int) -> None:
    loader = statecore.DataLoader(
        range(23), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5),
        num_workers=workers, executor=pinned(inner, pin=mark),
    )  # fmt: skip
    expected = torch.utils.data.DataLoader(
        range(23), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    got = batches(loader)
    assert all(isinstance(batch, Marked) for batch in got)
    assert [batch.batch.tolist() for batch in got] == [batch.tolist() for batch in expected]


@WORKERS
def test_under_a_stage_every_worker_process_is_started_before_iter_returns() -> None:
    # The stage's thread polls, and starting a worker from it would fork while the training
    # loop runs; so the workers all start in the caller's thread, as torch's do.
    before = children()
    loader = statecore.DataLoader(range(8), num_workers=3, executor=pinned("mp", pin=mark))
    iterator = iter(loader)
    try:
        assert len(children() - before) == 3
    finally:
        del iterator


@WORKERS
@pytest.mark.parametrize("inner", ["mp", "thread"])
def test_over_workers_batches_are_pinned_in_the_stage_thread(inner: str) -> None:
    got = batches(statecore.DataLoader(range(8), num_workers=2, executor=pinned(inner, pin=mark)))
    assert {batch.thread for batch in got} == {STAGE}


def test_in_process_batches_are_pinned_in_the_calling_thread_like_torchs() -> None:
    got = batches(statecore.DataLoader(range(4), executor=pinned(pin=mark)))
    assert {batch.thread for batch in got} == {threading.current_thread().name}


class Point(NamedTuple):
    position: torch.Tensor
    name: str


class CustomBatch:
    """A batch type of the user's, pinned by its own method, as torch's pin function does."""

    def __init__(self, items: list[int]) -> None:
        self.values = torch.tensor(items)
        self.pinned_by_its_method = False

    def pin_memory(self) -> CustomBatch:
        self.pinned_by_its_method = True
        return self


def records(items: list[int]) -> dict[str, Any]:
    values = torch.tensor(items)
    return {
        "values": values,
        "names": [f"item-{item}" for item in items],
        "point": Point(values * 2, "p"),
        "pair": (values + 1, [values - 1, "text"]),
        "raw": b"bytes",
    }


def tensors(data: Any) -> Iterator[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, dict):
        for value in data.values():
            yield from tensors(value)
    elif isinstance(data, list | tuple):
        for value in data:
            yield from tensors(value)


@WORKERS
def test_tensors_nested_in_dicts_lists_tuples_and_namedtuples_are_pinned(
    pinning_clones: set[int],
) -> None:
    loader = statecore.DataLoader(
        range(6), batch_size=3, collate_fn=records, num_workers=2,
        executor=pinned("mp", pin=torch_pin_memory),
    )  # fmt: skip
    for batch in loader:
        found = list(tensors(batch))
        assert len(found) == 4
        assert all(tensor.untyped_storage().data_ptr() in pinning_clones for tensor in found)
        assert isinstance(batch["point"], Point) and batch["point"].name == "p"
        assert batch["names"][0].startswith("item-") and batch["raw"] == b"bytes"
        assert batch["pair"][1][1] == "text"


@WORKERS
def test_a_custom_batch_type_is_pinned_by_its_own_method(pinning_clones: set[int]) -> None:
    loader = statecore.DataLoader(
        range(6), batch_size=2, collate_fn=CustomBatch, num_workers=2,
        executor=pinned("thread", pin=torch_pin_memory),
    )  # fmt: skip
    got = batches(loader)
    assert [batch.values.tolist() for batch in got] == [[0, 1], [2, 3], [4, 5]]
    assert all(batch.pinned_by_its_method for batch in got)


def refuses_four(batch: Any) -> Any:
    if 4 in batch.tolist():
        raise ValueError("cannot pin the batch holding 4")
    return batch


def outcomes(loader: Any) -> list[Any]:
    got: list[Any] = []
    iterator = iter(loader)
    while True:
        try:
            got.append(next(iterator).tolist())
        except StopIteration:
            return got
        except ValueError as error:
            got.append(error)


@WORKERS
@pytest.mark.parametrize(("inner", "workers"), [("inline", 0), ("mp", 2), ("thread", 2)])
def test_a_pinning_error_is_raised_in_its_batchs_turn_and_the_epoch_goes_on(
    inner: str, workers: int
) -> None:
    loader = statecore.DataLoader(
        range(8), batch_size=2, num_workers=workers, executor=pinned(inner, pin=refuses_four)
    )
    got = outcomes(loader)
    assert [item if isinstance(item, list) else "error" for item in got] == [
        [0, 1], [2, 3], "error", [6, 7],
    ]  # fmt: skip
    error = got[2]
    assert str(error) == "cannot pin the batch holding 4"
    assert any("pin-memory stage" in note for note in error.__notes__)


@WORKERS
@pytest.mark.parametrize("in_order", [True, False])
def test_out_of_order_loading_pins_every_batch_once(in_order: bool) -> None:
    loader = statecore.DataLoader(
        range(30), batch_size=2, num_workers=3, in_order=in_order,
        executor=pinned("thread", pin=mark),
    )  # fmt: skip
    got = sorted(tuple(batch.batch.tolist()) for batch in loader)
    assert got == [(i, i + 1) for i in range(0, 30, 2)]


@WORKERS
def test_persistent_workers_keep_one_stage_across_epochs() -> None:
    loader = statecore.DataLoader(
        range(6), batch_size=2, num_workers=2, persistent_workers=True,
        executor=pinned("mp", pin=mark),
    )  # fmt: skip
    for _ in range(3):
        assert [batch.batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5]]
        assert len(stage_threads()) == 1
    del loader
    assert stage_threads() == []


@WORKERS
def test_over_an_executor_not_known_to_be_thread_safe_batches_are_pinned_in_the_caller() -> None:
    # The "thread" factory declares that its executor may be polled from any thread; the bare
    # class (like most plug-ins, which load when polled) declares nothing, so nothing polls it
    # but the driver's thread.
    got = batches(
        statecore.DataLoader(range(4), num_workers=2, executor=pinned(ThreadExecutor, pin=mark))
    )
    assert {batch.thread for batch in got} == {threading.current_thread().name}
    assert stage_threads() == []


class BreaksOnce(ThreadExecutor):
    """The thread executor, except that its poll raises the first time it is called."""

    broke = False

    def poll(self, timeout: float | None) -> Any:
        if not BreaksOnce.broke:
            BreaksOnce.broke = True
            raise OSError("the result queue broke")
        return super().poll(timeout)


def breaks_once(launch: Launch) -> BreaksOnce:
    return BreaksOnce(launch)


# Declared as plug-ins did before `Capabilities`, with a function attribute: still honoured.
breaks_once.poll_from_any_thread = True  # type: ignore[attr-defined]


@WORKERS
def test_once_the_stage_fails_every_later_batch_raises_its_error() -> None:
    BreaksOnce.broke = False
    iterator = iter(
        statecore.DataLoader(range(8), num_workers=2, executor=pinned(breaks_once, pin=mark))
    )
    for _ in range(3):
        with pytest.raises(OSError, match="the result queue broke"):
            next(iterator)
    del iterator
    assert stage_threads() == []


# --- shutdown ------------------------------------------------------------------------------------


@WORKERS
@pytest.mark.parametrize("inner", ["mp", "thread"])
def test_no_stage_thread_is_left_after_an_epoch_a_break_or_a_deletion(inner: str) -> None:
    loader = statecore.DataLoader(
        range(40), batch_size=2, num_workers=2, executor=pinned(inner, pin=mark)
    )
    batches(loader)
    assert stage_threads() == []
    for _ in loader:
        break
    assert stage_threads() == []
    iterator = iter(loader)
    next(iterator)
    del iterator
    assert stage_threads() == []


class RecordingThreads(ThreadExecutor):
    """The thread executor, noting whether the stage thread was still there at shutdown."""

    stage_at_shutdown: ClassVar[list[list[str]]] = []

    def shutdown(self) -> None:
        RecordingThreads.stage_at_shutdown.append(stage_threads())
        super().shutdown()


def record_threads(launch: Launch) -> RecordingThreads:
    return RecordingThreads(launch)


recording_threads = Declared(record_threads, Capabilities(poll_from_any_thread=True))


@WORKERS
def test_the_stage_stops_before_the_workers_do() -> None:
    RecordingThreads.stage_at_shutdown.clear()
    loader = statecore.DataLoader(
        range(10), batch_size=2, num_workers=2, executor=pinned(recording_threads, pin=mark)
    )
    iterator = iter(loader)
    next(iterator)
    assert stage_threads() == [STAGE]
    del iterator
    assert RecordingThreads.stage_at_shutdown == [[]]


@WORKERS
def test_a_worker_death_reaches_the_consumer_through_the_stage() -> None:
    loader = statecore.DataLoader(
        ExitsAt(8, index=5), batch_size=2, num_workers=2, executor=pinned("mp", pin=mark)
    )
    with pytest.raises(WorkerDiedError, match="exit"):
        batches(loader)
    assert stage_threads() == []


@WORKERS
def test_a_timeout_reaches_the_consumer_through_the_stage() -> None:
    read, write = os.pipe()
    try:
        loader = statecore.DataLoader(
            BlocksAt(8, index=2, fd=read), num_workers=1, timeout=0.5,
            executor=pinned("mp", pin=mark),
        )  # fmt: skip
        with pytest.raises(LoaderTimeoutError, match="timed out"):
            batches(loader)
    finally:
        os.close(write)
        os.close(read)
    assert stage_threads() == []


# --- a device copy ahead of use, with a stand-in for CUDA ----------------------------------------


class RecordingCopy:
    """A DeviceCopy that records which thread launched and which claimed each batch."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, Any]] = []

    def launch(self, batch: Any) -> Any:
        self.log.append(("launch", threading.current_thread().name, batch.tolist()))
        return ("ticket", batch)

    def claim(self, ticket: Any) -> Any:
        _, batch = ticket
        self.log.append(("claim", threading.current_thread().name, batch.tolist()))
        return batch


@WORKERS
def test_a_device_copy_starts_in_the_stage_and_is_claimed_before_its_batch_is_handed_over() -> None:
    copy = RecordingCopy()

    def factory(launch: Launch) -> PinnedExecutor:
        return PinnedExecutor(ThreadExecutor(launch), lambda batch: batch, threaded=True, copy=copy)

    loader = statecore.DataLoader(range(12), batch_size=3, num_workers=2, executor=factory)
    got = []
    for batch in loader:
        claimed_so_far = [logged for kind, _, logged in copy.log if kind == "claim"]
        assert batch.tolist() in claimed_so_far
        got.append(batch.tolist())
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    launched = [batch for kind, thread, batch in copy.log if kind == "launch" and thread == STAGE]
    claimed = [batch for kind, thread, batch in copy.log if kind == "claim"]
    assert sorted(launched) == got
    consumer = threading.current_thread().name
    assert {thread for kind, thread, _ in copy.log if kind == "claim"} == {consumer}
    assert sorted(claimed) == got  # claims come in arrival order; the core reorders


def test_a_device_copy_to_the_cpu_is_refused_with_what_to_do() -> None:
    loader = statecore.DataLoader(range(4), executor=pinned(device="cpu", pin=mark))
    with pytest.raises(ValueError, match=r"CUDA devices only.*leave device out"):
        iter(loader)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without CUDA")
def test_a_device_copy_without_cuda_says_so() -> None:
    loader = statecore.DataLoader(range(4), executor=pinned(device="cuda", pin=mark))
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        iter(loader)


# --- torch's pin_memory=True, and the name "pinned" ----------------------------------------------


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only behaviour")
def test_without_an_accelerator_the_pinned_executor_warns_and_hands_batches_over() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = statecore.DataLoader(range(6), batch_size=2, num_workers=2, executor="pinned")
        got = batches(loader)
    assert [batch.tolist() for batch in got] == [[0, 1], [2, 3], [4, 5]]
    messages = [str(warning.message) for warning in caught]
    assert messages == [
        "the pinned executor found no accelerator to pin memory for; batches are handed over "
        "unpinned"
    ]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("executor", [None, "pinned"])
def test_without_an_accelerator_pin_memory_gives_torchs_warning_alone(executor: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = batches(statecore.DataLoader(range(4), pin_memory=True, executor=executor))
    with warnings.catch_warnings(record=True) as torchs:
        warnings.simplefilter("always")
        theirs = batches(torch.utils.data.DataLoader(range(4), pin_memory=True))
    assert [str(w.message) for w in caught] == [str(w.message) for w in torchs]
    assert [batch.tolist() for batch in ours] == [batch.tolist() for batch in theirs]
    assert not any(batch.is_pinned() for batch in ours)


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), [(None, 0), (None, 2), ("thread", 2)])
def test_pin_memory_puts_the_stage_over_the_executor_that_loads(
    an_accelerator: set[int], executor: Any, workers: int
) -> None:
    loader = statecore.DataLoader(
        range(6), batch_size=2, num_workers=workers, pin_memory=True, executor=executor
    )
    got = batches(loader)
    assert [batch.tolist() for batch in got] == [[0, 1], [2, 3], [4, 5]]
    assert all(batch.untyped_storage().data_ptr() in an_accelerator for batch in got)


def test_pin_memory_device_is_deprecated_as_in_torch(an_accelerator: set[int]) -> None:
    with pytest.warns(UserWarning, match="pin_memory_device is deprecated"):
        got = batches(statecore.DataLoader(range(2), pin_memory=True, pin_memory_device="cuda:1"))
    assert all(batch.untyped_storage().data_ptr() in an_accelerator for batch in got)


def test_the_pinned_executor_cannot_wrap_itself() -> None:
    with pytest.raises(ValueError, match="cannot wrap another pinned executor"):
        statecore.DataLoader(range(4), num_workers=1, executor=pinned("pinned"))


@pytest.mark.filterwarnings(NO_ACCELERATOR)
def test_the_name_pinned_chooses_its_inner_executor_from_num_workers() -> None:
    in_process = statecore.DataLoader(range(4), executor="pinned")
    with_workers = statecore.DataLoader(range(4), num_workers=2, executor="pinned")
    assert in_process.loads_in_process and not with_workers.loads_in_process
    assert "pinned" in statecore.executors.available()


# --- on a GPU machine ----------------------------------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@CUDA
@WORKERS
@pytest.mark.parametrize("workers", [0, 2])
def test_on_cuda_pin_memory_hands_over_pinned_batches(workers: int) -> None:
    loader = statecore.DataLoader(
        range(8), batch_size=2, collate_fn=records, num_workers=workers, pin_memory=True
    )
    for batch in loader:
        assert all(tensor.is_pinned() for tensor in tensors(batch))


@CUDA
@WORKERS
def test_on_cuda_the_device_copy_hands_over_device_tensors_with_the_loaded_values() -> None:
    size = 1 << 20  # big enough for the copy to take a while
    loader = statecore.DataLoader(
        range(16), batch_size=4, num_workers=2, collate_fn=lambda items: {
            "x": torch.stack([torch.full((size,), float(item)) for item in items]),
            "items": items,
        },
        executor=pinned("mp", device="cuda"),
    )  # fmt: skip
    for number, batch in enumerate(loader):
        x = batch["x"]
        assert x.device.type == "cuda"
        # Read on the consumer's stream at once: it must see the copied values, not garbage.
        expected = torch.tensor(batch["items"], device="cuda", dtype=torch.float32)
        assert torch.equal(x.mean(dim=1), expected)
        assert batch["items"] == list(range(4 * number, 4 * number + 4))


@CUDA
def test_on_cuda_the_device_copy_works_in_process() -> None:
    got = batches(statecore.DataLoader(range(6), batch_size=3, executor=pinned(device="cuda")))
    assert [batch.device.type for batch in got] == ["cuda", "cuda"]
    assert [batch.tolist() for batch in got] == [[0, 1, 2], [3, 4, 5]]
