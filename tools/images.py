"""The `images` workload of `python -m statecore bench`: a real image pipeline, against the peers.

JPEG-encoded images held in memory (about 100 kB each, 500x375, made once with Pillow and kept
in a cache folder), each sample decoded with Pillow, randomly resized-cropped to 224x224 and
flipped, then turned into a normalised float tensor with torch ops; batches of 64, 2 workers.
This is the pipeline of most image classification training scripts, written without torchvision.

The loaders, side by side in rotating rounds (`loader_bench.rotated`): torch's DataLoader,
statecore's default, its threads, its `num_workers="auto"`, and the loaders a user would pick
instead: SPDL's process loader (`spdl.dataloader.get_pytorch_dataloader`, torch's signature), its
thread loader (`spdl.dataloader.DataLoader`) and torchdata's `StatefulDataLoader`. Each is used
as its documentation shows, with its own defaults; a missing one is skipped with its install line.

Each run is a whole epoch of a fresh loader, from `iter(loader)` to the last batch: starting the
workers is part of what a user waits for, and SPDL has no persistent workers. Two figures per run:
images per second over that stretch, and CPU seconds per image of the whole process tree (the main
process with all its threads, and every worker process) over the run, the workers' shutdown
included (`TreeClock`).

`--breakdown` adds one run of each loader whose samples time their own stages in the thread that
ran them (`time.thread_time`): decoding, augmenting, making the tensor, collating; the rest of the
tree's CPU is the loader's, told apart by where it ran (worker processes or the main process);
and the minor page faults of collating, each a page of fresh memory a batch was written into.
"""

from __future__ import annotations

import gc
import importlib
import io
import itertools
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch
import torch.utils.data

from statecore.tools.workloads import Workload

__all__ = [
    "CROP",
    "IMAGE_BYTES",
    "Contender",
    "ImagesReport",
    "Jpegs",
    "Run",
    "Stages",
    "TreeClock",
    "available_contenders",
    "bench_workload",
    "cache_folder",
    "contenders",
    "encoded_images",
    "measure_run",
    "stage_collate",
]

WIDTH, HEIGHT, QUALITY = 500, 375, 90
"""The images as encoded: ImageNet's typical size, at a quality that gives about 100 kB."""
IMAGE_BYTES = 100_000
"""About the size of one encoded image."""
CROP = 224
"""The side of the square every sample is resized to."""
_FORMAT = 1
"""The cache file's format and the images' recipe: a change makes them again."""
_MEAN = torch.tensor([0.485, 0.456, 0.406]).mul(255.0).view(3, 1, 1)
_INVERSE_STD = torch.tensor([0.229, 0.224, 0.225]).mul(255.0).reciprocal().view(3, 1, 1)


# --- the images ---------------------------------------------------------------------------------


