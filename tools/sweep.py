"""`python -m statecore bench --sweep`: `num_workers="auto"` against every fixed count.

For each sweep workload (an I/O-bound, a CPU-bound, a mixed and a straggler dataset, and the
mixed one again under a training step that keeps one core busy), statecore's loader runs one
epoch with each fixed `num_workers` in `COUNTS` and one with `num_workers="auto"`, in rounds:
one run of each a round, in an order that rotates from round to round
(`loader_bench.rotated`), so that the drift of a busy machine falls on all alike.

A run is timed from its first batch to its last (start-up excluded, as for the benchmark's
steady workloads; an auto loader's tuning, which happens while batches flow, is inside the
clock, and so is the start-up of the workers it adds). The goal is judged on that figure. Each
run is also timed from `iter(loader)`, as a training loop lives the epoch: there every count
pays for starting its workers, a fixed count before its first batch. Where the workload has a
training step, the loop spins one core for that long per batch, so the figure is end-to-end
steps per second. After every auto run, the loader's `stats().tuning` says what it did: the
changes, with the batch of each, whether it settled and on how many workers; the sweep turns
the batch of the last change into seconds with the run's arrival times (how long tuning took).

Then, unless told not to, each count and auto make one more run while this process samples
the PSS of itself and its workers (`tools.memory`), taking at most a fifth of a core
(`sampler_pause`): the peak the run added, and the largest single worker seen (what "one
worker" costs).

The report gives, per workload, the median throughput of each count and of auto, the best
fixed count (the highest median), auto's ratio to it (of the medians), the count auto settled
on in each run, how long its tuning took, and the peak memory of the best count and of auto,
checked against the goals of issue 29 (auto within 95% of the best count, its memory within
the best count's plus one worker). docs/choosing-num-workers.md shows the latest figures.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

import attrs
import torch
import torch.utils.data

from statecore.tools.loader_bench import rotated
from statecore.tools.memory import AVAILABLE, INTERVAL, descendants, pss, tree_pss
from statecore.tools.workloads import SEED, Mixed, PythonWork, Sleeps, close, release

__all__ = [
    "AUTO",
    "COUNTS",
    "GOAL",
    "QUICK_ROUNDS",
    "ROUNDS",
    "SWEEP",
    "Count",
    "MemoryPeak",
    "SweepReport",
    "SweepResult",
    "SweepRun",
    "SweepWorkload",
    "TuningSummary",
    "run_sweep",
    "select_sweep",
    "spin",
    "sweep",
]

COUNTS = (1, 2, 4, 8, 16)
"""The fixed `num_workers` the sweep runs."""
AUTO = "auto"
Count = int | str
"""A fixed worker count, or `AUTO`."""
GOAL = 0.95
"""Auto's throughput goal, as a share of the best fixed count's (issue 29)."""
ROUNDS = 3
QUICK_ROUNDS = 2


def spin(seconds: float) -> None:
    """Keep one core busy for `seconds` of this thread's CPU time: a training step.

    CPU time, not wall time: on a busy machine the step still costs the core that long.
    """
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


@attrs.frozen
class SweepWorkload:
    """One sweep case: a dataset, the batches of a run, and the training step per batch."""

    name: str
    summary: str
    dataset: Callable[[int], torch.utils.data.Dataset[Any]] = attrs.field(repr=False)
    """Builds the dataset from its number of samples."""
    batch_size: int
    batches: int
    quick_batches: int
    step: float = 0.0
    """Seconds of one core the training loop spins per batch (0: it only takes the batch)."""

    @property
    def unit(self) -> str:
        return "steps/s" if self.step else "batches/s"

    def quick(self) -> SweepWorkload:
        return attrs.evolve(self, batches=self.quick_batches)

    def resized(self, batches: int) -> SweepWorkload:
        return attrs.evolve(self, batches=batches)


SWEEP = (
    SweepWorkload(
        "io-4ms",
        "I/O-bound: each sample sleeps 4 ms (remote storage)",
        functools.partial(Sleeps, seconds=0.004),
        batch_size=4,
        batches=600,
        quick_batches=150,
    ),
    SweepWorkload(
        "cpu-spin",
        "CPU-bound: each sample spins about 1 ms of one core in pure Python",
        PythonWork,
        batch_size=4,
        batches=600,
        quick_batches=150,
    ),
    SweepWorkload(
        "mixed",
        "each sample sleeps 2 ms, then spins about 1 ms (a read, then decoding)",
        Mixed,
        batch_size=4,
        batches=600,
        quick_batches=150,
    ),
    SweepWorkload(
        "straggler",
        "each sample sleeps 1 ms, one in 20 sleeps 40 ms",
        functools.partial(Sleeps, seconds=0.001, straggler_one_in=20, straggler_factor=40.0),
        batch_size=4,
        batches=600,
        quick_batches=150,
    ),
    SweepWorkload(
        "mixed-busy-consumer",
        "mixed, under a training step that spins one core 5 ms per batch",
        Mixed,
        batch_size=4,
        batches=400,
        quick_batches=100,
        step=0.005,
    ),
)


def select_sweep(names: Sequence[str] | None = None) -> tuple[SweepWorkload, ...]:
    """The sweep workloads named, in the sweep's order; all of them for None."""
    if names is None:
        return SWEEP
    known = {workload.name for workload in SWEEP}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"no sweep workload named {', '.join(unknown)}; the sweep's workloads are "
            f"{', '.join(sorted(known))}"
        )
    return tuple(workload for workload in SWEEP if workload.name in names)


