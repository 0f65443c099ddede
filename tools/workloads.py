"""The workloads of `python -m statecore bench`, and how one run of one loader is measured.

A `Workload` says which dataset to load, with which loader arguments, what to time and what
figure to report. `measure` builds one fresh loader (torch's or statecore's, from the same
arguments), times it as the workload says, stops its workers, and returns a `Measurement`:
the seconds timed and the work done in them, in the workload's unit of work. The throughput
`work / seconds` is what the benchmark compares between the two loaders.

The datasets are defined here, at module level, so that spawn and forkserver workers can
unpickle them by name. The ones that stand for real work (sleeping, computing) measure their
own work with a clock around it and return that duration as the sample: the ideal an
efficiency is measured against comes from what the workers really did, not from what they
were asked to do (a 3 ms sleep overshoots by tens of microseconds, more on a busy machine).

The table of workloads, with the reasons for each choice, is in docs/performance.md.
"""

from __future__ import annotations

import enum
import functools
import gc
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.utils.data
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from statecore.tools.big_dataset import Catalogue
from statecore.tools.copy_on_read import Records, shared_records

__all__ = [
    "SEED",
    "WARMUP_BATCHES",
    "Floats",
    "Indices",
    "Loader",
    "Losses",
    "Measurement",
    "Mixed",
    "NumpyWork",
    "PythonWork",
    "Rows",
    "Side",
    "Sleeps",
    "StatefulStream",
    "Stream",
    "Timing",
    "Unit",
    "Workload",
    "WORKLOADS",
    "close",
    "is_straggler",
    "measure",
    "release",
    "select",
    "the_sample",
]

SEED = 20240611
"""Seeds the shuffling generator of every loader, so both loaders draw the same order."""

WARMUP_BATCHES = 4
"""Batches per epoch of the untimed run each loader makes before a workload's first pair."""


# --- datasets ----------------------------------------------------------------------------------


class Indices(torch.utils.data.Dataset[int]):
    """`size` trivial samples: each is its own index, so the loader's own cost is all there is."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class StreamPosition:
    """The iterator of a `Stream`: the next sample number, and where the worker's part ends."""

    def __init__(self, first: int, step: int, end: int) -> None:
        self.at, self.step, self.end = first, step, end

    def __iter__(self) -> StreamPosition:
        return self

    def __next__(self) -> int:
        at = self.at
        if at >= self.end:
            raise StopIteration
        self.at = at + self.step
        return at


class StatefulStreamPosition(StreamPosition):
    """A `StreamPosition` that says where it is (torchdata's Stateful protocol)."""

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.at = state["at"]


