"""`python -m statecore bench`: torch's DataLoader and statecore's, side by side.

Each workload (see `statecore.tools.workloads`) is run in pairs: one run of each loader, built
from the same arguments, the two taking turns. Torch goes first in even pairs and statecore in
odd ones, so that whatever drifts on a busy machine (other processes, frequency scaling, a
warming cache) falls on both alike, and neither always gets the machine right after the other
has warmed or cooled it.

For each workload the report gives each loader's median figure and its range over the runs,
and the median of the per-pair ratios: statecore's throughput over torch's in the same pair,
so above 1 means statecore was faster. Taking the ratio within a pair before the median is
what cancels the drift: two runs a second apart see the same machine.

docs/performance.md explains each workload and shows the latest table.
"""

from __future__ import annotations

import enum
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
from typing import Any, TextIO

import attrs
import torch

from statecore.tools.workloads import (
    WARMUP_BATCHES,
    Loader,
    Measurement,
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
    "measure_side",
    "missing_dependencies",
    "pair_order",
    "pair_ratios",
    "plot",
    "read_json",
    "run_benchmark",
    "write_json",
]

ROUNDS = 5
"""Pairs of runs per workload by default."""
QUICK_ROUNDS = 3
"""Pairs of runs per workload under `--quick`."""
# statecore is installed from its checkout (README, "Run it"), not from an index: a bare
# `pip install 'statecore[bench]'` would look for it on PyPI.
INSTALL_HINT = "pip install -e '.[bench]' in the statecore checkout"


class Side(enum.Enum):
    """Which loader a run used."""

    TORCH = "torch"
    STATECORE = "statecore"

    def loader_class(self) -> type[Loader]:
        if self is Side.TORCH:
            return torch.utils.data.DataLoader
        import statecore

        ours: type[Loader] = statecore.DataLoader
        return ours


def pair_order(pair: int) -> tuple[Side, Side]:
    """Which loader runs first in pair number `pair` (from 0): torch in even pairs."""
    if pair % 2 == 0:
        return Side.TORCH, Side.STATECORE
    return Side.STATECORE, Side.TORCH