def cache_folder(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where the encoded images are kept: `cache` if given, else $STATECORE_CACHE, else
    $XDG_CACHE_HOME/statecore (~/.cache/statecore)."""
    if cache is not None:
        return Path(cache)
    if named := os.environ.get("STATECORE_CACHE"):
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "statecore"


def _encode(count: int) -> list[bytes]:
    """`count` JPEGs of WIDTH x HEIGHT, the same on every machine: a smooth random picture with
    grain on it, which compresses as photographs do (a pure gradient would make 10 kB files,
    pure noise 300 kB ones)."""
    import numpy
    from PIL import Image

    generator = numpy.random.default_rng(_FORMAT)
    # One field of grain, each image a window of it: drawing fresh grain per image would make
    # generating a few thousand take minutes.
    grain = generator.integers(-28, 29, (2 * HEIGHT, 2 * WIDTH, 3), dtype=numpy.int16)
    images = []
    for _ in range(count):
        coarse = generator.integers(0, 256, (HEIGHT // 25 + 1, WIDTH // 25 + 1, 3), numpy.uint8)
        smooth = Image.fromarray(coarse).resize((WIDTH, HEIGHT), Image.Resampling.BICUBIC)
        top, left = generator.integers(0, HEIGHT), generator.integers(0, WIDTH)
        window = grain[top : top + HEIGHT, left : left + WIDTH]
        pixels = numpy.clip(numpy.asarray(smooth, numpy.int16) + window, 0, 255)
        encoded = io.BytesIO()
        Image.fromarray(pixels.astype(numpy.uint8)).save(encoded, "JPEG", quality=QUALITY)
        images.append(encoded.getvalue())
    return images


def encoded_images(count: int, cache: str | os.PathLike[str] | None = None) -> list[bytes]:
    """`count` encoded images, read from the cache folder, or made and written there once.

    The file holds the offsets (count + 1 little-endian int64) and then the images back to back;
    it is written to a temporary name and renamed, so a run that is killed leaves no half file.
    """
    path = cache_folder(cache) / f"jpegs-v{_FORMAT}-{count}.bin"
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        images = _encode(count)
        offsets = [0, *itertools.accumulate(len(image) for image in images)]
        head = b"".join(offset.to_bytes(8, "little") for offset in offsets)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(head + b"".join(images))
        os.replace(partial, path)
        return images
    offsets = [int.from_bytes(blob[8 * at : 8 * at + 8], "little") for at in range(count + 1)]
    start = 8 * (count + 1)
    return [blob[start + a : start + b] for a, b in itertools.pairwise(offsets)]


Sample = tuple[torch.Tensor, int] | tuple[torch.Tensor, int, torch.Tensor]

STAGES = ("decode", "augment", "tensor", "collate")
"""The stages a sample's CPU is counted in with `Jpegs(stages=True)` and `stage_collate`."""


class Jpegs(torch.utils.data.Dataset[Sample]):
    """`size` JPEGs in memory; a sample is one of them decoded, randomly resized-cropped to
    CROP x CROP (a tenth to all of the area, aspect ratio 3/4 to 4/3), flipped half the time,
    and normalised with ImageNet's mean and deviation into a float32 tensor of 3 x CROP x CROP,
    with its label (the index modulo 1000).

    The random choices come from torch's generator, which every loader seeds per worker.

    With `stages`, a sample is `(tensor, label, cpu)`: `cpu` holds the CPU seconds of the thread
    that made it for each stage of STAGES (collate left at 0, `stage_collate` fills it), and
    whether it ran in the process that made the dataset (1.0) or in a worker process (0.0).
    """

    def __init__(
        self,
        size: int,
        cache: str | os.PathLike[str] | None = None,
        stages: bool = False,
    ) -> None:
        self.images = encoded_images(size, cache)
        self.stages = stages
        self.home = os.getpid()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Sample:
        from PIL import Image

        started = time.thread_time()
        picture = Image.open(io.BytesIO(self.images[index])).convert("RGB")
        decoded = time.thread_time()
        box = _crop_box(*picture.size)
        picture = picture.resize((CROP, CROP), Image.Resampling.BILINEAR, box=box)
        if torch.rand(()) < 0.5:
            picture = picture.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        augmented = time.thread_time()
        pixels = torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8)
        tensor = pixels.view(CROP, CROP, 3).permute(2, 0, 1).float().sub_(_MEAN).mul_(_INVERSE_STD)
        label = index % 1000
        if not self.stages:
            return tensor, label
        finished = time.thread_time()
        cpu = torch.tensor(
            [
                decoded - started,
                augmented - decoded,
                finished - augmented,
                0.0,
                float(os.getpid() == self.home),
            ],
            dtype=torch.float64,
        )
        return tensor, label, cpu


def _crop_box(width: int, height: int) -> tuple[float, float, float, float]:
    """A random crop of a tenth to all of the area and an aspect ratio from 3/4 to 4/3 (drawn
    on a log scale), as random resized crops are; the centred largest one if ten draws miss."""
    area = width * height
    for _ in range(10):
        target = area * float(torch.empty(()).uniform_(0.08, 1.0))
        ratio = float(torch.empty(()).uniform_(-0.2877, 0.2877).exp())  # log(3/4), log(4/3)
        crop_width = round((target * ratio) ** 0.5)
        crop_height = round((target / ratio) ** 0.5)
        if 0 < crop_width <= width and 0 < crop_height <= height:
            left = int(torch.randint(0, width - crop_width + 1, ()))
            top = int(torch.randint(0, height - crop_height + 1, ()))
            return (left, top, left + crop_width, top + crop_height)
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return (left, top, left + side, top + side)