class Stream(torch.utils.data.IterableDataset[int]):
    """`size` trivial samples (their numbers), split between workers by striding, as torch's
    documentation shows: the iterable twin of `Indices`."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> StreamPosition:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return self.position(first, step, self.size)

    position: type[StreamPosition] = StreamPosition


class StatefulStream(Stream):
    """A `Stream` whose iterator has a state: statecore takes it with every batch."""

    position = StatefulStreamPosition


def is_straggler(index: int, one_in: int) -> bool:
    """Whether sample `index` is one of the slow ones: about one in `one_in`, by a hash.

    A hash rather than `index % one_in`: a period would line up with round-robin dispatch
    (batch k goes to worker k % num_workers) and put every straggler on the same worker.
    """
    if one_in <= 0:
        return False
    mixed = (index * 2654435761) & 0xFFFFFFFF  # Knuth's multiplicative hash
    return (mixed >> 16) % one_in == 0


Span = tuple[float, float, int]
"""A sample that waited: the seconds it waited, when it started (`time.perf_counter`, one
clock for every process on the machine) and the thread that waited (`threading.get_native_id`,
unique across processes)."""


class Sleeps(torch.utils.data.Dataset[Span]):
    """Samples that wait, as on remote storage: each sleeps and returns its `Span`.

    With `straggler_one_in` > 0, about one sample in that many (chosen by `is_straggler`)
    sleeps `straggler_factor` times longer. The start and the thread of every sample let the
    benchmark tell where the workers' time went that was not work (`Losses`).
    """

    def __init__(
        self,
        size: int,
        seconds: float,
        straggler_one_in: int = 0,
        straggler_factor: float = 40.0,
    ) -> None:
        self.size = size
        self.seconds = seconds
        self.straggler_one_in = straggler_one_in
        self.straggler_factor = straggler_factor

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Span:
        seconds = self.seconds
        if is_straggler(index, self.straggler_one_in):
            seconds *= self.straggler_factor
        started = time.perf_counter()
        time.sleep(seconds)
        return (time.perf_counter() - started, started, threading.get_native_id())


class NumpyWork(torch.utils.data.Dataset[float]):
    """Samples that compute: elementwise numpy arithmetic (about 1 ms of one core by default).

    Each returns the CPU time its own thread spent (`time.thread_time`), so time spent waiting
    for a core on a busy machine is not counted as work. Elementwise operations run on one
    thread, so one sample keeps exactly one core busy.
    """

    def __init__(self, size: int, floats: int = 25_000, passes: int = 10) -> None:
        self.size = size
        self.floats = floats
        self.passes = passes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> float:
        import numpy  # imported here: numpy is optional (the `bench` extra), torch is not

        started = time.thread_time()
        values = numpy.random.default_rng(index).random(self.floats)
        for _ in range(self.passes):
            values = numpy.sqrt(values * values + 1.0) - 0.5
        return time.thread_time() - started


class PythonWork(torch.utils.data.Dataset[float]):
    """Samples that compute in pure Python (about 1 ms of one core by default), holding the GIL.

    Each returns the CPU time its own thread spent (`time.thread_time`): time spent waiting
    for the GIL or for a core is not counted as work.
    """

    def __init__(self, size: int, steps: int = 14_000) -> None:
        self.size = size
        self.steps = steps

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> float:
        started = time.thread_time()
        total = index
        for step in range(self.steps):
            total = (total * 31 + step) % 1_000_003
        return time.thread_time() - started


class Mixed(torch.utils.data.Dataset[float]):
    """Samples that wait, then compute: a read from storage followed by decoding (by default
    2 ms of sleep, then about 1 ms of one core in pure Python, holding the GIL).

    Each returns its seconds of work: the sleep as measured, plus the CPU time its thread spent
    computing (time waiting for a core or the GIL is not counted).
    """

    def __init__(self, size: int, seconds: float = 0.002, steps: int = 14_000) -> None:
        self.size = size
        self.seconds = seconds
        self.steps = steps
        self.decoding = PythonWork(size, steps)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> float:
        started = time.perf_counter()
        time.sleep(self.seconds)
        slept = time.perf_counter() - started
        return slept + self.decoding[index]


class Floats(torch.utils.data.Dataset[torch.Tensor]):
    """Large samples: each a float32 tensor of `floats` values, all equal to its index."""

    def __init__(self, size: int, floats: int) -> None:
        self.size = size
        self.floats = floats

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.floats,), float(index), dtype=torch.float32)


class Rows(torch.utils.data.Dataset[torch.Tensor]):
    """An in-memory dataset: one large float32 tensor, each sample a block of its rows.

    A sample is a view of the whole tensor's storage, as from any dataset that slices a tensor
    it holds in memory. The tensor holds `min(size, blocks)` blocks of `floats` values, each
    filled with its number; sample i is block i % blocks. Pickled without the tensor, which is
    made again on unpickling: nothing large goes to spawned workers or through a test's pickle.
    Copied (`copy.copy`), it shares the tensor.
    """

    def __init__(self, size: int, floats: int, blocks: int) -> None:
        self.size = size
        self.floats = floats
        self.blocks = max(1, min(size, blocks))
        self.data = self._make()

    def _make(self) -> torch.Tensor:
        numbers = torch.arange(self.blocks, dtype=torch.float32)
        # expand, then one copy: no temporary larger than the tensor itself
        return numbers.unsqueeze(1).expand(self.blocks, self.floats).contiguous()

    def __getstate__(self) -> dict[str, int]:
        return {"size": self.size, "floats": self.floats, "blocks": self.blocks}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.size, self.floats, self.blocks = state["size"], state["floats"], state["blocks"]
        self.data = self._make()

    def __copy__(self) -> Rows:
        # A shallow copy shares the tensor, as that of any in-memory dataset does (the thread
        # executor copies the dataset for each worker); only pickling leaves it behind.
        twin = Rows.__new__(Rows)
        twin.__dict__.update(self.__dict__)
        return twin

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index % self.blocks]


def the_sample(samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """A collate_fn for batches of one sample: the sample itself, as the dataset made it."""
    (sample,) = samples
    return sample


# --- what is timed, and what is reported -------------------------------------------------------


class Timing(enum.Enum):
    """Which stretch of a run the clock covers."""

    STEADY = "steady"
    """From the first batch handed over to the last: start-up and the first batch excluded."""
    EPOCH = "epoch"
    """A whole first epoch, from `iter(loader)` to the last batch: start-up included."""
    WARM_EPOCH = "warm-epoch"
    """A whole second epoch with persistent workers, from `iter(loader)` to the last batch.

    The first epoch starts the workers and is not timed. At the start of the second every
    worker is idle, so all the work counted was done inside the timed stretch.
    """
    FIRST_BATCH = "first-batch"
    """From `iter(loader)` to the first batch of a fresh loader: starting the workers."""
    SECOND_FIRST_BATCH = "second-first-batch"
    """From `iter(loader)` to the first batch of the second epoch (the first is not timed)."""


def _count(batch: object) -> float:
    return 1.0


def _keep(batch: object) -> object:
    return batch


def _touch(batch: object) -> float:
    """The bytes of a batch tensor, reading one value of it as the least a consumer does."""
    assert isinstance(batch, torch.Tensor)
    batch.reshape(-1)[-1].item()
    return float(batch.nbytes)


def _batches(notes: Sequence[object], workers: int) -> float:
    return float(len(notes))


def _seconds_of_work(batch: object) -> torch.Tensor | None:
    """The seconds of work of each sample of a batch: the batch itself, or its spans' first
    field (default collate turns a batch of `Span`s into three tensors)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return None


