"""The pinned executor: a pin-memory stage composed over any other executor.

`DataLoader(..., pin_memory=True)` wraps whatever executor loads the batches (inline, mp,
thread or a plug-in) in this stage; `executor="pinned"` (or `pinned(...)`) names it outright.

Over an executor whose factory declares `poll_from_any_thread` (`Capabilities`; mp and thread
do), the stage is one thread of the main process. It is the only caller of the inner executor's
`poll`: it takes each answer as it arrives, pins a batch's
tensors (torch's `pin_memory` semantics: tensors inside mappings, sequences, tuples and
namedtuples; `.pin_memory()` on a custom batch type; strings and other objects unchanged), and
queues the answer for the driver. Pinning thus overlaps with training, as torch's pin thread
does. Over any other executor (in-process ones, and plug-ins that load when polled) the batch
is pinned in the calling thread, as torch does with `num_workers=0`.

The stage decides nothing. Answers keep the order each worker gave them, so a resume is still
answered after every task sent before it; the core reorders batches as always. A batch that
fails to pin becomes that task's `TaskFailed`, so the error is raised in the batch's turn. At
shutdown the stage thread stops before the inner executor stops its workers, because it is
the stage that reads their answers.

Beyond torch, `pinned(device="cuda")` also copies each pinned batch to the GPU on a side
stream as soon as it is pinned (the tensors inside its mappings, lists and tuples; other
objects stay in pinned host memory), and records a CUDA event after the copy. Before the driver sees
the batch, the consumer's current stream is made to wait for that event, so the consumer can
never read a tensor before its copy is done; and each tensor is marked as used on the
consumer's stream, so the caching allocator does not hand its memory to the side stream while
the consumer still reads it. How far ahead copies run is bounded by what the core lets the
workers prefetch.

Over the "mp" executor the stage also page-locks the workers' buffers in place: each buffer is
registered with CUDA once, as its worker announces it (`_mp.leases`), so a batch arrives pinned
already and is copied to the device straight from the buffer its worker wrote, with no copy into
pinned memory first. Only `device=` asks for it, since only there the stage's own copy is the
last reader of the host batch (see the rule below); where page-locking fails (CUDA refuses the
memory), batches are pinned by copying, as before.

The copy's lifetime rule: the pinned host batch a copy reads is not let go of while that copy
may still run. The copy itself holds it (`CudaCopy.in_flight`) until both the consumer's stream
has waited on the copy's event (the batch was claimed) and the event has completed; a batch
never claimed (the loader stopped first) is let go of at shutdown, once the side stream has
finished. Memory a pin function hands out again (torch's pinned-memory cache, a pool of one's
own) is thus never reused under a running copy, whatever the pin function is.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import copy
import ctypes
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from statecore import Event, ReplaceWorker, ResumeWorker, SendTask, TaskCompleted, TaskFailed
from statecore.executors._confirm import Confirming
from statecore.executors._handoff import Handoff
from statecore.executors._incarnation import Standing
from statecore.executors._protocol import (
    Capabilities,
    Executor,
    ExecutorFactory,
    Launch,
    WorkerReport,
    capabilities_of,
    confirmer_of,
    replacer_of,
)

__all__ = [
    "CudaCopy",
    "CudaStreams",
    "DeviceCopy",
    "InFlight",
    "LendsBuffers",
    "PageLocking",
    "Pinned",
    "PinnedExecutor",
    "default_pin",
    "pinned",
]

# How long the stage thread waits on the workers before it checks whether it is to stop.
STAGE_POLL_INTERVAL = 0.05
# How long shutdown waits for the stage thread to finish the batch it is pinning.
STAGE_JOIN_TIMEOUT = 30.0

PinFunction = Callable[[Any], Any]


class DeviceCopy(Protocol):
    """Moves pinned batches to a device ahead of use, in two halves.

    The stage lets go of a batch once `launch` returns: an asynchronous copy must hold what it
    reads itself until the consumer has waited on the copy and the copy has run, as `CudaCopy`
    does.
    """

    def launch(self, batch: Any) -> Any:
        """In the stage thread: start copying `batch`; return a ticket for `claim`."""

    def claim(self, ticket: Any) -> Any:
        """In the consumer's thread: order the consumer after the copy; return the batch."""


