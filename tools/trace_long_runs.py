"""Tracing over long runs: what a traced batch costs, and what the tracer keeps, run after run.

    python -m statecore.tools.trace_long_runs [--quick] [SHAPE ...]

Each shape is one traced statecore loader, inline, over trivial samples in batches of one
(the `inline-b1` workload's dataset):

- `long`: one epoch of 1,000,000 batches, with the default limit (200,000 batches), which it
  passes in its first quarter;
- `epochs`: 20,000 epochs of one batch each, a new iterator each, with the default limit,
  which it does not reach (two waits and three marks an epoch);
- `epochs-small`: the same with a limit of 2,000, which it passes in its first quarter.

For each, per quarter of the run: the microseconds of CPU a batch took (the process's own
time: on a shared machine, wall times swing with the other programs), and what the tracer
kept at the quarter's end (batches, waits, marks, and their bytes, `kept_bytes`); then the
time of the last tenth of the run's batches over the first tenth's (the goal: at most 1.2),
the batches the tracer forgot, and how long `loader.stats()` took at the end (the goal:
under a second). Timing stops while the memory is counted. `--quick` runs each shape with a
fiftieth of its batches and of its limit (the tests run it). docs/profiling.md quotes the
output.
"""

from __future__ import annotations

import argparse
import sys
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

import statecore
from statecore.executors._observe.tracer import DEFAULT_LIMIT, Tracer
from statecore.tools.workloads import Indices

__all__ = [
    "GOAL_RATIO",
    "GOAL_STATS_SECONDS",
    "SHAPES",
    "LongRun",
    "Shape",
    "kept_bytes",
    "main",
    "run",
]

GOAL_RATIO = 1.2
"""The goal: the last tenth of a run's batches take at most this many times the first tenth."""
GOAL_STATS_SECONDS = 1.0
"""The goal: `stats()` at the limit takes less than this."""
QUICK = 50
"""`--quick` divides each shape's batches and limit by this."""
CHUNKS = 100
"""Timed stretches of a run: the quarters and the tenths are made of them."""