def _ideal(notes: Sequence[object], workers: int) -> float:
    # The samples are the seconds of work each took; spread evenly over the workers, that
    # much work takes this long at best.
    total = 0.0
    for batch in notes:
        seconds = _seconds_of_work(batch)
        if seconds is not None:
            total += float(seconds.sum())
    return total / max(1, workers)


def _samples(batch: object) -> float:
    """The samples of a batch: the length of its first tensor (a batch of (image, label)
    pairs collates into two)."""
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    assert isinstance(first, torch.Tensor)
    return float(len(first))


def _sum(notes: Sequence[object], workers: int) -> float:
    return float(sum(float(note) for note in notes if isinstance(note, float)))


def _bytes(notes: Sequence[object], workers: int) -> float:
    return float(sum(float(note) for note in notes if isinstance(note, float)))


@attrs.frozen
class _Accounting:
    lower_is_better: bool
    note: Callable[[object], object]
    """What the timed loop keeps of each batch: cheap, so that it costs both loaders little."""
    tally: Callable[[Sequence[object], int], float]
    """The work done, from the notes and the number of workers."""
    figure: Callable[[float], float]
    """The reported figure, from the throughput (work per second)."""


class Unit(enum.Enum):
    """What a workload reports. Every one is computed from the throughput, work per second."""

    US_PER_BATCH = "us/batch"
    """Microseconds per batch. Work: batches handed over."""
    EFFICIENCY = "% ideal"
    """Percent of the ideal. Work: the measured seconds of work of every sample / workers."""
    GB_PER_S = "GB/s"
    """Gigabytes (1e9 bytes) of batch tensors per second. Work: bytes handed over."""
    MS = "ms"
    """Milliseconds to the first batch. Work: 1 per run."""
    IMAGES_PER_S = "images/s"
    """Samples (images) per second. Work: the samples of every batch handed over."""

    @property
    def accounting(self) -> _Accounting:
        return _ACCOUNTING[self]

    @property
    def lower_is_better(self) -> bool:
        return self.accounting.lower_is_better

    def figure(self, throughput: float) -> float:
        """The figure reported for a run of this throughput (work per second)."""
        return self.accounting.figure(throughput)


_ACCOUNTING: Mapping[Unit, _Accounting] = {
    Unit.US_PER_BATCH: _Accounting(True, _count, _batches, lambda rate: 1e6 / rate),
    Unit.EFFICIENCY: _Accounting(False, _keep, _ideal, lambda rate: 100.0 * rate),
    Unit.GB_PER_S: _Accounting(False, _touch, _bytes, lambda rate: rate / 1e9),
    # Only the clock counts here: a run's work is the one first batch.
    Unit.MS: _Accounting(True, _count, lambda notes, workers: 1.0, lambda rate: 1e3 / rate),
    Unit.IMAGES_PER_S: _Accounting(False, _samples, _sum, lambda rate: rate),
}


@attrs.frozen
class Losses:
    """Where the workers' time went that was not work: fractions of workers x elapsed.

    Every worker's elapsed time (from `iter(loader)` to the last batch) is its samples' work,
    plus these four; with the work fraction (the efficiency) they add up to 1.
    """

    starting: float
    """Before each worker's first sample: starting or resuming the workers, the first task's
    way to them. A worker that loaded nothing counts here whole."""
    in_batch: float
    """Between the samples of one batch, in the worker: the dataset's and the fetcher's own
    overhead around each sample."""
    between: float
    """Between a worker's batches: collating, handing the batch over, waiting for the next
    task (head-of-line blocking shows here) and starting it."""
    ending: float
    """After each worker's last sample, until the last batch was handed over: the epoch's
    tail, when fewer batches remain than workers."""

    @property
    def total(self) -> float:
        return self.starting + self.in_batch + self.between + self.ending

    def to_json(self) -> dict[str, float]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Losses:
        return cls(**{field: float(data[field]) for field in attrs.fields_dict(cls)})


