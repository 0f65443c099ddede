"""Micro-benchmark: the cost of one `step` against torch-style mutable bookkeeping, and by workers.

One trace of events (8 workers, prefetch 2, answers arriving in a shuffled order within the
prefetch window, a consumer taking batches in order) is recorded once, then replayed many times
through `statecore.step` and through `TorchStyleBookkeeping`. Both replays do the same
decisions for the same events; the figure is the median time per event over several rounds,
alternating the two so that drift on a shared machine hits both alike.

The scale part records the same kind of trace for 2 to 256 workers (`SCALE_WORKERS`) and
replays each through `step`, taking the worker counts in turn within every round: the cost of
a step should not grow with the number of workers.

The goals (`MAX_RATIO`, `MAX_STEP_US`, `MAX_SPREAD`) are printed as met or missed, and by how
much; a timing taken on a shared machine does not fail `check`, whose exit status is the
exploration's.
"""

from __future__ import annotations

import random
import statistics
import time

import attrs

from statecore import (
    Config,
    Deliver,
    DrawIndex,
    Event,
    IndexDrawn,
    NextRequested,
    Phase,
    ResetRequested,
    SamplerExhausted,
    SendTask,
    TaskCompleted,
    initial_state,
    step,
)
from statecore.tools.torch_bookkeeping import TorchStyleBookkeeping

__all__ = [
    "MAX_RATIO",
    "MAX_SPREAD",
    "MAX_STEP_US",
    "SCALE_WORKERS",
    "BenchResult",
    "Goal",
    "ScalePoint",
    "record_trace",
    "run_bench",
    "run_scale",
]

MAX_RATIO = 3.0
"""The goal: one `step` costs at most this many times the torch-style bookkeeping's update."""
MAX_STEP_US = 5.0
"""The goal: one `step` costs less than this many microseconds."""
MAX_SPREAD = 2.0
"""The goal: over `SCALE_WORKERS`, the dearest step costs at most this many times the cheapest."""
SCALE_WORKERS = (2, 8, 32, 64, 256)
"""The worker counts of the scale part."""

PREFETCH = 2
WORKERS = 8


@attrs.frozen
class Goal:
    """One goal of the step benchmark, and the figure measured against it."""

    name: str
    figure: float
    limit: float
    unit: str
    """Printed after a number: "x" or " us"."""
    strict: bool
    """Met only below the limit, not at it."""
    bound: str = ""
    """The words between the name and the limit; "<" or "<=" (from `strict`) if empty."""

    @property
    def met(self) -> bool:
        return self.figure < self.limit if self.strict else self.figure <= self.limit

    def describe(self) -> str:
        bound = self.bound or ("<" if self.strict else "<=")
        goal = f"goal: {self.name} {bound} {self.limit:g}{self.unit}"
        margin = abs(self.figure - self.limit)
        share = 100 * margin / self.limit
        if self.met:
            verdict = f"met with {margin:.2f}{self.unit} ({share:.0f}%) to spare"
        else:
            verdict = f"MISSED by {margin:.2f}{self.unit} ({share:.0f}% over)"
        return f"{goal:54} {verdict}: {self.figure:.2f}{self.unit}"


@attrs.frozen
class ScalePoint:
    """The median cost of a step with `workers` workers, over a trace of `events` events."""

    workers: int
    events: int
    us: float


@attrs.frozen
class BenchResult:
    events: int
    rounds: int
    core_us: float
    """Median microseconds per event through `statecore.step`."""
    baseline_us: float
    """Median microseconds per event through the torch-style mutable bookkeeping."""
    scale: tuple[ScalePoint, ...] = ()
    """The scale part, one point per worker count; empty if it was not run."""
    scale_batches: int = 0
    scale_rounds: int = 0

    @property
    def ratio(self) -> float:
        return self.core_us / self.baseline_us

    @property
    def spread(self) -> float:
        """The dearest step of the scale part over the cheapest."""
        costs = [point.us for point in self.scale]
        return max(costs) / min(costs)

    @property
    def goals(self) -> tuple[Goal, ...]:
        """The cost relative to torch's way, the absolute cost, and (if run) how it scales."""
        goals = (
            Goal("step / bookkeeping", self.ratio, MAX_RATIO, "x", strict=False),
            Goal("step per event", self.core_us, MAX_STEP_US, " us", strict=True),
        )
        if not self.scale:
            return goals
        fewest, most = self.scale[0].workers, self.scale[-1].workers
        spread = Goal(
            f"per-event cost from {fewest} to {most} workers",
            self.spread,
            MAX_SPREAD,
            "x",
            strict=False,
            bound="within",
        )
        return (*goals, spread)

    def describe(self) -> str:
        met = sum(goal.met for goal in self.goals)
        lines = [
            f"step benchmark: {WORKERS} workers, prefetch {PREFETCH}, {self.events} events, "
            f"median of {self.rounds} rounds",
            f"  statecore.step          {self.core_us:6.2f} us/event",
            f"  torch-style bookkeeping {self.baseline_us:6.2f} us/event",
            f"  ratio                   {self.ratio:6.2f}x",
        ]
        if self.scale:
            lines.append(
                f"step by workers: prefetch {PREFETCH}, {self.scale_batches} batches each, "
                f"median of {self.scale_rounds} rounds"
            )
            lines += [
                f"  {point.workers:3} workers, {point.events:5} events {point.us:6.2f} us/event"
                for point in self.scale
            ]
            lines.append(f"  dearest / cheapest      {self.spread:6.2f}x")
        lines += [f"  {goal.describe()}" for goal in self.goals]
        lines.append(
            f"step goals met: {met} of {len(self.goals)} "
            "(timings: they do not change the exit status of check)"
        )
        return "\n".join(lines)


