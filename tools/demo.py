"""`python -m statecore demo`: statecore's DataLoader next to torch's, on a synthetic image set.

The dataset (`SyntheticImages`) makes 3x64x64 uint8 "images" from their index, with a little
integer arithmetic per image so that loading costs some CPU, and an int label. Every executor
the registry offers loads it (an in-process one with num_workers=0, the others with
num_workers=2), and so does torch's own DataLoader with the same arguments: shuffled by a
seeded generator, so every run of either hands over the same batches in the same order.

Each loader must hand over exactly torch's batches. Each loads one epoch a few times, taking
turns with the others, and the table shows the median: images per second (worker start-up
included, as in one epoch of training) and the ratio to torch's. The exit code is 0 when every
loader matched torch, 1 otherwise.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import attrs
import torch
import torch.utils.data

from statecore.tools.progress import Bar

__all__ = [
    "DemoResult",
    "Progress",
    "Run",
    "SyntheticImages",
    "compare_batches",
    "demo",
    "run_demo",
]

SIDE = 64
CHANNELS = 3
CLASSES = 10


class SyntheticImages(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """`size` images, each made from its index alone: the same in every process and run."""

    def __init__(self, size: int, side: int = SIDE, work: int = 4) -> None:
        self.size = size
        self.side = side
        self.work = work

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} images")
        generator = torch.Generator().manual_seed(int(index))
        shape = (CHANNELS, self.side, self.side)
        pixels = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32)
        for _ in range(self.work):  # a little blurring: integer arithmetic, so exact anywhere
            pixels = (2 * pixels + pixels.roll(1, 1) + pixels.roll(1, 2)) // 4
        return pixels.to(torch.uint8), int(index) % CLASSES


# --- comparing ----------------------------------------------------------------------------------


def _leaves(batch: object, path: str = "batch") -> Iterator[tuple[str, object]]:
    """Every tensor or plain value in a collated batch, with where it sits."""
    if isinstance(batch, (list, tuple)):
        for position, item in enumerate(batch):
            yield from _leaves(item, f"{path}[{position}]")
    elif isinstance(batch, dict):
        for key, item in batch.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    else:
        yield path, batch


def compare_batches(expected: Sequence[Any], got: Sequence[Any]) -> str | None:
    """None if `got` is exactly `expected`, batch for batch; else the first difference, in words.

    Tensors must agree in dtype, shape and every value; anything else must be equal.
    """
    for number, (want, have) in enumerate(zip(expected, got, strict=False)):
        want_leaves, have_leaves = list(_leaves(want)), list(_leaves(have))
        if [path for path, _ in want_leaves] != [path for path, _ in have_leaves]:
            return (
                f"batch {number} is made differently: {_outline(have)} instead of {_outline(want)}"
            )
        for (path, a), (_, b) in zip(want_leaves, have_leaves, strict=True):
            where = f"batch {number}, {path.replace('batch', '', 1) or 'the batch'}"
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                if a.dtype != b.dtype or a.shape != b.shape:
                    return (
                        f"{where}: {b.dtype} of shape {tuple(b.shape)} instead of "
                        f"{a.dtype} of shape {tuple(a.shape)}"
                    )
                if not torch.equal(a, b):
                    differ = int((a != b).sum())
                    return f"{where}: {differ} of {a.numel()} values differ"
            elif type(a) is not type(b) or a != b:
                return f"{where}: {b!r} instead of {a!r}"
    if len(got) != len(expected):
        return f"{len(got)} batches instead of {len(expected)}"
    return None


def _outline(batch: object) -> str:
    return ", ".join(path for path, _ in _leaves(batch))


# --- progress -----------------------------------------------------------------------------------


class Progress:
    """The demo's progress: a tqdm bar (`statecore.tools.progress.Bar`) showing the loader now
    loading, where a bar is wanted; anywhere else (a log, a pipe, CI) one line per stage.

    The stage lines are what a log of the demo needs to show where it stands; on a terminal
    the bar's description says the same, so only the closing line is printed there.
    """

    def __init__(self, total: int, stream: TextIO | None = None, show: bool = True) -> None:
        self.bar = Bar(total, unit="batch", description="demo", show=show, stream=stream)

    def stage(self, label: str) -> None:
        if self.bar.live:
            self.bar.describe(label)
        else:
            self.bar.note(f"demo: {label} ...")

    def advance(self, steps: int = 1) -> None:
        self.bar.advance(steps)

    def done(self, message: str) -> None:
        self.bar.close()
        self.bar.note(f"demo: {message}")


# --- running ------------------------------------------------------------------------------------


@attrs.frozen
class Run:
    """One loader of the demo: who loads, with how many workers, and how to build it."""

    name: str
    """An executor's name, or "torch"."""
    num_workers: int
    build: Callable[[], Any] = attrs.field(eq=False, repr=False)


@attrs.frozen
class DemoResult:
    name: str
    num_workers: int
    batches: int
    images_per_s: float
    """The median over the runs."""
    ratio: float
    """images_per_s over torch's with the same num_workers."""
    mismatch: str | None
    """None when every run handed over exactly torch's batches."""


