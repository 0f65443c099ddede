"""Tracing a loader: what happened to every batch, and what the consumer waited for.

A traced loader (`DataLoader(..., trace=True)`, or `STATECORE_TRACE` in the environment)
gives its driver a step function that wraps the scheduler's (`Tracer.wrap`): every event the
scheduler is told of and every command it gives passes through it, with the time. From those
the tracer keeps, per batch, when its task was sent, when the worker started and finished it
(the worker's own clock: `TaskTiming`, see `executors._timing`), when its answer arrived and
when it was handed over; per call of the consumer, how long it waited; and the epochs' starts
and ends, workers resumed and workers that died. Nothing here decides anything: the tracer
only watches what the scheduler does.

`Tracer.trace()` gives a `Trace`, plain data, from which come the figures (`Trace.stats`), the
verdict in words (`Trace.verdict`), and a Chrome/Perfetto trace file (`Trace.chrome`).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
import itertools
import json
import math
import operator
import os
import statistics
import struct
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from numpy.typing import NDArray

from statecore import (
    Deliver,
    DrawIndex,
    EndEpoch,
    Event,
    IndexDrawn,
    NextRequested,
    RaiseError,
    ResetRequested,
    ResumeWorker,
    SendTask,
    State,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    Transition,
    WorkerDied,
    WorkerResumed,
)
from statecore.executors._timing import WHOLE_BATCH

__all__ = [
    "DEFAULT_LIMIT",
    "TRACE_VARIABLE",
    "BatchRecord",
    "LoaderStats",
    "Mark",
    "Trace",
    "Tracer",
    "collect",
    "collecting",
    "stop_collecting",
    "tracing_from_environment",
]

TRACE_VARIABLE = "STATECORE_TRACE"
"""Set to 1 to trace every statecore loader made without `trace=`; set to a folder to also
have each traced loader write its trace, timeline and verdict there when the program ends."""

DEFAULT_LIMIT = 200_000
"""Batches a tracer keeps, and waits, and marks; past that it forgets the oldest (a long run's
first epochs), all that came before the stretch it keeps (`Tracer._forget_beyond`)."""

STRAGGLER_FACTOR = 3.0
"""A batch is a straggler when it took more than this many times the median batch."""

StepFunction = Callable[[State, Event], Transition]

Column = NDArray[Any]
"""A column of numbers as the figures read it (numpy: one thread, and little to call)."""

# The trace's own tables are columns holding numbers and None, which the garbage collector
# leaves out of its walks. A table of lists, one per batch, with the timings' tuples in them,
# added four objects a batch to every young collection of the main process: a third of what
# tracing cost where batches are small and fast. A batch sampler's lists of indices are kept
# packed (`_Packer`) for the same reason, and more: kept as they are, each batch's list and
# its int objects (2.6 kB for 64 indices) outlived it, and processes-b64 traced cost 11.6%
# more than untraced, against 7.3% with no indices kept at all.
_FIELDS = ("worker", "index", "packed", "sent", "started", "finished", "arrived", "handed", "cpu")

LIMIT_CHECKED_EVERY = 1024
"""Tasks a driver sends between two looks at the tracer's limit: between them it may keep up
to this many more batches than the limit; a trace read is cut to the limit exactly."""


class _Packer:
    """Packs a batch sampler's lists of indices into bytes, eight a number: 0.55 us for 64,
    where keeping a list kept 65 objects alive (see `_FIELDS`).

    A list that does not pack (not all integers, or one beyond 64 bits) is kept as it is, and
    so is every later one: a sampler that yields such lists once will again, and the failed
    attempt would cost each batch an exception.
    """

    def __init__(self) -> None:
        self.formats: dict[int, Callable[..., bytes]] = {}
        self.pack = self._pack
        """Packs a list, or answers None: the attribute is the method until a list does not
        pack, and then a function that answers None at once."""

    def _pack(self, index: list[Any]) -> bytes | None:
        size = len(index)
        pack = self.formats.get(size)
        if pack is None:
            pack = self.formats[size] = struct.Struct(f"{size}q").pack
        try:
            return pack(*index)
        except (struct.error, TypeError, OverflowError):
            self.pack = _keep
            return None


def _keep(index: list[Any]) -> None:
    return None


TASK_BITS = 36
"""A task's key in the tracer's tables: the number of the driver (loader iterator) that sent
it above these bits, the task's own number (counted by that driver) below. One table serves
all of a loader's iterators, so an iterator leaves nothing behind once its batches and waits
are forgotten: a table per iterator cost 3.7 kB an iterator, kept for the loader's life."""

_TASK = (1 << TASK_BITS) - 1
"""The task's number in a key; all ones in a wait's key: the wait ended its epoch."""

DRIVERS = 1 << (63 - TASK_BITS)
"""Drivers are numbered modulo this, so that keys fit the waits' column of signed 64-bit
numbers: a number comes back after 134 million iterators, long after the batches of the
iterator that had it were forgotten."""


_GROWN_BY = 1024
"""Rows the columns filled on an answer grow by at a time, NaN (not yet) until then."""
_NANS = array("d", [math.nan]) * _GROWN_BY