# --- one run ------------------------------------------------------------------------------------


@attrs.frozen
class TuningSummary:
    """What an auto run's tuner did, from `stats().tuning`."""

    settled: bool
    workers: int
    """Workers running at the end of the run: the count it settled on, if it settled."""
    changes: tuple[tuple[int, str, int, str], ...]
    """Each change: the batch it was decided at, "add", "retire", "raise prefetch" or "lower
    prefetch", the workers after it (the prefetch bound after it, for the last two), and the
    policy's reason (in the JSON; the table leaves it out)."""
    seconds: float
    """From the first batch to the batch of the last change (0 with no change): tuning."""
    latest: str
    prefetch: int | None = None
    """The prefetch bound at the end of the run, where `prefetch_factor="auto"` tuned it."""

    @property
    def batches(self) -> int:
        """The batch of the last change (0 with no change)."""
        return self.changes[-1][0] if self.changes else 0

    def describe(self) -> str:
        changes = ", ".join(
            f"b{batch} {move}->{workers}" for batch, move, workers, _ in self.changes
        )
        state = "settled on" if self.settled else "ended (not settled) at"
        return (
            f"{state} {self.workers}; {len(self.changes)} change(s) "
            f"in {self.batches} batches / {self.seconds:.1f} s ({changes or 'none'})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "settled": self.settled,
            "workers": self.workers,
            "changes": [list(change) for change in self.changes],
            "seconds": self.seconds,
            "latest": self.latest,
            "prefetch": self.prefetch,
        }


@attrs.frozen
class SweepRun:
    """One run of one count: the batches after the first, and the seconds they took."""

    batches: int
    seconds: float
    tuning: TuningSummary | None = None
    started: float = 0.0
    """Seconds from `iter(loader)` to the first batch: the workers' start-up and the first
    batch's making. A fixed count starts all its workers in it; an auto loader starts two, and
    the workers it adds start inside `seconds`."""

    @property
    def throughput(self) -> float:
        """Batches (or steps) per second from the first batch to the last."""
        return self.batches / self.seconds

    @property
    def from_iter(self) -> float:
        """Batches (or steps) per second over the whole epoch as a training loop sees it: every
        batch, the first one included, over the seconds from `iter(loader)` to the last."""
        return (self.batches + 1) / (self.started + self.seconds)

    def to_json(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "seconds": self.seconds,
            "started": self.started,
            "tuning": None if self.tuning is None else self.tuning.to_json(),
        }