def losses(notes: Sequence[object], started: float, finished: float, workers: int) -> Losses | None:
    """Where the workers' time went between `started` and `finished` (`time.perf_counter`),
    from batches of `Span`s; None if the batches carry no spans.

    The threads that loaded samples are the workers; if fewer did than `workers`, the rest
    count as starting for the whole run.
    """
    elapsed = finished - started
    if elapsed <= 0 or workers <= 0:
        return None
    spans: dict[int, list[tuple[float, float, int]]] = {}
    for number, batch in enumerate(notes):
        if not (isinstance(batch, (list, tuple)) and len(batch) == 3):
            return None
        seconds, starts, threads = (column.tolist() for column in batch)
        for took, start, thread in zip(seconds, starts, threads, strict=True):
            spans.setdefault(int(thread), []).append((start, start + took, number))
    if not spans:
        return None
    starting = in_batch = between = ending = 0.0
    for samples in spans.values():
        samples.sort()
        starting += samples[0][0] - started
        ending += finished - max(end for _, end, _ in samples)
        for (_, end, batch), (start, _, next_batch) in itertools.pairwise(samples):
            if batch == next_batch:
                in_batch += start - end
            else:
                between += start - end
    starting += max(0, workers - len(spans)) * elapsed
    whole = max(workers, len(spans)) * elapsed
    return Losses(starting / whole, in_batch / whole, between / whole, ending / whole)


@attrs.frozen
class Measurement:
    """One run of one loader: the seconds timed and the work done in them."""

    seconds: float
    work: float
    """In the workload's unit of work (see `Unit`)."""
    arrivals: tuple[float, ...] = ()
    """For workloads with a timeline: seconds from `iter(loader)` to each batch."""
    losses: Losses | None = None
    """For whole epochs of samples that wait (`Sleeps`): where the workers' other time went."""

    @property
    def throughput(self) -> float:
        return self.work / self.seconds


# --- workloads ---------------------------------------------------------------------------------


class Side(enum.Enum):
    """Which loader a run used: torch's, statecore's default, its threads, or its Ray actors."""

    TORCH = "torch"
    STATECORE = "statecore"
    """statecore as a user who swaps the import gets it: no `executor=`, so worker processes
    where `num_workers > 0` and the calling thread otherwise."""
    THREADS = "threads"
    """statecore with `executor="thread"`: its workers are threads of the main process."""
    RAY = "ray"
    """statecore with `executor="ray"`: its workers are Ray actors. Opt-in (`bench --ray`):
    only workloads made `with_ray()` run it."""
    AUTO = "auto"
    """statecore with `num_workers="auto"` (its default executor): the loader starts two
    workers and tunes the count as it runs. Opt-in (`bench --auto`): only workloads made
    `with_auto()` run it, where they have workers and a map-style dataset."""

    def loader_class(self) -> type[Loader]:
        if self is Side.TORCH:
            return torch.utils.data.DataLoader
        import statecore

        ours: type[Loader] = statecore.DataLoader
        return ours

    def options(self) -> dict[str, Any]:
        """Loader arguments of this side's own, beyond the workload's."""
        if self is Side.THREADS:
            return {"executor": "thread"}
        if self is Side.AUTO:
            return {"num_workers": "auto"}
        return {"executor": "ray"} if self is Side.RAY else {}

    def runs(self, workload: Workload) -> bool:
        """Whether this side has anything of its own to show on `workload`: with no workers,
        statecore loads in the calling thread whatever its executor; Ray only when asked."""
        if self is Side.RAY:
            return workload.ray and workload.num_workers > 0
        if self is Side.AUTO:
            # An auto loader refuses an iterable dataset, the workloads the loader does not
            # shuffle (torch refuses to shuffle one).
            return workload.auto and workload.num_workers > 0 and workload.shuffle
        return self is not Side.THREADS or workload.num_workers > 0