class _Tasks:
    """A loader's tasks as columns of numbers, one row a task in the order sent, and the
    consumer's waits. A task's row is found by its key (`TASK_BITS`) in `row`; a moment that
    did not (yet) come is NaN. A task's epoch is not kept: it is the number of epochs begun
    when it was sent.

    Columns of numbers, not dicts by key: dicts that forgot as many keys as a long run does
    took a third of a second to read at the limit, and each float in them was an object of
    its own (the tracer held 1.4 kB a batch at the limit)."""

    def __init__(self) -> None:
        self.row: dict[int, int] = {}
        """Each kept task's row by key, counted from the first task traced: its place in the
        columns is that less `first`."""
        self.first = 0
        """Rows forgotten."""
        self.key = array("q")
        self.worker = array("q")
        self.sent = array("d")
        """When each task was sent, in the order of sending: its length is the tasks kept."""
        self.started = array("d")
        self.finished = array("d")
        self.arrived = array("d")
        self.handed = array("d")
        self.cpu = array("d")
        self.slowest_took = array("d")
        """A task's slowest sample's seconds, as its worker reported it (a worker reports one).
        These six are filled as answers come, and grow `_GROWN_BY` rows at a time: they may
        be longer than `sent`, and what lies beyond it is no task's yet."""
        self.filled = (
            self.started,
            self.finished,
            self.arrived,
            self.handed,
            self.cpu,
            self.slowest_took,
        )
        self.index: dict[int, Any] = {}
        """The sampler's index of each task, by key, as it gave it, when not packed."""
        self.packed: dict[int, bytes] = {}
        """A batch sampler's list of ints, packed (see `_Packer`)."""
        self.slowest_index: dict[int, Any] = {}
        self.failed: set[int] = set()
        self.asked = array("d")
        self.got = array("d")
        self.waited_for = array("q")
        """The consumer's waits, in columns, in the order they ended: when it asked, when it
        got its answer, and the key of the task it got (the task number all ones: the end of
        an epoch). What of each wait was spent holding a ready batch back is worked out when
        the trace is read (`waits`)."""

    def grow(self) -> None:
        """Room for `_GROWN_BY` more tasks in the columns filled as answers come."""
        for column in self.filled:
            column.extend(_NANS)

    def forget_oldest(self, count: int) -> None:
        """Forget the `count` oldest batches kept (at most as many as are kept)."""
        keys = self.key[:count]
        row = self.row
        for key in keys:
            del row[key]
        for table in (self.index, self.packed, self.slowest_index):
            if table:
                pop = table.pop
                for key in keys:
                    pop(key, None)
        if self.failed:
            self.failed.difference_update(keys)
        for column in (self.key, self.worker, self.sent, *self.filled):
            del column[:count]
        self.first += count

    def forget_waits(self, count: int) -> None:
        """Forget the `count` oldest waits."""
        del self.asked[:count]
        del self.got[:count]
        del self.waited_for[:count]

    def waits(self, epoch_starts: list[float]) -> _Waits:
        """The consumer's waits, each with the time during which another batch of its driver
        and its epoch had arrived and was not handed over yet (`Wait.held`): a sweep in order
        of time over the answers' arrivals, each driver's kept apart, with the batches handed
        over meanwhile struck off. In the order the consumer asked, as `Trace.waits`.

        An answer handed over by the end of the wait during which it arrived holds nothing
        back, then or later (later waits end later): the sweep takes only the others, found a
        column at a time, and begins with the first wait one of them arrived in. Where every
        answer is handed over as it comes (in the calling thread, say), no wait held any."""
        asked, got = _numbers(self.asked), _numbers(self.got)
        held = got - np.maximum(asked, got)  # nothing held: 0, unless the clock went back
        tasks = (_numbers(self.waited_for) & _TASK).tolist()
        task_of = [None if task == _TASK else task for task in tasks]
        count = len(got)
        kept = len(self.sent)
        arrived, handed = _numbers(self.arrived, kept), _numbers(self.handed, kept)
        came = ~np.isnan(arrived)
        if count > 1 and not bool(np.all(got[1:] >= got[:-1])):
            # The clock went back: every answer goes through the sweep, from the first wait.
            rows, first = np.flatnonzero(came).tolist(), 0
        else:
            # The wait during which each answer arrived: the first to end at or after it.
            seen_by = np.searchsorted(got, np.nan_to_num(arrived, nan=math.inf))
            holding = came & (seen_by < count)
            if count:
                holding &= ~(handed <= got[np.minimum(seen_by, count - 1)])
            rows = np.flatnonzero(holding).tolist()
            first = int(seen_by[rows].min()) if rows else count
        held_for = held.tolist()
        if rows:
            self._sweep(rows, first, asked.tolist(), got.tolist(), held_for, epoch_starts)
        return _Waits(asked.tolist(), got.tolist(), task_of, held_for).in_order_asked()

    def _sweep(
        self,
        rows: list[int],
        first: int,
        asked: list[float],
        got: list[float],
        held_for: list[float],
        epoch_starts: list[float],
    ) -> None:
        """`held_for` of each wait from the `first` on, with the answers of `rows`."""
        arrived, handed, sent, keys = self.arrived, self.handed, self.sent, self.key
        # Answers are kept as they arrive, so mostly in order of time already: sorted cheaply.
        arrivals = sorted((arrived[row], keys[row], row) for row in rows)
        count, next_arrival = len(arrivals), 0
        ready: dict[int, list[tuple[float, int, int]]] = {}  # per driver: a heap
        push, pop, bisect_right = heapq.heappush, heapq.heappop, bisect.bisect_right
        waited_for = self.waited_for
        for number in range(first, len(got)):
            at, until, key = asked[number], got[number], waited_for[number]
            while next_arrival < count and arrivals[next_arrival][0] <= until:
                arrival = arrivals[next_arrival]
                heap = ready.get(arrival[1] >> TASK_BITS)
                if heap is None:
                    heap = ready[arrival[1] >> TASK_BITS] = []
                push(heap, arrival)
                next_arrival += 1
            heap = ready.get(key >> TASK_BITS) or []
            if heap:
                epoch = bisect_right(epoch_starts, at)
                while heap:
                    other = heap[0][2]
                    # Gone for good: handed over by now (the batch this wait got, among them),
                    # or of an epoch before this wait's, abandoned; the waits come in order.
                    if handed[other] <= until or bisect_right(epoch_starts, sent[other]) < epoch:
                        pop(heap)
                        continue
                    break
            since = heap[0][0] if heap else until
            held_for[number] = until - (at if at > since else since)

    def batches(self, epoch_starts: list[float], epochs_before: int) -> _Batches:
        """The batches kept, as columns; `epochs_before`: epochs begun before the first of
        `epoch_starts`. The columns are copied out whole, as tensors; the indices and the
        slowest samples, dear to read, are read only for the batches asked for
        (`_Batches.record`, `_Batches.records`), while these tables stay as they are: read
        them at once."""
        kept = len(self.sent)
        keys = _numbers(self.key)
        sent = _numbers(self.sent)
        if epoch_starts:
            starts = np.array(epoch_starts, dtype=np.float64)
            epoch = epochs_before + np.searchsorted(starts, sent, side="right")
        else:
            epoch = np.full(kept, epochs_before, dtype=np.int64)
        failed = self.failed
        flags = (
            np.array([key in failed for key in keys.tolist()], dtype=np.bool_)
            if failed
            else np.zeros(kept, dtype=np.bool_)
        )
        took = _numbers(self.slowest_took, kept)
        sampled = np.flatnonzero(~np.isnan(took))
        packed, given, sample_of, took_of = self.packed, self.index, self.slowest_index, took
        key_of = self.key[:kept]

        def index(key: int) -> Any:
            bytes_ = packed.get(key)
            return given[key] if bytes_ is None else array("q", bytes_).tolist()

        def slowest(key: int, seconds: float, whole: Any) -> tuple[tuple[Any, float], ...]:
            if seconds != seconds:
                return ()
            sample = sample_of[key]
            return (((whole if sample is WHOLE_BATCH else sample), seconds),)

        def sample_index(number: int) -> Any:
            key = key_of[int(sampled[number])]
            sample = sample_of[key]
            return index(key) if sample is WHOLE_BATCH else sample

        columns = _Batches(
            task=keys & _TASK,
            worker=_numbers(self.worker),
            epoch=epoch,
            sent=sent,
            started=_numbers(self.started, kept),
            finished=_numbers(self.finished, kept),
            arrived=_numbers(self.arrived, kept),
            handed=_numbers(self.handed, kept),
            cpu=_numbers(self.cpu, kept),
            failed=flags,
            sample_row=sampled,
            sample_took=took[sampled],
            sample_index=sample_index,
            records=lambda rows: records(rows),
        )

        def records(rows: Sequence[int] | None) -> list[BatchRecord]:
            chosen = None if rows is None else np.array(rows, dtype=np.int64)

            def of(column: Column) -> list[Any]:
                values: list[Any] = (column if chosen is None else column[chosen]).tolist()
                return values

            keys_ = key_of.tolist() if rows is None else [key_of[row] for row in rows]
            indices = list(map(index, keys_))
            return list(
                map(
                    BatchRecord,
                    of(columns.task),
                    of(columns.worker),
                    of(columns.epoch),
                    indices,
                    of(columns.sent),
                    *(
                        _nullable(of(column))
                        for column in (
                            columns.started,
                            columns.finished,
                            columns.arrived,
                            columns.handed,
                            columns.cpu,
                        )
                    ),
                    map(slowest, keys_, of(took_of), indices),
                    of(columns.failed),
                )
            )

        return columns