@attrs.frozen
class MemoryPeak:
    """The memory of one run: bytes of PSS of this process and its workers."""

    before: int
    peak: int
    worker: int
    """The largest PSS of a single worker process sampled (0 for none: threads, no workers)."""

    @property
    def added(self) -> int:
        return self.peak - self.before


def _loader(
    workload: SweepWorkload, count: Count, prefetch_factor: Count = 2
) -> torch.utils.data.DataLoader[Any]:
    import statecore

    loader: torch.utils.data.DataLoader[Any] = statecore.DataLoader(
        workload.dataset(workload.batches * workload.batch_size),
        batch_size=workload.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
        num_workers=count,
        prefetch_factor=prefetch_factor,
    )
    return loader


def _tuning(loader: torch.utils.data.DataLoader[Any], arrivals: Sequence[float]) -> TuningSummary:
    tuning = loader.stats().tuning  # type: ignore[attr-defined]
    assert tuning is not None, "an auto loader reports its tuning"
    changes = tuple(
        (
            record.batch,
            record.move.value,
            record.workers if record.prefetch is None else record.prefetch,
            record.why,
        )
        for record in tuning.decisions
    )
    last = changes[-1][0] if changes else 0
    seconds = arrivals[min(last, len(arrivals)) - 1] - arrivals[0] if last else 0.0
    return TuningSummary(
        tuning.settled, tuning.workers, changes, seconds, tuning.latest, tuning.prefetch
    )


def run_once(workload: SweepWorkload, count: Count, prefetch_factor: Count = 2) -> SweepRun:
    """One epoch of a fresh loader with `count` workers (and `prefetch_factor`, torch's 2
    unless told), timed from its first batch to its last; the training step spun after every
    batch. No worker outlives it."""
    if workload.batches < 2:
        raise ValueError(f"{workload.name}: a run needs at least 2 batches")
    loader = _loader(workload, count, prefetch_factor)
    arrivals: list[float] = []
    began = time.perf_counter()
    try:
        iterator = iter(loader)
        try:
            next(iterator)
            started = time.perf_counter() - began
            gc.collect()
            arrivals.append(time.perf_counter())
            for _ in range(len(loader) - 1):
                next(iterator)
                if workload.step:
                    spin(workload.step)
                arrivals.append(time.perf_counter())
            tuned = AUTO in (count, prefetch_factor)
            tuning = _tuning(loader, arrivals) if tuned else None
        finally:
            close(iterator)
    finally:
        release(loader)
    return SweepRun(len(arrivals) - 1, arrivals[-1] - arrivals[0], tuning, started)


SAMPLER_SHARE = 0.2
"""The most of one core the memory sampler takes: each read of a process's PSS walks its page
tables (about 5 ms a worker here), and sampling back to back took a whole core of this 2-core
machine from the run it measured: 8 fixed workers of `mixed` made 15% fewer batches, and the
sampler's CPU, counted as the training loop's, moved an auto loader's tuning."""


def sampler_pause(took: float) -> float:
    """Seconds the memory sampler waits after a sample that took `took` seconds: at least
    `INTERVAL`, and enough that it takes at most `SAMPLER_SHARE` of a core (about a third of a
    second between samples of 16 workers: a worker an auto loader tries and retires lives for
    half a second or more)."""
    return max(INTERVAL, took * (1 - SAMPLER_SHARE) / SAMPLER_SHARE)


