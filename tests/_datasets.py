"""The tests' small datasets, samplers and callbacks: one set, shared by the test files.

Everything here is defined at module level so that it pickles by reference: the same objects
serve torch's DataLoader and statecore's, under every start method (spawn and forkserver
workers import this module by name to unpickle them). So does every Ray actor, which is why
this module imports only what its datasets need (torch, numpy, statecore): the interrupting
datasets import `_interrupting` (statecore's models, Hypothesis: about 0.3 s of each worker's
start) only when they fire.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

import statecore

# --- map-style datasets ------------------------------------------------------------------------


class Numbers(Dataset):  # type: ignore[type-arg]
    """Item i is i: the simplest dataset whose batches show which indices went into them."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index


class Records(Dataset):  # type: ignore[type-arg]
    """Nested samples (dict, tuple, tensor, string), to exercise collation of structures."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "pair": (index, -index),
            "vector": torch.tensor([index, 2 * index], dtype=torch.float32),
            "name": f"item-{index}",
        }


class RandomDraws(Dataset):  # type: ignore[type-arg]
    """Item i: the index, the worker's info, and one draw from each seeded RNG, in this order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> list[Any]:
        return [index, *_info_fields(), *_draws()]


class GlobalDraws(Dataset):  # type: ignore[type-arg]
    """Item i: [i, a draw from torch's global generator], whose state is the dataset's own
    `state_dict()`: a main-process augmentation that keeps no generator of its own."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> list[int]:
        return [index, int(torch.randint(1000, (1,)))]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["rng"])


class WorkerGeneratorDraws(Dataset):  # type: ignore[type-arg]
    """Item i: the index, the worker id, two draws from `torch.thread_safe_generator()` and one
    from `get_worker_info().rng.random_generator`, the way a transform written for torch's
    thread workers draws: where the worker has no generators of its own (a worker process, the
    main process) those are None and the process-wide generators serve instead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> list[Any]:
        info = get_worker_info()
        own = None if info is None else info.rng
        draw = random if own is None else own.random_generator
        draws = torch.rand(2, generator=torch.thread_safe_generator()).tolist()
        return [index, -1 if info is None else info.id, draws, draw.random()]


class WorkerPids(Dataset):  # type: ignore[type-arg]
    """Item i is the pid of the process that loaded it."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> int:
        return os.getpid()


class ThreadCounts(Dataset):  # type: ignore[type-arg]
    """Each sample is the number of threads torch uses where it is loaded."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return torch.get_num_threads()


class Items(Dataset):  # type: ignore[type-arg]
    """Item i is tensor([i, pid of the worker]); the item at `fail_at` fails as `how` says.

    The pids are how tests learn which worker made each item; `fail` lists the ways to fail.
    """

    def __init__(self, n: int, fail_at: int | None = None, how: str = "value") -> None:
        self.n = n
        self.fail_at = fail_at
        self.how = how

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.fail_at:
            fail(self.how, index)
        return torch.tensor([index, os.getpid()])