@attrs.frozen
class Workload:
    """One benchmark case: a dataset, the loader arguments, what is timed and reported."""

    name: str
    summary: str
    """One line: what the workload stands for."""
    dataset: Callable[[int], torch.utils.data.Dataset[Any]] = attrs.field(repr=False)
    """Builds the dataset from its number of samples."""
    batch_size: int
    num_workers: int
    unit: Unit
    timing: Timing
    batches: int
    """Batches per epoch."""
    quick_batches: int
    """Batches per epoch under `--quick`."""
    options: Mapping[str, object] = attrs.field(factory=dict)
    """Further loader arguments, the same for both loaders."""
    ours: Mapping[str, object] = attrs.field(factory=dict)
    """Loader arguments that only statecore's loaders take (every side but torch's)."""
    rounds: int | None = None
    """Pairs of runs; None: the benchmark's default."""
    quick_rounds: int | None = None
    """Pairs of runs under `--quick`; None: the benchmark's default."""
    warmup: bool = True
    """Whether each loader makes one small untimed run before the first pair."""
    timeline: bool = False
    """Whether runs keep the arrival time of every batch (for the plot)."""
    needs: tuple[str, ...] = ()
    """Optional packages the dataset imports."""
    shuffle: bool = True
    """An iterable dataset is not shuffled by the loader (torch refuses)."""
    memory: bool = False
    """Whether the benchmark also measures each loader's peak memory on this workload."""
    ray: bool = False
    """Whether statecore's Ray executor runs too (`bench --ray`), on a workload with workers."""
    auto: bool = False
    """Whether statecore with `num_workers="auto"` runs too (`bench --auto`)."""
    floor: bool = False
    """Whether each round also times the floor: the same batches made by as many threads with
    no loader (`tools.floor`), which the threads' figure is a share of."""
    own_bench: str | None = None
    """The module that runs this workload itself, with loaders and figures of its own (its
    `bench_workload`, called by `bench`); None: `loader_bench` runs it against torch."""
    when_named: bool = False
    """Whether it runs only when named (`--only`): a study of its own that takes minutes (a
    dataset of millions of objects, thousands of JPEGs, a 500 MB dataset under spawn), left
    out of the plain run so that `bench` keeps its length."""

    def loader_arguments(self) -> dict[str, Any]:
        """The loader arguments, with a freshly seeded generator: call once per loader."""
        return dict(
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            generator=torch.Generator().manual_seed(SEED),
            num_workers=self.num_workers,
            **self.options,
        )

    def dataset_for_run(self) -> torch.utils.data.Dataset[Any]:
        """The dataset one run loads: `batches * batch_size` samples."""
        return self.dataset(self.batches * self.batch_size)

    @property
    def sides(self) -> tuple[Side, ...]:
        """The loaders this workload compares: threads (and Ray, if asked for) only where there
        are workers."""
        return tuple(side for side in Side if side.runs(self))

    def with_ray(self) -> Workload:
        """This workload with statecore's Ray executor as one more side (`Side.RAY`)."""
        return attrs.evolve(self, ray=True)

    def with_auto(self) -> Workload:
        """This workload with statecore's `num_workers="auto"` as one more side (`Side.AUTO`)."""
        return attrs.evolve(self, auto=True)

    def quick(self) -> Workload:
        """This workload as `--quick` runs it: smaller epochs, and maybe fewer pairs."""
        return attrs.evolve(self, batches=self.quick_batches, rounds=self.quick_rounds)

    def resized(self, batches: int) -> Workload:
        """This workload with `batches` batches per epoch."""
        return attrs.evolve(self, batches=batches)

    @property
    def workers(self) -> int:
        """The workers the work is spread over: the calling thread when num_workers is 0."""
        return max(1, self.num_workers)


_IO = functools.partial(Sleeps, seconds=0.003)
_STRAGGLERS = functools.partial(Sleeps, seconds=0.001, straggler_one_in=20, straggler_factor=40.0)
# 4 samples of 1.25M float32 values: 20 MB per batch.
_LARGE = functools.partial(Floats, floats=1_250_000)
# Samples of 1M float32 values (4 MB), views of one tensor of up to 64 of them (256 MB).
_ROWS = functools.partial(Rows, floats=1 << 20, blocks=64)
_STARTUP_WORKERS = 4
# The big dataset's samples are its rows: 4,096 batches of 64 make 262,144 rows, a 470 MB
# tensor and an index of as many names (see `Catalogue`); --quick a quarter of that.
_BIG_BATCHES = 4_096
_BIG_QUICK_BATCHES = 1_024


def _images(size: int) -> torch.utils.data.Dataset[Any]:
    """The `images` workload's dataset, imported when made: it needs Pillow to decode."""
    from statecore.tools.images import Jpegs

    return Jpegs(size)


