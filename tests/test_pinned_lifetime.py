"""The device copy's lifetime rule: a batch's pinned host memory outlives its copy.

A copy to the GPU runs on a side stream after `launch` returns. Were the pinned batch it reads
let go of then, a pin function's cache (torch's pinned-memory cache, or a pool of one's own)
could hand the same memory to the next batch while the copy still reads it: the consumer would
get the wrong values, silently. So `CudaCopy` holds each host batch until the consumer's
stream has waited on the copy's event and the event has completed.

Most tests run on any machine, with stand-ins for CUDA's streams and events (`FakeStreams`,
through `CudaCopy`'s `streams` seam) and the "meta" device in place of the GPU; they watch
when a host batch is freed with `weakref.finalize`. The last test needs CUDA and runs the real
path.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from typing import Any

import pytest
import torch
from _side_by_side import WORKERS

import statecore
from statecore.executors import Launch, PinnedExecutor
from statecore.executors._pinned import CudaCopy, CudaStreams, InFlight
from statecore.executors._thread.executor import ThreadExecutor

Log = list[tuple[str, int]]


class FakeEvent:
    """An event the test completes by hand (`finish`), or its stream does (`synchronize`)."""

    def __init__(self, number: int, log: Log, instant: bool) -> None:
        self.number = number
        self.log = log
        self.finished = instant

    def record(self, stream: FakeStream) -> None:
        stream.recorded.append(self)

    def query(self) -> bool:
        return self.finished

    def finish(self) -> None:
        self.finished = True
        self.log.append(("copied", self.number))


class FakeStream:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.recorded: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("waited", event.number))

    def synchronize(self) -> None:
        for event in self.recorded:
            if not event.finished:
                event.finish()


class FakeStreams(CudaStreams):
    """CUDA's streams and events, as a log of what happened to each copy, by its number."""

    def __init__(self, instant: bool = False) -> None:
        self.log: Log = []
        self.events: list[FakeEvent] = []
        self.instant = instant
        self.consumer = FakeStream(self.log)

    def side_stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self.log)

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.consumer

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def event(self) -> FakeEvent:
        event = FakeEvent(len(self.events), self.log, self.instant)
        self.events.append(event)
        return event


META = torch.device("meta")  # tensors "copied" there keep no reference to the host batch


def host_batch(number: int, log: Log) -> torch.Tensor:
    """A batch whose freeing is logged as ("freed", number)."""
    batch = torch.full((4,), float(number))
    weakref.finalize(batch, log.append, ("freed", number))
    return batch


def launched(copy: CudaCopy, streams: FakeStreams) -> InFlight:
    """The ticket of a fresh host batch's copy; nothing but the copy holds the batch."""
    return copy.launch(host_batch(len(streams.events), streams.log))


def test_a_copys_host_batch_is_held_until_the_consumer_has_waited_on_it() -> None:
    streams = FakeStreams()
    copy = CudaCopy(META, streams)
    first = launched(copy, streams)
    streams.events[0].finish()
    copy.claim(launched(copy, streams))  # another batch's claim: the first is still unclaimed
    gc.collect()
    assert ("freed", 0) not in streams.log
    copy.claim(first)
    assert streams.log.index(("waited", 0)) < streams.log.index(("freed", 0))


def test_a_claimed_copy_that_may_still_run_keeps_its_host_batch() -> None:
    streams = FakeStreams()
    copy = CudaCopy(META, streams)
    copy.claim(launched(copy, streams))
    gc.collect()
    assert ("freed", 0) not in streams.log
    streams.events[0].finish()
    copy.claim(launched(copy, streams))  # any later claim lets go of what may go
    assert streams.log[:3] == [("waited", 0), ("copied", 0), ("freed", 0)]


def test_a_copy_whose_event_completed_lets_go_at_the_next_launch_too() -> None:
    streams = FakeStreams()
    copy = CudaCopy(META, streams)
    copy.claim(launched(copy, streams))
    streams.events[0].finish()
    launched(copy, streams)
    assert ("freed", 0) in streams.log
    assert [ticket.host is None for ticket in copy.in_flight] == [False]


def test_closing_lets_go_of_unclaimed_batches_once_the_side_stream_has_finished() -> None:
    streams = FakeStreams()
    copy = CudaCopy(META, streams)
    launched(copy, streams)
    launched(copy, streams)
    copy.close()
    assert streams.log == [("copied", 0), ("copied", 1), ("freed", 0), ("freed", 1)]
    assert copy.in_flight == []


def test_the_consumer_gets_the_copy_not_the_host_batch() -> None:
    streams = FakeStreams(instant=True)
    copy = CudaCopy(META, streams)
    got = copy.claim(copy.launch({"x": torch.ones(3), "name": "a"}))
    assert got["x"].device == META and got["name"] == "a"


@WORKERS
@pytest.mark.timeout(60)
def test_through_a_loader_no_host_batch_is_freed_before_its_wait_and_none_is_kept() -> None:
    streams = FakeStreams(instant=True)
    copy = CudaCopy(META, streams)
    pinned_so_far = 0

    def pin(batch: torch.Tensor) -> torch.Tensor:
        # Called in the stage thread, in launch order: the n-th pinned batch is copy n.
        nonlocal pinned_so_far
        pinned = host_batch(pinned_so_far, streams.log)
        pinned_so_far += 1
        return pinned

    def factory(launch: Launch) -> PinnedExecutor:
        return PinnedExecutor(ThreadExecutor(launch), pin, threaded=True, copy=copy)

    loader = statecore.DataLoader(range(24), batch_size=3, num_workers=2, executor=factory)
    got = [batch.device for batch in loader]
    gc.collect()
    assert got == [META] * 8
    for number in range(8):
        assert streams.log.index(("waited", number)) < streams.log.index(("freed", number))
    assert copy.in_flight == []