def _thread_faults() -> int:
    """The minor page faults of the calling thread so far; 0 where the system does not say."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return 0 if who is None else resource.getrusage(who).ru_minflt


def stage_collate(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch's default collate of `(tensor, label, cpu)` samples, the CPU seconds it took added
    to the batch's `cpu`: one row per batch, STAGES summed over its samples, then where it ran,
    then the minor page faults collating took (pages of memory the batch was the first to write:
    a loader that collates into fresh memory pays for each of them, one that reuses none)."""
    faults = _thread_faults()
    started = time.thread_time()
    images, labels, cpu = torch.utils.data.default_collate(list(samples))
    took = time.thread_time() - started
    faulted = _thread_faults() - faults
    row = torch.cat((cpu.sum(dim=0), torch.zeros(1, dtype=cpu.dtype)))
    row[3] += took
    row[4] = cpu[0, 4]
    row[5] = faulted
    return images, labels, row


# --- CPU of the process tree --------------------------------------------------------------------


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_ticks(pid: int) -> int:
    """The CPU of process `pid` in clock ticks: its threads' user and system time, and that of
    its children it has reaped; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    fields = text[text.rindex(b")") + 2 :].split()
    # after the name: state ppid ... utime (14th field of the file) stime cutime cstime
    return sum(int(field) for field in fields[11:15])


@attrs.frozen
class TreeClock:
    """The CPU seconds spent so far by this process and all its descendants.

    On Linux, from /proc: each live process's own time and its reaped children's. A process
    counts once: live, in its own line; reaped, in its parent's (so a worker reaped by a
    worker, or a pool kept alive between runs, is neither lost nor counted twice). Threads
    are in their process's line, live or ended. Elsewhere, `resource.getrusage` of this
    process and its reaped children: right once every worker of a run has been joined.
    """

    root: int = attrs.field(factory=os.getpid)

    def seconds(self) -> float:
        if not Path(f"/proc/{self.root}/stat").exists():
            mine = resource.getrusage(resource.RUSAGE_SELF)
            reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
            return mine.ru_utime + mine.ru_stime + reaped.ru_utime + reaped.ru_stime
        from statecore.tools.memory import descendants

        ticks = sum(_process_ticks(pid) for pid in (self.root, *descendants(self.root)))
        return ticks / _TICK

    def own_seconds(self) -> float:
        """This process's own CPU seconds, every thread's, without any child's."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime


# --- the loaders --------------------------------------------------------------------------------


Arguments = dict[str, Any]


def _torch(dataset: Jpegs, arguments: Arguments) -> Iterable[Any]:
    return torch.utils.data.DataLoader(dataset, **arguments)


def _statecore(**ours: Any) -> Callable[[Jpegs, Arguments], Iterable[Any]]:
    def build(dataset: Jpegs, arguments: Arguments) -> Iterable[Any]:
        import statecore

        loader: Iterable[Any] = statecore.DataLoader(dataset, **{**arguments, **ours})
        return loader

    return build


def _peer(module: str) -> Any:
    """A peer's module, imported by name: the peers are optional, and typed or not."""
    return importlib.import_module(module)


def _spdl_process(dataset: Jpegs, arguments: Arguments) -> Iterable[Any]:
    loader: Iterable[Any] = _peer("spdl.dataloader").get_pytorch_dataloader(dataset, **arguments)
    return loader


