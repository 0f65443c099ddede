"""Micro-benchmark: the cost of one `step` against torch-style mutable bookkeeping.

One trace of events (8 workers, prefetch 2, answers arriving in a shuffled order within the
prefetch window, a consumer taking batches in order) is recorded once, then replayed many times
through `statecore.step` and through `TorchStyleBookkeeping`. Both replays do the same
decisions for the same events; the figure is the median time per event over several rounds,
alternating the two so that drift on a shared machine hits both alike.

The goals (`MAX_RATIO`, `MAX_STEP_US`) are printed as met or missed, and by how much; a timing
taken on a shared machine does not fail `check`, whose exit status is the exploration's.
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

__all__ = ["MAX_RATIO", "MAX_STEP_US", "BenchResult", "Goal", "record_trace", "run_bench"]

MAX_RATIO = 3.0
"""The goal: one `step` costs at most this many times the torch-style bookkeeping's update."""
MAX_STEP_US = 5.0
"""The goal: one `step` costs less than this many microseconds."""


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

    @property
    def met(self) -> bool:
        return self.figure < self.limit if self.strict else self.figure <= self.limit

    def describe(self) -> str:
        bound = "<" if self.strict else "<="
        goal = f"goal: {self.name} {bound} {self.limit:g}{self.unit}"
        margin = abs(self.figure - self.limit)
        share = 100 * margin / self.limit
        if self.met:
            verdict = f"met with {margin:.2f}{self.unit} ({share:.0f}%) to spare"
        else:
            verdict = f"MISSED by {margin:.2f}{self.unit} ({share:.0f}% over)"
        return f"{goal:34} {verdict}: {self.figure:.2f}{self.unit}"


@attrs.frozen
class BenchResult:
    events: int
    rounds: int
    core_us: float
    """Median microseconds per event through `statecore.step`."""
    baseline_us: float
    """Median microseconds per event through the torch-style mutable bookkeeping."""

    @property
    def ratio(self) -> float:
        return self.core_us / self.baseline_us

    @property
    def goals(self) -> tuple[Goal, Goal]:
        """The cost relative to torch's way, and the absolute cost per event."""
        return (
            Goal("step / bookkeeping", self.ratio, MAX_RATIO, "x", strict=False),
            Goal("step per event", self.core_us, MAX_STEP_US, " us", strict=True),
        )

    def describe(self) -> str:
        met = sum(goal.met for goal in self.goals)
        return "\n".join(
            [
                f"step benchmark: 8 workers, prefetch 2, {self.events} events, "
                f"median of {self.rounds} rounds",
                f"  statecore.step          {self.core_us:6.2f} us/event",
                f"  torch-style bookkeeping {self.baseline_us:6.2f} us/event",
                f"  ratio                   {self.ratio:6.2f}x",
                *(f"  {goal.describe()}" for goal in self.goals),
                f"step goals met: {met} of {len(self.goals)} "
                "(timings: they do not change the exit status of check)",
            ]
        )


def record_trace(batches: int, workers: int = 8, prefetch: int = 2, seed: int = 0) -> list[Event]:
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


def _replay_core(events: list[Event]) -> float:
    state = initial_state(Config(num_workers=8, prefetch_factor=2))
    started = time.perf_counter()
    for event in events:
        state = step(state, event).state
    return time.perf_counter() - started


def _replay_baseline(events: list[Event], handed_over: list[object] | None = None) -> float:
    book = TorchStyleBookkeeping(8, 2, lambda worker, message: None)
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


def _deliveries(events: list[Event]) -> int:
    state = initial_state(Config(num_workers=8, prefetch_factor=2))
    count = 0
    for event in events:
        state, commands = step(state, event)
        count += sum(1 for command in commands if isinstance(command, Deliver))
    return count


def run_bench(batches: int = 5000, rounds: int = 15) -> BenchResult:
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
    return BenchResult(
        events=len(events),
        rounds=rounds,
        core_us=statistics.median(core) * per_event,
        baseline_us=statistics.median(base) * per_event,
    )
