"""Micro-benchmark: the cost of one `step` against torch-style mutable bookkeeping.

One trace of events (8 workers, prefetch 2, answers arriving in a shuffled order within the
prefetch window, a consumer taking batches in order) is recorded once, then replayed many times
through `statecore.step` and through `TorchStyleBookkeeping`. Both replays do the same
decisions for the same events; the figure is the median time per event over several rounds,
alternating the two so that drift on a shared machine hits both alike.
"""

from __future__ import annotations

import random
import statistics
import time

import attrs

from statecore import (
    Config,
    Deliver,
    Event,
    IndexDrawn,
    NextRequested,
    Phase,
    PullIndex,
    ResetRequested,
    SamplerExhausted,
    SendTask,
    TaskCompleted,
    initial_state,
    step,
)
from statecore.models.baseline import TorchStyleBookkeeping

__all__ = ["BenchResult", "record_trace", "run_bench"]


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

    def describe(self) -> str:
        return (
            f"step benchmark: 8 workers, prefetch 2, {self.events} events, "
            f"median of {self.rounds} rounds\n"
            f"  statecore.step          {self.core_us:6.2f} us/event\n"
            f"  torch-style bookkeeping {self.baseline_us:6.2f} us/event\n"
            f"  ratio                   {self.ratio:6.2f}x  (goal: <= 3x and < 5 us)"
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
            if isinstance(command, PullIndex):
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