@WORKERS
@pytest.mark.timeout(60)
def test_a_loader_stopped_early_lets_go_of_its_copies_only_after_the_side_stream_finished() -> None:
    streams = FakeStreams()  # no copy finishes until the side stream is synchronized
    copy = CudaCopy(META, streams)
    pinned_so_far = 0

    def pin(batch: torch.Tensor) -> torch.Tensor:
        nonlocal pinned_so_far
        pinned = host_batch(pinned_so_far, streams.log)
        pinned_so_far += 1
        return pinned

    def factory(launch: Launch) -> PinnedExecutor:
        return PinnedExecutor(ThreadExecutor(launch), pin, threaded=True, copy=copy)

    loader = statecore.DataLoader(range(24), batch_size=3, num_workers=2, executor=factory)
    iterator = iter(loader)
    next(iterator)
    gc.collect()
    assert not any(kind == "freed" for kind, _ in streams.log)
    iterator._shutdown()  # type: ignore[attr-defined]
    gc.collect()
    freed = [number for kind, number in streams.log if kind == "freed"]
    assert sorted(freed) == list(range(pinned_so_far))
    for number in freed:
        assert streams.log.index(("copied", number)) < streams.log.index(("freed", number))
    assert copy.in_flight == []


# --- on a GPU machine ----------------------------------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@CUDA
def test_on_cuda_a_pinned_batch_is_held_until_claimed_and_copied_then_let_go() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    copy = CudaCopy(device)
    freed: list[int] = []
    host = torch.full((1 << 22,), 7.0).pin_memory()
    weakref.finalize(host, freed.append, 0)
    ticket = copy.launch(host)
    del host
    gc.collect()
    assert freed == []  # launched, not claimed: the copy may still read it
    moved = copy.claim(ticket)
    assert moved.device == device
    assert float(moved.sum()) == 7.0 * (1 << 22)  # on the consumer's stream, after the wait
    torch.cuda.synchronize(device)
    copy.claim(copy.launch(torch.zeros(4).pin_memory()))  # a later claim lets go of it
    gc.collect()
    assert freed == [0]
    copy.close()
    assert copy.in_flight == []


class RefillingPool:
    """Pinned buffers handed out again as soon as nobody but the pool holds one, as a pool of
    one's own does: the memory a copy still reads is refilled if the copy let go of it early."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers: list[torch.Tensor] = []

    def filled(self, value: float) -> torch.Tensor:
        for buffer in self.buffers:
            # The list, the loop's name and getrefcount's argument: no one else holds it.
            if sys.getrefcount(buffer) == 3:
                return buffer.fill_(value)
        buffer = torch.full((self.size,), value).pin_memory()
        self.buffers.append(buffer)
        return buffer


@CUDA
def test_on_cuda_a_pool_never_refills_a_buffer_whose_copy_has_not_run() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    copy = CudaCopy(device)
    pool = RefillingPool(1 << 20)
    tickets = []
    for number in range(6):
        with torch.cuda.stream(copy.stream):
            # Hold the side stream up, so each copy runs long after `launch` returned.
            torch.cuda._sleep(20_000_000)  # type: ignore[attr-defined]
        tickets.append(copy.launch(pool.filled(float(number))))
    got = [float(copy.claim(ticket).mean()) for ticket in tickets]
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(pool.buffers) == 6  # none was free to refill while its copy waited
    copy.close()


@CUDA
@WORKERS
@pytest.mark.timeout(120)
def test_on_cuda_a_loader_over_a_refilling_pool_hands_over_every_batch_intact() -> None:
    pool = RefillingPool(1 << 22)

    def pin(batch: torch.Tensor) -> torch.Tensor:
        return pool.filled(0.0).copy_(batch)

    loader = statecore.DataLoader(
        range(32), batch_size=None, num_workers=2,
        collate_fn=lambda item: torch.full((1 << 22,), float(item)),
        executor=statecore.executors.pinned("mp", device="cuda", pin=pin),
    )  # fmt: skip
    for number, batch in enumerate(loader):
        torch.cuda._sleep(5_000_000)  # type: ignore[attr-defined]  # a busy consumer stream
        assert float(batch.mean()) == float(number)
        assert float(batch[-1]) == float(number)


# --- the host-to-device workload (python -m statecore.tools.gpu_copy) ----------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what it says without CUDA")
def test_the_gpu_copy_workload_says_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from statecore.tools.gpu_copy import main

    assert main(["--rounds", "1"]) == 2
    assert "CUDA is not available here" in capsys.readouterr().err


@WORKERS
@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
@pytest.mark.parametrize("loader", ["torch", "pinned"])
def test_a_gpu_copy_run_counts_every_batch_but_the_first(
    monkeypatch: pytest.MonkeyPatch, loader: str
) -> None:
    # Run on the CPU: the "device" is the CPU, and there is no stream to wait for.
    from statecore.tools.gpu_copy import LOADERS, one_run

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    moved, seconds = one_run(LOADERS[loader], 3, torch.device("cpu"))
    assert moved == 2 * 4 * 1_250_000 * 4  # two batches of four samples of 1.25M float32
    assert seconds > 0


@CUDA
@WORKERS
@pytest.mark.timeout(120)
def test_on_cuda_the_gpu_copy_workload_reports_each_loader(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from statecore.tools.gpu_copy import main

    assert main(["--rounds", "1", "--batches", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["link,", "link,", "torch", "pinned", "side"]