WORKLOADS: tuple[Workload, ...] = (
    Workload(
        "inline-b1",
        "per-batch overhead, in the calling thread: trivial samples, batch size 1",
        Indices,
        batch_size=1,
        num_workers=0,
        unit=Unit.US_PER_BATCH,
        timing=Timing.STEADY,
        batches=20_000,
        quick_batches=4_000,
    ),
    Workload(
        "inline-b64",
        "per-batch overhead, in the calling thread: trivial samples, batch size 64",
        Indices,
        batch_size=64,
        num_workers=0,
        unit=Unit.US_PER_BATCH,
        timing=Timing.STEADY,
        batches=4_000,
        quick_batches=800,
    ),
    Workload(
        "processes-b64",
        "per-batch overhead, 2 worker processes: trivial samples, batch size 64",
        Indices,
        batch_size=64,
        num_workers=2,
        unit=Unit.US_PER_BATCH,
        timing=Timing.STEADY,
        batches=3_000,
        quick_batches=600,
    ),
    Workload(
        "processes-b64-per-batch",
        "as processes-b64, statecore seeding random, torch and numpy before every batch",
        Indices,
        batch_size=64,
        num_workers=2,
        unit=Unit.US_PER_BATCH,
        timing=Timing.STEADY,
        batches=3_000,
        quick_batches=600,
        ours={"seeding": "per-batch"},
    ),
    Workload(
        "processes-iterable",
        "per-batch overhead, 2 worker processes: an iterable dataset without state, batch 64",
        Stream,
        batch_size=64,
        num_workers=2,
        unit=Unit.US_PER_BATCH,
        timing=Timing.STEADY,
        batches=3_000,
        quick_batches=600,
        shuffle=False,
    ),
    Workload(
        "processes-stateful",
        "as processes-iterable, the iterator has a state_dict: statecore sends it every batch",
        StatefulStream,
        batch_size=64,
        num_workers=2,
        unit=Unit.US_PER_BATCH,
        timing=Timing.STEADY,
        batches=3_000,
        quick_batches=600,
        shuffle=False,
    ),
    Workload(
        "io",
        "I/O-bound: every sample sleeps 3 ms; 8 workers, batch size 8",
        _IO,
        batch_size=8,
        num_workers=8,
        unit=Unit.EFFICIENCY,
        timing=Timing.WARM_EPOCH,
        batches=400,
        quick_batches=96,
        options={"persistent_workers": True},
        memory=True,
    ),
    Workload(
        "io-32",
        "I/O-bound with many waiting workers: every sample sleeps 3 ms; 32 workers, batch size 8",
        _IO,
        batch_size=8,
        num_workers=32,
        unit=Unit.EFFICIENCY,
        timing=Timing.WARM_EPOCH,
        batches=640,
        quick_batches=128,
        options={"persistent_workers": True},
    ),
    Workload(
        "stragglers-in-order",
        "1 ms samples, 1 in 20 takes 40 ms; 4 workers, batch size 4, in_order=True",
        _STRAGGLERS,
        batch_size=4,
        num_workers=4,
        unit=Unit.EFFICIENCY,
        timing=Timing.EPOCH,
        batches=600,
        quick_batches=160,
        options={"in_order": True},
        timeline=True,
    ),
    Workload(
        "stragglers-any-order",
        "1 ms samples, 1 in 20 takes 40 ms; 4 workers, batch size 4, in_order=False",
        _STRAGGLERS,
        batch_size=4,
        num_workers=4,
        unit=Unit.EFFICIENCY,
        timing=Timing.EPOCH,
        batches=600,
        quick_batches=160,
        options={"in_order": False},
        timeline=True,
    ),
    Workload(
        "large-batches",
        "20 MB float32 batches (4 samples of 5 MB); 2 workers",
        _LARGE,
        batch_size=4,
        num_workers=2,
        unit=Unit.GB_PER_S,
        timing=Timing.STEADY,
        batches=150,
        quick_batches=40,
        memory=True,
        floor=True,
    ),
    Workload(
        "large-tensor-views",
        "4 MB batches, each a view of one 256 MB in-memory tensor (collated as it is); 2 workers",
        _ROWS,
        batch_size=1,
        num_workers=2,
        unit=Unit.GB_PER_S,
        timing=Timing.STEADY,
        batches=150,
        quick_batches=40,
        options={"collate_fn": the_sample},
        memory=True,
    ),
    Workload(
        "cpu",
        "CPU-bound: about 1 ms of numpy per sample; 2 workers, batch size 8",
        NumpyWork,
        batch_size=8,
        num_workers=2,
        unit=Unit.EFFICIENCY,
        timing=Timing.WARM_EPOCH,
        batches=200,
        quick_batches=50,
        options={"persistent_workers": True},
        needs=("numpy",),
    ),
    Workload(
        "cpu-python",
        "CPU-bound in pure Python, holding the GIL: about 1 ms a sample; 2 workers, batch size 8",
        PythonWork,
        batch_size=8,
        num_workers=2,
        unit=Unit.EFFICIENCY,
        timing=Timing.WARM_EPOCH,
        batches=200,
        quick_batches=50,
        options={"persistent_workers": True},
    ),
    Workload(
        "startup-fork",
        "time to the first batch, 4 workers started with fork",
        Indices,
        batch_size=64,
        num_workers=_STARTUP_WORKERS,
        unit=Unit.MS,
        timing=Timing.FIRST_BATCH,
        batches=32,
        quick_batches=32,
        options={"multiprocessing_context": "fork"},
    ),
    Workload(
        "startup-spawn",
        "time to the first batch, 4 workers started with spawn",
        Indices,
        batch_size=64,
        num_workers=_STARTUP_WORKERS,
        unit=Unit.MS,
        timing=Timing.FIRST_BATCH,
        batches=32,
        quick_batches=32,
        options={"multiprocessing_context": "spawn"},
        # Four interpreters importing torch take seconds on two cores: --quick affords one pair.
        quick_rounds=1,
        # Every run starts fresh interpreters: there is nothing for a warm-up to warm.
        warmup=False,
    ),
    Workload(
        "startup-forkserver",
        "time to the first batch, 4 workers started with forkserver",
        Indices,
        batch_size=64,
        num_workers=_STARTUP_WORKERS,
        unit=Unit.MS,
        timing=Timing.FIRST_BATCH,
        batches=32,
        quick_batches=32,
        options={"multiprocessing_context": "forkserver"},
        quick_rounds=1,  # as for spawn: every worker imports torch
        # The warm-up starts each library's fork server, once per process as in training.
        warmup=True,
    ),
    Workload(
        "epoch2-persistent",
        "time to the first batch of the second epoch, 4 workers, persistent_workers=True",
        Indices,
        batch_size=64,
        num_workers=_STARTUP_WORKERS,
        unit=Unit.MS,
        timing=Timing.SECOND_FIRST_BATCH,
        batches=32,
        quick_batches=32,
        options={"persistent_workers": True},
        memory=True,
    ),
    Workload(
        "epoch2-fresh",
        "time to the first batch of the second epoch, 4 workers, persistent_workers=False",
        Indices,
        batch_size=64,
        num_workers=_STARTUP_WORKERS,
        unit=Unit.MS,
        timing=Timing.SECOND_FIRST_BATCH,
        batches=32,
        quick_batches=32,
        options={"persistent_workers": False},
    ),
    # Copy on read (pytorch#13246): 2 million small dicts (7,812 batches of 256), 4 forked
    # workers, one shuffled epoch. Memory is the figure: one timed round, then the peak runs.
    Workload(
        "copy-on-read",
        "2M small dicts in a list, 4 forked workers, batch 256: the tree's memory",
        Records,
        batch_size=256,
        num_workers=4,
        unit=Unit.US_PER_BATCH,
        timing=Timing.EPOCH,
        batches=7_812,
        quick_batches=1_000,
        options={"multiprocessing_context": "fork"},
        rounds=1,
        quick_rounds=1,
        memory=True,
        when_named=True,
    ),
    Workload(
        "copy-on-read-shared",
        "as copy-on-read, the dicts kept in a statecore.SharedSequence (one flat buffer)",
        shared_records,
        batch_size=256,
        num_workers=4,
        unit=Unit.US_PER_BATCH,
        timing=Timing.EPOCH,
        batches=7_812,
        quick_batches=1_000,
        options={"multiprocessing_context": "fork"},
        rounds=1,
        quick_rounds=1,
        memory=True,
        when_named=True,
    ),
    Workload(
        "images",
        "JPEGs of 100 kB decoded with Pillow, random-resized-cropped, flipped, normalised; batch "
        "64, 2 workers: images/s and CPU/image against torch, SPDL and torchdata",
        _images,
        batch_size=64,
        num_workers=2,
        unit=Unit.IMAGES_PER_S,
        timing=Timing.EPOCH,
        batches=32,
        quick_batches=8,
        rounds=3,
        quick_rounds=2,
        own_bench="statecore.tools.images",
        when_named=True,
    ),
    Workload(
        "big-dataset-spawn",
        "time to the first batch of a 500 MB dataset (tensor + Python index), 4 spawn workers",
        Catalogue,
        batch_size=64,
        num_workers=_STARTUP_WORKERS,
        unit=Unit.MS,
        timing=Timing.FIRST_BATCH,
        batches=_BIG_BATCHES,
        quick_batches=_BIG_QUICK_BATCHES,
        options={"multiprocessing_context": "spawn"},
        quick_rounds=1,
        warmup=False,  # as for startup-spawn: every run starts fresh interpreters
        when_named=True,
    ),
    Workload(
        "big-dataset-forkserver",
        "time to the first batch of a 500 MB dataset (tensor + Python index), 4 forkserver workers",
        Catalogue,
        batch_size=64,
        num_workers=_STARTUP_WORKERS,
        unit=Unit.MS,
        timing=Timing.FIRST_BATCH,
        batches=_BIG_BATCHES,
        quick_batches=_BIG_QUICK_BATCHES,
        options={"multiprocessing_context": "forkserver"},
        quick_rounds=1,
        warmup=True,  # as for startup-forkserver: it starts each library's fork server
        when_named=True,
    ),
)
"""Every workload, in the order the benchmark runs and prints them."""


