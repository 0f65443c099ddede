"""`python -m statecore bench`: torch's DataLoader and statecore's, side by side.

Each workload (see `statecore.tools.workloads`) is run in rounds: one run of each loader,
built from the same arguments, taking turns. The loaders are torch's, statecore's as a user
who swaps the import gets it (its default executor), and, where the workload has workers,
statecore with `executor="thread"`. The order rotates from round to round, so that whatever
drifts on a busy machine (other processes, frequency scaling, a warming cache) falls on all
alike, and none always gets the machine right after another has warmed or cooled it.

For each workload the report gives each loader's median figure and its range over the runs,
and the median of the per-round ratios: statecore's throughput over torch's in the same
round, so above 1 means statecore was faster. Taking the ratio within a round before the
median is what cancels the drift: runs seconds apart see the same machine. Some workloads
also measure each loader's peak memory, once, in a fresh interpreter (`tools.memory`).

docs/performance.md explains each workload and shows the latest table."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

import attrs
import torch

from statecore.executors import _registry as registry
from statecore.tools.memory import Peak
from statecore.tools.progress import Bar
from statecore.tools.workloads import (
    WARMUP_BATCHES,
    Losses,
    Measurement,
    Side,
    Timing,
    Unit,
    Workload,
    measure,
    select,
)

__all__ = [
    "INSTALL_HINT",
    "QUICK_ROUNDS",
    "ROUNDS",
    "BenchReport",
    "Machine",
    "MissingDependency",
    "Side",
    "WorkloadResult",
    "bench",
    "memcpy_bandwidth",
    "measure_floor",
    "measure_handover",
    "measure_memory",
    "measure_side",
    "missing_dependencies",
    "rotated",
    "round_order",
    "pair_ratios",
    "plot",
    "read_json",
    "run_benchmark",
    "write_json",
]

_Taking = TypeVar("_Taking")
"""What takes turns in a round: a loader (`Side`), or a worker count in the sweep."""

ROUNDS = 5
"""Rounds per workload by default: one run of each loader in each."""
QUICK_ROUNDS = 3
"""Rounds per workload under `--quick`."""
_ALWAYS = (Side.TORCH, Side.STATECORE)
"""The loaders every workload runs; the others only where they have runs."""
# statecore is installed from its checkout (README, "Run it"), not from an index: a bare
# `pip install 'statecore[bench]'` would look for it on PyPI.
INSTALL_HINT = "pip install -e '.[bench]' in the statecore checkout"


def rotated(number: int, items: Sequence[_Taking]) -> tuple[_Taking, ...]:
    """`items` rotated by `number` places: in round `number` (from 0), each goes first, and
    after each other, equally often over `len(items)` rounds."""
    shift = number % len(items)
    return (*items[shift:], *items[:shift])


def round_order(
    number: int, sides: Sequence[Side] = (Side.TORCH, Side.STATECORE)
) -> tuple[Side, ...]:
    """The order the loaders run in, in round number `number` (from 0): `sides` rotated by
    one place a round (`rotated`, which the sweep's worker counts take turns by too).

    With two sides, torch goes first in even rounds and statecore in odd ones.
    """
    return rotated(number, sides)


def pair_ratios(
    torch_runs: Sequence[Measurement], statecore_runs: Sequence[Measurement]
) -> tuple[float, ...]:
    """Per round, statecore's throughput over torch's: above 1 when statecore was faster.

    For a time (us per batch, ms to the first batch) the throughput is its inverse, so the
    ratio is torch's time over statecore's.
    """
    if len(torch_runs) != len(statecore_runs):
        raise ValueError(f"{len(torch_runs)} torch runs but {len(statecore_runs)} statecore runs")
    return tuple(
        ours.throughput / theirs.throughput
        for theirs, ours in zip(torch_runs, statecore_runs, strict=True)
    )


# --- results ------------------------------------------------------------------------------------


def _measurement_json(run: Measurement) -> dict[str, Any]:
    return {
        "seconds": run.seconds,
        "work": run.work,
        "arrivals": list(run.arrivals),
        "losses": None if run.losses is None else run.losses.to_json(),
    }


def _measurement(data: Mapping[str, Any]) -> Measurement:
    losses = data.get("losses")
    return Measurement(
        float(data["seconds"]),
        float(data["work"]),
        tuple(float(t) for t in data["arrivals"]),
        None if losses is None else Losses.from_json(losses),
    )


@attrs.frozen
class WorkloadResult:
    """Every run of every loader on one workload, and the figures drawn from them."""

    name: str
    summary: str
    unit: Unit
    timing: Timing
    batches: int
    batch_size: int
    num_workers: int
    torch: tuple[Measurement, ...]
    statecore: tuple[Measurement, ...]
    first: tuple[Side, ...]
    """Which loader ran first, round by round."""
    error: str | None = None
    """What a run raised, if one did: the rounds before it are kept, the figures are not shown."""
    threads: tuple[Measurement, ...] = ()
    """statecore's runs with `executor="thread"`; none for a workload without workers."""
    memory: tuple[Peak, ...] = ()
    """Each loader's peak memory, for the workloads that measure it."""
    memory_error: str | None = None
    """Why the memory could not be measured, if it could not: the timings still stand."""
    ray: tuple[Measurement, ...] = ()
    """statecore's runs with `executor="ray"`, when asked for (`bench --ray`)."""
    auto: tuple[Measurement, ...] = ()
    """statecore's runs with `num_workers="auto"`, when asked for (`bench --auto`)."""
    floor: tuple[Measurement, ...] = ()
    """The floor's runs, one a round, for a workload that times it (`Workload.floor`)."""
    handover: tuple[Measurement, ...] = ()
    """The runs of the floor with a hand-over (`tools.floor.handover_floor`), one a round,
    where the floor is timed."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.first)

    @property
    def sides(self) -> tuple[Side, ...]:
        """The loaders that ran: threads only on workloads with workers, Ray if asked for."""
        return tuple(side for side in Side if side in _ALWAYS or self.runs(side))

    def runs(self, side: Side) -> tuple[Measurement, ...]:
        return {
            Side.TORCH: self.torch,
            Side.STATECORE: self.statecore,
            Side.THREADS: self.threads,
            Side.RAY: self.ray,
            Side.AUTO: self.auto,
        }[side]

    def figures(self, side: Side) -> tuple[float, ...]:
        """The reported figure of each run, in the workload's unit."""
        return tuple(self.unit.figure(run.throughput) for run in self.runs(side))

    def median(self, side: Side) -> float:
        return statistics.median(self.figures(side))

    def low(self, side: Side) -> float:
        return min(self.figures(side))

    def high(self, side: Side) -> float:
        return max(self.figures(side))

    def ratios_of(self, side: Side) -> tuple[float, ...]:
        """Per round, `side`'s throughput over torch's."""
        return pair_ratios(self.torch, self.runs(side))

    def ratio_of(self, side: Side) -> float:
        """The median of `side`'s per-round ratios against torch."""
        return statistics.median(self.ratios_of(side))

    def floor_shares(self, side: Side) -> tuple[float, ...]:
        """Per round, `side`'s throughput over the floor's (`tools.floor`); none without it."""
        return pair_ratios(self.floor, self.runs(side)) if self.floor else ()

    def handover_shares(self, side: Side | None = None) -> tuple[float, ...]:
        """Per round, `side`'s throughput over the floor with a hand-over's; with no side, the
        floor with a hand-over's over the floor's. None where it was not timed."""
        if not self.handover:
            return ()
        if side is None:
            return pair_ratios(self.floor, self.handover)
        return pair_ratios(self.handover, self.runs(side))

    @property
    def ratios(self) -> tuple[float, ...]:
        """Per round, statecore's (default executor) throughput over torch's."""
        return self.ratios_of(Side.STATECORE)

    @property
    def ratio(self) -> float:
        """The median of the per-round ratios of statecore's default over torch."""
        return statistics.median(self.ratios)

    def peak(self, side: Side) -> Peak | None:
        return next((peak for peak in self.memory if peak.side is side), None)

    def median_run(self, side: Side) -> Measurement:
        """The run of `side` whose figure is the median (the lower middle one, for an even
        number of runs), so that what is said of it adds up with that figure."""
        runs = self.runs(side)
        return sorted(runs, key=lambda run: run.throughput)[(len(runs) - 1) // 2]

    def to_json(self) -> dict[str, Any]:
        def side(which: Side) -> dict[str, Any]:
            ran = bool(self.first) and bool(self.runs(which))
            peak = self.peak(which)
            return {
                "median": self.median(which) if ran else None,
                "min": self.low(which) if ran else None,
                "max": self.high(which) if ran else None,
                "ratio": self.ratio_of(which) if ran else None,
                "ratios": list(self.ratios_of(which)) if ran else [],
                "figures": list(self.figures(which)),
                "runs": [_measurement_json(run) for run in self.runs(which)],
                "memory": None if peak is None else peak.to_json(),
            }

        return {
            "name": self.name,
            "summary": self.summary,
            "unit": self.unit.value,
            "timing": self.timing.value,
            "batches": self.batches,
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "ratio": self.ratio if self.first else None,
            "ratios": list(self.ratios),
            "first": [which.value for which in self.first],
            "error": self.error,
            "memory_error": self.memory_error,
            **(
                {"floor": {"runs": [_measurement_json(run) for run in self.floor]}}
                if self.floor
                else {}
            ),
            **(
                {"handover": {"runs": [_measurement_json(run) for run in self.handover]}}
                if self.handover
                else {}
            ),
            # Ray's and auto's figures only where they ran: a report without them reads as it
            # always did.
            **{
                which.value: side(which)
                for which in Side
                if which in _ALWAYS + (Side.THREADS,) or self.runs(which)
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkloadResult:
        """The result `to_json` wrote; the derived figures are computed again from the runs."""

        def runs(which: Side) -> tuple[Measurement, ...]:
            return tuple(_measurement(run) for run in data.get(which.value, {}).get("runs", []))

        memory = tuple(
            Peak.from_json(data[which.value]["memory"])
            for which in Side
            if (data.get(which.value) or {}).get("memory") is not None
        )
        return cls(
            name=data["name"],
            summary=data["summary"],
            unit=Unit(data["unit"]),
            timing=Timing(data["timing"]),
            batches=int(data["batches"]),
            batch_size=int(data["batch_size"]),
            num_workers=int(data["num_workers"]),
            torch=runs(Side.TORCH),
            statecore=runs(Side.STATECORE),
            first=tuple(Side(which) for which in data["first"]),
            error=data.get("error"),
            threads=runs(Side.THREADS),
            memory=memory,
            memory_error=data.get("memory_error"),
            ray=runs(Side.RAY),
            auto=runs(Side.AUTO),
            floor=tuple(_measurement(run) for run in data.get("floor", {}).get("runs", [])),
            handover=tuple(_measurement(run) for run in data.get("handover", {}).get("runs", [])),
        )


def _shares(shares: Sequence[float]) -> str:
    """Per-round shares as the median percentage, with the lowest and highest."""
    return (
        f"{100.0 * statistics.median(shares):.0f}% "
        f"({100.0 * min(shares):.0f}-{100.0 * max(shares):.0f})"
    )


def memcpy_bandwidth(megabytes: int = 20, repeats: int = 15) -> float:
    """This machine's copy bandwidth in GB/s: torch copying a tensor of `megabytes` MB into
    another, with its intra-op threads (the median of `repeats` copies, after one to fault the
    pages in).

    What collating a large batch does with every byte: each is read from a sample and written
    into the batch once. Counted as bytes copied per second (not read plus written).
    """
    source = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return source.nbytes / statistics.median(times) / 1e9


@attrs.frozen
class Machine:
    """Where the figures were taken."""

    cpus: int
    platform: str
    python: str
    torch: str
    statecore: str
    memcpy_gb_per_s: float = 0.0
    """`memcpy_bandwidth()`, measured when the benchmark ran; 0 if not measured."""

    @classmethod
    def here(cls, memcpy: bool = False) -> Machine:
        try:
            ours = importlib.metadata.version("statecore")
        except importlib.metadata.PackageNotFoundError:
            ours = "unknown"
        return cls(
            cpus=os.cpu_count() or 1,
            platform=platform.platform(),
            python=platform.python_version(),
            torch=torch.__version__,
            statecore=ours,
            memcpy_gb_per_s=memcpy_bandwidth() if memcpy else 0.0,
        )

    def describe(self) -> str:
        copies = (
            f"; memcpy {self.memcpy_gb_per_s:.2f} GB/s (torch copy_ of 20 MB)"
            if self.memcpy_gb_per_s
            else ""
        )
        return (
            f"{self.cpus} CPUs, {self.platform}, Python {self.python}, torch {self.torch}, "
            f"statecore {self.statecore}{copies}"
        )


def _number(value: float) -> str:
    """Three significant figures or so, without an exponent."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.0f}"


@attrs.frozen
class BenchReport:
    """Every workload's result, and where and how they were taken."""

    results: tuple[WorkloadResult, ...]
    machine: Machine
    seconds: float
    """Wall time of the whole benchmark, warm-ups and worker shutdowns included."""
    command: str = ""

    def table(self) -> str:
        """The report as the command prints it."""
        with_ray = any(result.ray for result in self.results)
        with_auto = any(result.auto for result in self.results)
        header = (
            f"{'workload':20} {'unit':8} {'torch median (min-max)':>23} "
            f"{'statecore (min-max)':>21} {'ratio':>6} "
            f"{'threads (min-max)':>21} {'ratio':>6} {'rounds':>6}"
        )
        if with_ray:
            header += f" {'ray (min-max)':>21} {'ratio':>6}"
        if with_auto:
            header += f" {'auto (min-max)':>21} {'ratio':>6}"
        lines = [header]
        for result in self.results:
            if not result.ok:
                lines.append(f"{result.name:20} {result.unit.value:8} FAILED: {result.error}")
                continue
            cells = {}
            for side in Side:
                if not result.runs(side):
                    cells[side] = "-"
                    continue
                spread = f"({_number(result.low(side))}-{_number(result.high(side))})"
                cells[side] = f"{_number(result.median(side))} {spread}"
            threads_ratio = f"{result.ratio_of(Side.THREADS):5.2f}x" if result.threads else "-"
            row = (
                f"{result.name:20} {result.unit.value:8} {cells[Side.TORCH]:>23} "
                f"{cells[Side.STATECORE]:>21} {result.ratio:5.2f}x "
                f"{cells[Side.THREADS]:>21} {threads_ratio:>6} {len(result.ratios):6d}"
            )
            if with_ray:
                ray_ratio = f"{result.ratio_of(Side.RAY):5.2f}x" if result.ray else "-"
                row += f" {cells[Side.RAY]:>21} {ray_ratio:>6}"
            if with_auto:
                auto_ratio = f"{result.ratio_of(Side.AUTO):5.2f}x" if result.auto else "-"
                row += f" {cells[Side.AUTO]:>21} {auto_ratio:>6}"
            lines.append(row)
        cost = self.state_cost()
        if cost is not None:
            lines.append(
                f"worker state for checkpoints: statecore's median us/batch on processes-stateful "
                f"is {cost:+.1f}% of processes-iterable's (goal: within 5%)"
            )
        cost = self.seeding_cost()
        if cost is not None:
            lines.append(
                f"seeding per batch: statecore's median us/batch on processes-b64-per-batch "
                f"is {cost:+.1f}% of processes-b64's"
            )
        lines += self.floor_lines()
        lines += self.memory_table()
        lines += self.footprint_table()
        lines += self.losses_table()
        lines += [
            "ratio: median over rounds of statecore throughput / torch throughput "
            '(above 1: statecore faster); threads: statecore with executor="thread"'
            + ('; ray: statecore with executor="ray" (a local Ray instance)' if with_ray else "")
            + ('; auto: statecore with num_workers="auto"' if with_auto else ""),
            "% ideal: (measured work of every sample / workers) / elapsed; "
            "us/batch and ms: lower is better",
            f"machine: {self.machine.describe()}; {self.seconds:.0f} s in all",
        ]
        return "\n".join(lines)

    def floor_lines(self) -> list[str]:
        """For each workload that timed its floor: the floor, and the threads' (and the default
        executor's) figure as a share of it, the median of the per-round shares; then the floor
        with a hand-over, its share of the floor, and the threads' share of it."""
        lines = []
        for result in self.results:
            if not (result.ok and result.floor):
                continue
            floors = [result.unit.figure(run.throughput) for run in result.floor]
            shares = ", ".join(
                f"{side.value} {_shares(result.floor_shares(side))}"
                for side in (Side.THREADS, Side.STATECORE)
                if result.runs(side)
            )
            lines.append(
                f"{result.name}: floor (its batches made by {result.num_workers} threads with no "
                f"loader) {_number(statistics.median(floors))} {result.unit.value} "
                f"({_number(min(floors))}-{_number(max(floors))}); share of it, median of "
                f"rounds (min-max): {shares}; goal for threads: at least 90%"
            )
            if not result.handover:
                continue
            handed = [result.unit.figure(run.throughput) for run in result.handover]
            lines.append(
                f"{result.name}: floor with a hand-over (the same threads, given batches in "
                "turns as torch's workers are, hand each to the main thread in order, through "
                "queues and a pool of batch tensors; no loader) "
                f"{_number(statistics.median(handed))} {result.unit.value} "
                f"({_number(min(handed))}-{_number(max(handed))}), "
                f"{_shares(result.handover_shares())} of the floor; threads "
                f"{_shares(result.handover_shares(Side.THREADS))} of it"
            )
        return lines

    def losses_table(self) -> list[str]:
        """Where the workers' time went, for each loader's median run of each workload whose
        samples wait: work (the efficiency) and the four `Losses`, in % of workers x elapsed."""
        rows = []
        for result in self.results:
            if not result.ok:
                continue
            for side in result.sides:
                run = result.median_run(side)
                if run.losses is None:
                    continue
                lost = run.losses
                shares = (1.0 - lost.total, lost.starting, lost.in_batch, lost.between, lost.ending)
                cells = " ".join(f"{100.0 * share:>9.1f}" for share in shares)
                rows.append(f"{result.name:20} {side.value:9} {cells}")
        if not rows:
            return []
        header = (
            f"{'workload':20} {'loader':9} {'work':>9} {'starting':>9} {'in batch':>9} "
            f"{'between':>9} {'ending':>9}"
        )
        return [
            "where the workers' time went, % of workers x elapsed (each loader's median run):",
            header,
            *rows,
        ]

    def memory_table(self) -> list[str]:
        """Peak memory, MB: what each loader's run added to its process tree at its peak,
        and in brackets the tree's whole PSS then."""
        measured = [result for result in self.results if result.memory or result.memory_error]
        if not measured:
            return []
        with_auto = any(result.auto for result in self.results)
        lines = [
            "peak memory, MB of PSS (main process + workers) added by one run "
            "(whole tree at its peak)",
            f"{'workload':20} {'torch':>16} {'statecore':>16} {'threads':>16}"
            + (f" {'auto':>16}" if with_auto else ""),
        ]
        for result in measured:
            if result.memory_error is not None:
                lines.append(f"{result.name:20} FAILED: {result.memory_error}")
                continue
            cells = []
            for side in (Side.TORCH, Side.STATECORE, Side.THREADS, Side.AUTO):
                peak = result.peak(side)
                cells.append(
                    "-" if peak is None else f"{_megabytes(peak.added)} ({_megabytes(peak.peak)})"
                )
            row = f"{result.name:20} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}"
            lines.append(row + (f" {cells[3]:>16}" if with_auto else ""))
        return lines

    def footprint_table(self) -> list[str]:
        """Each loader's tree at its peak as a multiple of one process: the loading process
        with its dataset made, before the run (the memory table's baseline), in MB after it.

        Workers that share the main process's pages keep this near 1; workers that copy what
        they read (pytorch#13246, the copy-on-read workloads) push it towards 1 + workers.
        """
        measured = [result for result in self.results if result.memory]
        if not measured:
            return []
        sides = (Side.TORCH, Side.STATECORE, Side.THREADS, Side.AUTO)
        shown = [side for side in sides if any(result.peak(side) for result in measured)]
        lines = [
            "peak of the tree / one process (the loading process with its dataset, MB)",
            f"{'workload':20}" + "".join(f" {side.value:>16}" for side in shown),
        ]
        for result in measured:
            cells = []
            for side in shown:
                peak = result.peak(side)
                cells.append(
                    "-"
                    if peak is None or peak.before <= 0
                    else f"{peak.peak / peak.before:.2f}x of {_megabytes(peak.before)}"
                )
            lines.append(f"{result.name:20}" + "".join(f" {cell:>16}" for cell in cells))
        return lines

    def state_cost(self) -> float | None:
        """What sending a stateful iterable dataset's state with every batch costs statecore,
        in percent of a batch's time, if both iterable workloads ran.

        The same stream, with and without `state_dict`, one workload after the other: the
        medians of statecore's runs, whose spread is a few percent where torch's is tens.
        """
        ran = {result.name: result for result in self.results if result.ok}
        plain, stateful = ran.get("processes-iterable"), ran.get("processes-stateful")
        if plain is None or stateful is None:
            return None
        side = Side.STATECORE
        return 100.0 * (stateful.median(side) / plain.median(side) - 1.0)

    def seeding_cost(self) -> float | None:
        """What seeding every batch (`seeding="per-batch"`) costs statecore, in percent of a
        batch's time, if both workloads ran: the same batches, seeded per worker and per batch,
        one workload after the other (the medians of statecore's runs)."""
        ran = {result.name: result for result in self.results if result.ok}
        plain, seeded = ran.get("processes-b64"), ran.get("processes-b64-per-batch")
        if plain is None or seeded is None:
            return None
        side = Side.STATECORE
        return 100.0 * (seeded.median(side) / plain.median(side) - 1.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "seconds": self.seconds,
            "machine": attrs.asdict(self.machine),
            "workloads": [result.to_json() for result in self.results],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchReport:
        return cls(
            results=tuple(WorkloadResult.from_json(item) for item in data["workloads"]),
            machine=Machine(**data["machine"]),
            seconds=float(data["seconds"]),
            command=str(data["command"]),
        )


def write_json(report: BenchReport, path: str | os.PathLike[str]) -> None:
    """Every figure of `report`, the raw time and work of every run included."""
    Path(path).write_text(json.dumps(report.to_json(), indent=1) + "\n")


def read_json(path: str | os.PathLike[str]) -> BenchReport:
    """The report `write_json` wrote."""
    return BenchReport.from_json(json.loads(Path(path).read_text()))


# --- running ------------------------------------------------------------------------------------

Measure = Callable[[Workload, Side], Measurement]
MeasurePeak = Callable[[Workload, Side], Peak]
MeasureFloor = Callable[[Workload], Measurement]


def measure_floor(workload: Workload) -> Measurement:
    """One run of `workload`'s floor (see `tools.floor`)."""
    from statecore.tools.floor import threads_floor

    return threads_floor(workload)


def measure_handover(workload: Workload) -> Measurement:
    """One run of `workload`'s floor with a hand-over (see `tools.floor`)."""
    from statecore.tools.floor import handover_floor

    return handover_floor(workload)


def measure_side(workload: Workload, side: Side) -> Measurement:
    """One timed run of `side`'s loader on `workload` (see `workloads.measure`)."""
    return measure(workload, side.loader_class(), side.options())


def measure_memory(workload: Workload, side: Side) -> Peak:
    """`side`'s peak memory on `workload`, in a fresh interpreter (see `tools.memory`)."""
    from statecore.tools.memory import measure_peak

    return measure_peak(workload, side)


def _live_workers() -> int:
    """Worker processes still alive, of either library (both reap the finished ones here)."""
    import multiprocessing

    import multiprocess

    return len(multiprocessing.active_children()) + len(multiprocess.active_children())


def _outlived(seconds: float = 2.0) -> int:
    deadline = time.monotonic() + seconds
    while (count := _live_workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def _failure(what: str, failure: BaseException) -> str:
    """What failed: `what` (a loader, or a floor) raised `failure`."""
    message = str(failure).strip().splitlines()
    return f"{what} raised {type(failure).__name__}: {message[0] if message else ''}"


def _run_rounds(
    workload: Workload,
    rounds: int,
    measure: Measure,
    peak: MeasurePeak | None,
    say: Callable[[str], None],
    ran: Callable[[], None] = lambda: None,
    floor: MeasureFloor = measure_floor,
    handover: MeasureFloor = measure_handover,
) -> WorkloadResult:
    """The warm-up and `rounds` rounds of one workload, then its memory if it measures it;
    a run that raises ends the workload. `ran` hears of each run as it ends. A workload that
    times its floor (`Workload.floor`) runs it and the floor with a hand-over once a round too,
    on either side of the threads' run (`_with_floors`), and in the warm-up."""
    sides = workload.sides
    runs: dict[Side, list[Measurement]] = {side: [] for side in Side}
    references: dict[str, list[Measurement]] = {_FLOOR: [], _HANDOVER: []}
    measure_reference = {_FLOOR: floor, _HANDOVER: handover}
    first: list[Side] = []
    error = None
    side = Side.TORCH
    running = side.value  # what a failure is reported of
    try:
        if workload.warmup:
            small = attrs.evolve(
                workload,
                batches=min(workload.batches, WARMUP_BATCHES),
                num_workers=min(workload.num_workers, 1),
            )
            for step in _with_floors(0, sides, workload.floor):
                running = step.value if isinstance(step, Side) else step
                if isinstance(step, Side):
                    measure(small, step)
                else:
                    measure_reference[step](small)
                ran()
        for number in range(rounds):
            order = round_order(number, sides)
            for step in _with_floors(number, order, workload.floor):
                running = step.value if isinstance(step, Side) else step
                if not isinstance(step, Side):
                    references[step].append(measure_reference[step](workload))
                    ran()
                    continue
                side = step
                runs[side].append(measure(workload, side))
                ran()
                if stray := _outlived():
                    say(f"warning: {stray} worker process(es) outlived a {side.value} run")
            first.append(order[0])
    except Exception as failure:  # reported in the table; the other workloads still run
        error = _failure(running, failure)
    memory: list[Peak] = []
    memory_error = None
    if peak is not None and workload.memory and error is None:
        try:
            for side in _peaked(sides):
                memory.append(peak(workload, side))
                ran()
        except Exception as failure:  # the timings stand; the memory row says what failed
            memory, memory_error = [], _failure(side.value, failure)
    complete = len(first)  # only whole rounds are kept: a ratio needs every side's run
    return WorkloadResult(
        name=workload.name,
        summary=workload.summary,
        unit=workload.unit,
        timing=workload.timing,
        batches=workload.batches,
        batch_size=workload.batch_size,
        num_workers=workload.num_workers,
        torch=tuple(runs[Side.TORCH][:complete]),
        statecore=tuple(runs[Side.STATECORE][:complete]),
        first=tuple(first),
        error=error,
        threads=tuple(runs[Side.THREADS][:complete]),
        memory=tuple(memory),
        memory_error=memory_error,
        ray=tuple(runs[Side.RAY][:complete]),
        auto=tuple(runs[Side.AUTO][:complete]),
        floor=tuple(references[_FLOOR][:complete]),
        handover=tuple(references[_HANDOVER][:complete]),
    )


_FLOOR = "floor"
_HANDOVER = "the floor with a hand-over"


def _with_floors(number: int, order: Sequence[Side], floors: bool) -> tuple[Side | str, ...]:
    """Round `number`'s runs: the loaders in `order` and, if `floors`, the floor and the floor
    with a hand-over on either side of the threads' run (at the end without one), the floor
    before it in even rounds and after it in odd ones.

    Next to the threads' run, because the threads' figure is a share of them: the machine's
    bandwidth moves from run to run (on a quiet machine the floor spread from 9.7 to 17.3 GB/s
    over one bench), and a floor timed two process loaders away from the threads' run measured
    another moment."""
    if not floors:
        return tuple(order)
    before, after = (_FLOOR, _HANDOVER) if number % 2 == 0 else (_HANDOVER, _FLOOR)
    if Side.THREADS not in order:
        return (*order, before, after)
    at = order.index(Side.THREADS)
    return (*order[:at], before, Side.THREADS, after, *order[at + 1 :])


def _peaked(sides: Iterable[Side]) -> tuple[Side, ...]:
    """The sides whose peak memory is measured: not Ray's, whose actors are not this process's
    children (the memory run's process tree would miss them) and would need a Ray instance of
    their own in the fresh interpreter each memory run takes."""
    return tuple(side for side in sides if side is not Side.RAY)


def _planned_runs(workload: Workload, rounds: int, memory: bool) -> int:
    """The runs `_run_rounds` makes of `workload` if none raises: warm-up, rounds, memory."""
    sides = len(workload.sides)
    peaks = len(_peaked(workload.sides)) if memory and workload.memory else 0
    floors = 2 if workload.floor else 0
    warmup = sides + floors if workload.warmup else 0
    return warmup + max(rounds, 0) * (sides + floors) + peaks


def run_benchmark(
    workloads: Iterable[Workload],
    rounds: int = ROUNDS,
    *,
    measure: Measure = measure_side,
    peak: MeasurePeak | None = measure_memory,
    progress: Callable[[str], None] | None = None,
    on_run: Callable[[str, int, int], None] | None = None,
    floor: MeasureFloor = measure_floor,
    handover: MeasureFloor = measure_handover,
) -> BenchReport:
    """Run every workload in `rounds` rounds (or the workload's own `rounds`); the report.

    A round is one run of each loader the workload compares (`Workload.sides`), in an order
    that rotates from round to round (`round_order`). Before the first round each loader
    makes one untimed run of a small epoch with at most one worker (and so do the floors,
    where timed), unless the workload says not to, so that imports and one-time set-up in this
    process (a fork server, say) are not charged to the first round. A run that raises ends
    its workload, whose result then carries the error; the other workloads still run.
    `measure` does one run; `peak`, if given, measures each loader's memory on the workloads
    that ask for it (`Workload.memory`), after their rounds; `floor` and `handover` time the
    floors (`tools.floor`) of the workloads that time them; `progress` hears what is going
    on, in lines of text.

    `on_run` hears `(workload name, runs done, runs planned in all)`, every run counted
    (warm-up, timed and memory runs alike): before each workload's first run, and after each
    run. When a run raises, the runs its workload no longer makes count as done.
    """
    say = progress or (lambda message: None)
    workloads = tuple(workloads)
    planned = [_planned_runs(w, w.rounds or rounds, peak is not None) for w in workloads]
    total, done, current = sum(planned), 0, ""
    heard = on_run or (lambda name, done, total: None)

    def ran() -> None:
        nonlocal done
        done += 1
        heard(current, done, total)

    started = time.perf_counter()
    machine = Machine.here(memcpy=True)
    results = []
    with warnings.catch_warnings():
        # Both loaders warn, alike, when num_workers exceeds the cores of a small machine.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for workload, runs in zip(workloads, planned, strict=True):
            count = workload.rounds or rounds
            if count < 1:
                raise ValueError(f"{workload.name}: at least one round of runs is needed")
            say(f"{workload.name}: {count} round(s) of {workload.batches}-batch runs ...")
            current, before = workload.name, done
            heard(current, done, total)
            began = time.perf_counter()
            result = _run_rounds(workload, count, measure, peak, say, ran, floor, handover)
            took = time.perf_counter() - began
            if done < before + runs:  # a run raised: the rest of the workload's runs are off
                done = before + runs
                heard(workload.name, done, total)
            if result.error is not None:
                say(f"{workload.name}: FAILED: {result.error} ({took:.0f} s)")
            else:
                others = "".join(
                    f", {side.value}/torch {result.ratio_of(side):.2f}x"
                    for side in (Side.THREADS, Side.RAY)
                    if result.runs(side)
                )
                say(f"{workload.name}: statecore/torch {result.ratio:.2f}x{others} ({took:.0f} s)")
            if result.memory_error is not None:
                say(f"{workload.name}: memory not measured: {result.memory_error}")
            results.append(result)
    return BenchReport(tuple(results), machine, time.perf_counter() - started)


# --- plotting -----------------------------------------------------------------------------------


class MissingDependency(RuntimeError):
    """An optional package the benchmark needs for what was asked is not installed."""


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def missing_dependencies(workloads: Iterable[Workload], plot: bool) -> str | None:
    """None if everything asked for can run; else what is missing, and how to install it."""
    missing = []
    if plot and not _importable("matplotlib"):
        missing.append("--plot needs matplotlib")
    for workload in workloads:
        missing += [
            f"the {workload.name} workload needs {name}"
            for name in workload.needs
            if not _importable(name)
        ]
    if not missing:
        return None
    return f"{'; '.join(missing)}, which is not installed: {INSTALL_HINT}"


_COLORS = {
    Side.TORCH: "tab:orange",
    Side.STATECORE: "tab:blue",
    Side.THREADS: "tab:green",
    Side.RAY: "tab:red",
    Side.AUTO: "tab:purple",
}


def plot(report: BenchReport, path: str | os.PathLike[str]) -> None:
    """Draw `report` as a PNG: the ratio of every workload, and the batch arrival timelines.

    The top panel has, per workload, a bar for statecore's default and one for its threads
    (median ratio against torch, whiskers to the lowest and highest round), and a line at
    1.0, on a log scale: ratios run from below 1 to over a thousand (threads start in
    milliseconds where spawned processes take seconds). Below it, one panel per workload
    that kept arrival times (the stragglers): batches handed over against time since
    `iter(loader)`, for the median run of each loader, with the ideal pace (all the measured
    work spread over the workers) dashed.
    Raises MissingDependency without matplotlib.
    """
    if not _importable("matplotlib"):
        raise MissingDependency(
            f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}"
        )
    from matplotlib.figure import Figure

    shown = [result for result in report.results if result.ok]
    timelines = [result for result in shown if result.torch[0].arrivals]
    figure = Figure(figsize=(12, 8 if timelines else 4.5), layout="constrained")
    grid = figure.add_gridspec(2 if timelines else 1, max(1, len(timelines)))
    bars = figure.add_subplot(grid[0, :])
    width = 0.4
    for offset, side in ((-width / 2, Side.STATECORE), (width / 2, Side.THREADS)):
        ran = [(place, result) for place, result in enumerate(shown) if result.runs(side)]
        if not ran:
            continue
        places = [place + offset for place, _ in ran]
        ratios = [result.ratio_of(side) for _, result in ran]
        below = [result.ratio_of(side) - min(result.ratios_of(side)) for _, result in ran]
        above = [max(result.ratios_of(side)) - result.ratio_of(side) for _, result in ran]
        label = "statecore (default)" if side is Side.STATECORE else 'statecore executor="thread"'
        bars.bar(
            places, ratios, width, color=_COLORS[side], yerr=[below, above], capsize=2, label=label
        )
        for place, (_, result) in zip(places, ran, strict=True):
            bars.annotate(
                f"{result.ratio_of(side):.2f}",
                (place, max(result.ratios_of(side))),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    bars.axhline(1.0, color="black", linewidth=1)
    bars.set_yscale("log")
    bars.set_xticks(range(len(shown)), [result.name for result in shown])
    bars.set_ylabel("throughput / torch's (log scale)")
    bars.set_title("median of per-round ratios against torch (above 1: faster than torch)")
    bars.tick_params(axis="x", labelrotation=35, labelsize=8)
    bars.legend(fontsize=8, loc="upper left")
    for column, result in enumerate(timelines):
        axes = figure.add_subplot(grid[1, column])
        for side in result.sides:
            run = result.median_run(side)
            axes.step(
                run.arrivals,
                range(1, len(run.arrivals) + 1),
                where="post",
                color=_COLORS[side],
                label=f"{side.value} ({_number(result.unit.figure(run.throughput))}"
                f" {result.unit.value})",
            )
        ideal = result.median_run(Side.STATECORE).work
        axes.plot([0, ideal], [0, result.batches], "k--", linewidth=1, label="ideal pace")
        axes.set_title(f"{result.name}: when each batch arrived", fontsize=10)
        axes.set_xlabel("seconds since iter(loader)")
        axes.set_ylabel("batches handed over")
        axes.legend(fontsize=8, loc="lower right")
    figure.savefig(path, format="png", dpi=100)


# --- the command --------------------------------------------------------------------------------


def _unwritable(path: str | os.PathLike[str]) -> str | None:
    """None if a file can be written at `path`; else why not, in words.

    Checked before the benchmark runs, so that a typo in a path costs a second, not the run.
    """
    target = Path(path)
    if target.is_dir():
        return "it is a folder"
    if target.exists():
        return None if os.access(target, os.W_OK) else "the file is not writable"
    folder = target.parent
    if not folder.exists():
        return f"the folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return None


def _output_problem(json_path: str | None, plot_path: str | None) -> str | None:
    outputs = (("--json", json_path), ("--plot", plot_path))
    asked = [(option, path) for option, path in outputs if path is not None]
    if len(asked) == 2 and Path(asked[0][1]).resolve() == Path(asked[1][1]).resolve():
        return f"--json and --plot name the same file, {asked[0][1]}: give each its own"
    for option, path in asked:
        if (why := _unwritable(path)) is not None:
            return f"cannot write {option} {path}: {why}"
    return None


def bench(
    quick: bool = False,
    only: Sequence[str] | None = None,
    rounds: int | None = None,
    batches: int | None = None,
    json_path: str | None = None,
    plot_path: str | None = None,
    command: str = "python -m statecore bench",
    stream: TextIO | None = None,
    memory: bool = True,
    progress_bar: bool = True,
    ray: bool = False,
    auto: bool = False,
    cache: str | None = None,
    breakdown: bool = False,
) -> int:
    """The `bench` command: run, print the table, write what was asked.

    The workloads that run themselves (`Workload.own_bench`: the image pipeline against the
    peers) run after the others, each printing its own table; `cache` is where they keep what
    they make once (the encoded images), `breakdown` asks them where the CPU went.

    `auto` adds statecore with `num_workers="auto"` as one more loader on the workloads with
    workers and a map-style dataset (docs/choosing-num-workers.md).

    `ray` adds statecore's Ray executor as one more loader on the workloads with workers (a
    local Ray instance unless this process is connected to one, or RAY_ADDRESS says where).

    Returns 0; 1 if a workload failed (its row says why, the others are complete); 2 on misuse
    or when an output asked for cannot be written.

    What is going on is told on stderr, a line at a time; while the runs go, and if stderr is
    a terminal and `progress_bar` is true, those lines go above a bar over every run of every
    loader (`statecore.tools.progress`).

    A missing optional package, or a path that cannot be written, is reported before anything
    runs, not after ten minutes.
    """
    out = sys.stdout if stream is None else stream

    try:
        workloads = select(only)
    except ValueError as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2
    missing = missing_dependencies(workloads, plot=plot_path is not None)
    if ray and (why := registry.missing("ray")) is not None:
        ray_missing = f"--ray needs {why.package}, which is not installed: {why.install}"
        missing = ray_missing if missing is None else f"{missing}; {ray_missing}"
    if missing is not None:
        print(f"bench: {missing}", file=sys.stderr)
        return 2
    if (problem := _output_problem(json_path, plot_path)) is not None:
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    if quick:
        workloads = tuple(workload.quick() for workload in workloads)
    if batches is not None:
        workloads = tuple(workload.resized(batches) for workload in workloads)
    if rounds is not None:  # asked for explicitly: every workload runs that many rounds
        workloads = tuple(attrs.evolve(workload, rounds=None) for workload in workloads)
    if ray:
        workloads = tuple(workload.with_ray() for workload in workloads)
    if auto:
        workloads = tuple(workload.with_auto() for workload in workloads)
    count = rounds if rounds is not None else (QUICK_ROUNDS if quick else ROUNDS)
    own = tuple(workload for workload in workloads if workload.own_bench is not None)
    workloads = tuple(workload for workload in workloads if workload.own_bench is None)
    if own and (json_path is not None or plot_path is not None):
        names = ", ".join(workload.name for workload in own)
        print(
            f"bench: {names}: its figures are in its own table, not in --json or --plot",
            file=sys.stderr,
        )
    if not workloads:
        return _bench_own(own, count, out, cache, breakdown, command)
    executors = "default executor, threads and ray" if ray else "default executor and threads"
    print(
        f"torch's DataLoader against statecore's ({executors}), "
        f"{len(workloads)} workload(s), runs taking turns in rounds ...",
        file=out,
        flush=True,
    )
    with Bar(unit="run", description="bench", show=progress_bar) as bar:

        def progress(message: str) -> None:
            bar.note(f"bench: {message}")

        def on_run(name: str, done: int, total: int) -> None:
            bar.goto(done, total, name)

        report = attrs.evolve(
            run_benchmark(
                workloads,
                count,
                peak=measure_memory if memory else None,
                progress=progress,
                on_run=on_run,
            ),
            command=command,
        )
    print(f"$ {command}", file=out)
    print(report.table(), file=out, flush=True)

    def write(
        option: str, path: str, writer: Callable[[BenchReport, str], None], what: str
    ) -> bool:
        try:
            writer(report, path)
        except OSError as error:  # checked before the run, but the disk may have changed since
            reason = error.strerror or str(error)
            print(
                f"bench: cannot write {option} {path}: {reason}; the table above has the figures",
                file=sys.stderr,
            )
            return False
        print(f"{what} written to {path}", file=out)
        return True

    written = True
    if json_path is not None:
        written = write("--json", json_path, write_json, "figures") and written
    if plot_path is not None:
        written = write("--plot", plot_path, plot, "plot") and written
    failed = [result.name for result in report.results if not result.ok]
    if failed:
        print(f"bench: {len(failed)} workload(s) failed: {', '.join(failed)}", file=sys.stderr)
    code = 1 if failed else 0 if written else 2
    return max(code, _bench_own(own, count, out, cache, breakdown, command))


def _bench_own(
    workloads: Sequence[Workload],
    rounds: int,
    out: TextIO,
    cache: str | None,
    breakdown: bool,
    command: str,
) -> int:
    """Run the workloads that run themselves (`Workload.own_bench`); the worst exit code."""
    code = 0
    for workload in workloads:
        assert workload.own_bench is not None
        runner = importlib.import_module(workload.own_bench)
        code = max(
            code,
            runner.bench_workload(
                workload,
                workload.rounds or rounds,
                stream=out,
                cache=cache,
                breakdown=breakdown,
                command=command,
            ),
        )
    return code