def _numbers(column: array[Any], length: int | None = None) -> Column:
    """The first `length` entries of `column` (all of them by default), copied into a tensor:
    a tensor over the column's own memory would stop it growing while it lived."""
    kind = np.float64 if column.typecode == "d" else np.int64
    part = column[:length] if length is not None else column[:]
    if not part:
        return np.empty(0, dtype=kind)
    return np.frombuffer(part, dtype=kind)


def _nullable(values: list[float]) -> list[float | None]:
    """`values`, with None for NaN (a moment that did not come)."""
    return [None if value != value else value for value in values]


_collected: list[Tracer] | None = None


def collect() -> list[Tracer]:
    """From now on, keep every tracer made in this process in the list returned (for `python
    -m statecore profile`, which writes all of a script's traces once it ends)."""
    global _collected
    _collected = []
    return _collected


def stop_collecting() -> None:
    """Tracers made from now on are no longer kept (see `collect`)."""
    global _collected
    _collected = None


def collecting(tracer: Tracer) -> None:
    """A new tracer: kept if `collect` asked for tracers."""
    if _collected is not None:
        _collected.append(tracer)


def tracing_from_environment() -> bool:
    """Whether the environment asks for tracing (`STATECORE_TRACE` set, and not 0 or empty)."""
    value = os.environ.get(TRACE_VARIABLE, "").strip()
    return value not in ("", "0", "false", "False", "no")


@attrs.frozen
class BatchRecord:
    """One task of the loader, from being sent to being handed over. Times are
    `time.perf_counter()` seconds; None where that moment did not (yet) come."""

    task: int
    worker: int
    epoch: int
    index: Any
    """The sampler's index for the task (a batch's list of dataset indices, map-style). A batch
    sampler's list comes back as a list of Python ints when its items were integers of any
    kind (numpy's, a 0-d tensor's): the tracer keeps such lists packed."""
    sent: float
    started: float | None = None
    """When the worker began it (the worker's clock, which on Linux is the same clock)."""
    finished: float | None = None
    arrived: float | None = None
    """When its answer reached the main process."""
    handed: float | None = None
    """When the consumer got it."""
    cpu: float | None = None
    """CPU seconds the worker spent on it."""
    slowest: tuple[tuple[Any, float], ...] = ()
    """Its slowest samples, (dataset index, seconds), slowest first."""
    failed: bool = False

    @property
    def seconds(self) -> float | None:
        """How long the worker took over it."""
        if self.started is None or self.finished is None:
            return None
        return self.finished - self.started


@attrs.frozen
class Mark:
    """Something that happened at one moment: an epoch's start or end, a worker resumed or
    dead, a timeout."""

    time: float
    kind: str
    worker: int | None = None
    detail: str = ""


@attrs.frozen
class Wait:
    """One call of the consumer (`next()` or `iter()`), from asking to getting its answer."""

    asked: float
    got: float
    task: int | None
    """The task whose batch (or error) it got; None for the end of an epoch."""
    held: float = 0.0
    """Seconds of the wait during which another batch was ready but not handed over: held
    back for the order of delivery (`in_order=True`) behind the one the consumer waited for."""


@attrs.frozen
class _Waits:
    """The consumer's waits as columns, in the order it asked (as `Trace.waits`)."""

    asked: list[float]
    got: list[float]
    task: list[int | None]
    held: list[float]

    @classmethod
    def of(cls, waits: Sequence[Wait]) -> _Waits:
        return cls(
            [wait.asked for wait in waits],
            [wait.got for wait in waits],
            [wait.task for wait in waits],
            [wait.held for wait in waits],
        )

    def in_order_asked(self) -> _Waits:
        """These waits, in the order the consumer asked (as they ended, mostly)."""
        asked = self.asked
        if all(map(operator.le, asked, itertools.islice(asked, 1, None))):
            return self
        order = sorted(range(len(asked)), key=asked.__getitem__)
        return _Waits(
            *([column[row] for row in order] for column in attrs.astuple(self, recurse=False))
        )

    def waits(self) -> tuple[Wait, ...]:
        return tuple(map(Wait, self.asked, self.got, self.task, self.held))


