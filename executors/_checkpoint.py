"""A loader's checkpoint as plain data, and what a loader needs to resume from one.

The scheduler says which of the epoch's draws were handed over (`statecore.progress`); this
module adds what lives outside the scheduler, so that a fresh loader can draw the same epoch
again: the state of the random generator the epoch's sampler draws from, taken as the epoch
began; the base seed the workers were seeded from; and, for a sampler with its own
`state_dict`, the sampler's state after the last draw handed over; for an iterable dataset,
where each worker's part of the dataset stands after its last batch handed over (its mark: see
`WorkerRuntime`), from which a fresh worker restores it or fast-forwards.

The checkpoint is made of dicts, lists, ints, strings and booleans only (a generator's state
is a base64 string), so `torch.load(weights_only=True)` and `json` both take it, as long as a
stateful sampler's own state is plain too.
"""

from __future__ import annotations

import base64
import itertools
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from statecore import Progress
from statecore.executors._elastic import Elastic, Stage
from statecore.executors._permutation import shown_class
from statecore.executors._worker import Mark, has_state

__all__ = [
    "FORMAT",
    "EpochRecord",
    "Resume",
    "SamplerLog",
    "decode_rng",
    "draws_nothing",
    "encode_rng",
    "fingerprint",
    "parse",
    "positioned",
    "snapshot",
    "stateful_sampler",
]

FORMAT = 2
"""The version of the checkpoint's layout; a loader refuses a version it does not know.

Version 2 added the fingerprint's sampler, shuffle, generator and distributed fields, the
workers found dry (`progress.dry`) and `seeded`. A version-1 state still loads (`_from_version_1`).
"""

_ADDED_IN_2 = ("sampler_class", "batch_sampler_class", "shuffle", "generator", "rank", "world_size")
"""The fingerprint's fields a version-1 state lacks: it cannot be checked against them."""

_KEY = "statecore"


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def stateful_sampler(index_sampler: Any) -> Any:
    """The sampler whose own `state_dict` positions the epoch, or None.

    torch's BatchSampler keeps nothing between batches, so the sampler it wraps, if stateful,
    is positioned exactly where the batch sampler is.
    """
    candidates = [index_sampler]
    if type(index_sampler) is BatchSampler:
        candidates.append(index_sampler.sampler)
    return next((candidate for candidate in candidates if has_state(candidate)), None)


def draws_nothing(index_sampler: Any) -> bool:
    """Whether the epoch's sampler draws no random number: torch's SequentialSampler, batched
    by torch's BatchSampler or not. Its epoch is drawn again with no generator's state."""
    sampler = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    return type(sampler) is SequentialSampler


def _qualified(thing: Any) -> str | None:
    kind = shown_class(thing)
    return None if thing is None else f"{kind.__module__}.{kind.__qualname__}"


def fingerprint(
    kind: str,
    *,
    dataset: Any,
    sampler: Any,
    batch_sampler: Any,
    batch_size: int | None,
    drop_last: bool,
    num_workers: int,
    generator: torch.Generator | None,
) -> dict[str, Any]:
    """What a state was taken from, checked on load (plain values: `json` takes them).

    A state loaded into a loader that differs in any of these would resume another stream of
    batches without a word: another dataset, batching, order (sampler, shuffle), source of
    randomness, or share of a distributed dataset. For an iterable dataset each worker resumes
    its own part, so the number of workers counts too; a map-style epoch is positions in the
    sampler's output, which any number of workers resumes.
    """
    samplers = [sampler, batch_sampler]
    if type(batch_sampler) is BatchSampler:
        samplers.append(batch_sampler.sampler)
    own = next(
        (
            s.generator
            for s in samplers
            if isinstance(getattr(s, "generator", None), torch.Generator)
            and s.generator is not generator
        ),
        None,
    )
    source = "sampler" if own is not None else "global" if generator is None else "loader"
    if kind == "iterable":
        return {
            "dataset_kind": kind,
            "num_workers": num_workers,
            "batch_size": batch_size,
            "drop_last": drop_last,
            "generator": source,
        }
    try:
        length: int | None = len(dataset)
    except TypeError:
        length = None
    shared = next((s for s in samplers if isinstance(s, DistributedSampler)), None)
    shuffle: bool | None = None
    for s in samplers:
        if isinstance(s, RandomSampler | SequentialSampler):
            shuffle = isinstance(s, RandomSampler)
    if shared is not None:
        shuffle = bool(shared.shuffle)
    return {
        "dataset_kind": kind,
        "dataset_length": length,
        "batch_size": batch_size,
        "drop_last": drop_last,
        "sampler_class": _qualified(sampler),
        "batch_sampler_class": _qualified(batch_sampler),
        "shuffle": shuffle,
        "generator": source,
        "rank": None if shared is None else int(shared.rank),
        "world_size": None if shared is None else int(shared.num_replicas),
    }


