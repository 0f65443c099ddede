"""What a tracer kept, as plain data, and what is read from it: `Trace` (every batch, wait
and mark), `LoaderStats` (the figures), and the verdict in words with what to try.

Pure readers: nothing here records, and nothing here imports the recorders
(`statecore.executors._observe.tracer`), which import this. The figures are worked out a
column at a time (`BatchColumns`, `WaitColumns`), from a trace's records or straight from a
tracer's columns, so that both give the same figures to the last bit.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import json
import math
import operator
import os
import re
import statistics
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from numpy.typing import NDArray

from statecore import Phase, State, WorkerHang, WorkerLoss, WorkerStatus

if TYPE_CHECKING:
    from statecore.executors._autotune import AutoTuning

__all__ = [
    "STRAGGLER_FACTOR",
    "BatchColumns",
    "BatchRecord",
    "Column",
    "LoaderCounters",
    "LoaderStats",
    "LostWorker",
    "Moment",
    "RetiredWorker",
    "Trace",
    "Wait",
    "WaitColumns",
    "collector_paused",
    "nullable",
    "shown_index",
    "stuck_at",
]

STRAGGLER_FACTOR = 3.0
"""A batch is a straggler when it took more than this many times the median batch."""

Column = NDArray[Any]
"""A column of numbers as the figures read it (numpy: one thread, and little to call)."""


def nullable(values: list[float]) -> list[float | None]:
    """`values`, with None for NaN (a moment that did not come)."""
    return [None if value != value else value for value in values]


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
    incarnation: int = 0
    """The incarnation of its worker's slot that it was sent to (see `LostWorker`): 0 unless
    that slot's worker was replaced before."""
    first_sent: float | None = None
    """For a task its worker was lost with and that was sent again to the replacement: when
    it was first sent, to the lost incarnation. `sent` is then the re-send, so that the
    task's queueing and loading count from it, not from the lost worker's try."""

    @property
    def resent(self) -> bool:
        """Whether the task was sent again after its worker was lost."""
        return self.first_sent is not None

    @property
    def seconds(self) -> float | None:
        """How long the worker took over it."""
        if self.started is None or self.finished is None:
            return None
        return self.finished - self.started


@attrs.frozen
class Moment:
    """Something that happened at one moment: an epoch's start or end, a worker resumed or
    dead, a timeout."""

    time: float
    kind: str
    worker: int | None = None
    detail: str = ""


@attrs.frozen
class LostWorker:
    """A worker the scheduler found lost: dead without being told to, or stuck past the
    loader's `worker_timeout` (`loss`, the core's own record of it). While restarts were left
    (`DataLoader(worker_restarts=N)`) it was replaced in its slot: `ReplaceWorker` went out at
    `replaced`, and the replacement (incarnation `incarnation + 1`) reported itself started at
    `started`; otherwise the loss failed the loader and both stay None."""

    worker: int
    incarnation: int
    """The lost incarnation of the slot (0: the worker it started with)."""
    loss: WorkerLoss
    at: float
    """When the scheduler was told (`time.perf_counter()` seconds, as every moment traced)."""
    held: tuple[int, ...] = ()
    """The tasks it held unanswered, sent again to its replacement once that started."""
    replaced: float | None = None
    started: float | None = None

    @property
    def restarted(self) -> bool:
        """Whether the lost worker was replaced (a restart), rather than failing the loader."""
        return self.replaced is not None

    @property
    def hang(self) -> bool:
        return type(self.loss) is WorkerHang

    @property
    def stack(self) -> str | None:
        """A stuck worker's Python stack when it was found stuck (innermost call last)."""
        return self.loss.stack if type(self.loss) is WorkerHang else None

    def describe(self) -> str:
        """The loss in a sentence, without the stack."""
        loss = self.loss
        said = (
            attrs.evolve(loss, stack=None) if type(loss) is WorkerHang else loss
        ).describe_alone()
        if self.incarnation:
            said = said.replace(
                f"worker {self.worker}", f"worker {self.worker} (incarnation {self.incarnation})", 1
            )
        if self.started is not None:
            said += f"; replaced, its replacement started {_s(self.started - self.at)} later"
        elif self.replaced is not None:
            said += "; replaced, its replacement had not started yet"
        else:
            said += "; not replaced (no restart left)"
        if self.held:
            count = len(self.held)
            said += f", {count} task{'s' if count != 1 else ''} sent again"
        return said