@attrs.frozen
class _Batches:
    """Batches as columns (tensors), one entry a batch, NaN for a moment that did not come,
    from which `LoaderStats` works out the figures: read from a trace's records (`of`), or
    from a tracer's tables (`_Tasks.batches`), where a record costs more than all the figures,
    and only the records the figures name are made (`records`)."""

    task: Column
    worker: Column
    epoch: Column
    sent: Column
    started: Column
    finished: Column
    arrived: Column
    handed: Column
    cpu: Column
    failed: Column
    sample_row: Column
    """The slowest samples of all batches, one entry a sample: the row of its batch..."""
    sample_took: Column
    """... its seconds ..."""
    sample_index: Callable[[int], Any]
    """... and its dataset index, by the sample's number."""
    records: Callable[[Sequence[int] | None], list[BatchRecord]]
    """The records of these rows, or of every row (None)."""

    @classmethod
    def of(cls, batches: Sequence[BatchRecord]) -> _Batches:
        samples = [(row, index, took) for row, b in enumerate(batches) for index, took in b.slowest]
        indices = [index for _, index, _ in samples]

        def times(values: Iterable[float | None]) -> Column:
            return np.array(
                [math.nan if value is None else value for value in values], dtype=np.float64
            )

        def records(rows: Sequence[int] | None) -> list[BatchRecord]:
            return list(batches) if rows is None else [batches[row] for row in rows]

        return cls(
            task=np.array([b.task for b in batches], dtype=np.int64),
            worker=np.array([b.worker for b in batches], dtype=np.int64),
            epoch=np.array([b.epoch for b in batches], dtype=np.int64),
            sent=times(b.sent for b in batches),
            started=times(b.started for b in batches),
            finished=times(b.finished for b in batches),
            arrived=times(b.arrived for b in batches),
            handed=times(b.handed for b in batches),
            cpu=times(b.cpu for b in batches),
            failed=np.array([b.failed for b in batches], dtype=np.bool_),
            sample_row=np.array([row for row, _, _ in samples], dtype=np.int64),
            sample_took=times(took for _, _, took in samples),
            sample_index=indices.__getitem__,
            records=records,
        )


def _least(column: Column) -> float:
    """The least of the moments in `column` that came; infinity if none did."""
    came = column[~np.isnan(column)]
    return float(came.min()) if len(came) else math.inf


def _most(column: Column) -> float:
    """The greatest of the moments in `column` that came; minus infinity if none did."""
    came = column[~np.isnan(column)]
    return float(came.max()) if len(came) else -math.inf


def _span(marks: Sequence[Mark], batches: _Batches, waits: _Waits) -> tuple[float, float]:
    """The first moment traced (the first `iter()`, or the oldest moment kept) and the last."""
    first = min(
        min((mark.time for mark in marks), default=math.inf),
        _least(batches.sent),
        min(waits.asked, default=math.inf),
    )
    last = max(
        max((mark.time for mark in marks), default=-math.inf),
        max(waits.got, default=-math.inf),
        _most(batches.handed),
        _most(batches.finished),
    )
    return (first if first < math.inf else 0.0), (last if last > -math.inf else 0.0)


def _median(values: Column) -> float | None:
    """The median of `values` as `statistics.median` gives it (the mean of the middle two of
    an even count), None for none."""
    count = len(values)
    if not count:
        return None
    ordered = np.sort(values)
    middle = count // 2
    if count % 2:
        return float(ordered[middle])
    return (float(ordered[middle - 1]) + float(ordered[middle])) / 2


def _slowest_first(rows: Column, seconds: Column) -> list[int]:
    """`rows`, by their `seconds`, the slowest first (ties in the order given)."""
    order = np.argsort(-seconds, kind="stable")
    return rows[order].tolist()  # type: ignore[no-any-return]


@attrs.frozen
class Trace:
    """Everything a tracer kept, as plain data."""

    num_workers: int
    in_order: bool
    persistent_workers: bool
    executor: str
    batches: tuple[BatchRecord, ...]
    waits: tuple[Wait, ...]
    marks: tuple[Mark, ...]
    dropped: int = 0
    """Batches forgotten. A tracer keeps the latest stretch of the run that holds at most its
    limit (`DEFAULT_LIMIT`) of batches, of waits and of marks, and forgets all before it."""
    dropped_waits: int = 0
    """The consumer's waits forgotten with them."""
    dropped_marks: int = 0
    """Marks forgotten with them."""
    epochs_dropped: int = 0
    """Epochs whose start was forgotten (a batch's `epoch` counts them)."""

    @property
    def start(self) -> float:
        """The first moment traced: the first `iter()`, or the oldest moment kept."""
        return _span(self.marks, _Batches.of(self.batches), _Waits.of(self.waits))[0]

    @property
    def end(self) -> float:
        """The last moment traced."""
        return _span(self.marks, _Batches.of(self.batches), _Waits.of(self.waits))[1]

    def stats(self) -> LoaderStats:
        return LoaderStats.of(self)

    def verdict(self) -> str:
        return self.stats().verdict()

    def chrome(self) -> dict[str, Any]:
        """The trace in Chrome's trace event format (JSON object form), which Perfetto and
        `chrome://tracing` open: one track per worker, one for the consumer."""
        return _chrome_trace(self)

    def write_chrome(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.chrome()))
        return path