def _spdl_thread(dataset: Jpegs, arguments: Arguments) -> Iterable[Any]:
    """SPDL's thread loader as its guide builds one from a map-style dataset: the sampler as
    the source, the dataset's `__getitem__` run on the worker threads, batches collated there."""
    sampler = torch.utils.data.RandomSampler(dataset, generator=arguments["generator"])
    workers = arguments["num_workers"]
    loader: Iterable[Any] = _peer("spdl.dataloader").DataLoader(
        sampler,
        preprocessor=dataset.__getitem__,
        batch_size=arguments["batch_size"],
        aggregator=arguments.get("collate_fn") or torch.utils.data.default_collate,
        buffer_size=2 * workers,  # torch's prefetch_factor of 2 per worker
        num_threads=workers,
    )
    return loader


def _torchdata(dataset: Jpegs, arguments: Arguments) -> Iterable[Any]:
    stateful = _peer("torchdata.stateful_dataloader").StatefulDataLoader
    loader: Iterable[Any] = stateful(dataset, **arguments)
    return loader


def _stop(loader: Iterable[Any], iterator: Iterator[Any]) -> None:
    """Stop a run's workers now, whichever library made them."""
    from statecore.tools.workloads import close

    close(iterator)
    if callable(stop := getattr(iterator, "_shutdown_workers", None)):
        stop()  # torchdata's iterator, not a subclass of torch's
    if callable(end := getattr(iterator, "close", None)):
        end()  # SPDL's loaders iterate in a generator: closing it stops its pool
    # SPDL's process loader leaves the dataset it pickled into shared memory behind (until the
    # interpreter exits): a few runs of a 200 MB dataset would fill /dev/shm.
    if (shared := getattr(loader, "_shmem", None)) is not None:
        shared.close()
        shared.unlink()


@attrs.frozen
class Contender:
    """One loader of the comparison: how to build it, and what it needs installed."""

    name: str
    build: Callable[[Jpegs, Arguments], Iterable[Any]] = attrs.field(repr=False)
    needs: str | None = None
    """The module it imports, for the peers; None for torch and statecore."""
    install: str = ""
    """The command that installs what it needs."""
    ours: bool = False
    """Whether it is one of statecore's loaders."""

    def missing(self) -> str | None:
        """None if it can run; else what is missing and the line that installs it."""
        if self.needs is None:
            return None
        try:
            importlib.import_module(self.needs)
        except ImportError:
            return f"{self.needs} is not installed: {self.install}"
        return None


_PEERS = "pip install -e '.[peers]' in the statecore checkout"


def contenders() -> tuple[Contender, ...]:
    """Every loader the workload compares, torch's first."""
    return (
        Contender("torch", _torch),
        Contender("statecore", _statecore(), ours=True),
        Contender("threads", _statecore(executor="thread"), ours=True),
        Contender("auto", _statecore(num_workers="auto"), ours=True),
        Contender(
            "spdl-process", _spdl_process, "spdl", f"pip install 'spdl==0.8.*' (or {_PEERS})"
        ),
        Contender("spdl-thread", _spdl_thread, "spdl", f"pip install 'spdl==0.8.*' (or {_PEERS})"),
        Contender(
            "torchdata", _torchdata, "torchdata", f"pip install 'torchdata>=0.10' (or {_PEERS})"
        ),
    )


def available_contenders(
    every: Sequence[Contender], say: Callable[[str], None]
) -> tuple[Contender, ...]:
    """The contenders that can run; each skipped one is said with its install line."""
    running = []
    for contender in every:
        if (why := contender.missing()) is not None:
            say(f"images: {contender.name} skipped, {why}")
        else:
            running.append(contender)
    return tuple(running)


# --- one run ------------------------------------------------------------------------------------


@attrs.frozen
class Stages:
    """Where a run's CPU went, in seconds: the samples' own stages, and the rest by process."""

    decode: float
    augment: float
    tensor: float
    collate: float
    workers: float
    """The worker processes' CPU beyond the stages they ran: the loader's worker side (taking
    tasks, handing batches over, its threads)."""
    main: float
    """The main process's CPU beyond the stages it ran (thread workers): the loader's main
    side (scheduling, receiving batches, its threads), the consumer's loop too."""

    @property
    def total(self) -> float:
        return self.decode + self.augment + self.tensor + self.collate + self.workers + self.main

    def shares(self) -> tuple[float, ...]:
        total = self.total or 1.0
        return tuple(part / total for part in attrs.astuple(self))