@runtime_checkable
class PageLocking(Protocol):
    """A device copy that can page-lock host memory where it lies (`CudaCopy`)."""

    def register(self, address: int, length: int) -> Callable[[], None] | None:
        """Page-lock `length` bytes at `address`; return what undoes it, or None."""


@runtime_checkable
class LendsBuffers(Protocol):
    """An executor whose batches arrive in buffers this process maps once ("mp"), which it
    page-locks when asked."""

    def register_buffers(self, register: Callable[[int, int], Callable[[], None] | None]) -> None:
        """Page-lock with `register` every buffer mapped from now on."""


def _moved(data: Any, device: torch.device) -> Any:
    """`data` with every tensor it holds copied to `device`, asynchronously.

    Only tensors inside mappings, lists and tuples (namedtuples too) move, because only those
    can be found again to mark them used on the consumer's stream (`_tensors`); anything else,
    a custom batch type included, is handed over as it is, in pinned host memory.
    """
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, collections.abc.Mapping):
        items = {key: _moved(value, device) for key, value in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            # A copy keeps the mapping's type and whatever else it carries (a defaultdict's
            # factory, say); only the values change.
            clone = copy.copy(data)
            clone.update(items)
            return clone
        try:
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(data, tuple):
        values = [_moved(value, device) for value in data]
        return type(data)(*values) if hasattr(data, "_fields") else type(data)(values)
    if isinstance(data, list):
        return [_moved(value, device) for value in data]
    return data


def _tensors(data: Any) -> collections.abc.Iterator[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, collections.abc.Mapping):
        for value in data.values():
            yield from _tensors(value)
    elif isinstance(data, tuple | list):
        for value in data:
            yield from _tensors(value)


class CudaStreams:
    """The CUDA runtime as `CudaCopy` uses it: streams, events, and which stream is current.

    A seam: the tests hand `CudaCopy` a stand-in with these four methods (streams with
    `wait_event` and `synchronize`, events with `record` and `query`), to check on a machine
    without CUDA when a copy's host memory is let go of.
    """

    def side_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def using(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]


@attrs.define(eq=False)
class InFlight:
    """One batch's copy: its ticket from `CudaCopy.launch` to `CudaCopy.claim`."""

    moved: Any
    """The batch as the consumer gets it: its tensors on the device."""
    done: Any
    """The event recorded on the side stream after the copy."""
    host: Any
    """The pinned batch the copy reads: held until it may be let go of (`CudaCopy.in_flight`),
    then None."""
    claimed: bool = False
    """Whether the consumer's stream has waited on `done`."""


class CudaCopy:
    """Copies batches to a CUDA device on a side stream, fenced by CUDA events."""

    def __init__(self, device: torch.device, streams: CudaStreams | None = None) -> None:
        self.device = device
        self.streams = CudaStreams() if streams is None else streams
        self.stream = self.streams.side_stream(device)
        self.lock = threading.Lock()
        self.page_locking = True
        """Whether to go on page-locking workers' buffers: off after CUDA refused once."""
        self.in_flight: list[InFlight] = []
        """Every copy whose host batch is still held: until it was claimed and its event has
        completed. Launched in the stage thread, claimed in the consumer's: hence the lock."""

    def launch(self, batch: Any) -> InFlight:
        streams = self.streams
        with streams.using(self.stream):
            moved = _moved(batch, self.device)
            done = streams.event()
            done.record(self.stream)
        ticket = InFlight(moved, done, batch)
        with self.lock:
            self._let_go()
            self.in_flight.append(ticket)
        return ticket

    def claim(self, ticket: InFlight) -> Any:
        consumer = self.streams.current_stream(self.device)
        consumer.wait_event(ticket.done)
        for tensor in _tensors(ticket.moved):
            if tensor.device.type == "cuda":
                tensor.record_stream(consumer)
        with self.lock:
            ticket.claimed = True
            self._let_go()
        return ticket.moved

    def register(self, address: int, length: int) -> Callable[[], None] | None:
        """Page-lock a worker's buffer for copies to any device (cudaHostRegister); return
        what undoes it, or None where CUDA refuses (the buffer's batches are then pinned by
        copying, as before)."""
        clear = _last_error_clearer()
        if not self.page_locking or clear is None:
            # Without a way to clear a refusal from this thread's CUDA error state, torch
            # would later report it as the failure of an unrelated kernel launch.
            return None
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        code = int(cudart.cudaHostRegister(address, length, _REGISTER_PORTABLE))
        if code != 0:
            clear()
            self.page_locking = False
            warnings.warn(
                f"statecore could not page-lock a worker's {length}-byte buffer for the GPU "
                f"(cudaHostRegister returned error {code}); its batches are pinned by copying "
                "instead, as torch pins them",
                stacklevel=2,
            )
            return None
        return functools.partial(_unregister, address)

    def close(self) -> None:
        """Let go of every host batch still held, once the side stream has finished: the
        batches never claimed too (the loader stopped before the consumer took them)."""
        self.stream.synchronize()
        with self.lock:
            for ticket in self.in_flight:
                ticket.host = None
            self.in_flight = []

    def _let_go(self) -> None:
        # The lock is held. A copy's host batch goes once the consumer has waited on the copy
        # and the copy has run: before either, the memory may be read by the copy still, and a
        # pin function's cache may hand it to the next batch.
        kept = []
        for ticket in self.in_flight:
            if ticket.claimed and ticket.done.query():
                ticket.host = None
            else:
                kept.append(ticket)
        self.in_flight = kept


_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's copies


def _unregister(address: int) -> None:
    # Called as the mapping goes, from whichever thread freed its last tensor: an error here
    # (the context already gone at exit) must not escape a finalizer.
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    cudart.cudaHostUnregister(address)
    clear = _last_error_clearer()
    if clear is not None:
        clear()


@functools.cache
def _last_error_clearer() -> Callable[[], int] | None:
    """`cudaGetLastError` of the CUDA runtime torch loaded, where it can be reached (torch
    builds that link the runtime statically hide it): it clears the error a refused call left."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        clear: Callable[[], int] = runtime.cudaGetLastError
        return clear
    return None


def default_pin() -> PinFunction | None:
    """torch's pin function for the current accelerator; None where torch would not pin."""
    if not torch.accelerator.is_available():
        return None
    accelerator = torch.accelerator.current_accelerator()
    device = accelerator.type if accelerator is not None else None
    if device == "mps":
        return None  # torch's DataLoader does not pin for MPS either: pinning fails there
    return functools.partial(torch_pin_memory, device=device)


class PinnedExecutor(Confirming):
    """An executor that pins (and optionally moves) every batch another executor produces."""

    capabilities: Capabilities = Capabilities(confirms_answers=True)
    """Read from the executor: `confirms_answers`, and whether it replaces (and kills) lost
    workers, as the executor under it does (`replace` and `report` pass through). Whether the
    stage loads in-process is its factory's to say (`Pinned.capabilities`)."""

    def __init__(
        self,
        inner: Executor,
        pin: PinFunction,
        *,
        threaded: bool,
        copy: DeviceCopy | None = None,
    ) -> None:
        self.inner = inner
        self.pin = pin
        self.copy = copy
        self.threaded = threaded
        self.answers: Handoff[Event | BaseException] = Handoff()
        self.inner_confirm = confirmer_of(inner)
        locking: object = copy  # either protocol is optional beside the one it extends
        lender: object = inner
        if isinstance(locking, PageLocking) and isinstance(lender, LendsBuffers):
            lender.register_buffers(locking.register)
        below = capabilities_of(inner)
        self.capabilities = Capabilities(
            confirms_answers=True,
            replaces_workers=below.replaces_workers,
            kills_stuck_workers=below.kills_stuck_workers,
        )
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.failed: BaseException | None = None
        """Why the stage thread ended early: every later poll raises it again."""
        self.closed = False

    def start(self) -> None:
        self.inner.start()
        if self.threaded:
            device_index = (
                torch.accelerator.current_device_index()
                if torch.accelerator.is_available()
                else None
            )
            self.thread = threading.Thread(
                target=self._stage, args=(device_index,), name="statecore-pin", daemon=True
            )
            self.thread.start()

    def dispatch(self, command: SendTask) -> None:
        self.inner.dispatch(command)

    def resume(self, command: ResumeWorker) -> None:
        self.inner.resume(command)

    def stop_worker(self, worker: int) -> None:
        self.inner.stop_worker(worker)

    def replace(self, command: ReplaceWorker, mark: Standing) -> None:
        # Declared only over an executor that replaces: the driver calls it on no other.
        replacer = replacer_of(self.inner)
        assert replacer is not None
        replacer.replace(command, mark)

    def report(self, worker: int) -> WorkerReport:
        replacer = replacer_of(self.inner)
        return WorkerReport() if replacer is None else replacer.report(worker)

    def poll(self, timeout: float | None) -> Event | None:
        # An interrupt may land anywhere here: an answer stays where it was (unconfirmed in the
        # inner executor, or in our list) until it is kept as ours (see _confirm); pinning or
        # claiming it again is harmless.
        if self._unconfirmed is not None:
            return self._unconfirmed  # not confirmed yet: an interrupt cut the last poll short
        if not self.threaded:
            # The inner executor keeps its answer too, until ours is confirmed (`confirm`).
            raw = self.inner.poll(timeout)
            if raw is None:
                return None
            event = self._claimed(self._pinned(raw))
            self._unconfirmed = event
            return event
        if self.failed is not None:
            raise self.failed  # the stage is gone: nothing will ever answer again
        answers = self.answers
        if not answers.wait(timeout):
            return None
        answer = answers.items[0]
        if isinstance(answer, BaseException):
            self.failed = answer
            raise answer
        return self._hand_out(self._claimed(answer), answers.items)

    def confirm(self) -> None:
        # The inner executor's answer first: until ours is forgotten too, an interrupt here
        # leaves the driver to confirm again, and the inner executor to forget nothing new.
        if not self.threaded and self.inner_confirm is not None:
            self.inner_confirm()
        self._unconfirmed = None

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stopping.set()
        if self.thread is not None:
            # The stage reads the workers' answers: it must be gone before they are.
            self.thread.join(STAGE_JOIN_TIMEOUT)
            if self.thread.is_alive():
                warnings.warn(
                    f"statecore's pin-memory stage did not finish pinning within "
                    f"{STAGE_JOIN_TIMEOUT:.0f} s; stopping the workers under it",
                    stacklevel=2,
                )
            self.thread = None
        self.inner.shutdown()
        self.answers.clear()
        self._unconfirmed = None
        if isinstance(self.copy, CudaCopy):
            self.copy.close()  # the host batches of copies nobody will claim now

    # --- the stage ---------------------------------------------------------------------------

    def _stage(self, device_index: int | None) -> None:
        # Pinning copies memory; one thread keeps it from competing with the training loop.
        torch.set_num_threads(1)
        if device_index is not None:
            torch.accelerator.set_device_index(device_index)
        try:
            while not self.stopping.is_set():
                asked = time.monotonic()
                raw = self.inner.poll(STAGE_POLL_INTERVAL)
                answer = None if raw is None else self._pinned(raw)
                if self.inner_confirm is not None:
                    self.inner_confirm()  # kept as ours below; no interrupt reaches this thread
                if answer is not None:
                    self._answer(answer)
                elif time.monotonic() - asked < STAGE_POLL_INTERVAL / 2:
                    # The inner executor owes nothing (its workers were stopped, and shutdown
                    # is on its way): wait for the stop rather than spin.
                    self.stopping.wait(STAGE_POLL_INTERVAL)
        except BaseException as error:
            # The driver is waiting on our queue: hand it the reason rather than leave it there.
            self._answer(error)

    def _answer(self, answer: Event | BaseException) -> None:
        self.answers.put(answer)

    def _pinned(self, event: Event) -> Event:
        """`event` with its batch pinned (and its copy launched); a pinning error as TaskFailed."""
        if type(event) is not TaskCompleted:
            return event
        try:
            batch = self.pin(event.payload)
            if self.copy is not None:
                batch = self.copy.launch(batch)
        except Exception as error:
            error.add_note(
                f"Raised while pinning the batch of task {event.task} from worker "
                f"{event.worker} in statecore's pin-memory stage"
            )
            return TaskFailed(
                event.task, event.worker, error, event.mark, event.timing, event.incarnation
            )
        return TaskCompleted.fast(
            event.task, event.worker, batch, event.mark, event.timing, event.incarnation
        )

    def _claimed(self, event: Event) -> Event:
        if self.copy is None or type(event) is not TaskCompleted:
            return event
        claimed = self.copy.claim(event.payload)
        return TaskCompleted.fast(
            event.task, event.worker, claimed, event.mark, event.timing, event.incarnation
        )


@attrs.frozen
class Pinned:
    """An executor factory: the pin-memory stage over `inner`.

    `inner` is a registered name, a factory, or None for the loader's default ("inline" with
    num_workers=0, "mp" otherwise); the DataLoader resolves it. `device`, if given, is where
    each pinned batch is copied ahead of use (CUDA only). `pin` replaces torch's pin function,
    for instance to run the stage where there is no accelerator.
    """

    inner: str | ExecutorFactory | None = None
    device: str | torch.device | None = None
    pin: PinFunction | None = None
    in_process: bool = False
    """Whether `inner` loads in the calling thread; set when `inner` is resolved."""

    @property
    def capabilities(self) -> Capabilities:
        # Its executor keeps every answer until the driver has recorded it, whatever `inner`
        # does; its own thread, if any, is the only caller of the inner `poll`. It replaces
        # lost workers where `inner` does, by asking `inner`.
        below = capabilities_of(self.inner)
        return Capabilities(
            in_process=self.in_process,
            confirms_answers=True,
            replaces_workers=below.replaces_workers,
            kills_stuck_workers=below.kills_stuck_workers,
        )

    def __call__(self, launch: Launch) -> Executor:
        if self.inner is None or isinstance(self.inner, str):
            raise TypeError(
                f"the pinned executor's inner executor {self.inner!r} is not resolved yet; "
                "pass it to statecore.DataLoader(executor=...), which resolves it"
            )
        pin = self.pin if self.pin is not None else default_pin()
        copy = self._device_copy()
        if pin is None:
            warnings.warn(
                "the pinned executor found no accelerator to pin memory for; batches are "
                "handed over unpinned",
                stacklevel=2,
            )
            if copy is None:
                return self.inner(launch)
            pin = _unchanged
        # A thread of our own may poll only an executor that says it can be polled from any
        # thread while the driver's thread dispatches: most that load when polled cannot.
        threaded = not self.in_process and capabilities_of(self.inner).poll_from_any_thread
        if threaded:
            launch = attrs.evolve(launch, start_all_at_once=True)
        return PinnedExecutor(self.inner(launch), pin, threaded=threaded, copy=copy)

    def _device_copy(self) -> DeviceCopy | None:
        if self.device is None:
            return None
        device = torch.device(self.device)
        if device.type != "cuda":
            raise ValueError(
                f"the pinned executor copies batches ahead of use to CUDA devices only, not "
                f"{device}; leave device out to keep batches in pinned host memory"
            )
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"the pinned executor was asked to copy batches to {device}, but CUDA is not "
                "available here; leave device out to load on the CPU"
            )
        # "cuda" alone means the current device, fixed now: the stage thread has its own.
        index: int | None = device.index
        chosen = torch.cuda.current_device() if index is None else index
        return CudaCopy(torch.device("cuda", chosen))


def _unchanged(batch: Any) -> Any:
    return batch


def pinned(
    inner: str | ExecutorFactory | None = None,
    *,
    device: str | torch.device | None = None,
    pin: PinFunction | None = None,
) -> Pinned:
    """The pin-memory stage over `inner`: `DataLoader(..., executor=pinned("thread"))`.

    `device="cuda"` also copies each batch to the GPU ahead of use, so the loop receives device
    tensors. `pin` replaces torch's pin function.
    """
    return Pinned(inner, device, pin)