@attrs.frozen
class LoaderStats:
    """The figures of a trace: how much the consumer waited, how busy the workers were, the
    slowest samples, and the signs behind each suggestion."""

    batches: int
    failed: int
    epochs: int
    seconds: float
    """From the first `iter()` to the last moment traced."""
    waited: float
    """Seconds the consumer spent waiting in `next()` and `iter()`."""
    waited_for_order: float
    """Of those, seconds spent waiting while another batch was ready and not handed over."""
    idle_behind_order: float
    """Worker-seconds that workers sat idle with a batch of theirs ready and not handed over,
    while the training loop waited for another worker's batch: head-of-line blocking, which
    `in_order=False` takes away."""
    startup_waits: tuple[float, ...]
    """Per epoch, seconds from `iter()` to the first batch handed over."""
    busy: tuple[float, ...]
    """Per worker, the share of the traced time it spent loading (0 to 1)."""
    median_batch: float | None
    """Median seconds a worker took over a batch."""
    cpu_share: float | None
    """CPU seconds over elapsed seconds of the workers' batches: near 1, the samples compute;
    far below, they wait (I/O, sleeps, locks)."""
    slowest: tuple[tuple[Any, float, int, int, int], ...]
    """The slowest samples seen: (dataset index, seconds, worker, task, epoch), slowest
    first."""
    stragglers: tuple[BatchRecord, ...]
    """Batches that took over `STRAGGLER_FACTOR` times the median batch, slowest first."""
    num_workers: int
    in_order: bool
    persistent_workers: bool
    executor: str
    dropped: int = 0
    """Batches the tracer forgot (see `Trace.dropped`): they count in `batches` and `epochs`,
    and in no other figure, each of which is over what was kept."""

    @property
    def waiting_share(self) -> float:
        """The share of the traced time the consumer waited on loading (0 to 1)."""
        return self.waited / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def of(cls, trace: Trace) -> LoaderStats:
        with _collector_paused():
            return cls._of(trace, _Batches.of(trace.batches), _Waits.of(trace.waits))

    @classmethod
    def _of(cls, trace: Trace, batches: _Batches, waits: _Waits) -> LoaderStats:
        """The figures of `batches` and `waits`, which are `trace`'s (its own `batches` and
        `waits` are not read: `Tracer.stats` gives none, and the columns). A trace can hold
        the tracer's limit of batches: each figure is worked out a column at a time."""
        start, end = _span(trace.marks, batches, waits)
        seconds = max(0.0, end - start)
        # How long a worker took over each batch it finished (NaN: not finished).
        took = batches.finished - batches.started
        done = ~np.isnan(took)
        took_done = took[done]
        median = _median(took_done)
        workers = trace.num_workers
        loading = [0.0] * workers
        if workers:
            worker_done = batches.worker[done]
            inside = (worker_done >= 0) & (worker_done < workers)
            loading = np.bincount(
                worker_done[inside], took_done[inside], minlength=workers
            ).tolist()
        # Over the batches whose CPU time was read (a worker reads it for only some fast ones).
        cpu_done = batches.cpu[done]
        read = ~np.isnan(cpu_done)
        cpu, wall = float(cpu_done[read].sum()), float(took_done[read].sum())
        busy = [mine / seconds if seconds > 0 else 0.0 for mine in loading]
        took_of = batches.sample_took
        samples = []
        slowest = _slowest_first(np.arange(len(took_of)), took_of)[:5]
        for number in slowest:
            row = int(batches.sample_row[number])
            samples.append(
                (
                    batches.sample_index(number),
                    float(took_of[number]),
                    int(batches.worker[row]),
                    int(batches.task[row]),
                    int(batches.epoch[row]),
                )
            )
        stragglers: tuple[BatchRecord, ...] = ()
        if median is not None and median > 0:
            slow = np.flatnonzero(done & (took > STRAGGLER_FACTOR * median))
            stragglers = tuple(batches.records(_slowest_first(slow, took[slow])))
        starts = [mark.time for mark in trace.marks if mark.kind == "epoch start"]
        startup: list[float] = []
        if starts:
            handed = np.sort(batches.handed[~np.isnan(batches.handed)])
            began = np.array(starts, dtype=np.float64)
            until = np.append(began[1:], math.inf)
            first = np.searchsorted(handed, began)
            if len(handed):
                at = handed[np.minimum(first, len(handed) - 1)]
                came = (first < len(handed)) & (at < until)
                startup = (at - began)[came].tolist()
        return cls(
            batches=len(batches.task) + trace.dropped,
            failed=int(batches.failed.sum()),
            epochs=len(starts) + trace.epochs_dropped,
            seconds=seconds,
            waited=sum(map(operator.sub, waits.got, waits.asked)),
            waited_for_order=sum(waits.held),
            idle_behind_order=_idle_behind_order(trace, batches, waits),
            startup_waits=tuple(startup),
            busy=tuple(busy),
            median_batch=median,
            cpu_share=cpu / wall if wall > 0 else None,
            slowest=tuple(samples),
            stragglers=stragglers,
            num_workers=trace.num_workers,
            in_order=trace.in_order,
            persistent_workers=trace.persistent_workers,
            executor=trace.executor,
            dropped=trace.dropped,
        )

    def suggestions(self) -> tuple[str, ...]:
        """What to try, each only when the figures support it."""
        tips = []
        if self.seconds <= 0 or self.waiting_share < 0.05:
            return ()
        if self.in_order and self.idle_behind_order >= 0.1 * self.waited:
            tips.append(
                f"in_order=False: workers sat idle {_s(self.idle_behind_order)} in all with "
                "batches ready, while the training loop waited for another worker's slower "
                "batch; out of order, the loop takes whichever batch is ready first and the "
                "workers keep loading."
            )
        mean_busy = statistics.fmean(self.busy) if self.busy else 0.0
        cores = os.cpu_count() or 1
        waits = self.cpu_share is not None and self.cpu_share < 0.5
        if self.executor == "inline" and mean_busy >= 0.5:
            tips.append(
                f"num_workers > 0 (up to {cores}, the cores here, or more if the samples wait): "
                f"the training loop itself spent {_pct(mean_busy)} of the time loading, and "
                "workers would load the next batches while it trains."
            )
        elif mean_busy >= 0.75:
            if waits or self.num_workers < cores:
                why = (
                    "the samples mostly wait rather than compute, so more workers than cores "
                    "still help"
                    if waits
                    else f"this machine has {cores} cores"
                )
                tips.append(
                    f"more workers (num_workers={self.num_workers} now): they were busy "
                    f"{_pct(mean_busy)} of the time; {why}."
                )
            else:
                tips.append(
                    f"a faster dataset or transform: the workers were busy {_pct(mean_busy)} of "
                    f"the time with as many workers ({self.num_workers}) as cores."
                )
        later = self.startup_waits[1:]
        if not self.persistent_workers and self.executor != "inline" and later:
            restart = sum(later)
            if restart >= 0.1 * self.waited:
                tips.append(
                    f"persistent_workers=True: each epoch after the first waited "
                    f"{_s(statistics.fmean(later))} for its first batch, starting workers "
                    f"anew ({_s(restart)} in all)."
                )
        if (
            self.executor == "mp"
            and self.cpu_share is not None
            and self.cpu_share < 0.3
            and self.num_workers > 0
        ):
            tips.append(
                f'executor="thread": the workers spent {_pct(self.cpu_share)} of their batches\' '
                "time on a CPU, so their samples wait (I/O) and threads would not be held back "
                "by the GIL; threads start in milliseconds and hand batches over without a copy."
            )
        return tuple(tips)

    def verdict(self) -> str:
        """The figures in plain words, and what to try."""
        workers = f"{self.num_workers} worker{'s' if self.num_workers != 1 else ''}"
        if self.executor == "inline":
            workers = "no workers"
        setting = (
            f"{workers} ({self.executor}), in_order={self.in_order}, "
            f"persistent_workers={self.persistent_workers}."
        )
        run = f"{self.batches} batches in {self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        if self.dropped:
            kept = self.batches - self.dropped
            lines = [
                f"{run}; {setting}",
                f"The tracer kept the last {kept} batches, over {_s(self.seconds)}, and forgot "
                f"the {self.dropped} before them: the figures below are over what it kept.",
            ]
        else:
            lines = [f"{run} over {_s(self.seconds)}; {setting}"]
        if self.seconds > 0:
            if self.waiting_share < 0.05:
                lines.append(
                    f"The training loop waited on loading {_pct(self.waiting_share)} of the time "
                    f"({_s(self.waited)}): loading is not what holds it back."
                )
            else:
                lines.append(
                    f"The training loop waited on loading {_pct(self.waiting_share)} of the time "
                    f"({_s(self.waited)})."
                )
        if self.busy and self.executor == "inline":
            lines.append(f"Loading, in the training loop's thread, took {_pct(self.busy[0])}.")
        elif self.busy:
            each = ", ".join(f"worker {w} {_pct(share)}" for w, share in enumerate(self.busy))
            lines.append(f"Workers were loading {_pct(statistics.fmean(self.busy))}: {each}.")
        if self.median_batch is not None:
            lines.append(f"A batch took a worker {_s(self.median_batch)} (median).")
        if self.stragglers:
            slowest = self.stragglers[0]
            count = len(self.stragglers)
            lines.append(
                f"{count} straggler batch{'es' if count != 1 else ''} "
                f"(over {STRAGGLER_FACTOR:g}x the median); the slowest, task {slowest.task} on "
                f"worker {slowest.worker}, took {_s(slowest.seconds or 0.0)}."
            )
        if self.slowest:
            named = "; ".join(
                f"index {_index(index)}: {_s(took)} (worker {worker}, epoch {epoch}, task {task})"
                for index, took, worker, task, epoch in self.slowest
            )
            lines.append(f"Slowest samples: {named}.")
        if self.failed:
            lines.append(f"{self.failed} task(s) raised.")
        tips = self.suggestions()
        if tips:
            lines.append("What to try:")
            lines += [f"- {tip}" for tip in tips]
        elif self.seconds > 0 and self.waiting_share >= 0.05:
            lines.append("Nothing in the trace points to a loader setting that would help.")
        return "\n".join(lines)