@attrs.define
class SamplerLog:
    """A stateful sampler's state after each draw the consumer may not have been handed yet.

    The scheduler draws ahead of the consumer (prefetching), so the sampler's state now is
    ahead of the checkpoint; the state after the last draw handed over is the one to keep.
    """

    sampler: Any
    origin: int
    """The epoch position of this run's first draw."""
    first: Any
    """The sampler's state before this run's first draw, if it was loaded from a checkpoint."""
    states: deque[tuple[int, Any]] = attrs.field(factory=deque)
    drawn: int = 0

    def record(self, handed_before: int) -> None:
        """Keep the state after the draw just made; forget those before `handed_before - 1`."""
        self.states.append((self.origin + self.drawn, self.sampler.state_dict()))
        self.drawn += 1
        states = self.states
        while len(states) > 1 and states[0][0] < handed_before - 1:
            states.popleft()

    def at(self, done: int) -> Any:
        """The sampler's state positioned at `done` (after draw `done - 1`), or None if unknown."""
        if done == self.origin:
            return self.first
        for position, state in self.states:
            if position == done - 1:
                return state
        return None


@attrs.define
class EpochRecord:
    """What the loader noted as an epoch began, to let a fresh loader draw it again."""

    rng: torch.Tensor
    """The state of the generator the sampler draws from, as the epoch's draws began."""
    seeded: bool = True
    """The epoch's `iter()` drew the workers' base seed (not a persistent iterator's later
    epoch): a resumed epoch draws it again, so that the generator moves on as it did."""
    log: SamplerLog | None = None
    carried: tuple[Mark | None, ...] | None = None
    """Where the datasets lived on from the epoch before (persistent workers, the main
    process): per worker, where its dataset stood as that epoch ended (the mark of its last
    batch), which a worker without a batch handed over this epoch still stands on."""
    after_a_break: bool = False
    """The epoch before was left before its end (a `break`) by persistent workers whose
    answers carry marks: they had loaded batches ahead that no one received, and
    load the rest of their tasks before they start this epoch, so where their datasets stood
    as it began is read from the marks of their last answers of that epoch (`Driver.left`),
    once those are in; `carried` is then where a worker without any stood."""
    length: int | None = None
    """The batches of this rank's epoch resumed on another number of ranks: those yielded
    before the checkpoint, and its share's (see `DataLoader.__len__`); None for others."""
    stage: Stage | None = None
    """The split of a DistributedSampler's epoch this epoch draws (see `executors/_elastic.py`):
    its epoch, and the splits it had on other numbers of ranks before a resume."""
    carried_open: frozenset[int] = frozenset()
    """The workers of an iterable dataset whose `carried` mark is of an iterator left before it
    ran dry (an epoch broken out of): restored there, their part is not run dry again."""


@attrs.frozen
class Resume:
    """A checkpoint read back, checked against the loader it is loaded into."""

    raw: Mapping[str, Any]
    """The checkpoint as given: what `state_dict()` returns until an epoch starts from it."""
    progress: Progress
    complete: bool
    base_seed: int | None
    rng_epoch_start: torch.Tensor | None
    rng_now: torch.Tensor | None
    sampler: Any
    num_yielded: int
    seeded: bool = True
    seed_epoch: int = 1
    """The epochs seeded from `base_seed` up to the checkpoint's, which it includes: more than 1
    for a persistent iterator's later epoch, whose batches a loader seeding per batch seeds
    from both (`_seeding.epoch_seed`)."""
    workers: tuple[Mark | None, ...] | None = None
    """An iterable dataset's, or a map-style dataset's with a state: per worker, the mark of
    its last batch handed over."""
    carried: tuple[Mark | None, ...] | None = None
    """A state taken in an epoch whose datasets lived on from the one before: per worker, the
    mark of its last batch of that one (see `EpochRecord.carried`)."""
    carried_open: frozenset[int] = frozenset()
    """See `EpochRecord.carried_open`."""
    elastic: Elastic | None = None
    """Where the state was taken on other ranks: this rank's share of the rest of the epoch
    (see `executors/_elastic.py`); `progress` is then through that share, none of it yet."""


