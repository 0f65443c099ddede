"""The reference semantics: what one epoch must hand to the consumer, computed the obvious way.

No scheduling, no timing: just the answer a correct loader gives. The simulated world
(`statecore.models.world`) compares every finished epoch against it.

An outcome is `("data", value)` for a batch or `("error", value)` for a task that raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

__all__ = ["IterableSpec", "MapSpec", "Outcome", "expected_epoch", "iterable_batch", "map_batch"]

Outcome = tuple[Literal["data", "error"], object]


@attrs.frozen
class MapSpec:
    """A map-style dataset whose sampler yields `batches` indices, 0, 1, ...

    The batch for index i of epoch e is `(e, i)`; indices in `failing` raise instead.
    """

    batches: int
    failing: frozenset[int] = frozenset()


@attrs.frozen
class IterableSpec:
    """An iterable dataset sharded over workers: worker w yields `lengths[w]` batches an epoch.

    The k-th batch of worker w in epoch e is `(w, e, k)`; pairs (w, k) in `failing` raise instead.
    """

    lengths: tuple[int, ...]
    failing: frozenset[tuple[int, int]] = frozenset()


def map_batch(spec: MapSpec, epoch: int, index: int) -> Outcome:
    kind: Literal["data", "error"] = "error" if index in spec.failing else "data"
    return (kind, (epoch, index))


def iterable_batch(spec: IterableSpec, worker: int, epoch: int, k: int) -> Outcome | None:
    """The k-th answer of `worker` in `epoch`, or None once its shard has run dry."""
    if k >= spec.lengths[worker]:
        return None
    kind: Literal["data", "error"] = "error" if (worker, k) in spec.failing else "data"
    return (kind, (worker, epoch, k))


def expected_epoch(spec: MapSpec | IterableSpec, epoch: int) -> Sequence[Outcome]:
    """Every outcome of `epoch`, in the order an in-order loader hands them over.

    Map-style: the sampler's order. Iterable: workers take turns, torch's round robin starting
    at worker 0, and a worker whose shard has run dry drops out of the turn.
    """
    if isinstance(spec, MapSpec):
        return [map_batch(spec, epoch, i) for i in range(spec.batches)]
    merged: list[Outcome] = []
    rounds = max(spec.lengths, default=0)
    for k in range(rounds):
        for w in range(len(spec.lengths)):
            outcome = iterable_batch(spec, w, epoch, k)
            if outcome is not None:
                merged.append(outcome)
    return merged