@attrs.frozen
class RetiredWorker:
    """A worker retired mid-epoch (`Driver.retire`, a tuner's choice): from `at` it was given
    no new task, and it was stopped (`StopWorker`) at `stopped`, once it had answered the
    tasks it held then (`held`). Its slot added back (`Driver.add`) at `added` runs incarnation
    `incarnation + 1`, which reported itself started at `started`. None where that moment did
    not (yet) come. Times are `time.perf_counter()` seconds, as every moment traced."""

    worker: int
    incarnation: int
    """The retired incarnation of the slot (0: the worker it started with)."""
    at: float
    held: tuple[int, ...] = ()
    """The tasks it held unanswered when it was retired: it finished them before it stopped."""
    stopped: float | None = None
    added: float | None = None
    started: float | None = None
    lapsed: bool = False
    """Lost (dead, or stuck) before it stopped: replaced as a running worker instead (see
    `Trace.losses`), its retirement lapsed."""

    @property
    def back(self) -> bool:
        """Whether its slot was added back."""
        return self.added is not None

    def describe(self) -> str:
        """The retirement in a sentence."""
        said = f"worker {self.worker}"
        if self.incarnation:
            said += f" (incarnation {self.incarnation})"
        count = len(self.held)
        said += f" retired holding {count} task{'s' if count != 1 else ''}"
        if self.lapsed:
            return said + "; lost before it stopped, and replaced"
        if self.stopped is None:
            return said + "; still finishing them"
        if self.stopped == self.at:
            said += "; stopped at once"
        else:
            said += f"; stopped {_s(self.stopped - self.at)} later"
        if self.added is not None:
            said += (
                f"; added back {_s(self.added - self.stopped)} after that, as incarnation "
                f"{self.incarnation + 1}"
            )
            if self.started is not None:
                said += f", started {_s(self.started - self.added)} later"
            else:
                said += ", not started yet"
        return said


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
class WaitColumns:
    """The consumer's waits as columns, in the order it asked (as `Trace.waits`)."""

    asked: list[float]
    got: list[float]
    task: list[int | None]
    held: list[float]

    @classmethod
    def of(cls, waits: Sequence[Wait]) -> WaitColumns:
        return cls(
            [wait.asked for wait in waits],
            [wait.got for wait in waits],
            [wait.task for wait in waits],
            [wait.held for wait in waits],
        )

    def in_order_asked(self) -> WaitColumns:
        """These waits, in the order the consumer asked (as they ended, mostly)."""
        asked = self.asked
        if all(map(operator.le, asked, itertools.islice(asked, 1, None))):
            return self
        order = sorted(range(len(asked)), key=asked.__getitem__)
        return WaitColumns(
            *([column[row] for row in order] for column in attrs.astuple(self, recurse=False))
        )

    def waits(self) -> tuple[Wait, ...]:
        return tuple(map(Wait, self.asked, self.got, self.task, self.held))


@attrs.frozen
class BatchColumns:
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
    def of(cls, batches: Sequence[BatchRecord]) -> BatchColumns:
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