@attrs.frozen
class Run:
    """One whole epoch of one loader."""

    images: int
    seconds: float
    """From `iter(loader)` to the last batch."""
    cpu: float
    """CPU seconds of the process tree, from `iter(loader)` until its workers were stopped."""
    stages: Stages | None = None
    collate_faults: int = 0
    """With `stages`: the minor page faults of collating, over all the run's batches."""

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds

    @property
    def cpu_per_image(self) -> float:
        return self.cpu / self.images


def measure_run(
    contender: Contender,
    dataset: Jpegs,
    arguments: Arguments,
    batches: int | None = None,
) -> Run:
    """One epoch (or its first `batches` batches) of a fresh loader, timed and its CPU counted.

    Building the loader is not counted (SPDL's process loader pickles the dataset then); with
    `dataset.stages`, the batches' stage times are added up into the run's `Stages`.
    """
    loader = contender.build(dataset, dict(arguments))
    clock = TreeClock()
    gc.collect()  # garbage left by earlier runs is not this run's to collect
    images = 0
    totals = torch.zeros(len(STAGES), dtype=torch.float64)
    in_main = torch.zeros(len(STAGES), dtype=torch.float64)
    faults = 0.0
    cpu_before, own_before = clock.seconds(), clock.own_seconds()
    started = time.perf_counter()
    iterator = iter(loader)
    try:
        for batch in itertools.islice(iterator, batches):
            images += len(batch[0])
            if dataset.stages:
                row = batch[2]
                totals += row[:4]
                if row[4]:
                    in_main += row[:4]
                faults += float(row[5])
        seconds = time.perf_counter() - started
    finally:
        _stop(loader, iterator)
        del iterator, loader
    cpu, own = clock.seconds() - cpu_before, clock.own_seconds() - own_before
    stages = None
    if dataset.stages:
        decode, augment, tensor, collate = totals.tolist()
        stages = Stages(
            decode,
            augment,
            tensor,
            collate,
            workers=max(0.0, cpu - own - float((totals - in_main).sum())),
            main=max(0.0, own - float(in_main.sum())),
        )
    return Run(images, seconds, cpu, stages, round(faults))


# --- the rounds and the report ------------------------------------------------------------------


