"""A checkpoint of a distributed epoch, resumed on another number of ranks.

With torch's `DistributedSampler`, each rank's state says which of its share's batches its
consumer was handed. A state that is to resume on another number of ranks needs every rank's:
when `torch.distributed` is initialised, `state_dict()` gathers them (`gathered`, one
`all_gather_object` on the default group, which every rank must call, as checkpoint code
already does), and `merge_state_dicts` merges states saved separately, one per rank. The
state's `distributed` entry holds them, with what the split is made of: the sampler's seed,
epoch, shuffle and `drop_last`, the world size, and the splits the epoch had before (an epoch
resumed on another number of ranks and checkpointed again).

Loaded on M ranks, the samples no rank received are shared out by `statecore._reshard` (pure),
the way DistributedSampler shares an epoch; each rank's loader draws its share for the rest of
the epoch, and DistributedSampler's ordinary epochs after it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed
from torch.utils.data import BatchSampler, DistributedSampler

from statecore import Progress
from statecore._reshard import (
    EpochSplit,
    RankMergeError,
    RankPart,
    handed_positions,
    merge_ranks,
    reshard,
)
from statecore.executors._permutation import shown_class

__all__ = [
    "Elastic",
    "Stage",
    "batches_of",
    "align_epoch",
    "check_process_group",
    "distributed_sampler",
    "entry",
    "merge_state_dicts",
    "process_group_entry",
    "continuation",
    "facts_for",
]

_KEY = "distributed"


def distributed_sampler(sampler: Any, batch_sampler: Any) -> DistributedSampler[Any] | None:
    """The loader's DistributedSampler, given as `sampler` or inside torch's BatchSampler."""
    for candidate in (sampler, getattr(batch_sampler, "sampler", None)):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None


@attrs.frozen
class Stage:
    """Which split of which epoch a loader's epoch draws: the sampler's epoch, and the splits the
    epoch had on earlier numbers of ranks (empty for DistributedSampler's ordinary epoch)."""

    epoch: int
    earlier: tuple[tuple[int, tuple[Progress, ...]], ...] = ()
    """Per earlier split: its world size, and each of its ranks' progress through its share."""


@attrs.frozen
class Elastic:
    """What a loader resumed on another number of ranks draws for the rest of the epoch."""

    share: tuple[int, ...]
    """This rank's dataset indices for the rest of the epoch, in order."""
    stage: Stage


def _plain(progress: Progress) -> dict[str, Any]:
    return {"done": progress.done, "also": sorted(progress.also)}


def _identity(sampler: DistributedSampler[Any], stage: Stage) -> dict[str, Any]:
    """What names an epoch's split: ranks whose states agree on it took one epoch's progress."""
    return {
        "world_size": int(sampler.num_replicas),
        "seed": int(sampler.seed),
        "epoch": stage.epoch,
        "shuffle": bool(sampler.shuffle),
        "drop_last": bool(sampler.drop_last),
        "earlier": [
            {"world_size": world, "ranks": [_plain(p) for p in ranks]}
            for world, ranks in stage.earlier
        ],
    }


def gathered(mine: dict[str, Any]) -> list[Any] | None:
    """Every process's `mine`, where a `torch.distributed` process group is initialised.

    One collective on the default group: every process calls it, or the others wait for it.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _group() -> tuple[int, int] | None:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def process_group_entry() -> dict[str, int] | None:
    """An iterable dataset's state's `process_group` entry: the rank and world size it was
    taken on, where torch.distributed is initialised."""
    group = _group()
    return None if group is None else {"rank": group[0], "world_size": group[1]}


def check_process_group(state: Any) -> None:
    """Refuse an iterable dataset's state taken on other ranks than this process's.

    Each rank's iterable dataset shards itself (by rank, say) and goes on with its own part of
    the stream: a state of one rank's part cannot be shared out among other ranks.
    """
    if not isinstance(state, Mapping) or not isinstance(state.get("process_group"), Mapping):
        return
    group, taken = _group(), state["process_group"]
    if group is None or (taken.get("rank"), taken.get("world_size")) == group:
        return
    raise _fail(
        f"it is an iterable dataset's state taken on rank {taken.get('rank')!r} of "
        f"{taken.get('world_size')!r} processes, and this process is rank {group[0]} of "
        f"{group[1]}: each rank's iterable dataset goes on with its own part of its stream, so "
        "it resumes only on as many ranks, each loading its own rank's state. To change the "
        "number of ranks mid-epoch, use a map-style dataset with torch's DistributedSampler"
    )


def align_epoch(state: Mapping[str, Any], loader: Any) -> None:
    """Set the loader's DistributedSampler to the epoch a mid-epoch `state` was taken in.

    The state resumes that epoch, whatever `set_epoch` said last: Lightning, for one, makes
    the resumed loader's iterator before it calls `set_epoch`, and a loader with workers draws
    its first batches as the iterator is made. The program's own `set_epoch` for the next
    epochs works as ever.
    """
    taken = state.get(_KEY)
    sampler = distributed_sampler(loader.sampler, loader.batch_sampler)
    if not isinstance(taken, Mapping) or sampler is None or state.get("complete") is not False:
        return
    sampler.set_epoch(int(taken["epoch"]))


def entry(
    sampler: DistributedSampler[Any],
    stage: Stage,
    progress: Progress,
    length: int,
    *,
    gather: bool = True,
) -> dict[str, Any]:
    """The state's `distributed` entry, with every rank's progress where they can be gathered.

    `ranks` is None where they cannot (torch.distributed is not initialised, or the processes
    are not the sampler's ranks): the state then resumes on its own rank only, unless merged
    with the others' (`merge_state_dicts`).
    """
    identity = _identity(sampler, stage)
    rank = int(sampler.rank)
    mine = {"rank": rank, "identity": identity, "progress": _plain(progress)}
    everyone = gathered(mine) if gather else None
    ranks: list[Any] | None = None
    if everyone is not None:
        by_rank = {
            other["rank"]: other["progress"]
            for other in everyone
            if isinstance(other, Mapping) and other.get("identity") == identity
        }
        if set(by_rank) == set(range(identity["world_size"])):
            ranks = [by_rank[r] for r in range(identity["world_size"])]
    return {
        **identity,
        "rank": rank,
        # How many samples DistributedSampler repeats to fill an ordinary epoch of these ranks.
        "padding": max(int(sampler.total_size) - length, 0),
        "ranks": ranks,
    }


def _fail(message: str) -> ValueError:
    return ValueError(f"cannot load this DataLoader state: {message}")


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _progress(value: Any, path: str) -> Progress:
    if (
        not isinstance(value, Mapping)
        or type(value.get("done")) is not int
        or not isinstance(value.get("also"), list | tuple)
        or any(type(p) is not int for p in value["also"])
    ):
        raise _fail(
            f"{path} holds {_shown(value)}; expected a dict with 'done' (an int) and 'also'"
        )
    try:
        return Progress(value["done"], frozenset(value["also"]))
    except ValueError as error:
        raise _fail(f"{path} holds {_shown(value)}: {error}") from None


def _ranks(value: Any, world: int, path: str) -> tuple[Progress, ...]:
    if not isinstance(value, list | tuple) or len(value) != world:
        raise _fail(
            f"{path} holds {_shown(value)}; expected one progress per rank, {world} of them"
        )
    return tuple(_progress(p, f"{path}[{r}]") for r, p in enumerate(value))


def _int(value: Any, path: str, low: int | None = 0, high: int | None = None) -> int:
    if (
        type(value) is not int
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        span = "" if low is None else f" from {low}"
        span += "" if high is None else f" to {high}"
        raise _fail(f"{path} holds {_shown(value)}; expected an int{span}")
    return value


def _bool(value: Any, path: str) -> bool:
    if type(value) is not bool:
        raise _fail(f"{path} holds {_shown(value)}; expected True or False")
    return value


def _read(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state's `distributed` entry, checked for its types."""
    raw = state[_KEY]
    if not isinstance(raw, Mapping):
        raise _fail(f"{_KEY} holds {_shown(raw)}; expected a dict")
    path = _KEY
    got: dict[str, Any] = {}
    world = got["world_size"] = _int(raw.get("world_size"), f"{path}.world_size", 1)
    got["rank"] = _int(raw.get("rank"), f"{path}.rank", 0, world - 1)
    got["seed"] = _int(raw.get("seed"), f"{path}.seed", None)  # torch takes any int
    for name in ("epoch", "padding"):
        got[name] = _int(raw.get(name), f"{path}.{name}")
    for name in ("shuffle", "drop_last"):
        got[name] = _bool(raw.get(name), f"{path}.{name}")
    earlier = raw.get("earlier")
    if not isinstance(earlier, list | tuple):
        raise _fail(f"{path}.earlier holds {_shown(earlier)}; expected a list")
    stages = []
    for s, split in enumerate(earlier):
        where = f"{path}.earlier[{s}]"
        if not isinstance(split, Mapping):
            raise _fail(f"{where} holds {_shown(split)}; expected a dict")
        size = _int(split.get("world_size"), f"{where}.world_size", 1)
        stages.append((size, _ranks(split.get("ranks"), size, f"{where}.ranks")))
    got["earlier"] = tuple(stages)
    ranks = raw.get("ranks")
    got["ranks"] = None if ranks is None else _ranks(ranks, got["world_size"], f"{path}.ranks")
    return got


def epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> tuple[int, ...]:
    """The epoch's order of the dataset's indices, drawn by torch's DistributedSampler itself
    (one rank, no padding): the permutation of `seed + epoch`, or 0, 1, 2..."""
    whole: DistributedSampler[int] = DistributedSampler(
        range(length),  # type: ignore[arg-type]  # a Sized is all it reads
        num_replicas=1,
        rank=0,
        shuffle=shuffle,
        seed=seed,
    )
    whole.set_epoch(epoch)
    return tuple(whole)


def _splittable(loader: Any, sampler: DistributedSampler[Any] | None, taken: Any) -> str | None:
    """Why this loader cannot draw a share of another number of ranks, or None."""
    if sampler is None:
        kind = shown_class(loader.sampler).__qualname__
        return (
            f"it was taken on rank {taken['rank']} of {taken['world_size']} with a "
            f"DistributedSampler, and this loader's sampler ({kind}) is not distributed-aware: "
            "build the loader with sampler=DistributedSampler(dataset, num_replicas=..., "
            f"rank=..., shuffle={taken['shuffle']}, seed={taken['seed']}, "
            f"drop_last={taken['drop_last']})"
        )
    if type(sampler).__iter__ is not DistributedSampler.__iter__:
        return (
            f"this loader's sampler, {type(sampler).__qualname__}, draws its own split (its "
            "__iter__ is not DistributedSampler's), so the rest of the epoch cannot be shared "
            "out among another number of ranks: resume on the state's world size "
            f"({taken['world_size']}), or use torch's DistributedSampler"
        )
    batches = loader.batch_sampler
    if batches is not None and type(batches) is not BatchSampler:
        return (
            f"this loader's batch sampler, {type(batches).__qualname__}, is not torch's "
            "BatchSampler, so its batches of another rank's share are unknown: resume on the "
            f"state's world size ({taken['world_size']}) and rank"
        )
    return None


def facts_for(
    state: Any, loader: Any, facts: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The facts to check `state` against (`parse`), and its `distributed` entry where this
    loader resumes it other than as any state (see `continuation`), else None.

    A state taken on this rank of this world size, in DistributedSampler's ordinary epoch,
    resumes as any other; one taken on another rank or world size is checked as any other but
    for those two, once this loader is known to be able to draw a share of it.
    """
    if not isinstance(state, Mapping) or not isinstance(state.get(_KEY), Mapping):
        return dict(facts), None
    taken = _read(state)
    sampler = distributed_sampler(loader.sampler, loader.batch_sampler)
    if (
        sampler is not None
        and taken["world_size"] == sampler.num_replicas
        and taken["rank"] == sampler.rank
        and not taken["earlier"]
    ):
        return dict(facts), None
    why = _splittable(loader, sampler, taken)
    if why is not None:
        raise _fail(why)
    assert sampler is not None
    for name, mine in (
        ("seed", int(sampler.seed)),
        ("shuffle", bool(sampler.shuffle)),
        ("drop_last", bool(sampler.drop_last)),
    ):
        if taken[name] != mine:
            raise _fail(
                f"it was taken with a DistributedSampler of {name}={taken[name]!r}, and this "
                f"loader's has {name}={mine!r}: the rest of the epoch is the original's only "
                f"with the same {name}; build the sampler with {name}={taken[name]!r}"
            )
    return {**facts, "rank": state.get("rank"), "world_size": state.get("world_size")}, taken


def continuation(taken: dict[str, Any], complete: bool, loader: Any) -> Progress | Elastic | None:
    """How this loader goes on from a state `facts_for` set apart, once `parse` accepted it.

    None between epochs (the next is DistributedSampler's ordinary one); a `Progress` where as
    many ranks go on with DistributedSampler's ordinary epoch, each from its own progress;
    an `Elastic` where this rank draws its share of the rest of the epoch.
    """
    if complete:
        return None
    sampler = distributed_sampler(loader.sampler, loader.batch_sampler)
    assert sampler is not None
    rank, world = int(sampler.rank), int(sampler.num_replicas)
    ranks: tuple[Progress, ...] | None = taken["ranks"]
    if ranks is None:
        raise _fail(
            f"it holds the progress of rank {taken['rank']} only, of {taken['world_size']} "
            f"ranks, and this loader is rank {rank} of {world}: the rest of the epoch needs "
            "every rank's progress. Take the state with torch.distributed initialised "
            "(state_dict() gathers it), or merge every rank's state with "
            "statecore.executors.merge_state_dicts([...]) and load the result"
        )
    if not taken["earlier"] and taken["world_size"] == world:
        # As many ranks: each goes on with its own share, as the uninterrupted run would.
        return ranks[rank]
    order = epoch_order(len(loader.dataset), taken["shuffle"], taken["seed"], taken["epoch"])
    split = EpochSplit(order, 1, taken["drop_last"])
    try:
        for earlier, progress in (*taken["earlier"], (taken["world_size"], ranks)):
            split = _next(attrs.evolve(split, world_size=earlier), progress, loader)
    except ValueError as error:
        raise _fail(f"its progress does not fit this dataset's epoch: {error}") from None
    split = attrs.evolve(split, world_size=world)
    stage = Stage(taken["epoch"], (*taken["earlier"], (taken["world_size"], ranks)))
    return Elastic(split.share(rank), stage)


def _next(split: EpochSplit, ranks: Sequence[Progress], loader: Any) -> EpochSplit:
    """`split` with every rank's handed-over samples consumed (its world size unchanged)."""
    batches = loader.batch_sampler
    batch_size = None if batches is None else int(batches.batch_size)
    drop_batch = False if batches is None else bool(batches.drop_last)
    positions = [handed_positions(p) for p in ranks]
    return reshard(split, positions, split.world_size, batch_size, drop_batch)


def batches_of(share: Sequence[int], loader: Any) -> Any:
    """An iterator over this loader's draws of `share`: its batches, or its samples."""
    batches = loader.batch_sampler
    if batches is None:
        return iter(share)
    return iter(BatchSampler(list(share), batches.batch_size, batches.drop_last))


def merge_state_dicts(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state holding every rank's progress, from states each rank saved on its own.

    For frameworks and programs that save one file per rank without torch.distributed's help
    (`state_dict()` gathers them itself where it is initialised). The states must be of one
    checkpoint: the same epoch and split, one per rank of its world size. The result is the
    lowest rank's state with everyone's progress; load it on any number of ranks.
    """
    parts = []
    for n, state in enumerate(states):
        if not isinstance(state, Mapping) or not isinstance(state.get(_KEY), Mapping):
            raise RankMergeError(
                f"states[{n}] is not a statecore DataLoader state of a DistributedSampler's "
                "loader (it has no 'distributed' entry): only those are merged"
            )
        taken = _read(state)
        identity = (
            taken["seed"],
            taken["epoch"],
            taken["shuffle"],
            taken["drop_last"],
            taken["earlier"],
            state.get("dataset_length"),
        )
        progress = _progress(state.get("progress"), f"states[{n}].progress")
        parts.append(RankPart(taken["rank"], taken["world_size"], identity, progress))
    ranks = merge_ranks(parts)
    lowest = min(range(len(parts)), key=lambda n: parts[n].rank)
    merged = copy.deepcopy(dict(states[lowest]))
    merged[_KEY] = {**merged[_KEY], "ranks": [_plain(p) for p in ranks]}
    return merged
