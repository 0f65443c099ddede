"""The sampler of `shuffle=True`: torch's `RandomSampler` order, without its list of ints.

torch's `RandomSampler` turns each epoch's permutation into a Python list before yielding its
first index (`randperm(n).tolist()`): for 2 million samples, 2 million int objects, about
72 MB, in the main process. Worse under fork, the heap they fill is copied page by page: the
workers forked after the first draw inherit those pages, and the main process, writing the
reference count of every int it hands out, then copies each of them again (pytorch#13246's
"memory grows with every worker", docs/performance.md "Copy-on-read memory").

`PermutationSampler` keeps the permutation as torch makes it, one tensor (int32 below 2**31
samples: 4 bytes an index, 8 MB for 2 million, in one block that nothing writes after it is
drawn), and turns a chunk of it at a time into ints. It makes exactly the same draws from the
same generators, in the same order and at the same points of the iteration, so the indices it
yields, the seed it draws from torch's global generator when it has no generator of its own,
and where it leaves the generator it was given are all torch's. It is a `RandomSampler` (a
subclass), since users and frameworks recognise the shuffling sampler by that class.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import RandomSampler

__all__ = ["CHUNK", "PermutationSampler", "default_sampler", "shown_class"]

CHUNK = 4096
"""Indices turned into Python ints at a time: 150 kB of them, against 72 MB for a whole epoch
of 2 million, and one more step of the loop per 4096 indices."""


_INT32_INDICES = 2**31
"""The most samples whose indices an int32 permutation holds."""


class PermutationSampler(RandomSampler):
    """torch's `RandomSampler`, yielding the same indices from a permutation kept as a tensor.

    Takes the same arguments with the same validation. Without replacement, each epoch draws
    `num_samples // n` whole permutations and then one more, of which the first
    `num_samples % n` indices are yielded (a full epoch draws that last one and uses none of
    it, as torch does: the generator moves on the same way); each permutation is turned into
    Python ints `CHUNK` at a time. With replacement torch's own draws (32 indices at a time)
    are used unchanged.
    """

    def __iter__(self) -> Iterator[int]:
        if self.replacement:
            return super().__iter__()
        # Chained in C: a Python frame per chunk, not per index (two generators yielding each
        # index cost a batch of 64 about 2 us). Lazy still: nothing is drawn before the first.
        return itertools.chain.from_iterable(self._chunks())

    def _chunks(self) -> Iterator[list[int]]:
        size = len(self.data_source)
        wanted = self.num_samples
        generator = self._epoch_generator()
        whole, left = divmod(wanted, size)
        # torch's randperm draws the same numbers, and so the same order, into either dtype.
        dtype = torch.int32 if size <= _INT32_INDICES else torch.int64
        for _ in range(whole):
            yield from _in_chunks(torch.randperm(size, generator=generator, dtype=dtype))
        if left:
            yield from _in_chunks(torch.randperm(size, generator=generator, dtype=dtype)[:left])
        elif generator is self.generator:
            # torch draws one more permutation and yields none of it: the generator the user
            # gave moves on by it in torch's epochs too. An epoch's own generator dies unused.
            torch.randperm(size, generator=generator, dtype=dtype)

    def _epoch_generator(self) -> torch.Generator:
        """The generator this epoch draws from: the sampler's, else one of its own seeded from
        torch's global generator (one draw from it, as torch's sampler makes)."""
        if self.generator is not None:
            generator: torch.Generator = self.generator
            return generator
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        own = torch.Generator()
        own.manual_seed(seed)
        return own


def _in_chunks(permutation: torch.Tensor) -> Iterator[list[int]]:
    for start in range(0, len(permutation), CHUNK):
        yield permutation[start : start + CHUNK].tolist()


def default_sampler(
    dataset: Sized,
    shuffle: object,
    sampler: object,
    batch_sampler: object,
    generator: torch.Generator | None,
) -> PermutationSampler | None:
    """The sampler `DataLoader` passes torch in place of the `RandomSampler` torch would make
    from `shuffle`, or None where torch makes none, or where making one fails (torch then
    raises its own error, after the checks it makes first)."""
    if sampler is not None or batch_sampler is not None or not shuffle:
        return None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        return PermutationSampler(dataset, generator=generator)
    except (TypeError, ValueError):
        return None


def shown_class(thing: object) -> type:
    """The class a checkpoint's fingerprint and the loader's messages name for `thing`:
    torch's `RandomSampler` for a `PermutationSampler`, whose order is torch's (a state taken
    with either loads into a loader with the other, and the user who passed `shuffle=True`
    reads the name torch's documentation uses)."""
    return RandomSampler if type(thing) is PermutationSampler else type(thing)
