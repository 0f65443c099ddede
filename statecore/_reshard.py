"""An epoch begun on N ranks, finished on M: the remainder shared out as DistributedSampler would.

torch's `DistributedSampler` shares an epoch among the ranks of a job: it orders the dataset
(a permutation drawn from `seed + epoch`, or 0, 1, 2...), makes the list divisible by the number
of ranks (without `drop_last`, by repeating its first samples; with it, by dropping its last
ones), and gives rank r every world-size-th sample from position r on. Each rank then batches
its share; every rank has as many samples, hence as many batches, which keeps DDP's ranks in
lock-step.

A checkpoint taken mid-epoch says which batches of its share each rank's consumer was handed
(`Progress`, positions of its sampler's draws). Loaded on another number of ranks, those
positions mean nothing to the new ranks; the dataset indices they stand for do. An
`EpochSplit` is therefore the epoch's order less the samples handed over earlier in the
epoch, shared out by DistributedSampler's own rules: resharding an epoch is a new split of
what no rank received, and a split that received nothing is DistributedSampler's ordinary
epoch. Splitting again, from a checkpoint of a resharded epoch, works the same way, so an
epoch may change its number of ranks any number of times.

What "exactly once" means here: every sample of the order that no rank received before the
checkpoint is in exactly one new rank's share, and none received before is; apart from
DistributedSampler's own rules applied to the remainder: without `drop_last`, up to M - 1 of
its first samples are repeated (padding); with it, up to M - 1 of its last are left out of the
epoch. A batch sampler with `drop_last` leaves out each rank's last, incomplete batch as in any
epoch.

Pure, like `step`: no torch. The shell draws the epoch's order (with torch's own sampler) and
hands it over as a tuple.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence

import attrs

from statecore._state import Progress

__all__ = [
    "EpochSplit",
    "RankMergeError",
    "RankPart",
    "handed_positions",
    "merge_ranks",
    "received_samples",
    "reshard",
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@attrs.frozen
class EpochSplit:
    """One epoch's samples still to come, shared among `world_size` ranks as torch's
    DistributedSampler shares an epoch."""

    order: tuple[int, ...]
    """The epoch's order of the dataset's indices: DistributedSampler's permutation for the
    epoch, or 0, 1, 2... without shuffling. Every index appears once."""
    world_size: int
    drop_last: bool
    """The sampler's `drop_last`: the remainder is cut to a multiple of `world_size` rather than
    padded to one."""
    consumed: frozenset[int] = frozenset()
    """The indices handed over earlier in the epoch, under earlier splits: none is shared out."""

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"a split needs at least one rank, got world_size={self.world_size}")
        if not self.consumed <= set(self.order):
            stray = sorted(self.consumed - set(self.order))[:8]
            raise ValueError(f"consumed indices {stray} are not in the epoch's order")

    @property
    def remaining(self) -> tuple[int, ...]:
        """The epoch's indices not handed over yet, in the epoch's order."""
        if not self.consumed:
            return self.order
        return tuple(i for i in self.order if i not in self.consumed)

    @property
    def per_rank(self) -> int:
        """Each rank's number of samples (DistributedSampler's `num_samples`)."""
        left, world = len(self.remaining), self.world_size
        return left // world if self.drop_last else _ceil_div(left, world)

    @property
    def padding(self) -> int:
        """How many of the remainder's first samples are repeated to make it divisible."""
        return self.per_rank * self.world_size - len(self.remaining) if not self.drop_last else 0

    def padded(self) -> tuple[int, ...]:
        """The remainder made divisible by the number of ranks, by DistributedSampler's rules:
        repeated from its start (as many times as it takes) or cut at its end."""
        remaining = self.remaining
        total = self.per_rank * self.world_size
        if total <= len(remaining):
            return remaining[:total]
        # total > len(remaining) > 0 here: a remainder of nothing needs no padding.
        times = _ceil_div(total, len(remaining))
        return (remaining * times)[:total]

    def share(self, rank: int) -> tuple[int, ...]:
        """What rank `rank` loads for the rest of the epoch, in order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a split of world_size={self.world_size}")
        return self.padded()[rank :: self.world_size]

    def shares(self) -> tuple[tuple[int, ...], ...]:
        padded = self.padded()
        return tuple(padded[r :: self.world_size] for r in range(self.world_size))


def handed_positions(progress: Progress) -> frozenset[int]:
    """The positions of the sampler's draws that `progress` says were handed over."""
    return frozenset(range(progress.done)) | progress.also