class Augmented(Dataset):  # type: ignore[type-arg]
    """Item i: [i, a draw from this copy's own generator], as a random augmentation draws.

    The generator is seeded by worker id when first used, so each worker draws its own
    stream; its state is the dataset's `state_dict()`, as torchdata restores per worker.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator: torch.Generator | None = None

    def __len__(self) -> int:
        return self.n

    def _drawn_from(self) -> torch.Generator:
        if self.generator is None:
            info = get_worker_info()
            seed = 1000 + (0 if info is None else info.id)
            self.generator = torch.Generator().manual_seed(seed)
        return self.generator

    def __getitem__(self, index: int) -> list[int]:
        return [index, int(torch.randint(1000, (1,), generator=self._drawn_from()))]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._drawn_from().get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drawn_from().set_state(state["generator"])


# --- iterable datasets -------------------------------------------------------------------------


class ShardedRange(IterableDataset):  # type: ignore[type-arg]
    """range(n), split between workers by striding with get_worker_info(), as torch documents."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class Positioned:
    """An iterator over `items` that says where it is: torchdata's Stateful protocol."""

    reads = 0
    """Items read by every instance in this process: a restored one does not read again."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.at = 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.at >= len(self.items):
            raise StopIteration
        Positioned.reads += 1
        self.at += 1
        return self.items[self.at - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


class ItsOwnIterator(Positioned, IterableDataset):  # type: ignore[type-arg]
    """An iterable dataset that is its own iterator (`iter()` returns it as it stands): its
    position is its state, and a program that reuses the object finds it where the last run
    left it."""

    def __init__(self, n: int) -> None:
        super().__init__(list(range(n)))


def share_of_range(n: int) -> list[int]:
    """This worker's items of range(n), dealt round by worker id; all of them in-process."""
    info = get_worker_info()
    return list(range(n)) if info is None else list(range(info.id, n, info.num_workers))