def measure_memory(workload: SweepWorkload, count: Count) -> MemoryPeak:
    """One run while this process samples its own PSS and its workers' (`tools.memory`).

    In this process, not a fresh interpreter as the benchmark's memory runs: a worker count's
    run is compared with the other counts' runs in the same process, each from its own
    baseline taken just before.
    """
    gc.collect()
    me = os.getpid()
    before = tree_pss(me)
    highest = [before, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            began = time.perf_counter()
            tree = descendants(me)
            own = pss(me)
            workers = [pss(child) for child in tree]
            # A worker forked (auto adds them mid-run) or ended while the tree was read is
            # counted wrongly, shared pages twice (`tools.memory.tree_pss`): read again.
            if descendants(me) == tree:
                highest[0] = max(highest[0], own + sum(workers))
                highest[1] = max([highest[1], *workers])
            done.wait(sampler_pause(time.perf_counter() - began))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run_once(workload, count)
    finally:
        done.set()
        sampler.join(timeout=10)
    return MemoryPeak(before, highest[0], highest[1])


# --- results ------------------------------------------------------------------------------------


@attrs.frozen
class SweepResult:
    """Every run of every count on one workload."""

    workload: SweepWorkload
    runs: Mapping[Count, tuple[SweepRun, ...]]
    first: tuple[Count, ...]
    """Which count ran first, round by round."""
    memory: Mapping[Count, MemoryPeak] = attrs.field(factory=dict)

    def median(self, count: Count) -> float:
        """The median throughput of `count`'s runs (batches, or steps, per second)."""
        return statistics.median(run.throughput for run in self.runs[count])

    def median_from_iter(self, count: Count) -> float:
        """The median of `count`'s runs timed from `iter(loader)` (`SweepRun.from_iter`)."""
        return statistics.median(run.from_iter for run in self.runs[count])

    @property
    def best_from_iter(self) -> int:
        """The fixed count with the highest median timed from `iter(loader)`."""
        return max(self.fixed, key=self.median_from_iter)

    @property
    def ratio_from_iter(self) -> float:
        """Auto's median over the best fixed count's, both timed from `iter(loader)`: the
        workers' start-up counted for every count, not only for the ones auto adds."""
        return self.median_from_iter(AUTO) / self.median_from_iter(self.best_from_iter)

    def spread(self, count: Count) -> tuple[float, float]:
        """The lowest and highest throughput of `count`'s runs: on a shared machine the rounds
        of one count can differ by more than the goal's margin, and the ratio of the medians
        reads differently beside them."""
        rates = [run.throughput for run in self.runs[count]]
        return min(rates), max(rates)

    @property
    def fixed(self) -> tuple[int, ...]:
        return tuple(count for count in self.runs if isinstance(count, int))

    @property
    def best(self) -> int:
        """The fixed count with the highest median throughput."""
        return max(self.fixed, key=self.median)

    @property
    def ratio(self) -> float:
        """Auto's median throughput over the best fixed count's."""
        return self.median(AUTO) / self.median(self.best)

    @property
    def tunings(self) -> tuple[TuningSummary, ...]:
        return tuple(run.tuning for run in self.runs[AUTO] if run.tuning is not None)

    @property
    def settled_on(self) -> tuple[int, ...]:
        """The workers each auto run ended with."""
        return tuple(tuning.workers for tuning in self.tunings)

    def median_tuning(self) -> TuningSummary:
        """The tuning of the auto run whose throughput is the median (the lower middle)."""
        runs = sorted(self.runs[AUTO], key=lambda run: run.throughput)
        tuning = runs[(len(runs) - 1) // 2].tuning
        assert tuning is not None
        return tuning

    @property
    def memory_goal(self) -> bool | None:
        """Whether auto's peak added at most the best count's plus one worker; None if not
        measured."""
        best, auto = self.memory.get(self.best), self.memory.get(AUTO)
        if best is None or auto is None:
            return None
        return auto.added <= best.added + best.worker

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.workload.name,
            "summary": self.workload.summary,
            "unit": self.workload.unit,
            "batches": self.workload.batches,
            "batch_size": self.workload.batch_size,
            "step": self.workload.step,
            "first": list(self.first),
            "medians": {str(count): self.median(count) for count in self.runs},
            "spread": {str(count): list(self.spread(count)) for count in self.runs},
            "best": self.best,
            "ratio": self.ratio,
            "medians_from_iter": {str(count): self.median_from_iter(count) for count in self.runs},
            "best_from_iter": self.best_from_iter,
            "ratio_from_iter": self.ratio_from_iter,
            "settled_on": list(self.settled_on),
            "runs": {
                str(count): [run.to_json() for run in runs] for count, runs in self.runs.items()
            },
            "memory": {
                str(count): attrs.asdict(peak) | {"added": peak.added}
                for count, peak in self.memory.items()
            },
        }


def _mb(count: int) -> str:
    return f"{count / 1e6:.0f} MB"


@attrs.frozen
class SweepReport:
    results: tuple[SweepResult, ...]
    seconds: float
    cpus: int
    command: str = ""

    def table(self) -> str:
        """The report as the command prints it."""
        lines = []
        for result in self.results:
            workload = result.workload
            counts = tuple(result.runs)
            lines.append(
                f"{workload.name}: {workload.summary} ({workload.batches} batches of "
                f"{workload.batch_size}, {len(result.first)} round(s))"
            )
            lines.append(f"  {'num_workers':12}" + "".join(f"{c!s:>8}" for c in counts))
            lines.append(
                f"  {workload.unit:12}" + "".join(f"{result.median(c):8.1f}" for c in counts)
            )
            if len(result.first) > 1:
                for name, end in (("lowest", 0), ("highest", 1)):
                    lines.append(
                        f"  {name:12}" + "".join(f"{result.spread(c)[end]:8.1f}" for c in counts)
                    )
            lines.append(
                f"  {'from iter()':12}"
                + "".join(f"{result.median_from_iter(c):8.1f}" for c in counts)
            )
            met = "met" if result.ratio >= GOAL else "MISSED"
            lines.append(
                f"  best fixed: {result.best}; auto/best = {result.ratio:.2f} "
                f"(goal >= {GOAL:.2f}: {met}); auto settled on "
                f"{', '.join(map(str, result.settled_on))} (per run)"
            )
            lines.append(
                f"  from iter(), start-up in every count's clock: best fixed "
                f"{result.best_from_iter}; auto/best = {result.ratio_from_iter:.2f}"
            )
            lines.append(f"  auto's median run: {result.median_tuning().describe()}")
            best, auto = result.memory.get(result.best), result.memory.get(AUTO)
            if best is not None and auto is not None:
                met = "met" if result.memory_goal else "MISSED"
                lines.append(
                    f"  peak memory added: best fixed ({result.best}) {_mb(best.added)}, auto "
                    f"{_mb(auto.added)}; one worker {_mb(best.worker)} (goal auto <= best + "
                    f"one worker: {met})"
                )
        lines.append(
            f"{self.cpus} CPU(s); {self.seconds:.0f} s in all; throughputs are medians over the "
            "rounds (lowest and highest run below them), timed from each run's first batch "
            "(the goal's figure) and, on the 'from iter()' row, from iter(loader); auto/best "
            "is the ratio of the medians"
        )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "cpus": self.cpus,
            "seconds": self.seconds,
            "results": [result.to_json() for result in self.results],
        }