def pair_ratios(
    torch_runs: Sequence[Measurement], statecore_runs: Sequence[Measurement]
) -> tuple[float, ...]:
    """Per pair, statecore's throughput over torch's: above 1 when statecore was faster.

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
    return {"seconds": run.seconds, "work": run.work, "arrivals": list(run.arrivals)}


def _measurement(data: Mapping[str, Any]) -> Measurement:
    return Measurement(
        float(data["seconds"]), float(data["work"]), tuple(float(t) for t in data["arrivals"])
    )


@attrs.frozen
class WorkloadResult:
    """Every run of both loaders on one workload, and the figures drawn from them."""

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
    """Which loader ran first, pair by pair."""
    error: str | None = None
    """What a run raised, if one did: the pairs before it are kept, the figures are not shown."""

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.first)

    def runs(self, side: Side) -> tuple[Measurement, ...]:
        return self.torch if side is Side.TORCH else self.statecore

    def figures(self, side: Side) -> tuple[float, ...]:
        """The reported figure of each run, in the workload's unit."""
        return tuple(self.unit.figure(run.throughput) for run in self.runs(side))

    def median(self, side: Side) -> float:
        return statistics.median(self.figures(side))

    def low(self, side: Side) -> float:
        return min(self.figures(side))

    def high(self, side: Side) -> float:
        return max(self.figures(side))

    @property
    def ratios(self) -> tuple[float, ...]:
        return pair_ratios(self.torch, self.statecore)

    @property
    def ratio(self) -> float:
        """The median of the per-pair ratios."""
        return statistics.median(self.ratios)

    def to_json(self) -> dict[str, Any]:
        def side(which: Side) -> dict[str, Any]:
            return {
                "median": self.median(which) if self.first else None,
                "min": self.low(which) if self.first else None,
                "max": self.high(which) if self.first else None,
                "figures": list(self.figures(which)),
                "runs": [_measurement_json(run) for run in self.runs(which)],
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
            "torch": side(Side.TORCH),
            "statecore": side(Side.STATECORE),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkloadResult:
        """The result `to_json` wrote; the derived figures are computed again from the runs."""
        return cls(
            name=data["name"],
            summary=data["summary"],
            unit=Unit(data["unit"]),
            timing=Timing(data["timing"]),
            batches=int(data["batches"]),
            batch_size=int(data["batch_size"]),
            num_workers=int(data["num_workers"]),
            torch=tuple(_measurement(run) for run in data["torch"]["runs"]),
            statecore=tuple(_measurement(run) for run in data["statecore"]["runs"]),
            first=tuple(Side(which) for which in data["first"]),
            error=data.get("error"),
        )


@attrs.frozen
class Machine:
    """Where the figures were taken."""

    cpus: int
    platform: str
    python: str
    torch: str
    statecore: str

    @classmethod
    def here(cls) -> Machine:
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
        )

    def describe(self) -> str:
        return (
            f"{self.cpus} CPUs, {self.platform}, Python {self.python}, torch {self.torch}, "
            f"statecore {self.statecore}"
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
        header = (
            f"{'workload':22} {'unit':8} {'torch median (min-max)':>26} "
            f"{'statecore median (min-max)':>28} {'ratio':>7} {'pairs':>5}"
        )
        lines = [header]
        for result in self.results:
            if not result.ok:
                lines.append(f"{result.name:22} {result.unit.value:8} FAILED: {result.error}")
                continue
            cells = []
            for side in Side:
                spread = f"({_number(result.low(side))}-{_number(result.high(side))})"
                cells.append(f"{_number(result.median(side))} {spread}")
            lines.append(
                f"{result.name:22} {result.unit.value:8} {cells[0]:>26} {cells[1]:>28} "
                f"{result.ratio:6.2f}x {len(result.ratios):5d}"
            )
        cost = self.state_cost()
        if cost is not None:
            lines.append(
                f"worker state for checkpoints: statecore's median us/batch on processes-stateful "
                f"is {cost:+.1f}% of processes-iterable's (goal: within 5%)"
            )
        lines += [
            "ratio: median over pairs of statecore throughput / torch throughput "
            "(above 1: statecore faster)",
            "% ideal: (measured work of every sample / workers) / elapsed; "
            "us/batch and ms: lower is better",
            f"machine: {self.machine.describe()}; {self.seconds:.0f} s in all",
        ]
        return "\n".join(lines)

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


def measure_side(workload: Workload, side: Side) -> Measurement:
    """One timed run of `side`'s loader on `workload` (see `workloads.measure`)."""
    return measure(workload, side.loader_class())


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


def _run_pairs(
    workload: Workload, pairs: int, measure: Measure, say: Callable[[str], None]
) -> WorkloadResult:
    """The warm-up and `pairs` pairs of one workload; a run that raises ends the workload."""
    runs: dict[Side, list[Measurement]] = {side: [] for side in Side}
    first: list[Side] = []
    error = None
    side = Side.TORCH
    try:
        if workload.warmup:
            small = attrs.evolve(
                workload,
                batches=min(workload.batches, WARMUP_BATCHES),
                num_workers=min(workload.num_workers, 1),
            )
            for side in Side:
                measure(small, side)
        for pair in range(pairs):
            order = pair_order(pair)
            for side in order:
                runs[side].append(measure(workload, side))
                if stray := _outlived():
                    say(f"warning: {stray} worker process(es) outlived a {side.value} run")
            first.append(order[0])
    except Exception as failure:  # reported in the table; the other workloads still run
        message = str(failure).strip().splitlines()
        error = f"{side.value} raised {type(failure).__name__}: {message[0] if message else ''}"
    complete = len(first)  # only whole pairs are kept: a ratio needs both runs
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
    )


def run_benchmark(
    workloads: Iterable[Workload],
    rounds: int = ROUNDS,
    *,
    measure: Measure = measure_side,
    progress: Callable[[str], None] | None = None,
) -> BenchReport:
    """Run every workload in `rounds` pairs (or the workload's own `rounds`); the report.

    Before the first pair each loader makes one untimed run of a small epoch with at most one
    worker, unless the workload says not to, so that imports and one-time set-up in this
    process (a fork server, say) are not charged to the first pair. A run that raises ends
    its workload, whose result then carries the error; the other workloads still run.
    `measure` does one run; `progress` hears what is going on.
    """
    say = progress or (lambda message: None)
    started = time.perf_counter()
    results = []
    with warnings.catch_warnings():
        # Both loaders warn, alike, when num_workers exceeds the cores of a small machine.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for workload in workloads:
            pairs = workload.rounds or rounds
            if pairs < 1:
                raise ValueError(f"{workload.name}: at least one pair of runs is needed")
            say(f"{workload.name}: {pairs} pair(s) of {workload.batches}-batch runs ...")
            began = time.perf_counter()
            result = _run_pairs(workload, pairs, measure, say)
            took = time.perf_counter() - began
            if result.error is not None:
                say(f"{workload.name}: FAILED: {result.error} ({took:.0f} s)")
            else:
                say(f"{workload.name}: statecore/torch {result.ratio:.2f}x ({took:.0f} s)")
            results.append(result)
    return BenchReport(tuple(results), Machine.here(), time.perf_counter() - started)


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


