"""The tracer: a traced loader's recorder, on the hot path of every step.

A traced loader (`DataLoader(..., trace=True)`, or `STATECORE_TRACE` in the environment)
gives its driver a step function that wraps the scheduler's (`Tracer.wrap`): every event the
scheduler is told of and every command it gives passes through it, with the time. From those
the tracer keeps, per batch, when its task was sent, when the worker started and finished it
(the worker's own clock: `TaskTiming`, see `executors._timing`), when its answer arrived and
when it was handed over; per call of the consumer, how long it waited; and the epochs' starts
and ends, workers resumed and workers that died. Nothing here decides anything: the tracer
only watches what the scheduler does.

It keeps them in columns of numbers, which the garbage collector leaves out of its walks: a
table of lists, one per batch, with the timings' tuples in them, added four objects a batch
to every young collection of the main process, a third of what tracing cost where batches are
small and fast. A batch sampler's lists of indices are kept packed (eight bytes a number) for
the same reason, and more: kept as they are, each batch's list and its int objects (2.6 kB for 64
indices) outlived it, and processes-b64 traced cost 11.6% more than untraced, against 7.3%
with no indices kept at all.

`Tracer.trace()` gives a `Trace`, and `Tracer.stats()` its figures, read from the columns
(`statecore.executors._observe.trace`, which this module imports and which imports nothing of
it). The process-wide list of tracers that `python -m statecore profile` writes out is here
too (`collect`).
"""

from __future__ import annotations

import bisect
import heapq
import math
import os
import struct
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from statecore import (
    AddRequested,
    Deliver,
    DrawIndex,
    EndEpoch,
    Event,
    IndexDrawn,
    NextRequested,
    Pending,
    RaiseError,
    ReplaceWorker,
    ResetRequested,
    ResumeWorker,
    RetireRequested,
    SendTask,
    State,
    StopWorker,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    Transition,
    WorkerDeath,
    WorkerDied,
    WorkerHang,
    WorkerResumed,
    WorkerStarted,
    WorkerStuck,
)
from statecore.executors._observe.seam import Hook, Observer, StepFunction, observed
from statecore.executors._observe.trace import (
    BatchColumns,
    BatchRecord,
    Column,
    LoaderStats,
    LostWorker,
    Moment,
    RetiredWorker,
    Trace,
    WaitColumns,
    collector_paused,
    nullable,
)
from statecore.executors._timing import WHOLE_BATCH