Interval = tuple[float, float]


def _merged(intervals: list[Interval]) -> list[Interval]:
    """The union of `intervals`, as sorted disjoint intervals."""
    union: list[Interval] = []
    for start, end in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        elif end > start:
            union.append((start, end))
    return union


def _intersected(first: list[Interval], second: list[Interval]) -> list[Interval]:
    """The intersection of two lists of sorted disjoint intervals."""
    both: list[Interval] = []
    i = j = 0
    while i < len(first) and j < len(second):
        start = max(first[i][0], second[j][0])
        end = min(first[i][1], second[j][1])
        if end > start:
            both.append((start, end))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return both


def _idle_behind_order(trace: Trace, batches: _Batches, waits: _Waits) -> float:
    """Worker-seconds idle with a ready batch held, while the consumer waited for another
    worker's batch (see `LoaderStats.idle_behind_order`)."""
    if trace.num_workers < 2:
        return 0.0  # no other worker's batch to wait for
    worker_of = batches.worker.tolist()
    owner = dict(
        zip(zip(batches.epoch.tolist(), batches.task.tolist(), strict=True), worker_of, strict=True)
    )
    starts = sorted(m.time for m in trace.marks if m.kind == "epoch start")
    before = trace.epochs_dropped
    # Each wait for a batch, with the worker that batch was loaded by (its epoch: the number
    # of epochs begun by then), found once for all workers.
    awaited = [
        (asked, got, owner.get((before + bisect.bisect_right(starts, asked), task)))
        for asked, got, task in zip(waits.asked, waits.got, waits.task, strict=True)
        if task is not None
    ]
    started, finished, arrived, handed = (
        _nullable(column.tolist())
        for column in (batches.started, batches.finished, batches.arrived, batches.handed)
    )
    loaded: dict[int, list[int]] = {}
    for row, worker in enumerate(worker_of):
        if started[row] is not None:
            loaded.setdefault(worker, []).append(row)
    total = 0.0
    for worker in range(trace.num_workers):
        mine = sorted(loaded.get(worker, ()), key=lambda row: started[row] or 0.0)
        gaps = [
            (done, later)
            for one, after in itertools.pairwise(mine)
            if (done := finished[one]) is not None
            and (later := started[after]) is not None
            and later > done
        ]
        ready = _merged(
            [
                (at, out)
                for row in mine
                if (at := arrived[row]) is not None and (out := handed[row]) is not None
            ]
        )
        waiting = _merged(
            [(asked, got) for asked, got, other in awaited if other not in (None, worker)]
        )
        blocked = _intersected(_intersected(gaps, ready), waiting)
        total += sum(end - start for start, end in blocked)
    return total


def _pct(share: float) -> str:
    return f"{100.0 * share:.0f}%" if share >= 0.1 else f"{100.0 * share:.1f}%"