@attrs.frozen
class ImagesReport:
    """Every run of every loader, round by round, and the figures drawn from them."""

    images: int
    batch_size: int
    num_workers: int
    runs: Mapping[str, tuple[Run, ...]]
    """Each loader's runs, one a round, in the contenders' order."""
    skipped: Mapping[str, str] = attrs.field(factory=dict)
    """The loaders that did not run, and why."""
    failed: Mapping[str, str] = attrs.field(factory=dict)
    """The loaders whose run raised, and what: they have no runs."""
    breakdown: Mapping[str, Run] = attrs.field(factory=dict)
    """The staged run of each loader, with `--breakdown`."""
    seconds: float = 0.0

    def speed_ratios(self, name: str) -> tuple[float, ...]:
        """Per round, the loader's images/s over torch's."""
        return tuple(
            ours.images_per_second / theirs.images_per_second
            for ours, theirs in zip(self.runs[name], self.runs["torch"], strict=True)
        )

    def cpu_ratios(self, name: str) -> tuple[float, ...]:
        """Per round, the loader's CPU per image over torch's (below 1: less CPU)."""
        return tuple(
            ours.cpu_per_image / theirs.cpu_per_image
            for ours, theirs in zip(self.runs[name], self.runs["torch"], strict=True)
        )

    def speed(self, name: str) -> float:
        return statistics.median(self.speed_ratios(name))

    def cpu(self, name: str) -> float:
        return statistics.median(self.cpu_ratios(name))

    def verdict(self, ours: Iterable[str]) -> str | None:
        """The issue's goals, checked on statecore's best column (by images/s)."""
        ran = [name for name in ours if name in self.runs]
        if not ran or "torch" not in self.runs:
            return None
        best = max(ran, key=self.speed)
        peers = [name for name in self.runs if name != "torch" and name not in ran]
        behind = [peer for peer in peers if self.speed(peer) >= self.speed(best)]
        goals = [
            f"images/s {self.speed(best):.2f}x torch (goal >= 1.10x: "
            f"{'met' if self.speed(best) >= 1.10 else 'missed'})",
            f"CPU/image {self.cpu(best):.2f}x torch (goal <= 0.85x: "
            f"{'met' if self.cpu(best) <= 0.85 else 'missed'})",
            "ahead of every peer that ran" if not behind else f"NOT ahead of {', '.join(behind)}",
        ]
        return f"goals, statecore's best column ({best}): " + "; ".join(goals)

    def table(self, ours: Iterable[str] = ("statecore", "threads", "auto")) -> str:
        rounds = len(self.runs["torch"]) if "torch" in self.runs else 0
        lines = [
            f"images: {self.images} JPEGs of about {IMAGE_BYTES // 1000} kB ({WIDTH}x{HEIGHT}), "
            f"decoded, random-resized-cropped to {CROP}, flipped, normalised; batch "
            f"{self.batch_size}, {self.num_workers} workers, {rounds} round(s), a whole epoch "
            f"of a fresh loader per run",
            f"{'loader':13} {'images/s (min-max)':>22} {'ratio':>6} "
            f"{'CPU ms/image (min-max)':>23} {'ratio':>6}",
        ]
        for name, runs in self.runs.items():
            speeds = [run.images_per_second for run in runs]
            costs = [1e3 * run.cpu_per_image for run in runs]
            speed = f"{statistics.median(speeds):.0f} ({min(speeds):.0f}-{max(speeds):.0f})"
            cost = f"{statistics.median(costs):.2f} ({min(costs):.2f}-{max(costs):.2f})"
            against = "torch" in self.runs
            speed_ratio = f"{self.speed(name):5.2f}x" if against else "-"
            cpu_ratio = f"{self.cpu(name):5.2f}x" if against else "-"
            lines.append(f"{name:13} {speed:>22} {speed_ratio:>6} {cost:>23} {cpu_ratio:>6}")
        for name, why in self.skipped.items():
            lines.append(f"{name:13} skipped: {why}")
        for name, why in self.failed.items():
            lines.append(f"{name:13} FAILED: {why}")
        lines.append(
            "ratio: median over rounds of the loader's figure / torch's in the same round "
            "(images/s: above 1 is faster; CPU: below 1 is cheaper); CPU: the whole process "
            "tree, main process and workers, from iter(loader) until the workers were stopped"
        )
        if (verdict := self.verdict(ours)) is not None:
            lines.append(verdict)
        lines += self.breakdown_table()
        return "\n".join(lines)

    def breakdown_table(self) -> list[str]:
        if not self.breakdown:
            return []
        names = (*STAGES, "workers", "main")
        lines = [
            "where the CPU went, one staged run of each loader: ms per image (% of the tree's)",
            f"{'loader':13} {'total':>7} "
            + " ".join(f"{name:>13}" for name in names)
            + f" {'faults':>7}",
        ]
        for name, run in self.breakdown.items():
            assert run.stages is not None
            parts = attrs.astuple(run.stages)
            cells = " ".join(
                f"{1e3 * part / run.images:6.2f} ({100 * share:3.0f}%)"
                for part, share in zip(parts, run.stages.shares(), strict=True)
            )
            faults = run.collate_faults / run.images
            lines.append(
                f"{name:13} {1e3 * run.stages.total / run.images:7.2f} {cells} {faults:7.1f}"
            )
        lines.append(
            "decode/augment/tensor/collate: CPU of the thread running each stage (time."
            "thread_time); workers: the worker processes' other CPU (the loader's worker side: "
            "taking tasks, handing batches over); main: the main process's other CPU (the "
            "loader's main side: scheduling, receiving batches, its threads; and the loop); "
            "faults: minor page faults per image while collating (each a page of fresh memory "
            "the batch was the first to write)"
        )
        return lines


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_images(
    images: int,
    rounds: int,
    *,
    batch_size: int = 64,
    num_workers: int = 2,
    cache: str | os.PathLike[str] | None = None,
    breakdown: bool = False,
    every: Sequence[Contender] | None = None,
    say: Callable[[str], None] = _say,
) -> ImagesReport:
    """Run each available contender once per round, taking turns in an order that rotates
    from round to round, after one small untimed run of each; with `breakdown`, one staged
    run of each afterwards."""
    from statecore.tools.loader_bench import rotated

    started = time.perf_counter()
    every = contenders() if every is None else tuple(every)
    running = available_contenders(every, say)
    skipped = {c.name: why for c in every if (why := c.missing()) is not None}
    say(f"images: {images} encoded images, from the cache in {cache_folder(cache)} ...")
    dataset = Jpegs(images, cache)

    def arguments() -> Arguments:
        return {
            "batch_size": batch_size,
            "shuffle": True,
            "generator": torch.Generator().manual_seed(images),
            "num_workers": num_workers,
        }

    runs: dict[str, list[Run]] = {contender.name: [] for contender in running}
    staged: dict[str, Run] = {}
    failed: dict[str, str] = {}

    def attempt(contender: Contender, data: Jpegs, options: Arguments, **how: Any) -> Run | None:
        """One run; a loader that raises is out from then on (its runs gone: a ratio needs
        every round), and the others go on."""
        try:
            return measure_run(contender, data, options, **how)
        except Exception as failure:
            lines = str(failure).strip().splitlines()
            failed[contender.name] = f"raised {type(failure).__name__}: {lines[0] if lines else ''}"
            say(f"images: {contender.name} {failed[contender.name]}")
            runs.pop(contender.name, None)
            return None

    with warnings.catch_warnings():
        # torchdata 0.11 warns on every loader it makes that it calls a deprecated torch API.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        for contender in running:  # imports, one-time set-up, a warm page cache: no round's
            attempt(contender, dataset, arguments(), batches=2)
        for number in range(rounds):
            for contender in rotated(number, running):
                if contender.name in failed:
                    continue
                run = attempt(contender, dataset, arguments())
                if run is None:
                    continue
                runs[contender.name].append(run)
                say(
                    f"images: round {number + 1}/{rounds} {contender.name}: "
                    f"{run.images_per_second:.0f} images/s, "
                    f"{1e3 * run.cpu_per_image:.2f} CPU ms/image"
                )
        if breakdown:
            timed = Jpegs.__new__(Jpegs)
            timed.__dict__.update(dataset.__dict__, stages=True)
            for contender in running:
                options = {**arguments(), "collate_fn": stage_collate}
                if contender.name not in failed and (run := attempt(contender, timed, options)):
                    staged[contender.name] = run
    return ImagesReport(
        images=len(dataset),
        batch_size=batch_size,
        num_workers=num_workers,
        runs={name: tuple(done) for name, done in runs.items()},
        skipped=skipped,
        failed=failed,
        breakdown=staged,
        seconds=time.perf_counter() - started,
    )


def bench_workload(
    workload: Workload,
    rounds: int,
    *,
    stream: TextIO | None = None,
    cache: str | os.PathLike[str] | None = None,
    breakdown: bool = False,
    command: str = "",
    say: Callable[[str], None] = _say,
) -> int:
    """The images workload as `bench` runs it (`Workload.own_bench`): `workload.batches` batches
    of `workload.batch_size` images, its workers, `rounds` rounds; the table on `stream`.

    Returns 0, or 2 without Pillow (said with its install line, nothing run)."""
    out = sys.stdout if stream is None else stream
    try:
        importlib.import_module("PIL")
    except ImportError:
        say(f"bench: the {workload.name} workload needs Pillow, which is not installed: {_PEERS}")
        return 2
    report = run_images(
        workload.batches * workload.batch_size,
        rounds,
        batch_size=workload.batch_size,
        num_workers=workload.num_workers,
        cache=cache,
        breakdown=breakdown,
        say=say,
    )
    if command:
        print(f"$ {command}", file=out)
    print(report.table(), file=out, flush=True)
    return 0