def _median_run(runs: Sequence[Measurement]) -> Measurement:
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


_COLORS = {Side.TORCH: "tab:orange", Side.STATECORE: "tab:blue"}


def plot(report: BenchReport, path: str | os.PathLike[str]) -> None:
    """Draw `report` as a PNG: the ratio of every workload, and the batch arrival timelines.

    The top panel has a bar per workload (median ratio, whiskers to the lowest and highest
    pair) and a line at 1.0. Below it, one panel per workload that kept arrival times (the
    stragglers): batches handed over against time since `iter(loader)`, for the median run of
    each loader, with the ideal pace (all the measured work spread over the workers) dashed.
    Raises MissingDependency without matplotlib.
    """
    if not _importable("matplotlib"):
        raise MissingDependency(
            f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}"
        )
    from matplotlib.figure import Figure

    shown = [result for result in report.results if result.ok]
    timelines = [result for result in shown if result.torch[0].arrivals]
    figure = Figure(figsize=(11, 8 if timelines else 4.5), layout="constrained")
    grid = figure.add_gridspec(2 if timelines else 1, max(1, len(timelines)))
    bars = figure.add_subplot(grid[0, :])
    names = [result.name for result in shown]
    ratios = [result.ratio for result in shown]
    below = [result.ratio - min(result.ratios) for result in shown]
    above = [max(result.ratios) - result.ratio for result in shown]
    colors = ["tab:green" if ratio >= 1.0 else "tab:red" for ratio in ratios]
    bars.bar(names, ratios, color=colors, yerr=[below, above], capsize=3)
    bars.axhline(1.0, color="black", linewidth=1)
    for position, result in enumerate(shown):
        bars.annotate(
            f"{result.ratio:.2f}",
            (position, max(result.ratios)),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    bars.set_ylabel("statecore / torch throughput")
    bars.set_title("median of per-pair ratios (above 1: statecore faster)")
    bars.tick_params(axis="x", labelrotation=35, labelsize=8)
    for column, result in enumerate(timelines):
        axes = figure.add_subplot(grid[1, column])
        for side in Side:
            run = _median_run(result.runs(side))
            axes.step(
                run.arrivals,
                range(1, len(run.arrivals) + 1),
                where="post",
                color=_COLORS[side],
                label=f"{side.value} ({_number(result.unit.figure(run.throughput))}"
                f" {result.unit.value})",
            )
        ideal = _median_run(result.statecore).work
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
) -> int:
    """The `bench` command: run, print the table, write what was asked.

    Returns 0; 1 if a workload failed (its row says why, the others are complete); 2 on misuse
    or when an output asked for cannot be written.

    A missing optional package, or a path that cannot be written, is reported before anything
    runs, not after ten minutes.
    """
    out = sys.stdout if stream is None else stream

    def progress(message: str) -> None:
        print(f"bench: {message}", file=sys.stderr, flush=True)

    try:
        workloads = select(only)
    except ValueError as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2
    missing = missing_dependencies(workloads, plot=plot_path is not None)
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
    if rounds is not None:  # asked for explicitly: every workload runs that many pairs
        workloads = tuple(attrs.evolve(workload, rounds=None) for workload in workloads)
    pairs = rounds if rounds is not None else (QUICK_ROUNDS if quick else ROUNDS)
    print(
        f"torch's DataLoader against statecore's, {len(workloads)} workload(s), "
        f"alternating runs in pairs ...",
        file=out,
        flush=True,
    )
    report = attrs.evolve(run_benchmark(workloads, pairs, progress=progress), command=command)
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
        return 1
    return 0 if written else 2