def _s(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


def _index(index: Any) -> str:
    text = repr(index)
    return text if len(text) <= 40 else text[:37] + "..."


class Tracer:
    """Watches a loader's scheduler through the step function of each of its drivers.

    One tracer serves a loader for its whole life: each iterator's driver gets a step wrapped
    by `wrap`, and all of them keep their tasks in one table, told apart by the driver's
    number in each task's key (`TASK_BITS`).

    It keeps the latest stretch of the run that holds at most `limit` batches, `limit` of the
    consumer's waits and `limit` marks, and forgets all before it, the oldest first: memory
    stays bounded however long the run, in one epoch or in many short ones, and forgetting
    costs the same at every batch (`forget_work`).
    """

    def __init__(
        self,
        num_workers: int,
        in_order: bool,
        persistent_workers: bool,
        executor: str,
        limit: int = DEFAULT_LIMIT,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.num_workers = num_workers
        self.in_order = in_order
        self.persistent_workers = persistent_workers
        self.executor = executor
        self.limit = limit
        self.clock = clock
        self.tasks = _Tasks()
        """Every driver's tasks and waits, filled as they come."""
        self.marks: list[Mark] = []
        self.drivers = 0
        """Drivers wrapped so far."""
        self.dropped = 0
        self.dropped_waits = 0
        self.dropped_marks = 0
        self.epochs_dropped = 0
        self.forget_work = 0
        """Entries looked at or moved while forgetting, all told: a few a batch, waits and
        marks included, however long the run (the tests count it)."""
        self.epoch = 0

    def wrap(self, step: StepFunction) -> StepFunction:
        """`step`, watched: the step function for one driver (one loader iterator)."""
        clock = self.clock
        tasks = self.tasks
        offset = (self.drivers % DRIVERS) << TASK_BITS
        end = offset | _TASK
        self.drivers += 1
        row_of, index_of, packed_of = tasks.row, tasks.index, tasks.packed
        key_column, worker_column, sent_at = tasks.key, tasks.worker, tasks.sent
        packing = _Packer()
        started_at, finished_at, arrived_at = tasks.started, tasks.finished, tasks.arrived
        handed_at, cpu_of = tasks.handed, tasks.cpu
        slowest_index, slowest_took = tasks.slowest_index, tasks.slowest_took
        grow = tasks.grow
        asked_at, got_at, waited_for = tasks.asked.append, tasks.got.append, tasks.waited_for.append
        marks = self.marks
        check = self._check
        asked: float | None = None

        # Every step of a traced loader runs this, in the main process, between the loader's
        # own work: what is asked most comes first, and everything that can wait until the
        # trace is read (which batches were ready while the loop waited) does.
        def traced(state: State, event: Event) -> Transition:
            nonlocal asked
            now = clock()
            transition = step(state, event)
            kind = type(event)
            if kind is IndexDrawn:
                pass
            elif kind is TaskCompleted or kind is TaskFailed:
                task = event.task + offset  # type: ignore[attr-defined]
                row = row_of.get(task)
                if row is not None:
                    row -= tasks.first
                    arrived_at[row] = now
                    timing = event.timing  # type: ignore[attr-defined]
                    if timing is not None:
                        started_at[row], finished_at[row], cpu, slowest, ready = timing
                        if cpu is not None:
                            cpu_of[row] = cpu
                        if slowest:
                            slowest_index[task], slowest_took[row] = slowest[0]
                        if ready is not None:
                            worker = event.worker  # type: ignore[attr-defined]
                            marks.append(Mark(ready, "worker ready", worker))
                    if kind is TaskFailed:
                        tasks.failed.add(task)
            elif kind is NextRequested:
                if asked is None:
                    asked = now
            elif kind is ResetRequested:
                self.epoch += 1
                marks.append(Mark(now, "epoch start", None, f"epoch {self.epoch}"))
                if asked is None:
                    asked = now
                check()
            else:
                self._saw_rare(now, event)
            for command in transition[1]:
                ckind = type(command)
                if ckind is DrawIndex:
                    continue
                if ckind is SendTask:
                    number = command.task  # type: ignore[attr-defined]
                    task = number + offset
                    row = len(sent_at)
                    row_of[task] = row + tasks.first
                    key_column.append(task)
                    worker_column.append(command.worker)  # type: ignore[attr-defined]
                    sent_at.append(now)
                    if row >= len(arrived_at):
                        grow()
                    index = command.index  # type: ignore[attr-defined]
                    packed = packing.pack(index) if type(index) is list else None
                    if packed is None:
                        index_of[task] = index
                    else:
                        packed_of[task] = packed
                    if not number % LIMIT_CHECKED_EVERY:
                        check()
                elif ckind is Deliver or ckind is RaiseError or ckind is EndEpoch:
                    if ckind is Deliver:
                        task = command.task + offset  # type: ignore[attr-defined]
                    elif ckind is RaiseError:
                        task = getattr(command.failure, "task", None)  # type: ignore[attr-defined]
                        if task is not None:
                            task += offset
                    else:
                        task = None
                        marks.append(Mark(now, "epoch end", None, f"epoch {self.epoch}"))
                    if task is not None:
                        row = row_of.get(task)
                        if row is not None:
                            handed_at[row - tasks.first] = now
                    if asked is not None:
                        asked_at(asked)
                        got_at(now)
                        waited_for(end if task is None else task)
                        asked = None
                    if task is None:
                        check()
                elif ckind is ResumeWorker:
                    marks.append(Mark(now, "resume sent", command.worker))  # type: ignore[attr-defined]
            return transition

        return traced

    @property
    def kept(self) -> int:
        """Batches kept now."""
        return len(self.tasks.sent)

    def _check(self) -> None:
        """Forget what is beyond the limit, in passing: the drivers call this at every
        `LIMIT_CHECKED_EVERY` tasks they send, and at each epoch's start and end."""
        self._forget_beyond(self.limit, self.limit // 4)

    def _forget_beyond(self, limit: int, slack: int) -> None:
        """Forget all that came before the last `limit` batches, the last `limit` waits or the
        last `limit` marks, whichever began latest, so that the trace is one stretch of the
        run, the latest. Each kind goes only once more than `slack` of it is due: forgetting
        moves the rest of its column, so that with a slack of a quarter of the limit each
        batch, wait or mark traced costs at most five moves, however long the run."""
        tasks, marks = self.tasks, self.marks
        sent, got = tasks.sent, tasks.got
        kept = len(sent)
        over = kept > limit + slack or len(got) > limit + slack or len(marks) > limit + slack
        if slack and not over:
            return  # a read (no slack) goes on: what is older than the batches kept goes
        forgotten = max(0, kept - limit)
        # The moment before which all goes: the oldest of each kind that the limit leaves,
        # and once batches were forgotten, the oldest batch kept.
        cut = sent[forgotten] if kept > forgotten and (forgotten or self.dropped) else -math.inf
        waits_over = len(got) - limit
        if waits_over > 0:
            cut = max(cut, tasks.asked[waits_over])
        marks_over = len(marks) - limit
        if marks_over > 0:
            cut = max(cut, marks[marks_over].time)
        while forgotten < kept and sent[forgotten] < cut:
            forgotten += 1
        # Each batch looked at, and the look at the one left; the searches, a few steps each.
        self.forget_work += forgotten + 1 + 2 * (len(got) + len(marks)).bit_length()
        if forgotten > slack:
            tasks.forget_oldest(forgotten)
            self.dropped += forgotten
            self.forget_work += forgotten + kept
        # By count too: a clock that did not move gives the same moment to many.
        waits = max(waits_over, bisect.bisect_left(got, cut))
        if waits > slack:
            tasks.forget_waits(waits)
            self.dropped_waits += waits
            self.forget_work += waits + len(got)
        gone = max(marks_over, bisect.bisect_left(marks, cut, key=_moment))
        if gone > slack:
            self.epochs_dropped += sum(1 for mark in marks[:gone] if mark.kind == "epoch start")
            del marks[:gone]
            self.dropped_marks += gone
            self.forget_work += gone + len(marks)

    def _saw_rare(self, now: float, event: Event) -> None:
        """The events that come once an epoch or less."""
        kind = type(event)
        if kind is WorkerDied:
            detail = f"pid {event.pid}, exit code {event.exitcode}"  # type: ignore[attr-defined]
            self.marks.append(Mark(now, "worker died", event.worker, detail))  # type: ignore[attr-defined]
        elif kind is WorkerResumed:
            self.marks.append(Mark(now, "worker resumed", event.worker))  # type: ignore[attr-defined]
        elif kind is TimedOut:
            self.marks.append(Mark(now, "timed out", None, f"after {event.seconds} s"))  # type: ignore[attr-defined]

    def trace(self) -> Trace:
        """What was traced so far (cut to the limit exactly)."""
        with _collector_paused():
            batches, waits = self._read()
            return attrs.evolve(
                self._settings(), batches=tuple(batches.records(None)), waits=waits.waits()
            )

    def stats(self) -> LoaderStats:
        """The figures of `trace()`, worked out from the tracer's tables: of its records,
        only those the figures name are made (`_Batches`)."""
        with _collector_paused():
            batches, waits = self._read()
            return LoaderStats._of(self._settings(), batches, waits)

    def _read(self) -> tuple[_Batches, _Waits]:
        self._forget_beyond(self.limit, 0)
        starts = [mark.time for mark in self.marks if mark.kind == "epoch start"]
        return self.tasks.batches(starts, self.epochs_dropped), self.tasks.waits(starts)

    def _settings(self) -> Trace:
        """The trace with no batches nor waits: its settings, marks and counts."""
        return Trace(
            num_workers=self.num_workers,
            in_order=self.in_order,
            persistent_workers=self.persistent_workers,
            executor=self.executor,
            batches=(),
            waits=(),
            marks=tuple(self.marks),
            dropped=self.dropped,
            dropped_waits=self.dropped_waits,
            dropped_marks=self.dropped_marks,
            epochs_dropped=self.epochs_dropped,
        )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The garbage collector paused, if it ran. Reading a trace makes a few objects a batch,
    all kept: the collector's passes meanwhile found nothing to free and walked them all, again
    and again, and took two thirds of the time of `stats()` at the limit."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


def _moment(mark: Mark) -> float:
    return mark.time


# --- Chrome's trace event format -------------------------------------------------------------

_PROCESS = 1
_CONSUMER = 0


def _us(moment: float, origin: float) -> float:
    return round((moment - origin) * 1e6, 3)


def _chrome_trace(trace: Trace) -> dict[str, Any]:
    origin = trace.start
    stats = trace.stats()
    stragglers = {(b.epoch, b.task, b.worker) for b in stats.stragglers}
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": _PROCESS,
            "tid": _CONSUMER,
            "args": {"name": f"statecore loader ({trace.executor})"},
        },
        {
            "name": "thread_name",
            "ph": "M",
            "pid": _PROCESS,
            "tid": _CONSUMER,
            "args": {"name": "consumer (training loop)"},
        },
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": _PROCESS,
            "tid": _CONSUMER,
            "args": {"sort_index": 0},
        },
    ]
    for worker in range(trace.num_workers):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": _PROCESS,
                "tid": worker + 1,
                "args": {"name": f"worker {worker}"},
            }
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": _PROCESS,
                "tid": worker + 1,
                "args": {"sort_index": worker + 1},
            }
        )
    for b in trace.batches:
        if b.started is None or b.finished is None:
            continue
        straggler = (b.epoch, b.task, b.worker) in stragglers
        args: dict[str, Any] = {
            "task": b.task,
            "epoch": b.epoch,
            "index": _jsonable(b.index),
            "cpu_ms": None if b.cpu is None else round(b.cpu * 1e3, 3),
            "slowest_samples": [
                {"index": _jsonable(index), "ms": round(took * 1e3, 3)} for index, took in b.slowest
            ],
            "queued_ms": round((b.started - b.sent) * 1e3, 3),
        }
        if b.handed is not None and b.arrived is not None:
            args["held_ms"] = round((b.handed - b.arrived) * 1e3, 3)
        name = f"{'straggler ' if straggler else ''}batch {b.task}"
        if b.failed:
            name = f"failed {name}"
        event: dict[str, Any] = {
            "name": name,
            "cat": "straggler" if straggler else "batch",
            "ph": "X",
            "pid": _PROCESS,
            "tid": b.worker + 1,
            "ts": _us(b.started, origin),
            "dur": max(0.0, _us(b.finished, b.started)),
            "args": args,
        }
        if straggler:
            event["cname"] = "terrible"
        events.append(event)
    for wait in trace.waits:
        events.append(
            {
                "name": "waiting for a batch" if wait.task is not None else "waiting",
                "cat": "wait",
                "ph": "X",
                "pid": _PROCESS,
                "tid": _CONSUMER,
                "ts": _us(wait.asked, origin),
                "dur": max(0.0, _us(wait.got, wait.asked)),
                "args": {"task": wait.task, "held_ms": round(wait.held * 1e3, 3)},
            }
        )
    for mark in trace.marks:
        global_mark = mark.worker is None
        events.append(
            {
                "name": mark.kind if not mark.detail else f"{mark.kind}: {mark.detail}",
                "cat": "lifecycle",
                "ph": "i",
                "s": "g" if global_mark else "t",
                "pid": _PROCESS,
                "tid": _CONSUMER if global_mark else (mark.worker or 0) + 1,
                "ts": _us(mark.time, origin),
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "statecore",
            "verdict": stats.verdict(),
        },
    }


def _jsonable(value: Any) -> Any:
    """`value` if JSON takes it as it is (numbers, strings, lists of them), else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(
        isinstance(item, (bool, int, float, str)) for item in value
    ):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() <= 64:
        return value.tolist()
    return _index(value)