# --- running ------------------------------------------------------------------------------------


def run_sweep(
    workloads: Iterable[SweepWorkload],
    rounds: int = ROUNDS,
    *,
    memory: bool = True,
    counts: Sequence[int] = COUNTS,
    progress: Callable[[str], None] | None = None,
) -> SweepReport:
    """Run every workload: `rounds` rounds of one run per count and auto, then (if `memory`
    and /proc has PSS) one memory run of each."""
    if rounds < 1:
        raise ValueError("the sweep needs at least one round")
    say = progress or (lambda message: None)
    started = time.perf_counter()
    taking: tuple[Count, ...] = (*counts, AUTO)
    results = []
    with warnings.catch_warnings():
        # The loader warns, rightly, that 16 workers exceed a small machine's cores.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for workload in workloads:
            say(f"{workload.name}: {rounds} round(s) of {len(taking)} runs ...")
            # Imports and one-time set-up in this process are not the first run's to pay.
            run_once(attrs.evolve(workload, batches=2, step=0.0), 1)
            runs: dict[Count, list[SweepRun]] = {count: [] for count in taking}
            first = []
            for number in range(rounds):
                order = rotated(number, taking)
                first.append(order[0])
                for count in order:
                    runs[count].append(run_once(workload, count))
            peaks = {}
            if memory and AVAILABLE:
                for count in taking:
                    peaks[count] = measure_memory(workload, count)
            result = SweepResult(
                workload, {count: tuple(done) for count, done in runs.items()}, tuple(first), peaks
            )
            say(
                f"{workload.name}: best fixed {result.best}, auto/best {result.ratio:.2f}, "
                f"auto settled on {result.settled_on}"
            )
            results.append(result)
    return SweepReport(tuple(results), time.perf_counter() - started, len(os.sched_getaffinity(0)))