def _batches(samples: int, batch_size: int | None, drop_batch: bool) -> int:
    if batch_size is None:
        return samples
    return samples // batch_size if drop_batch else _ceil_div(samples, batch_size)


def received_samples(
    split: EpochSplit,
    rank: int,
    positions: Collection[int],
    batch_size: int | None,
    drop_batch: bool = False,
) -> frozenset[int]:
    """The dataset indices in the batches at `positions` of `rank`'s share.

    `batch_size` is None where the sampler's draws are samples (no automatic batching);
    `drop_batch` is the loader's `drop_last`, which leaves out a share's incomplete last batch.
    """
    share = split.share(rank)
    count = _batches(len(share), batch_size, drop_batch)
    stray = sorted(p for p in positions if not 0 <= p < count)
    if stray:
        raise ValueError(
            f"rank {rank} of {split.world_size} has {count} batches this epoch, and positions "
            f"{stray[:8]} are not among them"
        )
    size = 1 if batch_size is None else batch_size
    return frozenset(i for p in positions for i in share[p * size : (p + 1) * size])


def reshard(
    split: EpochSplit,
    positions: Sequence[Collection[int]],
    world_size: int,
    batch_size: int | None,
    drop_batch: bool = False,
) -> EpochSplit:
    """The rest of `split`'s epoch, shared among `world_size` ranks.

    `positions[r]` are the positions of the draws rank r's consumer was handed (in any pattern:
    ranks stopped at different points, out-of-order holes). Every rank of `split` must be
    there: a rank left out would have its samples loaded again.
    """
    if len(positions) != split.world_size:
        raise ValueError(
            f"the epoch was split among {split.world_size} ranks, and progress is given for "
            f"{len(positions)}: every rank's is needed"
        )
    taken = frozenset().union(
        *(
            received_samples(split, rank, done, batch_size, drop_batch)
            for rank, done in enumerate(positions)
        )
    )
    return attrs.evolve(split, world_size=world_size, consumed=split.consumed | taken)


class RankMergeError(ValueError):
    """Per-rank progress that does not make one epoch's: what differs is named."""


@attrs.frozen
class RankPart:
    """One rank's progress through its share of an epoch, as its own checkpoint records it."""

    rank: int
    world_size: int
    epoch: Hashable
    """What names the epoch and its split (seed, epoch number, shuffle, the splits before):
    parts of different epochs do not merge."""
    progress: Progress


def merge_ranks(parts: Iterable[RankPart]) -> tuple[Progress, ...]:
    """Each rank's progress, by rank, from parts saved separately (one per rank)."""
    parts = list(parts)
    if not parts:
        raise RankMergeError("no rank's progress was given")
    first = parts[0]
    by_rank: dict[int, Progress] = {}
    for part in parts:
        if part.world_size != first.world_size:
            raise RankMergeError(
                f"rank {part.rank}'s state was taken on {part.world_size} ranks, and rank "
                f"{first.rank}'s on {first.world_size}: merge states of one checkpoint"
            )
        if part.epoch != first.epoch:
            raise RankMergeError(
                f"rank {part.rank}'s state is of another epoch or split ({part.epoch!r}) than "
                f"rank {first.rank}'s ({first.epoch!r}): merge states of one checkpoint"
            )
        if not 0 <= part.rank < part.world_size:
            raise RankMergeError(f"rank {part.rank} is not a rank of {part.world_size}")
        seen = by_rank.setdefault(part.rank, part.progress)
        if seen != part.progress:
            raise RankMergeError(f"two states of rank {part.rank} disagree on its progress")
    missing = sorted(set(range(first.world_size)) - by_rank.keys())
    if missing:
        raise RankMergeError(
            f"the states of ranks {missing[:8]} of {first.world_size} are missing: every rank's "
            "is needed, or its samples would be loaded again"
        )
    return tuple(by_rank[r] for r in range(first.world_size))
