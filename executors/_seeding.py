"""Seeding per batch: a batch's random numbers depend on where it stands in its epoch, not on
which worker made it.

torch seeds each worker once (`base_seed + worker_id`), so a dataset that draws random
augmentations gives other samples when `num_workers` changes, when a lost worker is replaced,
or when workers are added or retired mid-epoch. With `seeding="per-batch"` the worker seeds
again before each batch, from the epoch's seed and the batch's position in the epoch (the
position a checkpoint records, so a resumed epoch's batch at position p gets the seed the
unbroken run's had): whichever worker makes it, and however many there are, it draws the same
numbers.

The seed of each batch travels with its task (`SeededTask`, made by the driver from the
scheduler's `SendTask`), and the worker seeds where it runs (`seeder_for`): a process of its
own seeds `random` and torch as torch seeds a worker, and numpy from its low word mixed again
(`numpy_seed`); a thread seeds the generators of its own WorkerInfo (`rng`); the loader's own
thread (`num_workers=0`) seeds the process-wide ones for the batch and puts them back
afterwards, so the training loop's numbers stay its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils.data._utils import HAS_NUMPY

from statecore import Lifecycle, SendTask
from statecore._progress import _position

__all__ = [
    "PER_BATCH",
    "PER_WORKER",
    "SEEDINGS",
    "BatchSeeds",
    "SeededTask",
    "batch_seed",
    "epoch_seed",
    "numpy_seed",
    "resolve_seeding",
    "seed_globals",
    "seeder_for",
]

PER_WORKER = "per-worker"
"""torch's seeding: each worker once, as it starts, from `base_seed + worker_id`."""
PER_BATCH = "per-batch"
"""Each batch, before it is made, from the epoch's seed and its position in the epoch."""
SEEDINGS = (PER_WORKER, PER_BATCH)


def resolve_seeding(
    seeding: object, num_workers: object, iterable: bool = False, *, auto: bool = False
) -> str:
    """The seeding a loader with these arguments uses: `seeding` checked, None resolved.

    None is "per-worker", torch's, whatever `num_workers` is, except for a loader that tunes
    its number of workers (`auto`, `num_workers="auto"`): there it is "per-batch", so that its
    batches do not depend on how many workers the tuner runs as each is made. An iterable
    dataset is refused "per-batch": its workers each yield their own stream, so which samples
    a batch holds depends on the number of workers whatever the seeds are.
    """
    if seeding is None:
        return PER_BATCH if auto and not iterable else PER_WORKER
    if not isinstance(seeding, str) or seeding not in SEEDINGS:
        raise ValueError(
            f"seeding must be one of {', '.join(map(repr, SEEDINGS))} or None (torch's "
            f"'per-worker'), got {seeding!r}"
        )
    if seeding == PER_BATCH and iterable:
        raise ValueError(
            "seeding='per-batch' needs a map-style dataset: the workers of an IterableDataset "
            "each yield their own stream, so the samples of a batch depend on how many workers "
            "there are whatever they are seeded with; use seeding='per-worker' (or None), or "
            "a map-style dataset"
        )
    return seeding


_MASK = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_GAMMA = 0x9E3779B97F4A7C15
"""splitmix64's increment: its state moves on by this much per output."""


def _mix(value: int) -> int:
    """One step of splitmix64: a 64-bit value whose every bit depends on every bit of `value`."""
    z = (value + _GAMMA) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def epoch_seed(base_seed: int, epoch: int) -> int:
    """The seed of the `epoch`-th epoch (1 first) seeded from `base_seed`.

    Each iter() draws a base seed, as torch's does; persistent workers keep theirs for every
    later epoch (torch draws none then), which the count of epochs tells apart.
    """
    return _mix(_mix(base_seed & _MASK) ^ epoch)


def _mix32(value: int) -> int:
    """murmur3's finalizer: a bijection of 32-bit values (each step, a shift folded in or a
    multiplication by an odd number, can be undone) whose every output bit depends on every
    input bit."""
    value ^= value >> 16
    value = (value * 0x85EBCA6B) & _MASK32
    value ^= value >> 13
    value = (value * 0xC2B2AE35) & _MASK32
    return value ^ (value >> 16)


def batch_seed(seed_of_epoch: int, position: int) -> int:
    """The seed of the batch at `position` (0 first) of the epoch whose seed is
    `seed_of_epoch`: 63 bits, a non-negative int64 as torch's seeds are.

    Its low 32 bits are all torch's CPU generator keeps of a seed (its MT19937 state is made
    from them alone): they are a bijection of the position, offset by the epoch's seed, so no
    two batches of an epoch (up to 2**32 of them) draw the same numbers from torch, where 32
    hashed bits would collide within about 1e5 batches (the birthday bound). The high 31 bits
    are output `position` of a splitmix64 generator seeded with the epoch's seed, for `random`,
    which keeps every bit. Mixed, not added: `base_seed + position` would be the seed of another
    epoch's worker or batch.
    """
    low = _mix32((seed_of_epoch + position) & _MASK32)
    high = _mix((seed_of_epoch + position * _GAMMA) & _MASK) >> 33
    return (high << 32) | low