def sweep(
    quick: bool = False,
    only: Sequence[str] | None = None,
    rounds: int | None = None,
    batches: int | None = None,
    json_path: str | None = None,
    memory: bool = True,
    command: str = "python -m statecore bench --sweep",
    stream: TextIO | None = None,
    errors: TextIO | None = None,
) -> int:
    """The `bench --sweep` command: run, print the report, write the JSON if asked. Returns
    0, or 2 on misuse (an unknown workload)."""
    import sys

    out = sys.stdout if stream is None else stream
    err = sys.stderr if errors is None else errors
    try:
        workloads = select_sweep(only)
    except ValueError as error:
        print(f"bench: {error}", file=err)
        return 2
    if quick:
        workloads = tuple(workload.quick() for workload in workloads)
    if batches is not None:
        workloads = tuple(workload.resized(batches) for workload in workloads)
    count = rounds if rounds is not None else (QUICK_ROUNDS if quick else ROUNDS)
    print(
        f'num_workers in {COUNTS} and "auto", {len(workloads)} workload(s), {count} round(s) ...',
        file=out,
        flush=True,
    )
    report = attrs.evolve(
        run_sweep(
            workloads,
            count,
            memory=memory,
            progress=lambda message: print(f"bench: {message}", file=err, flush=True),
        ),
        command=command,
    )
    print(f"$ {command}", file=out)
    print(report.table(), file=out, flush=True)
    if json_path is not None:
        with open(json_path, "w") as file:
            json.dump(report.to_json(), file, indent=1)
        print(f"figures written to {json_path}", file=out)
    return 0


# --- studies: auto against the run's length, and prefetch_factor="auto" -------------------------

LENGTHS = (1200, 2400, 4800, 9600)
"""The epoch lengths (batches) `lengths` runs at: auto's tuning is a shrinking part of each."""
LONG_COUNTS = (8, 16)
"""The fixed counts `lengths` runs by default: the best two of the full sweep on the workloads
it is for (I/O-bound and stragglers); the small counts only scale down from them, and at 9600
batches one worker alone would take minutes a run. `--counts 1,2,4,8,16` runs them all."""
PREFETCH_FACTORS = (1, 2, 4)
"""The fixed prefetch bounds `prefetch_factor="auto"` is compared with."""


def take_turns(
    workload: SweepWorkload,
    choices: Sequence[Count],
    rounds: int,
    run: Callable[[Count], SweepRun],
) -> SweepResult:
    """`rounds` rounds of one run per choice, in an order that rotates from round to round."""
    runs: dict[Count, list[SweepRun]] = {choice: [] for choice in choices}
    first = []
    for number in range(rounds):
        order = rotated(number, tuple(choices))
        first.append(order[0])
        for choice in order:
            runs[choice].append(run(choice))
    return SweepResult(
        workload, {choice: tuple(done) for choice, done in runs.items()}, tuple(first)
    )