__all__ = [
    "DEFAULT_LIMIT",
    "DRIVERS",
    "LIMIT_CHECKED_EVERY",
    "TASK_BITS",
    "TRACE_VARIABLE",
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

LIMIT_CHECKED_EVERY = 1024
"""Tasks a driver sends between two looks at the tracer's limit: between them it may keep up
to this many more batches than the limit; a trace read is cut to the limit exactly."""


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


_STARTED, _FINISHED, _ARRIVED, _HANDED, _CPU, _TOOK = range(6)
"""The places in a row of `_Tasks.moments` of a task's moments and figures."""
_WIDTH = 6
"""Numbers in a row of `_Tasks.moments`."""

_GROWN_BY = 1024
"""Rows `_Tasks.moments` grows by at a time, NaN (not yet) until then."""
_NANS = array("d", [math.nan]) * (_GROWN_BY * _WIDTH)


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
        self.moments = array("d")
        """What is filled in as answers come, `_WIDTH` numbers a task, a row after another:
        when its worker started and finished it, when its answer arrived, when it was handed
        over, its CPU seconds, and its slowest sample's seconds as its worker reported it (a
        worker reports one); places `_STARTED` to `_TOOK`. One row where six columns were: an
        answer then touches one place in memory, not six, and between two answers a loader's
        main process has done enough else that each place touched is likely a miss in the
        caches. It grows `_GROWN_BY` rows at a time: it may hold more
        rows than `sent`, and what lies beyond it is no task's yet. Read whole, as columns
        (`table`)."""
        self.index: dict[int, Any] = {}
        """The sampler's index of each task, by key, as it gave it, when not packed."""
        self.packed: dict[int, bytes] = {}
        """A batch sampler's list of ints, packed: eight bytes a number (`struct`'s "q")."""
        self.slowest_index: dict[int, Any] = {}
        """A task's slowest sample's dataset index, by key, where a worker timed the samples
        of its batch one by one; where it timed the batch whole (`WHOLE_BATCH`, the common
        case of fast samples), nothing: that costs each answer no entry here."""
        self.failed: set[int] = set()
        self.incarnation: dict[int, int] = {}
        """The incarnation each task was sent to, by key, where not 0 (a replaced slot's)."""
        self.first_sent: dict[int, float] = {}
        """When a task sent again to a lost worker's replacement was first sent, by key; its
        row's `sent` is the re-send."""
        self.asked = array("d")
        self.got = array("d")
        self.waited_for = array("q")
        """The consumer's waits, in columns, in the order they ended: when it asked, when it
        got its answer, and the key of the task it got (the task number all ones: the end of
        an epoch). What of each wait was spent holding a ready batch back is worked out when
        the trace is read (`waits`)."""

    def grow(self) -> None:
        """Room for `_GROWN_BY` more tasks in `moments`."""
        self.moments.extend(_NANS)

    def table(self, kept: int) -> Any:
        """The first `kept` rows of `moments`, copied out as a tensor of `kept` rows and
        `_WIDTH` columns (a column of it: `table[:, _ARRIVED]`)."""
        return _numbers(self.moments, kept * _WIDTH).reshape(kept, _WIDTH)

    def forget_oldest(self, count: int) -> None:
        """Forget the `count` oldest batches kept (at most as many as are kept)."""
        keys = self.key[:count]
        row = self.row
        for key in keys:
            del row[key]
        for table in (
            self.index,
            self.packed,
            self.slowest_index,
            self.incarnation,
            self.first_sent,
        ):
            if table:
                pop = table.pop
                for key in keys:
                    pop(key, None)
        if self.failed:
            self.failed.difference_update(keys)
        for column in (self.key, self.worker, self.sent):
            del column[:count]
        del self.moments[: count * _WIDTH]
        self.first += count

    def forget_waits(self, count: int) -> None:
        """Forget the `count` oldest waits."""
        del self.asked[:count]
        del self.got[:count]
        del self.waited_for[:count]

    def waits(self, epoch_starts: list[float]) -> WaitColumns:
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
        table = self.table(kept)
        arrived, handed = table[:, _ARRIVED], table[:, _HANDED]
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
            self._sweep(rows, first, asked.tolist(), got.tolist(), held_for, epoch_starts, table)
        return WaitColumns(asked.tolist(), got.tolist(), task_of, held_for).in_order_asked()

    def _sweep(
        self,
        rows: list[int],
        first: int,
        asked: list[float],
        got: list[float],
        held_for: list[float],
        epoch_starts: list[float],
        table: Any,
    ) -> None:
        """`held_for` of each wait from the `first` on, with the answers of `rows`; `table`:
        the rows of `moments` kept (`table`)."""
        arrived, handed = table[:, _ARRIVED].tolist(), table[:, _HANDED].tolist()
        sent, keys = self.sent, self.key
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

    def batches(self, epoch_starts: list[float], epochs_before: int) -> BatchColumns:
        """The batches kept, as columns; `epochs_before`: epochs begun before the first of
        `epoch_starts`. The columns are copied out whole, as tensors; the indices and the
        slowest samples, dear to read, are read only for the batches asked for
        (`BatchColumns.record`, `BatchColumns.records`), while these tables stay as they are: read
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
        table = self.table(kept)
        took = np.ascontiguousarray(table[:, _TOOK])
        sampled = np.flatnonzero(~np.isnan(took))
        packed, given, sample_of, took_of = self.packed, self.index, self.slowest_index, took
        incarnation_of, first_sent_of = self.incarnation, self.first_sent
        key_of = self.key[:kept]

        def index(key: int) -> Any:
            bytes_ = packed.get(key)
            return given[key] if bytes_ is None else array("q", bytes_).tolist()

        def slowest(key: int, seconds: float, whole: Any) -> tuple[tuple[Any, float], ...]:
            if seconds != seconds:
                return ()
            sample = sample_of.get(key, WHOLE_BATCH)
            return (((whole if sample is WHOLE_BATCH else sample), seconds),)

        def sample_index(number: int) -> Any:
            key = key_of[int(sampled[number])]
            sample = sample_of.get(key, WHOLE_BATCH)
            return index(key) if sample is WHOLE_BATCH else sample

        columns = BatchColumns(
            task=keys & _TASK,
            worker=_numbers(self.worker),
            epoch=epoch,
            sent=sent,
            started=np.ascontiguousarray(table[:, _STARTED]),
            finished=np.ascontiguousarray(table[:, _FINISHED]),
            arrived=np.ascontiguousarray(table[:, _ARRIVED]),
            handed=np.ascontiguousarray(table[:, _HANDED]),
            cpu=np.ascontiguousarray(table[:, _CPU]),
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
            made = list(
                map(
                    BatchRecord,
                    of(columns.task),
                    of(columns.worker),
                    of(columns.epoch),
                    indices,
                    of(columns.sent),
                    *(
                        nullable(of(column))
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
            if incarnation_of or first_sent_of:  # only where a worker was replaced
                for number, key in enumerate(keys_):
                    incarnation, first = incarnation_of.get(key, 0), first_sent_of.get(key)
                    if incarnation or first is not None:
                        made[number] = attrs.evolve(
                            made[number], incarnation=incarnation, first_sent=first
                        )
            return made

        return columns


def _numbers(column: array[Any], length: int | None = None) -> Column:
    """The first `length` entries of `column` (all of them by default), copied into a tensor:
    a tensor over the column's own memory would stop it growing while it lived."""
    kind = np.float64 if column.typecode == "d" else np.int64
    part = column[:length] if length is not None else column[:]
    if not part:
        return np.empty(0, dtype=kind)
    return np.frombuffer(part, dtype=kind)


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
        self.tuner: Any = None
        """The loader's `AutoTuner` where its num_workers is "auto" (set by the loader), so
        that `python -m statecore profile` can name the count it settled on."""
        self.marks: list[Moment] = []
        self.drivers = 0
        """Drivers wrapped so far."""
        self.dropped = 0
        self.dropped_waits = 0
        self.dropped_marks = 0
        self.epochs_dropped = 0
        self.forget_work = 0
        """Entries looked at or moved while forgetting, all told: a few a batch, waits and
        marks included, however long the run (the tests count it)."""
        self.losses: list[_Loss] = []
        """Every worker lost (dead or stuck), in order, over all the loader's iterators."""
        self.retirements: list[_Retirement] = []
        """Every worker retired, in order, over all the loader's iterators (each knows its
        iterator's driver: a slot's number means another worker in another iterator)."""
        self.epochs = 0
        """The loader's epochs begun so far, over all its iterators: the epoch of the latest
        one's scheduler, after those of the iterators before it."""

    def wrap(self, step: StepFunction) -> StepFunction:
        """`step`, watched through the seam as a driver's is (`observer`)."""
        return observed(step, [self.observer()])

    def observer(self) -> Observer:
        """The tracer's hooks at the seam of one driver (one loader iterator)."""
        clock = self.clock
        tasks = self.tasks
        offset = (self.drivers % DRIVERS) << TASK_BITS
        end = offset | _TASK
        driver = self.drivers
        self.drivers += 1
        row_of, index_of, packed_of = tasks.row, tasks.index, tasks.packed
        keyed, worked, sent_at = tasks.key.append, tasks.worker.append, tasks.sent
        moments, slowest_index = tasks.moments, tasks.slowest_index
        formats: dict[int, Callable[..., bytes]] = {}
        """Per length of a batch sampler's list, what packs a list of that many ints."""
        # Whether the lists of indices are packed: a list that does not pack (not all ints, or
        # one beyond 64 bits) is kept as it is, and so is every later one: a sampler that
        # yields such lists once will again, and each failed attempt would cost an exception.
        packing = True
        grow = tasks.grow
        asked_at, got_at, waited_for = tasks.asked.append, tasks.got.append, tasks.waited_for.append
        marks = self.marks
        check = self._check
        # When the consumer's wait began, from its request (`next()` or `iter()`) to its
        # outcome. Not the scheduler's `waiting`: an `iter()` ends without an outcome, and the
        # wait for the epoch's first batch counts from it (the scheduler stops waiting there).
        # A clock's reading, which no state of the core holds.
        asked: float | None = None
        # The loader's epochs count over all its iterators, a scheduler's only its own (each
        # iter() without persistent workers makes a new one, at epoch 1): this driver's epoch
        # n is the loader's `epochs_before + n`, the number read from the state each time.
        epochs_before = self.epochs
        # Whether a worker of this driver was replaced (`ReplaceWorker` went out): only then
        # may a task be sent twice or an answer come from a lost incarnation, and only then
        # does a batch look for either (a flag, where a dict's lookup would cost every batch).
        restarted = False
        incarnation_now: dict[int, int] = {}
        """The incarnation running in each slot replaced so far."""
        incarnation_of, first_sent_of = tasks.incarnation, tasks.first_sent

        def sent_again(now: float, task: int, worker: int) -> bool:
            """Whether `task` was sent before (to a worker lost since): its row then counts
            from now, and keeps when it was first sent. Otherwise its incarnation is noted,
            where not 0, and the caller adds its row."""
            incarnation = incarnation_now.get(worker, 0)
            row = row_of.get(task)
            if row is None:
                if incarnation:
                    incarnation_of[task] = incarnation
                return False
            row -= tasks.first
            first_sent_of.setdefault(task, sent_at[row])
            sent_at[row] = now
            incarnation_of[task] = incarnation
            return True

        # Every step of a traced loader runs one of these, in the main process, between the
        # loader's own work; the seam picks it by the event's type. What is asked most comes
        # first, and everything that can wait until the trace is read (which batches were
        # ready while the loop waited) does.
        def batch_hooks(
            before_draw: Hook | None = None,
            before_answer: Hook | None = None,
            before_request: Hook | None = None,
        ) -> tuple[Callable[..., None], Hook, Hook]:
            """The hooks of the three events every batch brings (its index drawn, its answer,
            the consumer's request), each calling the hook given for its event first: another
            observer's for the same event (`Observer.joined`), so that both run in one call, a
            Python frame less a transition than the seam's own joining call."""

            def carried(
                state: State,
                event: Event,
                transition: Transition,
                now: float | None = None,
                before: Hook | None = before_draw,
            ) -> None:
                """The commands of a transition: tasks sent, outcomes handed over, resumes;
                `now`: the moment the caller read, None to read it here; `before`: what to
                call first (the hooks here pass None). An index drawn has no more to it: this
                is that event's hook, a call less on every batch's send."""
                nonlocal asked, restarted, packing
                if before is not None:
                    before(state, event, transition)
                if now is None:
                    now = clock()
                task: int | None
                for command in transition[1]:
                    ckind = type(command)
                    if ckind is DrawIndex:
                        continue
                    if ckind is SendTask:
                        number = command.task  # type: ignore[attr-defined]
                        task = number + offset
                        if restarted and sent_again(now, task, command.worker):  # type: ignore[attr-defined]
                            continue
                        row = len(sent_at)
                        row_of[task] = row + tasks.first
                        keyed(task)
                        worked(command.worker)  # type: ignore[attr-defined]
                        sent_at.append(now)
                        if row * _WIDTH >= len(moments):
                            grow()
                        index = command.index  # type: ignore[attr-defined]
                        if packing and type(index) is list:
                            # Eight bytes a number: 0.6 us for 64, where keeping the list kept
                            # 65 objects alive (see the module's docstring).
                            pack = formats.get(len(index))
                            if pack is None:
                                pack = formats[len(index)] = struct.Struct(f"{len(index)}q").pack
                            try:
                                packed_of[task] = pack(*index)
                            except (struct.error, TypeError, OverflowError):
                                packing = False
                                index_of[task] = index
                        else:
                            index_of[task] = index
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
                            epoch = epochs_before + transition[0].life.epoch
                            marks.append(Moment(now, "epoch end", None, f"epoch {epoch}"))
                        if task is not None:
                            handed = row_of.get(task)
                            if handed is not None:
                                moments[(handed - tasks.first) * _WIDTH + _HANDED] = now
                        if asked is not None:
                            asked_at(asked)
                            got_at(now)
                            waited_for(end if task is None else task)
                            asked = None
                        if task is None:
                            check()
                    elif ckind is ResumeWorker:
                        marks.append(Moment(now, "resume sent", command.worker))  # type: ignore[attr-defined]
                    elif ckind is ReplaceWorker:
                        restarted = True
                        worker = command.worker  # type: ignore[attr-defined]
                        incarnation_now[worker] = command.incarnation  # type: ignore[attr-defined]
                        self._replacing(now, driver, worker, command.incarnation)  # type: ignore[attr-defined]
                    elif ckind is StopWorker and self.retirements:
                        self._stopped(now, driver, command.worker)  # type: ignore[attr-defined]

            def answered(state: State, event: Event, transition: Transition) -> None:
                nonlocal asked
                if before_answer is not None:
                    before_answer(state, event, transition)
                now = clock()
                task = event.task + offset  # type: ignore[attr-defined]
                row = row_of.get(task)
                if restarted and row is not None:
                    worker = event.worker  # type: ignore[attr-defined]
                    if event.incarnation < incarnation_now.get(worker, 0):  # type: ignore[attr-defined]
                        row = None  # a lost incarnation's late answer, which the scheduler drops
                if row is not None:
                    at = (row - tasks.first) * _WIDTH
                    moments[at + _ARRIVED] = now
                    timing = event.timing  # type: ignore[attr-defined]
                    if timing is not None:
                        # At `at` itself: `_STARTED`.
                        moments[at], moments[at + _FINISHED], cpu, slowest, ready = timing
                        if cpu is not None:
                            moments[at + _CPU] = cpu
                        if slowest:
                            sample, moments[at + _TOOK] = slowest[0]
                            if sample is not WHOLE_BATCH:
                                slowest_index[task] = sample
                        if ready is not None:
                            worker = event.worker  # type: ignore[attr-defined]
                            marks.append(Moment(ready, "worker ready", worker))
                commands = transition[1]
                if not commands:  # an answer nobody waits for yet
                    return
                first = commands[0]
                if (
                    asked is not None
                    and row is not None
                    and type(first) is Deliver
                    and first.task + offset == task
                    and (
                        len(commands) == 1
                        or (len(commands) == 2 and type(commands[1]) is DrawIndex)
                    )
                ):
                    # The answer the consumer waits for, handed over at once, and maybe the
                    # next index asked for (a draw has no more to it): what `carried` would
                    # do, without its call, its loop and a second lookup of the row.
                    moments[at + _HANDED] = now
                    asked_at(asked)
                    got_at(now)
                    waited_for(task)
                    asked = None
                    return
                carried(state, event, transition, now, None)

            def requested(state: State, event: Event, transition: Transition) -> None:
                nonlocal asked
                if before_request is not None:
                    before_request(state, event, transition)
                now = clock()
                if asked is None:
                    asked = now
                if transition[1]:  # often none: a request mostly, an answer nobody waits for
                    carried(state, event, transition, now, None)

            return carried, answered, requested

        carried, answered, requested = batch_hooks()

        def failed(state: State, event: Event, transition: Transition) -> None:
            task = event.task + offset  # type: ignore[attr-defined]
            late = restarted and event.incarnation < incarnation_now.get(event.worker, 0)  # type: ignore[attr-defined]
            if task in row_of and not late:
                tasks.failed.add(task)
            answered(state, event, transition)

        def reset(state: State, event: Event, transition: Transition) -> None:
            nonlocal asked
            now = clock()
            # The epoch the scheduler has begun, as the loader counts it.
            self.epochs = epoch = epochs_before + transition[0].life.epoch
            marks.append(Moment(now, "epoch start", None, f"epoch {epoch}"))
            if asked is None:
                asked = now
            check()
            carried(state, event, transition, now)

        def rare(state: State, event: Event, transition: Transition) -> None:
            now = clock()
            self._saw_rare(now, state, event, transition, driver)
            carried(state, event, transition, now)

        hooks: dict[type[Event], Hook | None] = {
            IndexDrawn: carried,
            TaskCompleted: answered,
            TaskFailed: failed,
            NextRequested: requested,
            ResetRequested: reset,
        }

        def joined(kind: type[Event], before: Hook) -> Hook | None:
            """The hook for `kind` that calls `before` first (`Observer.joined`): for the three
            events of every batch."""
            if kind is IndexDrawn:
                return batch_hooks(before_draw=before)[0]
            if kind is TaskCompleted:
                return batch_hooks(before_answer=before)[1]
            if kind is NextRequested:
                return batch_hooks(before_request=before)[2]
            return None

        return Observer(rare, owner=self, on=hooks, joined=joined)

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
        retirements = self.retirements
        if retirements:
            # A tuner may retire and add as long as the loader runs: those of the stretch
            # forgotten go with it.
            gone = bisect.bisect_left(retirements, cut, key=_retired_at)
            if gone > slack:
                del retirements[:gone]
                self.forget_work += gone + len(retirements)

    def _saw_rare(
        self, now: float, state: State, event: Event, transition: Transition, driver: int = 0
    ) -> None:
        """The events that come once an epoch or less (a tuner's too); `driver`: the number of
        the driver (loader iterator) whose scheduler was told of `event`."""
        kind = type(event)
        if kind is WorkerDied or kind is WorkerStuck:
            self._lost(now, state, event, transition, driver)
        elif kind is WorkerStarted:
            self._started(now, event, driver)
        elif kind is RetireRequested:
            self._retiring(now, state, event.worker, driver)  # type: ignore[attr-defined]
        elif kind is AddRequested:
            self._adding(now, event.worker, driver)  # type: ignore[attr-defined]
        if kind is WorkerDied:
            detail = f"pid {event.pid}, exit code {event.exitcode}"  # type: ignore[attr-defined]
            self.marks.append(Moment(now, "worker died", event.worker, detail))  # type: ignore[attr-defined]
        elif kind is WorkerResumed:
            self.marks.append(Moment(now, "worker resumed", event.worker))  # type: ignore[attr-defined]
        elif kind is TimedOut:
            self.marks.append(Moment(now, "timed out", None, f"after {event.seconds} s"))  # type: ignore[attr-defined]

    def _lost(
        self, now: float, before: State, event: Event, transition: Transition, driver: int = 0
    ) -> None:
        """A death or a hang: kept if the scheduler counted it a loss (it replaced the worker,
        or failed the loader with it), not if it was a stopped worker's exit or a lost
        incarnation's late news."""
        life, after = before.life, transition[0].life
        loss: WorkerDeath | WorkerHang
        if len(after.replaced) > len(life.replaced):
            loss = after.replaced[-1]
        elif after.failure is not life.failure and type(after.failure) in (WorkerDeath, WorkerHang):
            loss = after.failure  # type: ignore[assignment]
        else:
            return
        worker = loss.worker
        held = tuple(
            before.rcvd_idx + number
            for number, slot in enumerate(before.window)
            if type(slot) is Pending and slot.worker == worker
        )
        incarnation = event.incarnation  # type: ignore[attr-defined]
        loss = attrs.evolve(loss, earlier=())
        self.losses.append(_Loss(worker, incarnation, loss, now, held, driver=driver))
        retiring = self._open_retirement(driver, worker)
        if retiring is not None:
            retiring.lapsed = True  # replaced (or failing the loader) as a running worker

    def _replacing(self, now: float, driver: int, worker: int, incarnation: int) -> None:
        """`ReplaceWorker` went out for `worker`'s incarnation `incarnation`: if it replaces a
        loss, that loss is a restart (otherwise it adds a retired slot back)."""
        for lost in reversed(self.losses):
            if lost.driver == driver and lost.worker == worker:
                if lost.replaced is None and lost.incarnation == incarnation - 1:
                    lost.replaced = now
                return

    def _started(self, now: float, event: Event, driver: int = 0) -> None:
        """A replacement, or a slot added back, reported itself started."""
        worker, incarnation = event.worker, event.incarnation  # type: ignore[attr-defined]
        for lost in reversed(self.losses):
            if (lost.driver, lost.worker, lost.incarnation) == (driver, worker, incarnation - 1):
                if lost.started is None and lost.replaced is not None:
                    lost.started = now
                return
        for retired in reversed(self.retirements):
            if retired.driver == driver and retired.worker == worker:
                if retired.incarnation == incarnation - 1 and retired.added is not None:
                    retired.started = retired.started or now
                return

    def _retiring(self, now: float, before: State, worker: int, driver: int) -> None:
        """`RetireRequested` for `worker`: what it held then, it finishes before it stops."""
        held = tuple(
            before.rcvd_idx + number
            for number, slot in enumerate(before.window)
            if type(slot) is Pending and slot.worker == worker
        )
        incarnations = before.life.incarnations
        incarnation = incarnations[worker] if worker < len(incarnations) else 0
        self.retirements.append(_Retirement(driver, worker, incarnation, now, held))

    def _open_retirement(self, driver: int, worker: int) -> _Retirement | None:
        """`worker`'s retirement in `driver` that has not ended yet (stopped, or lapsed)."""
        for retired in reversed(self.retirements):
            if retired.driver == driver and retired.worker == worker:
                open_ = retired.stopped is None and not retired.lapsed
                return retired if open_ else None
        return None

    def _stopped(self, now: float, driver: int, worker: int) -> None:
        """`StopWorker` went out: a retiring worker's is its retirement's end."""
        retiring = self._open_retirement(driver, worker)
        if retiring is not None:
            retiring.stopped = now

    def _adding(self, now: float, worker: int, driver: int) -> None:
        """`AddRequested`: the slot's latest retirement ends with its return."""
        for retired in reversed(self.retirements):
            if retired.driver == driver and retired.worker == worker:
                if retired.added is None and retired.stopped is not None:
                    retired.added = now
                return

    def trace(self) -> Trace:
        """What was traced so far (cut to the limit exactly)."""
        with collector_paused():
            batches, waits = self._read()
            return attrs.evolve(
                self._settings(), batches=tuple(batches.records(None)), waits=waits.waits()
            )

    def stats(self) -> LoaderStats:
        """The figures of `trace()`, worked out from the tracer's tables: of its records,
        only those the figures name are made (`BatchColumns`)."""
        with collector_paused():
            batches, waits = self._read()
            return LoaderStats._of(self._settings(), batches, waits)

    def _read(self) -> tuple[BatchColumns, WaitColumns]:
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
            losses=tuple(lost.record() for lost in self.losses),
            retirements=tuple(retired.record() for retired in self.retirements),
        )


@attrs.define
class _Loss:
    """A `LostWorker` while it is traced: its replacement's moments come later."""

    worker: int
    incarnation: int
    loss: WorkerDeath | WorkerHang
    at: float
    held: tuple[int, ...]
    replaced: float | None = None
    started: float | None = None
    driver: int = 0
    """The number of the driver (loader iterator) that lost it."""

    def record(self) -> LostWorker:
        return LostWorker(
            self.worker,
            self.incarnation,
            self.loss,
            self.at,
            self.held,
            self.replaced,
            self.started,
        )


@attrs.define
class _Retirement:
    """A `RetiredWorker` while it is traced, with its driver's number."""

    driver: int
    worker: int
    incarnation: int
    at: float
    held: tuple[int, ...]
    stopped: float | None = None
    added: float | None = None
    started: float | None = None
    lapsed: bool = False

    def record(self) -> RetiredWorker:
        return RetiredWorker(
            self.worker,
            self.incarnation,
            self.at,
            self.held,
            self.stopped,
            self.added,
            self.started,
            self.lapsed,
        )


def _moment(mark: Moment) -> float:
    return mark.time


def _retired_at(retired: _Retirement) -> float:
    return retired.at