@attrs.frozen
class SeededTask(SendTask):
    """A `SendTask` whose batch is made under `seed` (see the module's docstring).

    Made by the driver where the loader seeds per batch; an executor carries it as any task,
    and the worker's runtime seeds before it loads the batch.
    """

    seed: int

    @classmethod
    def fast(cls, worker: int, task: int, index: object, seed: int) -> SeededTask:  # type: ignore[override]
        """`SeededTask(worker, task, index, seed)`, built as `SendTask.fast` builds its own (one
        per batch, without attrs' frozen `__init__`)."""
        command: SeededTask = object.__new__(cls)
        _SET_WORKER(command, worker)
        _SET_TASK(command, task)
        _SET_INDEX(command, index)
        _SET_SEED(command, seed)
        return command


_SET_WORKER = SendTask.__dict__["worker"].__set__
_SET_TASK = SendTask.__dict__["task"].__set__
_SET_INDEX = SendTask.__dict__["index"].__set__
_SET_SEED = SeededTask.__dict__["seed"].__set__


@attrs.frozen
class BatchSeeds:
    """An epoch's seeding per batch: the driver makes each of its tasks a `SeededTask`."""

    epoch_seed: int

    @classmethod
    def of(cls, base_seed: int, epoch: int) -> BatchSeeds:
        return cls(epoch_seed(base_seed, epoch))

    def task(self, command: SendTask, life: Lifecycle) -> SeededTask:
        """`command`, seeded for its position in the epoch: the core's own mapping of a task
        number to the position a checkpoint records, so a resumed epoch's tasks (numbered
        afresh) get the seeds of the positions they stand for."""
        position = _position(life.resumed, command.task - life.base)
        seed = batch_seed(self.epoch_seed, position)
        return SeededTask.fast(command.worker, command.task, command.index, seed)


_NUMPY_WORD = 0x5BD1E995
"""Folded into a batch's low word before it is mixed for numpy, so that numpy's seed is not
torch's word (see `numpy_seed`)."""


def numpy_seed(seed: int) -> int:
    """The 32-bit seed of numpy's generator for a batch seeded `seed`: its low 32 bits with
    `_NUMPY_WORD` folded in, mixed once more (`_mix32`).

    32 bits: numpy's cheapest seeding (`numpy.random.seed` of an int, 7 us after a batch's work
    against 55 for a state of 64 bits), and a bijection of the same word torch's generator
    keeps, so that no two batches of an epoch draw the same numbers from numpy either. Not that
    word itself: numpy's scalar seeding and torch's are the same MT19937 initialisation, so
    numpy seeded with it would draw the words torch draws. `random.seed` seeds MT19937 another
    way (from the whole seed, `init_by_array`).
    """
    return _mix32((seed & _MASK32) ^ _NUMPY_WORD)


def _seed_numpy(seed: int) -> None:
    """Seed numpy's global generator for a batch seeded `seed` (`numpy_seed`)."""
    import numpy

    numpy.random.seed(numpy_seed(seed))


def seed_globals(seed: int) -> None:
    """Seed `random` and torch as torch seeds a worker with `seed`, and numpy from
    `numpy_seed(seed)` (`_seed_numpy`).

    torch's CPU generator alone, the one a dataset's augmentations draw from: `torch.manual_seed`
    also seeds every accelerator's, and where CUDA is not initialised it queues that with a
    traceback of its caller, 270 us a batch on this machine against 3 us.
    """
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if HAS_NUMPY:
        _seed_numpy(seed)


def _tell_seed(seed: int) -> None:
    """`get_worker_info().seed` is `seed` while the batch is made."""
    info = torch.utils.data.get_worker_info()
    if info is not None:
        # WorkerInfo refuses assignment once built: this is the one field that changes.
        object.__setattr__(info, "seed", seed)


def _seed_process(seed: int) -> None:
    seed_globals(seed)
    _tell_seed(seed)


def _seed_thread(seed: int) -> None:
    # The process-wide generators are every thread's: a thread seeds its own (WorkerInfo.rng),
    # as it was seeded per worker at its start (`_startup.worker_info`).
    info = torch.utils.data.get_worker_info()
    rng = getattr(info, "rng", None)
    if rng is not None:
        rng.random_generator.seed(seed)
        rng.torch_generator.manual_seed(seed)
        numpy_generator = rng.numpy_generator
        if numpy_generator is not None:
            bits = numpy_generator.bit_generator
            bits.state = type(bits)(numpy_seed(seed)).state
    _tell_seed(seed)


def _seed_caller(seed: int) -> Callable[[], None]:
    # The loader's thread is the training loop's: its generators are put back as they were,
    # so that seeding the batch moves nothing the program draws (`seed_globals` leaves torch's
    # accelerators' generators alone).
    numpy_state: Any = None
    if HAS_NUMPY:
        import numpy

        numpy_state = numpy.random.get_state()
    saved = random.getstate(), torch.default_generator.get_state(), numpy_state
    seed_globals(seed)

    def restore() -> None:
        random.setstate(saved[0])
        torch.default_generator.set_state(saved[1])
        if saved[2] is not None:
            import numpy

            numpy.random.set_state(saved[2])

    return restore


Seeder = Callable[[int], Callable[[], None] | None]
"""Seeds a worker for one batch; returns what puts its generators back afterwards, if needed."""


def seeder_for(kind: str) -> Seeder:
    """How a worker seated in `kind` ("process", "thread" or "caller": `_startup.SeatKind`'s
    values) seeds itself for a batch."""
    seeders: dict[str, Seeder] = {
        "process": _seed_process,
        "thread": _seed_thread,
        "caller": _seed_caller,
    }
    return seeders[kind]
