"""What a worker measures of each task when its loader is traced.

A traced loader's workers stamp every answer with a `TaskTiming`: when the task started and
finished on the worker's clock, the CPU time its thread spent on it, and its slowest samples
by dataset index. The clock is `time.perf_counter`, which on Linux reads CLOCK_MONOTONIC: one
clock for every process of the machine, so the main process lines worker timings up with its
own without any exchange. The scheduler passes timings by, as it does batches; the main
process's tracer (`executors._observe.tracer`) collects them.

This module runs in every worker process: it imports nothing beyond what a worker already has.
"""

from __future__ import annotations

import operator
import time
from typing import Any

__all__ = [
    "CPU_SAMPLED_EVERY",
    "ClockSkew",
    "FAST_SAMPLE",
    "FAST_TASK",
    "SLOWEST_KEPT",
    "WHOLE_BATCH",
    "TaskTiming",
    "TimedFetch",
]

SLOWEST_KEPT = 1
"""Samples of a task whose times a worker sends: the slowest only. Finding more costs every
traced batch several microseconds more, and the trace's slowest samples come from across
its batches anyway."""


TaskTiming = tuple[float, float, float | None, tuple[tuple[Any, float], ...], float | None]
"""One task as its worker saw it: `(started, finished, cpu, slowest, ready)`.

- `started`, `finished`: `time.perf_counter()` when the worker began the task and when its
  batch was made (collated), before the executor sends it;
- `cpu`: CPU seconds the worker's thread spent on it (`time.thread_time`): far below the
  task's duration when its samples wait (I/O, sleeps), close to it when they compute. None
  when it was not read: a worker reads it for every task after one that took `FAST_TASK` or
  more, and for one in `CPU_SAMPLED_EVERY` of the faster ones;
- `slowest`: the task's slowest samples as (dataset index, seconds), slowest first, up to
  `SLOWEST_KEPT`; empty for an iterable dataset (its samples have no index); one entry for the
  whole batch, its index `WHOLE_BATCH`, when the dataset loads it at once (`__getitems__`) or
  its samples take under `FAST_SAMPLE` each;
- `ready`: with a worker's first answer, when the worker became ready (seeded, its dataset
  prepared, `worker_init_fn` run); None with every later one.

A plain tuple, not a class: every answer of a traced loader carries one across the process
boundary, and a tuple of floats unpickles in 0.5 us where a named tuple takes 2 us.
"""


WHOLE_BATCH = None
"""The index of a slowest "sample" that is the whole batch: the main process, which sent the
batch's indices, puts them back in its place rather than have every answer carry them."""

FAST_SAMPLE = 20e-6
"""Below this mean time a sample, a worker times its batches whole, not each sample: the two
clock readings around a sample cost about 0.2 us, which is then over 1% of loading."""


FAST_TASK = 200e-6
"""Below this a task is fast: the two readings of the CPU clock around it (system calls, 0.8 us
each) would cost it over 1%, so only one in `CPU_SAMPLED_EVERY` fast tasks has its CPU time
read. The CPU share of a trace is taken over the tasks that have one."""

CPU_SAMPLED_EVERY = 16


class TimedFetch:
    """A worker's fetch that also times each sample of a map-style dataset.

    It does what torch's map-style fetcher does (a list of `dataset[i]`, or `__getitems__`, then
    collate), with a clock around each sample, or around the whole batch while the samples
    take under `FAST_SAMPLE` each. `slowest` holds the last fetch's slowest samples.
    """

    def __init__(self, fetcher: Any, map_style: bool) -> None:
        self.fetcher = fetcher
        self.map_style = map_style
        self.slowest: tuple[tuple[Any, float], ...] = ()
        self.sample_seconds = float("inf")
        """The mean time of a sample in the last batch: the first batch times each sample."""

    def __call__(self, index: Any) -> Any:
        fetcher = self.fetcher
        self.slowest = ()  # a fetch that raises leaves none: the failed task's own are unknown
        if not self.map_style:
            return fetcher.fetch(index)
        dataset = fetcher.dataset
        clock = time.perf_counter
        if not fetcher.auto_collation:
            started = clock()
            data = dataset[index]
            self.slowest = ((index, clock() - started),)
            return fetcher.collate_fn(data)
        getitems = getattr(dataset, "__getitems__", None)
        if getitems:
            started = clock()
            samples = getitems(index)
            self.slowest = ((WHOLE_BATCH, clock() - started),)
            return fetcher.collate_fn(samples)
        if self.sample_seconds < FAST_SAMPLE:
            # Samples this fast cost less than the clock readings around each would: the batch
            # is timed as a whole, and a slow sample shows as its batch, by its indices. A
            # batch slow enough to matter brings the timing of each sample back.
            started = clock()
            samples = [dataset[sample_index] for sample_index in index]
            took = clock() - started
            self.slowest = ((WHOLE_BATCH, took),)
            if samples:
                self.sample_seconds = took / len(samples)
            return fetcher.collate_fn(samples)
        indices = list(index)
        if not indices:
            return fetcher.collate_fn([])
        # One clock reading after each sample; the differences and the slowest found in C.
        samples = []
        stamps = [clock()]
        keep, stamp = samples.append, stamps.append
        for sample_index in indices:
            keep(dataset[sample_index])
            stamp(clock())
        times = map(operator.sub, stamps[1:], stamps)
        took, at = max(zip(times, range(len(indices)), strict=True))
        self.slowest = ((indices[at], took),)
        self.sample_seconds = (stamps[-1] - stamps[0]) / len(indices)
        return fetcher.collate_fn(samples)


class ClockSkew:
    """How far the clock of another machine's worker is from this process's, for an executor
    whose workers may run elsewhere (Ray's actors on other nodes): CLOCK_MONOTONIC is one clock
    per machine, counted from its boot.

    Each answer's arrival here, less the worker's end of the task there, is the skew plus the
    answer's time in transit, which is never negative: the smallest of these so far is the
    estimate, too large by the fastest transit seen (under a millisecond on a local network).
    So a task's aligned end never comes after its answer's arrival, and its start never
    before it was sent. No call to the worker is needed: it may be busy with the next tasks.
    """

    def __init__(self) -> None:
        self.seconds = float("inf")

    def shifted(self, timing: TaskTiming, arrived: float) -> TaskTiming:
        """`timing` on this process's clock; `arrived`, when its answer arrived here."""
        started, finished, cpu, slowest, ready = timing
        self.seconds = skew = min(self.seconds, arrived - finished)
        return (
            started + skew,
            finished + skew,
            cpu,
            slowest,
            None if ready is None else ready + skew,
        )