def snapshot(
    facts: Mapping[str, Any],
    *,
    progress: Progress,
    complete: bool,
    base_seed: int | None,
    rng_epoch_start: torch.Tensor | None,
    rng_now: torch.Tensor | None,
    sampler: Any,
    num_yielded: int,
    seeded: bool = True,
    seed_epoch: int = 1,
    workers: list[Mark | None] | None = None,
    carried: list[Mark | None] | None = None,
    carried_open: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The checkpoint as plain data (see the module's docstring)."""
    state = {
        _KEY: FORMAT,
        **facts,
        "progress": {
            "done": progress.done,
            "also": sorted(progress.also),
            "ended": progress.ended,
            "turn": progress.turn,
            "dry": sorted(progress.dry),
        },
        "complete": complete,
        "base_seed": base_seed,
        "rng": {
            "epoch_start": None if rng_epoch_start is None else encode_rng(rng_epoch_start),
            "now": None if rng_now is None else encode_rng(rng_now),
        },
        "sampler": sampler,
        "num_yielded": num_yielded,
        "seeded": seeded,
    }
    if seed_epoch != 1:
        # Absent where 1: the epoch drew its base seed (every epoch but a persistent
        # iterator's later ones), and states written before it existed.
        state["seed_epoch"] = seed_epoch
    if workers is not None:
        state["workers"] = _plain_marks(workers)
    if carried is not None:
        state["carried"] = _plain_marks(carried)
    if carried_open:
        # Absent where empty: only an iterable epoch broken out of leaves a part open.
        state["carried_open"] = sorted(carried_open)
    return state


def _plain_marks(marks: list[Mark | None]) -> list[dict[str, Any]]:
    return [
        {"since": 0, "state": None} if mark is None else {"since": mark[0], "state": mark[1]}
        for mark in marks
    ]


def _fail(message: str) -> ValueError:
    return ValueError(f"cannot load this DataLoader state: {message}")


def _wrong(path: str, value: Any, expected: str) -> ValueError:
    """A field that holds something else than it should: names it, its value and the rule."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return _fail(f"{path} holds {shown} ({type(value).__name__}); expected {expected}")


_MISSING = object()


def _get(mapping: Mapping[str, Any], key: str, path: str) -> Any:
    value = mapping.get(key, _MISSING)
    if value is _MISSING:
        raise _fail(
            f"{path} is missing; the state was cut short or edited: pass state_dict()'s result "
            "as it was returned"
        )
    return value


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _wrong(path, value, "a dict")
    return value


def _int(value: Any, path: str, low: int = 0, high: int | None = None) -> int:
    """An int from `low` to `high` (both included); a bool is refused, though Python counts it
    as an int: `True` in a count or a position is a corrupted state, not a 1."""
    span = f"from {low}" + ("" if high is None else f" to {high}")
    if type(value) is not int:
        raise _wrong(path, value, f"an int {span}")
    if value < low or (high is not None and value > high):
        raise _wrong(path, value, f"an int {span}")
    return value


def _bool(value: Any, path: str) -> bool:
    if type(value) is not bool:
        raise _wrong(path, value, "True or False")
    return value


def _rng(value: Any, path: str, size: int | None) -> torch.Tensor | None:
    """A generator state written by `encode_rng`, or None, of the size this loader's has."""
    if value is None:
        return None
    expected = "None or a generator state as base64 text" + (
        "" if size is None else f" of {size} bytes"
    )
    if not isinstance(value, str):
        raise _wrong(path, value, expected)
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise _wrong(path, value, expected) from None
    if size is not None and len(raw) != size:
        raise _wrong(path, value, expected)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


_SEEDS = 2**63 - 1
"""The largest base seed: torch draws it as a non-negative int64, and a worker's seed (base
seed plus worker id) must still fit the 64 bits torch's and numpy's generators take."""


def _workers(value: Any, count: int | None, key: str = "workers") -> tuple[Mark | None, ...]:
    """Per-worker marks, as `snapshot` wrote them: `count` of them for an iterable dataset,
    any number (one per worker it was taken with) for a map-style dataset's states."""
    if not isinstance(value, list | tuple) or (len(value) != count if count else not value):
        many = "one or more" if count is None else str(count)
        raise _wrong(key, value, f"a list of {many} entries, one per worker")
    marks: list[Mark | None] = []
    for w, entry in enumerate(value):
        path = f"{key}[{w}]"
        entry = _mapping(entry, path)
        since = _int(_get(entry, "since", f"{path}.since"), f"{path}.since")
        saved = _get(entry, "state", f"{path}.state")
        if saved is not None:
            saved = _mapping(saved, f"{path}.state")
            unknown = sorted(map(str, saved.keys() - {"dataset", "iterator"}))
            if unknown:
                raise _wrong(
                    f"{path}.state", saved, "None or a dict with 'dataset' and 'iterator' keys"
                )
        marks.append((since, saved))
    return tuple(marks)


def _from_version_1(state: Mapping[str, Any], facts: Mapping[str, Any]) -> dict[str, Any]:
    """A state an earlier statecore wrote (format 1), in today's layout, so that a training
    run checkpointed before an upgrade still resumes.

    What version 1 did not record cannot be checked: the fingerprint's newer fields take this
    loader's values, with a warning naming them; no worker is known to have run dry (as
    version 1 resumed: a dry worker whose state went back to its start is read again); the
    epoch's iter() is taken to have drawn its seeds, as it did unless the iterator was
    persistent. Everything else is checked as a version-2 state's is.
    """
    upgraded = dict(state)
    upgraded[_KEY] = FORMAT
    unchecked = [name for name in _ADDED_IN_2 if name in facts and name not in state]
    for name in unchecked:
        upgraded[name] = facts[name]
    progress = state.get("progress")
    if isinstance(progress, Mapping) and "dry" not in progress:
        upgraded["progress"] = {**progress, "dry": []}
    upgraded.setdefault("seeded", True)
    if unchecked:
        warnings.warn(
            "this DataLoader state was written by an earlier statecore (format 1), which did not "
            f"record {', '.join(unchecked)}: it resumes, but cannot be checked to come from a "
            "loader sampled the same way; a state_dict() taken now records them",
            UserWarning,
            stacklevel=4,
        )
    return upgraded


def parse(
    state: Any,
    facts: Mapping[str, Any],
    *,
    batches: int | None = None,
    rng_size: int | None = None,
    drawless: bool = False,
) -> Resume:
    """Read a checkpoint made by `snapshot`, refusing one taken from a different loader setup.

    `facts` are this loader's own (dataset kind and length, batch size, drop_last): a
    checkpoint of another dataset or batching would resume the wrong epoch, silently.
    `batches` is the epoch's number of draws when the sampler tells it, and `rng_size` the
    size of the state of the generator the epoch draws from: positions and generator states
    beyond them cannot come from this loader. `drawless` says the sampler draws no random
    number (`draws_nothing`): its epoch needs no generator's state. Every field is checked
    for its type and range before anything is used, and a refusal names the field, what it
    holds and what was expected: a corrupted state must not resume a wrong epoch or kill the
    workers.
    """
    if not isinstance(state, Mapping) or _KEY not in state:
        raise _fail(
            f"it is not a statecore DataLoader state_dict (no {_KEY!r} entry); got "
            f"{type(state).__name__} with keys {sorted(map(str, state))[:8]!r}"
            if isinstance(state, Mapping)
            else f"expected the dict that state_dict() returned, got {type(state).__name__}"
        )
    version = state[_KEY]
    if type(version) is int and version == 1:
        state = _from_version_1(state, facts)
        version = state[_KEY]
    if type(version) is not int or version != FORMAT:
        raise _fail(
            f"it has format version {version!r}, and this statecore reads version {FORMAT}; "
            "load it with the statecore version that wrote it"
        )
    workers = None
    count = 1
    if facts.get("dataset_kind") == "iterable":
        taken, have = _get(state, "num_workers", "num_workers"), facts["num_workers"]
        if type(taken) is not type(have) or taken != have:
            raise _fail(
                f"it was taken with num_workers={taken!r}, and this loader has "
                f"num_workers={have!r}: each worker of an iterable dataset goes on with its own "
                f"part of the dataset, so it resumes only with num_workers={taken!r}"
            )
        count = max(int(have), 1)
        workers = _workers(_get(state, "workers", "workers"), count)
    elif state.get("workers") is not None:
        # A map-style dataset with a state: each worker's, after its last batch handed over.
        workers = _workers(state["workers"], None)
    # Absent from states that carry nothing over (and from those written before it existed).
    carried = state.get("carried")
    if carried is not None:
        iterable_kind = facts.get("dataset_kind") == "iterable"
        carried = _workers(carried, count if iterable_kind else None, "carried")
    carried_open = state.get("carried_open", [])
    if (
        not isinstance(carried_open, list | tuple)
        or len(set(carried_open)) != len(carried_open)
        or any(type(w) is not int or not 0 <= w < count for w in carried_open)
        or (carried_open and (carried is None or facts.get("dataset_kind") != "iterable"))
    ):
        raise _wrong(
            "carried_open",
            carried_open,
            f"a list of distinct worker numbers below {count}, of an iterable dataset's state "
            "with `carried`",
        )
    for name, mine in facts.items():
        theirs = state.get(name, _MISSING)
        # Compared with their types: True is not the batch size 1, nor 1.0 the length 1.
        if theirs is _MISSING or type(theirs) is not type(mine) or theirs != mine:
            shown = "nothing" if theirs is _MISSING else repr(theirs)
            raise _fail(
                f"it was taken with {name}={shown}, and this loader has {name}={mine!r}; "
                "a checkpoint resumes only the same dataset, sampled and batched the same way "
                "(a DistributedSampler's, taken by this statecore, on any number of ranks: see "
                "'Changing the number of GPUs' in docs/checkpointing.md)"
            )
    progress = _mapping(_get(state, "progress", "progress"), "progress")
    done = _int(_get(progress, "done", "progress.done"), "progress.done", high=batches)
    also = _get(progress, "also", "progress.also")
    later = f"a list of distinct positions after progress.done={done}" + (
        "" if batches is None else f", below {batches}"
    )
    if not isinstance(also, list | tuple):
        raise _wrong("progress.also", also, later)
    for position in also:
        top = None if batches is None else batches - 1
        if type(position) is not int or position <= done or (top is not None and position > top):
            raise _wrong("progress.also", also, later)
    if len(set(also)) != len(also):
        raise _wrong("progress.also", also, later)
    ended = _bool(_get(progress, "ended", "progress.ended"), "progress.ended")
    # A map-style epoch resumes under any number of workers: a turn beyond them starts at 0.
    top = count - 1 if facts.get("dataset_kind") == "iterable" else None
    turn = _int(_get(progress, "turn", "progress.turn"), "progress.turn", high=top)
    dry = _get(progress, "dry", "progress.dry")
    iterable = facts.get("dataset_kind") == "iterable"
    expected = (
        f"a list of distinct worker numbers below {count}"
        if iterable
        else "[] (a map-style dataset's workers never run dry)"
    )
    if (
        not isinstance(dry, list | tuple)
        or len(set(dry)) != len(dry)
        or any(type(w) is not int or not 0 <= w < count for w in dry)
        or (not iterable and dry)
    ):
        raise _wrong("progress.dry", dry, expected)
    complete = _bool(_get(state, "complete", "complete"), "complete")
    base_seed = _get(state, "base_seed", "base_seed")
    if base_seed is not None:
        base_seed = _int(base_seed, "base_seed", high=_SEEDS - count)
    rng = _mapping(_get(state, "rng", "rng"), "rng")
    rng_epoch_start = _rng(_get(rng, "epoch_start", "rng.epoch_start"), "rng.epoch_start", rng_size)
    rng_now = _rng(_get(rng, "now", "rng.now"), "rng.now", rng_size)
    num_yielded = _int(_get(state, "num_yielded", "num_yielded"), "num_yielded")
    # Whether the epoch's iter() drew its seeds from the global generator (False for a
    # persistent iterator's later epochs); states written before it existed drew them.
    seeded = _bool(state.get("seeded", True), "seeded")
    seed_epoch = _int(state.get("seed_epoch", 1), "seed_epoch", low=1)
    sampler = _get(state, "sampler", "sampler")
    if (
        facts.get("dataset_kind") != "iterable"
        and not complete
        and rng_epoch_start is None
        and sampler is None
        and not drawless
    ):
        # A map-style epoch is drawn again from its start unless the sampler restores itself.
        raise _wrong(
            "rng.epoch_start",
            None,
            "the generator's state as the epoch began, for a state taken mid-epoch of a "
            "sampler without state_dict()",
        )
    return Resume(
        raw=state,
        progress=Progress(done, frozenset(also), ended, turn, frozenset(dry)),
        complete=complete,
        base_seed=base_seed,
        rng_epoch_start=rng_epoch_start,
        rng_now=rng_now,
        sampler=sampler,
        num_yielded=num_yielded,
        seeded=seeded,
        seed_epoch=seed_epoch,
        workers=workers,
        carried=carried,
        carried_open=frozenset(carried_open),
    )


def positioned(iterator: Iterator[Any], done: int, peek: bool) -> Iterator[Any]:
    """`iterator` moved on by `done` draws, which a sampler cannot skip but can repeat.

    With `peek`, one more draw is made now and put back: a sampler such as torch's
    RandomSampler without a generator draws its seed from torch's global generator on its first
    draw, which must happen while that generator is set to the epoch's start.
    """
    for _ in itertools.islice(iterator, done):
        pass
    if not peek:
        return iterator
    marker = object()
    first = next(iterator, marker)
    if first is marker:
        return iter(())
    return itertools.chain((first,), iterator)
