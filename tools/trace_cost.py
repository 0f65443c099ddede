"""What tracing costs: `bench` workloads with `trace=True` and without, in turns.

    python -m statecore.tools.trace_cost [--rounds N] [--quick]
    python -m statecore.tools.trace_cost WORKLOAD ... [--rounds N] [--batches N]

Without a workload named, it prints the three figures tracing is held to, each with its goal:

- the main process's CPU time per batch that `trace=True` adds, on processes-b64 (its
  samples cost nothing and its workers are other processes, so the main process's CPU is the
  loader's own): the median of the per-round differences, traced minus untraced, of
  `time.process_time` over the steady stretch, per batch (goal: at most 10 us);
- traced statecore against untraced torch on processes-b64, the same rounds: the median of
  the per-round ratios of torch's time per batch to traced statecore's (goal: at least 3x);
- the cost on io and on the two straggler workloads: traced time over untraced, less 1,
  per round (goal: under 1%).

With workloads named, it prints for each the traced and untraced figures and the median of
the per-round ratios of traced time to untraced.

Each round runs every loader once, in an order that rotates from round to round, and every
ratio or difference is taken within a round before its median: runs seconds apart see the same
machine, so that is the steadier figure on a shared machine. Each median comes with its
quartiles and a 95% bootstrap interval, which says how far it can be trusted (on a 2-core
machine shared with other work, a round's ratio can stray by 10% either way, and a 2-point
difference needs some 60 rounds to show). docs/profiling.md quotes its output.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch.utils.data

import statecore
from statecore.tools.loader_bench import pair_ratios, rotated
from statecore.tools.workloads import (
    Loader,
    Measurement,
    Timing,
    Workload,
    close,
    measure,
    release,
    select,
)

__all__ = [
    "CPU_GOAL_US",
    "EFFICIENCY_WORKLOADS",
    "OVERHEAD_WORKLOAD",
    "SPEEDUP_GOAL",
    "Goals",
    "SteadyRun",
    "TraceCost",
    "compare",
    "goals",
    "main",
    "median_interval",
    "steady_run",
]

CPU_GOAL_US = 10.0
"""The most main-process CPU per batch that tracing may add, in microseconds."""
SPEEDUP_GOAL = 3.0
"""How many times faster than untraced torch traced statecore is to stay on processes-b64."""
COST_GOAL = 0.01
"""The most tracing may cost on the efficiency workloads: a fraction of their time."""
OVERHEAD_WORKLOAD = "processes-b64"
EFFICIENCY_WORKLOADS = ("io", "stragglers-in-order", "stragglers-any-order")

RESAMPLES = 2000
"""Resamples of the rounds behind a median's bootstrap interval."""


def median_interval(
    values: Sequence[float], confidence: float = 0.95, resamples: int = RESAMPLES
) -> tuple[float, float]:
    """A percentile bootstrap interval for the median of `values`: the rounds are drawn again,
    with replacement, `resamples` times, and the interval holds the middle `confidence` of
    those medians. The draws are seeded, so the same rounds always give the same interval."""
    if not values:
        raise ValueError("no values to take a median of")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, not {confidence}")
    draw = random.Random(0).choices
    medians = sorted(statistics.median(draw(values, k=len(values))) for _ in range(resamples))
    cut = round(resamples * (1 - confidence) / 2)
    return medians[cut], medians[-1 - cut]