def lengths(
    workloads: Iterable[SweepWorkload],
    batches: Sequence[int] = LENGTHS,
    counts: Sequence[int] = LONG_COUNTS,
    rounds: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[SweepResult]:
    """Per workload and epoch length, the fixed `counts` and auto taking turns: how auto's
    ratio to the best count grows as its tuning becomes a smaller part of the run."""
    say = progress or (lambda message: None)
    results = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for workload in workloads:
            run_once(attrs.evolve(workload, batches=2, step=0.0), 1)
            for length in batches:
                sized = workload.resized(length)
                say(f"{workload.name}: {length} batches ...")
                results.append(
                    take_turns(sized, (*counts, AUTO), rounds, functools.partial(run_once, sized))
                )
    return results


def prefetch(
    workloads: Iterable[SweepWorkload],
    workers: int,
    factors: Sequence[int] = PREFETCH_FACTORS,
    rounds: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[SweepResult]:
    """Per workload, `workers` workers with each fixed prefetch factor and with
    `prefetch_factor="auto"`, taking turns (the result's counts are prefetch factors)."""
    say = progress or (lambda message: None)
    results = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for workload in workloads:
            run_once(attrs.evolve(workload, batches=2, step=0.0), 1)
            say(f"{workload.name}: prefetch {', '.join(map(str, factors))} and auto ...")

            def run(factor: Count, workload: SweepWorkload = workload) -> SweepRun:
                return run_once(workload, workers, factor)

            results.append(take_turns(workload, (*factors, AUTO), rounds, run))
    return results


def study_table(results: Sequence[SweepResult], key: str) -> str:
    """One line per result: the medians, the best fixed choice, auto's ratio to it and what
    auto's median run did; `key` names what the columns are (num_workers, prefetch_factor)."""
    if not results:
        return ""
    choices = tuple(results[0].runs)
    lines = [
        f"{'workload':20}{'batches':>8}"
        + "".join(f"{key + '=' + str(c) if c != AUTO else 'auto':>18}" for c in choices)
        + f"{'best':>6}{'auto/best':>10}  auto's median run"
    ]
    for result in results:
        tuning = result.median_tuning()
        runs = sorted(result.runs[AUTO], key=lambda run: run.throughput)
        epoch = runs[(len(runs) - 1) // 2].seconds
        did = tuning.describe() + (f"; prefetch {tuning.prefetch}" if tuning.prefetch else "")
        lines.append(
            f"{result.workload.name:20}{result.workload.batches:8}"
            + "".join(f"{result.median(c):18.1f}" for c in choices)
            + f"{result.best:6}{result.ratio:10.2f}  epoch {epoch:.2f} s, {did}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m statecore.tools.sweep lengths|prefetch ...`: the two studies, printed."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m statecore.tools.sweep")
    parser.add_argument("study", choices=("lengths", "prefetch"))
    parser.add_argument("--only", default="io-4ms,straggler", help="sweep workloads, by name")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--batches",
        default=None,
        help="lengths: the epoch lengths (default 1200,2400,4800,9600)"
        "; prefetch: the one length (default the workload's)",
    )
    parser.add_argument("--counts", default="8,16", help="lengths: the fixed counts")
    parser.add_argument("--workers", type=int, default=16, help="prefetch: the worker count")
    args = parser.parse_args(argv)

    def ints(text: str) -> list[int]:
        return [int(part) for part in text.split(",")]

    try:
        workloads = select_sweep(args.only.split(","))
    except ValueError as error:
        print(f"sweep: {error}")
        return 2

    def say(message: str) -> None:
        print(f"sweep: {message}", flush=True)

    started = time.perf_counter()
    if args.study == "lengths":
        sizes = ints(args.batches) if args.batches else list(LENGTHS)
        results = lengths(workloads, sizes, ints(args.counts), args.rounds, say)
        print(study_table(results, "n"))
    else:
        if args.batches:
            workloads = tuple(workload.resized(int(args.batches)) for workload in workloads)
        results = prefetch(workloads, args.workers, PREFETCH_FACTORS, args.rounds, say)
        print(f"num_workers={args.workers}")
        print(study_table(results, "pf"))
    print(
        f"{len(os.sched_getaffinity(0))} CPU(s); {time.perf_counter() - started:.0f} s; "
        f"medians over {args.rounds} round(s), auto/best the ratio of the medians"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