def record_trace(
    batches: int, workers: int = WORKERS, prefetch: int = PREFETCH, seed: int = 0
) -> list[Event]:
    """The events of one epoch, with answers arriving in a seeded random order."""
    rng = random.Random(seed)
    config = Config(num_workers=workers, prefetch_factor=prefetch)
    state = initial_state(config)
    events: list[Event] = []
    pending: list[SendTask] = []
    drawn = 0
    todo: list[Event] = [ResetRequested()]

    def feed(event: Event) -> list[object]:
        nonlocal state
        events.append(event)
        state, commands = step(state, event)
        return list(commands)

    while state.phase is not Phase.FINISHED:
        event = todo.pop() if todo else None
        if event is None:
            if not state.waiting:
                event = NextRequested()
            else:
                task = pending.pop(rng.randrange(min(len(pending), workers)))
                event = TaskCompleted(task.task, task.worker, task.index)
        for command in feed(event):
            if isinstance(command, DrawIndex):
                todo.append(IndexDrawn([drawn]) if drawn < batches else SamplerExhausted())
                drawn += 1
            elif isinstance(command, SendTask):
                pending.append(command)
    return events


def _replay_core(events: list[Event], workers: int = WORKERS) -> float:
    state = initial_state(Config(num_workers=workers, prefetch_factor=PREFETCH))
    started = time.perf_counter()
    for event in events:
        state = step(state, event).state
    return time.perf_counter() - started


def _replay_baseline(events: list[Event], handed_over: list[object] | None = None) -> float:
    book = TorchStyleBookkeeping(WORKERS, PREFETCH, lambda worker, message: None)
    kinds = [type(event) for event in events]
    started = time.perf_counter()
    for kind, event in zip(kinds, events, strict=True):
        if kind is TaskCompleted:
            result = book.data_arrived(event.task, event.payload)  # type: ignore[attr-defined]
        elif kind is NextRequested:
            result = book.next_requested()
        elif kind is IndexDrawn:
            book.index_drawn(event.index)  # type: ignore[attr-defined]
            continue
        else:
            book.start()
            continue
        if handed_over is not None and result is not None:
            handed_over.append(result[0])
    return time.perf_counter() - started


def _deliveries(events: list[Event], workers: int = WORKERS) -> int:
    state = initial_state(Config(num_workers=workers, prefetch_factor=PREFETCH))
    count = 0
    for event in events:
        state, commands = step(state, event)
        count += sum(1 for command in commands if isinstance(command, Deliver))
    return count


def run_scale(batches: int = 5000, rounds: int = 9) -> tuple[ScalePoint, ...]:
    """The median cost of a step for each of `SCALE_WORKERS`, taken in turn in every round."""
    traces = {workers: record_trace(batches, workers) for workers in SCALE_WORKERS}
    for workers, events in traces.items():
        if _deliveries(events, workers) != batches:
            raise RuntimeError(f"the {workers}-worker replay does not hand over every batch")
    seconds: dict[int, list[float]] = {workers: [] for workers in SCALE_WORKERS}
    for _ in range(rounds):
        for workers, events in traces.items():
            seconds[workers].append(_replay_core(events, workers))
    return tuple(
        ScalePoint(workers, len(events), statistics.median(seconds[workers]) * 1e6 / len(events))
        for workers, events in traces.items()
    )


def run_bench(
    batches: int = 5000, rounds: int = 15, scale_batches: int = 5000, scale_rounds: int = 9
) -> BenchResult:
    """Both parts; `scale_rounds=0` leaves the scale part out."""
    events = record_trace(batches)
    # Both replays must do the whole epoch's real work, or the figures compare nothing.
    baseline_batches: list[object] = []
    _replay_baseline(events, baseline_batches)
    if _deliveries(events) != batches or len(baseline_batches) != batches:
        raise RuntimeError("a benchmark replay does not hand over every batch")
    core: list[float] = []
    base: list[float] = []
    for _ in range(rounds):
        core.append(_replay_core(events))
        base.append(_replay_baseline(events))
    per_event = 1e6 / len(events)
    scale = run_scale(scale_batches, scale_rounds) if scale_rounds else ()
    return BenchResult(
        events=len(events),
        rounds=rounds,
        core_us=statistics.median(core) * per_event,
        baseline_us=statistics.median(base) * per_event,
        scale=scale,
        scale_batches=scale_batches if scale else 0,
        scale_rounds=scale_rounds if scale else 0,
    )