@attrs.frozen
class Shape:
    """A run: `epochs` epochs of `batches` batches each, traced with a limit of `limit`."""

    name: str
    epochs: int
    batches: int
    limit: int

    def quick(self) -> Shape:
        return Shape(
            self.name,
            max(1, self.epochs // QUICK) if self.epochs > 1 else 1,
            max(1, self.batches // QUICK) if self.batches > 1 else 1,
            max(1, self.limit // QUICK),
        )

    @property
    def total(self) -> int:
        return self.epochs * self.batches


SHAPES = {
    "long": Shape("long", epochs=1, batches=1_000_000, limit=DEFAULT_LIMIT),
    "epochs": Shape("epochs", epochs=20_000, batches=1, limit=DEFAULT_LIMIT),
    "epochs-small": Shape("epochs-small", epochs=20_000, batches=1, limit=2_000),
}


@attrs.frozen
class Kept:
    """What a tracer held at one moment."""

    batches: int
    waits: int
    marks: int
    bytes: int


@attrs.frozen
class LongRun:
    """One shape, run: the seconds of each of its `CHUNKS` stretches, what the tracer kept at
    each quarter's end, what it forgot, and the seconds `stats()` took."""

    shape: Shape
    chunks: tuple[float, ...]
    kept: tuple[Kept, ...]
    dropped: int
    stats_seconds: float
    """CPU seconds `stats()` took."""
    stats_wall: float
    """Seconds `stats()` took by the wall clock."""

    def per_batch_us(self, chunks: Sequence[float]) -> float:
        batches = self.shape.total * len(chunks) / len(self.chunks)
        return 1e6 * sum(chunks) / batches

    @property
    def quarters(self) -> tuple[float, ...]:
        """Microseconds a batch, per quarter of the run."""
        size = len(self.chunks) // 4
        return tuple(
            self.per_batch_us(self.chunks[size * part : size * (part + 1)]) for part in range(4)
        )

    @property
    def ratio(self) -> float:
        """The last tenth of the run's time over its first tenth's."""
        tenth = len(self.chunks) // 10
        return sum(self.chunks[-tenth:]) / sum(self.chunks[:tenth])

    def describe(self) -> str:
        shape = self.shape
        batches = f"{shape.batches:,} batch{'es' if shape.batches > 1 else ''}"
        run = (
            f"one epoch of {batches}"
            if shape.epochs == 1
            else f"{shape.epochs:,} epochs of {batches}"
        )
        lines = [f"{shape.name}: {run}, limit {shape.limit:,}"]
        for number, (us, kept) in enumerate(zip(self.quarters, self.kept, strict=True), 1):
            lines.append(
                f"  quarter {number}: {us:.1f} us a batch; kept {kept.batches:,} batches, "
                f"{kept.waits:,} waits, {kept.marks:,} marks, {kept.bytes / 1e6:.1f} MB"
            )
        tenth = shape.total // 10
        verdict = "met" if self.ratio <= GOAL_RATIO else "NOT met"
        lines.append(
            f"  last {tenth:,} batches / first {tenth:,}: {self.ratio:.2f} "
            f"(goal {GOAL_RATIO}: {verdict})"
        )
        verdict = "met" if self.stats_seconds < GOAL_STATS_SECONDS else "NOT met"
        lines.append(
            f"  forgot {self.dropped:,} batches; stats() took {self.stats_seconds:.2f} s of CPU "
            f"(goal under {GOAL_STATS_SECONDS:g} s: {verdict}), {self.stats_wall:.2f} s of wall"
        )
        return "\n".join(lines)


def kept_bytes(tracer: Tracer) -> int:
    """The bytes a tracer holds: its tables and marks, and every object in them, each counted
    once (`sys.getsizeof`; an int or float shared by several columns counts once)."""
    seen: dict[int, Any] = {}
    pending: list[Any] = [tracer.tasks.__dict__, tracer.marks]
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen[id(item)] = item
        if isinstance(item, dict):
            pending += item.keys()
            pending += item.values()
        elif isinstance(item, (list, tuple, set)):
            pending += item
        elif attrs.has(type(item)):
            pending += attrs.astuple(item, recurse=False)
    return sum(map(sys.getsizeof, seen.values()))


def traced_loader(dataset: Indices, limit: int) -> statecore.DataLoader[Any]:
    """An inline loader of `dataset` in batches of one, traced with a limit of `limit`."""
    loader = statecore.DataLoader(dataset, batch_size=1, trace=True)
    # A loader makes its tracer with its first iterator, with the default limit, unless it
    # has one already: this one, with the shape's limit.
    loader._tracer = Tracer(0, loader.in_order, False, "inline", limit=limit)
    return loader


def _batches(loader: statecore.DataLoader[Any], epochs: int) -> Iterator[None]:
    for _ in range(epochs):
        for _ in loader:
            yield None


def run(shape: Shape, clock: Callable[[], float] = time.process_time) -> LongRun:
    """Run `shape`, timing each of its `CHUNKS` stretches; count what the tracer keeps at
    each quarter's end, outside the time. The clock is this process's CPU time: on a shared
    machine, the time other programs take the CPU would swamp a ratio of wall times (on
    this project's 2-core machine, quarters of one run ranged from 36 to 88 us a batch)."""
    loader = traced_loader(Indices(shape.batches), shape.limit)
    tracer = loader._tracer
    assert tracer is not None
    chunk = max(1, shape.total // CHUNKS)
    ends = {chunk * (number + 1) - 1 for number in range(CHUNKS)}
    quarter_ends = {chunk * (CHUNKS // 4) * (part + 1) - 1 for part in range(4)}
    chunks = array("d")
    kept = []
    began = clock()
    for done, _ in enumerate(_batches(loader, shape.epochs)):
        if done in ends:
            now = clock()
            chunks.append(now - began)
            if done in quarter_ends:
                tasks = tracer.tasks
                kept.append(
                    Kept(tracer.kept, len(tasks.got), len(tracer.marks), kept_bytes(tracer))
                )
            began = clock()
    start, wall = clock(), time.perf_counter()
    stats = loader.stats()
    stats_seconds, stats_wall = clock() - start, time.perf_counter() - wall
    return LongRun(shape, tuple(chunks), tuple(kept), stats.dropped, stats_seconds, stats_wall)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m statecore.tools.trace_long_runs", description=__doc__.split("\n")[0]
    )
    parser.add_argument("shapes", nargs="*", metavar="SHAPE", help=", ".join(SHAPES))
    parser.add_argument("--quick", action="store_true", help="a fiftieth of each run")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shapes if name not in SHAPES]
    if unknown:
        parser.error(f"no shape {', '.join(unknown)}: choose among {', '.join(SHAPES)}")
    for name in args.shapes or SHAPES:
        shape = SHAPES[name].quick() if args.quick else SHAPES[name]
        print(run(shape).describe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