def _span(
    marks: Sequence[Moment], batches: BatchColumns, waits: WaitColumns
) -> tuple[float, float]:
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
    marks: tuple[Moment, ...]
    dropped: int = 0
    """Batches forgotten. A tracer keeps the latest stretch of the run that holds at most its
    limit (`DEFAULT_LIMIT`) of batches, of waits and of marks, and forgets all before it."""
    dropped_waits: int = 0
    """The consumer's waits forgotten with them."""
    dropped_marks: int = 0
    """Marks forgotten with them."""
    epochs_dropped: int = 0
    """Epochs whose start was forgotten (a batch's `epoch` counts them)."""
    losses: tuple[LostWorker, ...] = ()
    """Every worker lost, in order: the replaced ones are the restarts. Never forgotten (there
    are at most `worker_restarts` of them, and one more that failed the loader)."""
    retirements: tuple[RetiredWorker, ...] = ()
    """Every worker retired (`Driver.retire`), in order, with its slot's return if it was
    added back (`Driver.add`). Those that began before the stretch kept are forgotten with it
    (a tuner may retire and add for as long as the loader runs)."""

    @property
    def restarts(self) -> int:
        """Lost workers replaced."""
        return sum(1 for lost in self.losses if lost.restarted)

    @property
    def retired(self) -> int:
        """Workers retired."""
        return len(self.retirements)

    @property
    def added(self) -> int:
        """Retired slots added back."""
        return sum(1 for retired in self.retirements if retired.back)

    @property
    def start(self) -> float:
        """The first moment traced: the first `iter()`, or the oldest moment kept."""
        return _span(self.marks, BatchColumns.of(self.batches), WaitColumns.of(self.waits))[0]

    @property
    def end(self) -> float:
        """The last moment traced."""
        return _span(self.marks, BatchColumns.of(self.batches), WaitColumns.of(self.waits))[1]

    def stats(self) -> LoaderStats:
        return LoaderStats.of(self)

    def verdict(self) -> str:
        return self.stats().verdict()

    def chrome(self) -> dict[str, Any]:
        """The trace in Chrome's trace event format (JSON object form), which Perfetto and
        `chrome://tracing` open: one track per worker, one for the consumer."""
        from statecore.executors._observe.chrome import chrome_trace

        return chrome_trace(self)

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
    traced: bool = True
    """Whether the figures above come from a trace. `DataLoader.stats()` answers for an
    untraced loader too: its figures are then those of nothing traced (no batch, no second,
    no worker busy) and only `counters` says what happened."""
    counters: LoaderCounters | None = None
    """What the scheduler of the loader's latest iterator knows now, traced or not; None in
    the figures of a `Trace` alone (`Trace.stats()`), which has no scheduler."""
    losses: tuple[LostWorker, ...] = ()
    """The workers lost, as `Trace.losses` (traced only; `counters.restarts` counts restarts
    untraced)."""
    retirements: tuple[RetiredWorker, ...] = ()
    """The workers retired, and their slots added back, as `Trace.retirements` (traced only;
    `counters.added` counts the slots added back untraced)."""
    tuning: AutoTuning | None = None
    """What `num_workers="auto"` did (its changes: when, how many, why; the count it stands
    at), traced or not; None for a loader with a fixed count."""

    @property
    def restarts(self) -> int:
        """Lost workers replaced (traced; untraced, see `counters.restarts`)."""
        return sum(1 for lost in self.losses if lost.restarted)

    @property
    def retired(self) -> int:
        """Workers retired (traced)."""
        return len(self.retirements)

    @property
    def added(self) -> int:
        """Retired slots added back (traced; untraced, see `counters.added`)."""
        return sum(1 for retired in self.retirements if retired.back)

    @property
    def restarts_per_worker(self) -> tuple[int, ...]:
        """Per worker slot, how many times its worker was replaced."""
        counts = [0] * self.num_workers
        for lost in self.losses:
            if lost.restarted and 0 <= lost.worker < len(counts):
                counts[lost.worker] += 1
        return tuple(counts)

    @property
    def hangs(self) -> tuple[LostWorker, ...]:
        """The workers found stuck, each with its stack (`LostWorker.stack`)."""
        return tuple(lost for lost in self.losses if lost.hang)

    @classmethod
    def counted(
        cls,
        counters: LoaderCounters,
        num_workers: int,
        in_order: bool,
        persistent_workers: bool,
        executor: str,
        traced: bool = False,
        tuning: AutoTuning | None = None,
    ) -> LoaderStats:
        """The statistics of a loader with nothing traced: its counters and its settings."""
        return cls(
            batches=0,
            failed=0,
            epochs=0,
            seconds=0.0,
            waited=0.0,
            waited_for_order=0.0,
            idle_behind_order=0.0,
            startup_waits=(),
            busy=(),
            median_batch=None,
            cpu_share=None,
            slowest=(),
            stragglers=(),
            num_workers=num_workers,
            in_order=in_order,
            persistent_workers=persistent_workers,
            executor=executor,
            traced=traced,
            counters=counters,
            tuning=tuning,
        )

    @property
    def waiting_share(self) -> float:
        """The share of the traced time the consumer waited on loading (0 to 1)."""
        return self.waited / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def of(cls, trace: Trace) -> LoaderStats:
        with collector_paused():
            return cls._of(trace, BatchColumns.of(trace.batches), WaitColumns.of(trace.waits))

    @classmethod
    def _of(cls, trace: Trace, batches: BatchColumns, waits: WaitColumns) -> LoaderStats:
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
            losses=trace.losses,
            retirements=trace.retirements,
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
        elif mean_busy >= 0.75 and self.tuning is None:  # an auto loader chooses its count
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

    def _lost_lines(self) -> list[str]:
        """The workers lost, restarts and hangs, in words: one line each, a hang's stack's
        innermost line with it."""
        if not self.losses:
            return []
        restarts, hangs = self.restarts, len(self.hangs)
        lines = [
            f"{len(self.losses)} worker(s) lost ({hangs} stuck, {len(self.losses) - hangs} "
            f"dead), {restarts} restart(s):"
        ]
        for lost in self.losses:
            line = f"- {lost.describe()}"
            where = stuck_at(lost.stack or "")
            if where:
                line += f"; stuck at {where}"
            lines.append(line)
        return lines

    def _retired_lines(self) -> list[str]:
        """The workers retired and added back, in words: one line each."""
        if not self.retirements:
            return []
        lines = [f"{self.retired} worker(s) retired, {self.added} added back:"]
        lines += [f"- {retired.describe()}" for retired in self.retirements]
        return lines

    def verdict(self) -> str:
        """The figures in plain words, and what to try."""
        workers = f"{self.num_workers} worker{'s' if self.num_workers != 1 else ''}"
        if self.executor == "inline":
            workers = "no workers"
        setting = (
            f"{workers} ({self.executor}), in_order={self.in_order}, "
            f"persistent_workers={self.persistent_workers}."
        )
        if not self.traced:
            lines = [f"Not traced; {setting}"]
            if self.counters is not None:
                lines.append(self.counters.describe())
            if self.tuning is not None:
                lines += self.tuning.describe()
            lines.append(
                "For where the time goes (the training loop's waits, the workers' busy time, "
                "the slowest samples), trace the loader: trace=True, or STATECORE_TRACE=1 in "
                "the environment."
            )
            return "\n".join(lines)
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
                f"index {shown_index(index)}: {_s(took)} "
                f"(worker {worker}, epoch {epoch}, task {task})"
                for index, took, worker, task, epoch in self.slowest
            )
            lines.append(f"Slowest samples: {named}.")
        if self.failed:
            lines.append(f"{self.failed} task(s) raised.")
        lines += self._lost_lines()
        lines += self._retired_lines()
        if self.tuning is not None:
            lines += self.tuning.describe()
        tips = self.suggestions()
        if tips:
            lines.append("What to try:")
            lines += [f"- {tip}" for tip in tips]
        elif self.seconds > 0 and self.waiting_share >= 0.05:
            lines.append("Nothing in the trace points to a loader setting that would help.")
        return "\n".join(lines)


