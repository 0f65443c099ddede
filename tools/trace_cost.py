"""What tracing costs: a workload of `statecore bench` with `trace=True` and without, in turns.

    python -m statecore.tools.trace_cost [WORKLOAD ...] [--rounds N] [--batches N]

For each workload (default: inline-b1 and processes-b64), statecore's loader runs with tracing
off and on, alternately (off first in even rounds, on first in odd ones), and the command
prints both medians and the median of the per-round ratios, with its quartiles and a 95%
bootstrap interval: runs seconds apart see the same machine, so the ratio within a round is
the steadier figure on a shared machine, and the interval says how far its median can be
trusted (on a 2-core machine shared with other work, a round's ratio can stray by 10%
either way, and a 2-point difference needs some 60 rounds to show). docs/profiling.md quotes
its output.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence

import attrs

import statecore
from statecore.tools.loader_bench import pair_ratios
from statecore.tools.workloads import Measurement, Workload, measure, select

__all__ = ["TraceCost", "compare", "main", "median_interval"]

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

    def describe(self) -> str:
        ratios = sorted(self.ratios)
        quarter = len(ratios) // 4
        unit = self.workload.unit

        def median(runs: tuple[Measurement, ...]) -> float:
            return statistics.median(unit.figure(run.throughput) for run in runs)

        low, high = median_interval(ratios)
        return (
            f"{self.workload.name}: off {median(self.off):.1f} {unit.value}, "
            f"on {median(self.on):.1f} {unit.value}; traced time / untraced, per round: "
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m statecore.tools.trace_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("workloads", nargs="*", default=["inline-b1", "processes-b64"])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch")
    args = parser.parse_args(argv)
    for workload in select(args.workloads):
        if args.batches is not None:
            workload = workload.resized(args.batches)
        print(compare(workload, args.rounds).describe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