def _groups(
    dataset: SyntheticImages, batch_size: int, workers: int, seed: int
) -> list[tuple[Run, list[Run]]]:
    """torch's loader and statecore's with the same arguments, grouped by num_workers.

    Every executor that can run here is in one group: one that loads in-process with
    num_workers=0, any other with num_workers=`workers`. One whose optional package is not
    installed (Ray without the `ray` extra) is left out; `skipped` names it. "pinned" runs only
    where there is an accelerator to pin for; elsewhere it would hand over mp's batches again.
    """
    import statecore
    from statecore.executors._registry import PINNED, loads_in_process, runnable

    def arguments(num_workers: int) -> dict[str, Any]:
        return dict(
            batch_size=batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
            num_workers=num_workers,
        )

    def torch_loader(num_workers: int) -> Callable[[], Any]:
        return lambda: torch.utils.data.DataLoader(dataset, **arguments(num_workers))

    def statecore_loader(name: str, num_workers: int) -> Callable[[], Any]:
        return lambda: statecore.DataLoader(dataset, **arguments(num_workers), executor=name)

    executors: dict[int, list[Run]] = {}
    for name in runnable()[0]:
        if name == PINNED and not torch.accelerator.is_available():
            continue  # without an accelerator it hands over mp's batches, unpinned
        num_workers = 0 if loads_in_process(name) else workers
        executors.setdefault(num_workers, []).append(
            Run(name, num_workers, statecore_loader(name, num_workers))
        )
    return [
        (Run("torch", num_workers, torch_loader(num_workers)), ours)
        for num_workers, ours in sorted(executors.items())
    ]


def _epoch(run: Run, progress: Progress) -> tuple[list[Any], float]:
    """Load one epoch; return its batches and the seconds it took, worker start-up included."""
    batches: list[Any] = []
    started = time.perf_counter()
    loader = run.build()
    for batch in loader:
        batches.append(batch)
        progress.advance()
    del loader
    return batches, time.perf_counter() - started


def run_demo(
    batches: int = 40,
    batch_size: int = 32,
    workers: int = 2,
    repeats: int = 3,
    seed: int = 0,
    stream: TextIO | None = None,
    progress_bar: bool = True,
) -> list[DemoResult]:
    """Time and check every loader; results in table order (executors, then torch, per group).

    Each loader loads one epoch `repeats` times. Within a group they take turns, in an order
    that reverses every round so that drift on a busy machine hits them alike; torch goes
    first in the first round, so its batches are there to compare with. Every run of every
    loader, torch's included, is compared with torch's first.
    """
    dataset = SyntheticImages(batches * batch_size)
    groups = _groups(dataset, batch_size, workers, seed)
    runs = [run for theirs, ours in groups for run in (theirs, *ours)]
    progress = Progress(len(runs) * repeats * batches, stream, show=progress_bar)
    seconds: dict[Run, list[float]] = {run: [] for run in runs}
    counts: dict[Run, int] = {}
    mismatch: dict[Run, str | None] = {run: None for run in runs}
    reference: dict[Run, list[Any]] = {}
    for round_ in range(repeats):
        for theirs, ours in groups:
            order = [theirs, *ours]
            for run in order if round_ % 2 == 0 else reversed(order):
                progress.stage(
                    f"{run.name} (num_workers={run.num_workers}) run {round_ + 1}/{repeats}"
                )
                got, took = _epoch(run, progress)
                seconds[run].append(took)
                counts.setdefault(run, len(got))
                expected = reference.setdefault(theirs, got)  # torch's first run
                if mismatch[run] is None:
                    mismatch[run] = compare_batches(expected, got)
                del got, expected
    images = batches * batch_size
    results = []
    for theirs, ours in groups:
        torch_rate = _rate(images, seconds[theirs])
        for run in (*ours, theirs):
            rate = _rate(images, seconds[run])
            results.append(
                DemoResult(
                    run.name, run.num_workers, counts[run], rate, rate / torch_rate, mismatch[run]
                )
            )
    progress.done(f"{len(runs) * repeats} epochs loaded")
    return results


def _rate(images: int, seconds: list[float]) -> float:
    return images / statistics.median(seconds)


def format_table(results: Sequence[DemoResult], repeats: int) -> str:
    lines = [
        f"{'executor':10} {'workers':>7} {'batches':>7} {'images/s':>10} {'vs torch':>8}  match",
    ]
    for result in results:
        match = "yes" if result.mismatch is None else "NO"
        lines.append(
            f"{result.name:10} {result.num_workers:7d} {result.batches:7d} "
            f"{result.images_per_s:10.0f} {result.ratio:7.2f}x  {match}"
        )
    lines.append(f"(medians of {repeats} runs each; images/s include starting the workers)")
    return "\n".join(lines)


def skipped_line() -> str | None:
    """One line naming each executor that cannot run here and how to install what it needs:
    "ray: skipped, pip install -e '.[ray]'"; None when every executor can run."""
    from statecore.executors._registry import runnable

    skipped = runnable()[1]
    return "; ".join(str(why) for why in skipped) or None


def demo(
    quick: bool = False, batches: int | None = None, workers: int = 2, progress_bar: bool = True
) -> int:
    """The `demo` command: print the table; 0 if every loader matched torch, else 1."""
    batch_size, repeats = (16, 2) if quick else (32, 3)
    count = batches if batches is not None else (6 if quick else 40)
    if count < 1:
        print("demo: --batches must be at least 1", file=sys.stderr)
        return 2
    print(
        f"loading {count} batches of {batch_size} synthetic {CHANNELS}x{SIDE}x{SIDE} images, "
        f"shuffled with a seeded generator, through each executor and through torch ...",
        flush=True,
    )
    if skipped := skipped_line():
        print(skipped, flush=True)
    results = run_demo(
        batches=count,
        batch_size=batch_size,
        workers=workers,
        repeats=repeats,
        progress_bar=progress_bar,
    )
    print(format_table(results, repeats))
    failed = [result for result in results if result.mismatch is not None]
    for result in failed:
        what = (
            "torch's own runs differ from one another"
            if result.name == "torch"
            else f"{result.name} did not hand over torch's batches"
        )
        print(f"MISMATCH (num_workers={result.num_workers}): {what}: {result.mismatch}")
    if failed:
        return 1
    print("every loader handed over exactly torch's batches")
    return 0