@attrs.frozen
class LoaderCounters:
    """What the scheduler of a loader's latest iterator knows now, read from its state: cheap
    (nothing is recorded to count them), and there whether or not the loader is traced
    (`DataLoader.stats().counters`). They are the epoch's, as the scheduler keeps them."""

    epoch: int
    """Epochs the latest iterator began (with persistent workers, one iterator serves every
    epoch; without, each `iter()` makes a new one); 0 before the first `iter()`."""
    phase: Phase | None
    """Where its scheduler stands (`statecore.Phase`); None before the first `iter()`."""
    handed_over: int
    """Batches (and workers' errors) handed to the consumer this epoch."""
    skipped: int
    """Tasks of this epoch skipped (an iterable dataset's worker ran dry before them)."""
    in_flight: int
    """Tasks sent to a worker and not answered yet."""
    buffered: int
    """Tasks answered and not handed over yet (in order, held behind an earlier one)."""
    tasks_per_worker: tuple[int, ...]
    """Per worker, tasks of this epoch given to it and not handed over yet (in flight or
    buffered)."""
    workers: tuple[WorkerStatus, ...]
    """Per worker, what the scheduler believes of it (active, exhausted, resuming...)."""
    waiting: bool
    """Whether the consumer waits for the scheduler now (in `next()`, or in `iter()`)."""
    restarts: int = 0
    """Lost workers replaced: over the loader's life where the loader counts them (its
    `worker_restarts` are a budget per loader), else over the scheduler's."""
    added: int = 0
    """Retired slots started again (`Driver.add`), over the scheduler's life. Which workers
    are retiring or retired now is in `workers`; the trace lists every retirement."""

    @classmethod
    def of(
        cls, state: State | None, num_workers: int, restarts: int | None = None
    ) -> LoaderCounters:
        """The counters of a scheduler in `state`; None: a loader not iterated yet.
        `restarts`: the loader's count of restarts, over all its iterators; by default the
        scheduler's own (`State.stats().restarts`)."""
        if state is None:
            return cls(
                epoch=0,
                phase=None,
                handed_over=0,
                skipped=0,
                in_flight=0,
                buffered=0,
                tasks_per_worker=(0,) * num_workers,
                workers=(WorkerStatus.ACTIVE,) * num_workers,
                waiting=False,
                restarts=restarts or 0,
            )
        stats = state.stats()
        return cls(
            epoch=stats.epoch,
            phase=stats.phase,
            handed_over=stats.delivered,
            skipped=stats.skipped,
            in_flight=stats.in_flight,
            buffered=stats.buffered,
            tasks_per_worker=stats.loads,
            workers=stats.workers,
            waiting=state.waiting or state.life.resetting,
            restarts=stats.restarts if restarts is None else restarts,
            added=state.life.added,
        )

    def describe(self) -> str:
        """The counters in a sentence."""
        if self.phase is None:
            return "Not iterated yet."
        each = ", ".join(
            f"worker {worker} {tasks}" for worker, tasks in enumerate(self.tasks_per_worker)
        )
        per_worker = f" (tasks per worker: {each})" if each else ""
        waits = "waits for a batch now" if self.waiting else "is not waiting for a batch now"
        restarts = f" {self.restarts} lost worker(s) replaced." if self.restarts else ""
        tuned = ""
        retiring = [w for w, status in enumerate(self.workers) if status is WorkerStatus.RETIRING]
        if retiring:
            tuned += f" Retiring: worker(s) {', '.join(map(str, retiring))}."
        if self.added:
            tuned += f" {self.added} retired worker(s) added back."
        return (
            f"Epoch {self.epoch}, {self.phase.name.lower()}: {self.handed_over} handed over, "
            f"{self.in_flight} in flight, {self.buffered} answered and not handed over yet"
            f"{per_worker}; the training loop {waits}.{restarts}{tuned}"
        )


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