class StatefulIterator(IterableDataset[int]):
    """Its iterator has the state: saved after each batch, loaded into a fresh iterator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Positioned:
        return Positioned(share_of_range(self.n))


class StatefulDataset(IterableDataset[int]):
    """The dataset has the state, and its next iterator starts from it (as Hugging Face's)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        items, self.start = share_of_range(self.n)[self.start :], 0
        self.yielded = 0
        for item in items:
            self.yielded += 1
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"start": getattr(self, "yielded", 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = state["start"]


class PerWorkerCounts(IterableDataset):  # type: ignore[type-arg]
    """Worker k yields counts[k] items (100 * k + j), so workers run dry at different times.

    Loaded in the main process it yields every worker's items, one worker after the other.
    """

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = tuple(counts)

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        workers = range(len(self.counts)) if info is None else [info.id]
        for k in workers:
            yield from (100 * k + j for j in range(self.counts[k]))


class CountsEpochs(IterableDataset):  # type: ignore[type-arg]
    """(item, epoch) for this worker's share of range(n); its state counts the epochs.

    The count moves on only once its iterator has run dry, so the state that tells the next
    epoch's number exists only after the epoch's last item: a dataset that keeps its own epoch.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for item in share_of_range(self.n):
            yield item, self.epoch
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]


class CountsItems(IterableDataset):  # type: ignore[type-arg]
    """(item, count) for this worker's share of range(n), where count numbers every item this
    copy of the dataset has read, in every epoch (as an augmentation's generator goes on).

    Its state is that count and where its iterator stands, which its next iterator starts from
    (as `StatefulDataset`'s): a persistent worker's next epoch counts on from the last item it
    read, whether or not the consumer received it.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0
        self.at = 0
        self.count = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # Taken up as iter() is called, not at the first item, as a generator function would.
        start, self.start = self.start, 0
        self.at = start
        return self._items(share_of_range(self.n)[start:])

    def _items(self, items: list[int]) -> Iterator[tuple[int, int]]:
        for item in items:
            self.at += 1
            self.count += 1
            yield item, self.count

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.at, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start, self.count = state["start"], state["count"]


class Rewinding(Positioned):
    """A `Positioned` that goes back to the start once it has run dry, as many datasets do so
    that the next epoch starts over: its state after the last item is that of the start."""

    read: list[int] = []  # noqa: RUF012
    """Items read by every instance in this process, in order: clear it before use."""

    def __next__(self) -> int:
        try:
            item = super().__next__()
        except StopIteration:
            self.at = 0
            raise
        Rewinding.read.append(item)
        return item


class RewindsWhenDry(PerWorkerCounts):
    """`PerWorkerCounts` through a `Rewinding` iterator: a stateful shard per worker, whose
    state returns to the start once the worker has run dry."""

    def __iter__(self) -> Rewinding:  # type: ignore[override]
        return Rewinding(list(super().__iter__()))


class Unsharded(IterableDataset):  # type: ignore[type-arg]
    """range(n) in every worker: each worker yields a full copy, as torch documents."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class SizedIterable(IterableDataset):  # type: ignore[type-arg]
    """Yields `actual` items (sharded between workers) but reports `reported` as its length."""

    def __init__(self, actual: int, reported: int) -> None:
        self.actual = actual
        self.reported = reported

    def __len__(self) -> int:
        return self.reported

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        if info is None:
            return iter(range(self.actual))
        return iter(range(info.id, self.actual, info.num_workers))


class InitDraws(IterableDataset):  # type: ignore[type-arg]
    """Yields, once per worker, what `record_init_draws` saw followed by fresh draws."""

    init_draws: tuple[Any, ...] = ()

    def __iter__(self) -> Iterator[list[Any]]:
        yield [*self.init_draws, *_info_fields(), *_draws()]


class WorkerInfoProbe(IterableDataset):  # type: ignore[type-arg]
    """Yields, once per worker, what statecore.get_worker_info() tells about the worker."""

    def __iter__(self) -> Iterator[list[Any]]:
        info = statecore.get_worker_info()
        if info is None:
            yield [None]
            return
        yield [
            info is get_worker_info(),
            info.id,
            info.num_workers,
            info.seed,
            info.dataset is self,
            type(info).__module__ + "." + type(info).__qualname__,
        ]


class _Drawing(Positioned):
    """A `Positioned` whose items each come with a draw from torch's global generator, whose
    state is part of the iterator's."""

    def __next__(self) -> list[int]:  # type: ignore[override]
        return [super().__next__(), int(torch.randint(1000, (1,)))]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        torch.set_rng_state(state["rng"])


class DrawsAsItGoes(IterableDataset):  # type: ignore[type-arg]
    """No state of its own; its iterator's state is its position and the worker's global
    generator, whose stream a persistent worker carries from one epoch into the next."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _Drawing:
        return _Drawing(share_of_range(self.n))


class WorkerRngProbe(IterableDataset):  # type: ignore[type-arg]
    """Yields, once per worker, its WorkerInfo and what `torch.thread_safe_generator()` returns
    there. Load it with batch_size=None under threads: the objects themselves come back."""

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        yield (get_worker_info(), torch.thread_safe_generator())


class WorkerMethodProbe(IterableDataset):  # type: ignore[type-arg]
    """Yields, once per worker (once in the main process), what torch's thread-worker API says
    there: `worker_method`, whether `rng` is None, whether `torch.thread_safe_generator()` is."""

    def __iter__(self) -> Iterator[list[Any]]:
        info = get_worker_info()
        if info is None:
            yield [None, None, torch.thread_safe_generator() is None]
            return
        yield [info.worker_method, info.rng is None, torch.thread_safe_generator() is None]


def _info_fields() -> list[int]:
    info = get_worker_info()
    if info is None:
        return [-1, -1, -1]
    return [info.id, info.num_workers, info.seed]


def _draws() -> list[float]:
    return [random.random(), torch.rand(1).item(), float(numpy.random.rand())]


# --- samplers ----------------------------------------------------------------------------------


class EveryOtherBackwards(Sampler[int]):
    """n-1, n-3, ...: a custom sampler that skips and reverses."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n - 1, -1, -2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


class GrowingBatches(Sampler[list[int]]):
    """Batches of 1, 2, 3, ... consecutive indices, the last one possibly short."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(start + size, self.n)))
            start += size
            size += 1

    def __len__(self) -> int:
        return sum(1 for _ in self)


class LoggingSampler(Sampler[int]):
    """0, 1, ..., n-1, noting each index as it is drawn, to show when the loader draws."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.drawn: list[int] = []

    def __iter__(self) -> Iterator[int]:
        for index in range(self.n):
            self.drawn.append(index)
            yield index

    def __len__(self) -> int:
        return self.n


# --- collate functions and worker_init_fns -----------------------------------------------------


def sum_and_items(batch: list[Any]) -> dict[str, Any]:
    """A custom collate_fn for batches: the items as a list and their sum."""
    return {"items": list(batch), "sum": sum(batch)}


def tag_sample(sample: Any) -> tuple[str, Any]:
    """A custom collate_fn without auto-collation: it gets one sample at a time."""
    return ("sample", sample)


def record_init_draws(worker_id: int) -> None:
    """A worker_init_fn: note the worker id and one draw from each RNG on the worker's dataset."""
    info = get_worker_info()
    assert info is not None
    info.dataset.init_draws = (worker_id, *_draws())


def failing_init(worker_id: int) -> None:
    """A worker_init_fn that raises in every worker."""
    raise RuntimeError(f"worker_init_fn failed in worker {worker_id}")


# --- failures: datasets and samplers that raise, block, or end their worker --------------------


class FailsAt(Dataset):  # type: ignore[type-arg]
    """Numbers(n), except that loading any index in `bad` raises KeyError, or `error` if given.

    `error` is raised as it is, the same object each time: where nothing pickles it (in
    process, in worker threads) the consumer can check that it got that very exception.
    """

    def __init__(self, n: int, bad: Sequence[int], error: BaseException | None = None) -> None:
        self.n = n
        self.bad = frozenset(bad)
        self.error = error

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            if self.error is not None:
                raise self.error
            raise KeyError(f"bad index {index}")
        return index


class CustomError(Exception):
    """An exception class of the user's own, defined where the main process can import it."""


class TwoArgumentError(Exception):
    """An exception that cannot be rebuilt from a message alone."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


def fail(how: str, index: int) -> None:
    """Fail at dataset index `index` in the way `how` names (how Items fails at `fail_at`)."""
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit3":
        os._exit(3)
    elif how == "value":
        raise ValueError(f"bad sample {index} (marker-value-error)")
    elif how == "custom":
        raise CustomError(f"custom failure at {index} (marker-custom-error)")
    elif how == "two-argument":
        raise TwoArgumentError(7, f"two-argument failure at {index}")
    else:
        raise AssertionError(f"unknown failure {how!r}")


class BadSample(Exception):
    """An exception that carries data, as user code's exceptions often do."""

    def __init__(self, index: int) -> None:
        super().__init__(f"bad sample {index}")
        self.index = index


class RaisesBadSample(Dataset):  # type: ignore[type-arg]
    """Every index raises BadSample(index)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        raise BadSample(index)


class BrokenSampler(Sampler[int]):
    """0, 1, ... until `fails_at`, where it raises ValueError; with `once`, only the first time.

    Like any generator it is finished once it has raised: that epoch draws nothing more.
    """

    def __init__(self, n: int, fails_at: int, once: bool = False) -> None:
        self.n = n
        self.fails_at = fails_at
        self.once = once
        self.failed = False

    def __iter__(self) -> Iterator[int]:
        for index in range(self.n):
            if index == self.fails_at and not (self.once and self.failed):
                self.failed = True
                raise ValueError(f"sampler failed at {index}")
            yield index

    def __len__(self) -> int:
        return self.n


class BlocksAt(Dataset):  # type: ignore[type-arg]
    """Numbers(n), except that loading `index` first reads a byte from the pipe `fd`.

    The loading blocks until the main process writes a byte; a worker killed while it waits
    leaves nothing shared in a bad state. Fork only: the descriptor is inherited.
    """

    def __init__(self, n: int, index: int, fd: int) -> None:
        self.n = n
        self.index = index
        self.fd = fd

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.index:
            os.read(self.fd, 1)
        return index


class ExitsAt(Dataset):  # type: ignore[type-arg]
    """Numbers(n), except that the worker loading `index` exits at once, without cleanup."""

    def __init__(self, n: int, index: int) -> None:
        self.n = n
        self.index = index

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.index:
            os._exit(3)
        return index


class DiesAt(Dataset):  # type: ignore[type-arg]
    """(i, pid of the loading process) for range(n); loading `index` kills with `signum`.

    With a `marker` path only the first load of `index` kills (it leaves the marker behind,
    which every worker sees), so a loader that replaces its workers can load it afterwards.
    """

    def __init__(self, n: int, index: int, signum: int, marker: Path | None = None) -> None:
        self.n = n
        self.index = index
        self.signum = signum
        self.marker = marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == self.index:
            if self.marker is None:
                os.kill(os.getpid(), self.signum)
            elif not self.marker.exists():
                self.marker.touch()
                os.kill(os.getpid(), self.signum)
        return i, os.getpid()


class Unsendable:
    """A sample that cannot be sent back to the main process: pickling it raises `make_error()`.

    The exception is made when the worker tries to send the sample, in the worker: some kinds
    of exception cannot be pickled themselves, or exist only there.
    """

    def __init__(self, make_error: Callable[[], BaseException]) -> None:
        self.make_error = make_error

    def __reduce__(self) -> Any:
        raise self.make_error()


class UnsendableAt(Dataset):  # type: ignore[type-arg]
    """Item i is (i, pid of the worker), but item `at` is Unsendable(make_error)."""

    def __init__(self, n: int, at: int, make_error: Callable[[], BaseException]) -> None:
        self.n, self.at, self.make_error = n, at, make_error

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, (Unsendable(self.make_error) if index == self.at else os.getpid())


# --- interrupts: Ctrl-C, or a signal handler raising, while the loader works --------------------


class InterruptsAt(Dataset):  # type: ignore[type-arg]
    """range(n); loading `index` the first time interrupts the main process's wait.

    The worker sends `signum` once the main process waits in the executor's `poll` (the
    `polling` flag of _interrupting.watched), and answers at once.
    """

    def __init__(self, n: int, index: int, marker: Path, polling: Any, signum: int) -> None:
        self.n, self.index, self.marker, self.polling = n, index, marker, polling
        self.signum = signum
        self.main = os.getpid()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.index:
            from _interrupting import interrupt_main_once  # see the module docstring

            interrupt_main_once(self.main, self.polling, self.marker, self.signum)
        return i


class InterruptsResume(IterableDataset):  # type: ignore[type-arg]
    """Each worker yields its share of range(n); worker 0's first resume interrupts iter()."""

    def __init__(self, n: int, marker: Path, polling: Any) -> None:
        self.n, self.marker, self.polling = n, marker, polling
        self.main = os.getpid()
        self.starts = 0

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None
        self.starts += 1  # a persistent worker keeps its copy of the dataset
        if info.id == 0 and self.starts == 2:
            from _interrupting import interrupt_main_once  # see the module docstring

            interrupt_main_once(self.main, self.polling, self.marker, signal.SIGINT)
        return iter(range(info.id, self.n, info.num_workers))


class InterruptsInMainThread(Dataset):  # type: ignore[type-arg]
    """range(n), loaded in the main thread; loading `index` the first time raises Ctrl-C."""

    def __init__(self, n: int, index: int) -> None:
        self.n, self.index, self.fired = n, index, False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.index and not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return i


class InterruptingSampler(Sampler[int]):
    """0..n-1; the first attempt to draw `at` raises KeyboardInterrupt, as Ctrl-C there would.

    Unlike a generator's, its iterator goes on after the interrupt: the next draw is `at`.
    """

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at, self.fired = n, at, False

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return _Draws(self)


class _Draws:
    def __init__(self, sampler: InterruptingSampler) -> None:
        self.sampler, self.next = sampler, 0

    def __next__(self) -> int:
        sampler = self.sampler
        if self.next >= sampler.n:
            raise StopIteration
        if self.next == sampler.at and not sampler.fired:
            sampler.fired = True
            raise KeyboardInterrupt
        self.next += 1
        return self.next - 1