def select(names: Sequence[str] | None = None) -> tuple[Workload, ...]:
    """The workloads of these names, in the benchmark's order; for None, all of them but those
    that run only when named (`Workload.when_named`).

    Raises ValueError naming the unknown names and the known ones.
    """
    if names is None:
        return tuple(workload for workload in WORKLOADS if not workload.when_named)
    known = {workload.name for workload in WORKLOADS}
    unknown = [name for name in names if name not in known]
    if not names:
        raise ValueError(f"no workload named; choose from {', '.join(sorted(known))}")
    if unknown:
        raise ValueError(
            f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}"
        )
    return tuple(workload for workload in WORKLOADS if workload.name in names)


# --- one run -----------------------------------------------------------------------------------

Loader = torch.utils.data.DataLoader[Any]


def close(iterator: object) -> None:
    """Stop an iterator's workers now, whichever library made it (a no-op without workers)."""
    from statecore.executors._loader import _Iterator as StatecoreIterator

    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()
    elif isinstance(iterator, StatecoreIterator):
        iterator._shutdown()


def release(loader: Loader) -> None:
    """Stop the workers a loader keeps between epochs (persistent workers), now."""
    iterator = loader._iterator
    if iterator is not None:
        close(iterator)
        loader._iterator = None


def measure(
    workload: Workload,
    loader_class: type[Loader],
    options: Mapping[str, Any] | None = None,
    dataset: torch.utils.data.Dataset[Any] | None = None,
) -> Measurement:
    """One timed run: a fresh loader of `loader_class`, timed as `workload.timing` says.

    `options` are loader arguments beyond the workload's (`Side.options`); `dataset`, if
    given, is `workload.dataset_for_run()` made beforehand. Building the dataset and the loader
    is not timed; stopping the workers afterwards is neither timed nor skipped: no worker
    outlives the run.
    """
    if workload.timing is Timing.STEADY and workload.batches < 2:
        raise ValueError(f"{workload.name}: the steady state needs at least 2 batches per epoch")
    if dataset is None:
        dataset = workload.dataset_for_run()
    arguments = workload.loader_arguments()
    if loader_class is not torch.utils.data.DataLoader:
        arguments.update(workload.ours)
    arguments.update(options or {})  # a side's own arguments win (`Side.AUTO`'s num_workers)
    loader = loader_class(dataset, **arguments)
    try:
        return _TIMERS[workload.timing](workload, loader)
    finally:
        release(loader)