def _idle_behind_order(trace: Trace, batches: BatchColumns, waits: WaitColumns) -> float:
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
        nullable(column.tolist())
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


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')


def stuck_at(stack: str) -> str:
    """Where a stuck worker's `stack` (innermost call last, as `traceback` prints it) was
    stuck, in a few words: the innermost frame outside Python's own library (a dataset's line
    waiting on a lock, rather than the lock's `acquire`), as "file.py:72 in f: its code"; ""
    if the stack names no frame."""
    frames: list[tuple[str, str, str, str]] = []
    lines = stack.splitlines()
    for number, text in enumerate(lines):
        found = _FRAME.match(text)
        if found is not None:
            code = lines[number + 1].strip() if number + 1 < len(lines) else ""
            if _FRAME.match(code):
                code = ""
            frames.append((found["file"], found["line"], found["function"], code))
    if not frames:
        return ""
    library = sysconfig.get_paths()["stdlib"]
    own = [frame for frame in frames if not frame[0].startswith(library)]
    file, line, function, code = (own or frames)[-1]
    where = f"{Path(file).name}:{line} in {function}"
    return f"{where}: {code}" if code else where


def _pct(share: float) -> str:
    return f"{100.0 * share:.0f}%" if share >= 0.1 else f"{100.0 * share:.1f}%"


def _s(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


def shown_index(index: Any) -> str:
    text = repr(index)
    return text if len(text) <= 40 else text[:37] + "..."


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
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