@attrs.frozen
class TraceCost:
    """A workload's runs with tracing off and on, round by round."""

    workload: Workload
    off: tuple[Measurement, ...]
    on: tuple[Measurement, ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """Per round, the traced run's time over the untraced one's (above 1: tracing costs):
        the inverse of the throughput ratio the bench reports (`pair_ratios`)."""
        return tuple(1.0 / ratio for ratio in pair_ratios(self.off, self.on))

    def describe_figures(self) -> str:
        """The untraced and traced runs' median figures."""
        unit = self.workload.unit

        def median(runs: tuple[Measurement, ...]) -> float:
            return statistics.median(unit.figure(run.throughput) for run in runs)

        return f"off {median(self.off):.1f} {unit.value}, on {median(self.on):.1f} {unit.value}"

    def describe(self) -> str:
        ratios = sorted(self.ratios)
        quarter = len(ratios) // 4
        low, high = median_interval(ratios)
        return (
            f"{self.workload.name}: {self.describe_figures()}; traced time / untraced, per round: "
            f"median {statistics.median(ratios):.3f} (95% interval {low:.3f} to {high:.3f}), "
            f"quartiles {ratios[quarter]:.3f} to {ratios[-1 - quarter]:.3f} "
            f"({len(ratios)} rounds)"
        )


def compare(workload: Workload, rounds: int) -> TraceCost:
    """`rounds` rounds of `workload` with statecore's loader, tracing off and on in turns."""
    off: list[Measurement] = []
    on: list[Measurement] = []
    for number in range(rounds):
        order = (False, True) if number % 2 == 0 else (True, False)
        for traced in order:
            run = measure(workload, statecore.DataLoader, {"trace": traced})
            (on if traced else off).append(run)
    return TraceCost(workload, tuple(off), tuple(on))


def _spread(values: Sequence[float], form: str) -> str:
    """A median, its 95% interval and its quartiles, each written with `form`."""
    ordered = sorted(values)
    quarter = len(ordered) // 4
    low, high = median_interval(ordered)
    return (
        f"{format(statistics.median(ordered), form)} (95% interval {format(low, form)} to "
        f"{format(high, form)}; quartiles {format(ordered[quarter], form)} to "
        f"{format(ordered[-1 - quarter], form)})"
    )


@attrs.frozen
class SteadyRun:
    """One run over a workload's steady stretch (`Timing.STEADY`): its wall time, and the CPU
    time of the whole main process (every thread of it) over the same stretch."""

    seconds: float
    cpu_seconds: float
    batches: int

    @property
    def us_per_batch(self) -> float:
        return 1e6 * self.seconds / self.batches

    @property
    def cpu_us_per_batch(self) -> float:
        return 1e6 * self.cpu_seconds / self.batches


def steady_run(
    workload: Workload, loader_class: type[Loader], options: dict[str, Any] | None = None
) -> SteadyRun:
    """One run of `workload`, timed as `workloads.measure` times its steady state (from the
    first batch to the last), with the main process's CPU time over the same stretch."""
    if workload.timing is not Timing.STEADY:
        raise ValueError(f"{workload.name} is not timed in its steady state")
    arguments = workload.loader_arguments()
    if loader_class is not torch.utils.data.DataLoader:
        arguments.update(workload.ours)
    arguments.update(options or {})
    loader = loader_class(workload.dataset_for_run(), **arguments)
    try:
        iterator = iter(loader)
        try:
            next(iterator)
            count = len(loader) - 1
            gc.collect()
            cpu, started = time.process_time(), time.perf_counter()
            for _ in itertools.islice(iterator, count):
                pass
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        finally:
            close(iterator)
    finally:
        release(loader)
    return SteadyRun(seconds, cpu, count)


_SIDES: dict[str, tuple[type[Loader], dict[str, Any]]] = {
    "torch": (torch.utils.data.DataLoader, {}),
    "off": (statecore.DataLoader, {"trace": False}),
    "on": (statecore.DataLoader, {"trace": True}),
}


@attrs.frozen
class Goals:
    """The rounds behind the three figures tracing is held to."""

    overhead: Workload
    steady: dict[str, tuple[SteadyRun, ...]]
    """processes-b64's runs: torch untraced, statecore untraced ("off") and traced ("on")."""
    costs: tuple[TraceCost, ...]
    """The efficiency workloads, traced and not."""

    @property
    def added_cpu_us(self) -> tuple[float, ...]:
        """Per round, the main-process CPU per batch that tracing added, in microseconds."""
        return tuple(
            on.cpu_us_per_batch - off.cpu_us_per_batch
            for off, on in zip(self.steady["off"], self.steady["on"], strict=True)
        )

    @property
    def speedups(self) -> tuple[float, ...]:
        """Per round, untraced torch's time per batch over traced statecore's."""
        return tuple(
            theirs.seconds / theirs.batches / (ours.seconds / ours.batches)
            for theirs, ours in zip(self.steady["torch"], self.steady["on"], strict=True)
        )

    def describe(self) -> str:
        def median(side: str, figure: str) -> float:
            return float(statistics.median(getattr(run, figure) for run in self.steady[side]))

        name = self.overhead.name
        added = statistics.median(self.added_cpu_us)
        speedup = statistics.median(self.speedups)
        lines = [
            f"main-process CPU per batch, {name}: untraced {median('off', 'cpu_us_per_batch'):.1f}"
            f" us, traced {median('on', 'cpu_us_per_batch'):.1f} us; added by trace=True, per "
            f"round: {_spread(self.added_cpu_us, '.1f')} us; goal at most {CPU_GOAL_US:.0f} us: "
            + ("met" if added <= CPU_GOAL_US else "NOT met"),
            f"{name}: torch untraced {median('torch', 'us_per_batch'):.0f} us/batch, statecore "
            f"untraced {median('off', 'us_per_batch'):.0f}, traced "
            f"{median('on', 'us_per_batch'):.0f}; torch's time over traced statecore's, per "
            f"round: {_spread(self.speedups, '.2f')}x; goal at least {SPEEDUP_GOAL:.0f}x: "
            + ("met" if speedup >= SPEEDUP_GOAL else "NOT met"),
        ]
        for cost in self.costs:
            extra = [100.0 * (ratio - 1.0) for ratio in cost.ratios]
            met = statistics.median(extra) < 100.0 * COST_GOAL
            lines.append(
                f"{cost.workload.name}: {cost.describe_figures()}; cost of trace=True, traced "
                f"time over untraced less 1, per round: {_spread(extra, '+.2f')}%; goal under "
                f"{100.0 * COST_GOAL:.0f}%: " + ("met" if met else "NOT met")
            )
        lines.append(f"({len(self.speedups)} rounds, runs taking turns in each)")
        return "\n".join(lines)


def goals(rounds: int, quick: bool = False, batches: int | None = None) -> Goals:
    """`rounds` rounds of processes-b64 (torch, statecore untraced and traced, taking turns)
    and of each efficiency workload (statecore untraced and traced)."""

    def sized(workload: Workload) -> Workload:
        workload = workload.quick() if quick else workload
        return workload if batches is None else workload.resized(batches)

    overhead = sized(select([OVERHEAD_WORKLOAD])[0])
    steady: dict[str, list[SteadyRun]] = {side: [] for side in _SIDES}
    for side in _SIDES:  # one small untimed run each: imports and first-time set-up
        loader_class, options = _SIDES[side]
        steady_run(overhead.resized(4), loader_class, options)
    for number in range(rounds):
        for side in rotated(number, tuple(_SIDES)):
            loader_class, options = _SIDES[side]
            steady[side].append(steady_run(overhead, loader_class, options))
    costs = tuple(compare(sized(workload), rounds) for workload in select(EFFICIENCY_WORKLOADS))
    return Goals(overhead, {side: tuple(runs) for side, runs in steady.items()}, costs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m statecore.tools.trace_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "workloads", nargs="*", help="workloads to compare, traced and not (default: the goals)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="default 41; 21 for the goals")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch")
    parser.add_argument("--quick", action="store_true", help="the workloads' smaller epochs")
    args = parser.parse_args(argv)
    if not args.workloads:
        print(goals(args.rounds or 21, args.quick, args.batches).describe(), flush=True)
        return 0
    for workload in select(args.workloads):
        workload = workload.quick() if args.quick else workload
        if args.batches is not None:
            workload = workload.resized(args.batches)
        print(compare(workload, args.rounds or 41).describe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