def _steady(workload: Workload, loader: Loader) -> Measurement:
    accounting = workload.unit.accounting
    note = accounting.note
    iterator = iter(loader)
    try:
        next(iterator)
        notes: list[object] = []
        gc.collect()  # garbage left by earlier runs is not this run's to collect
        started = time.perf_counter()
        # islice stops at the last batch, so the clock stops before an exhausted iterator
        # shuts its workers down (torch does that inside the call that raises StopIteration).
        for batch in itertools.islice(iterator, len(loader) - 1):
            notes.append(note(batch))
        seconds = time.perf_counter() - started
    finally:
        close(iterator)
    return Measurement(seconds, accounting.tally(notes, workload.workers))


def _whole_epoch(workload: Workload, loader: Loader, warm: bool) -> Measurement:
    accounting = workload.unit.accounting
    note = accounting.note
    if warm:
        for _ in loader:
            pass
    notes: list[object] = []
    arrivals: list[float] = []
    gc.collect()
    started = time.perf_counter()
    iterator = iter(loader)
    try:
        for batch in itertools.islice(iterator, len(loader)):
            notes.append(note(batch))
            arrivals.append(time.perf_counter() - started)
    finally:
        close(iterator)
    return Measurement(
        arrivals[-1],
        accounting.tally(notes, workload.workers),
        tuple(arrivals) if workload.timeline else (),
        losses(notes, started, started + arrivals[-1], workload.workers),
    )


def _first_batch(workload: Workload, loader: Loader, second: bool) -> Measurement:
    if second:
        for _ in loader:
            pass
    gc.collect()
    started = time.perf_counter()
    iterator = iter(loader)
    try:
        next(iterator)
        seconds = time.perf_counter() - started
    finally:
        close(iterator)
    return Measurement(seconds, 1.0)


_TIMERS: Mapping[Timing, Callable[[Workload, Loader], Measurement]] = {
    Timing.STEADY: _steady,
    Timing.EPOCH: functools.partial(_whole_epoch, warm=False),
    Timing.WARM_EPOCH: functools.partial(_whole_epoch, warm=True),
    Timing.FIRST_BATCH: functools.partial(_first_batch, second=False),
    Timing.SECOND_FIRST_BATCH: functools.partial(_first_batch, second=True),
}
