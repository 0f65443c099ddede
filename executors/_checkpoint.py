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
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.utils.data import BatchSampler

from statecore import Progress
from statecore.executors._worker import Mark, has_state

__all__ = [
    "FORMAT",
    "EpochRecord",
    "Resume",
    "SamplerLog",
    "decode_rng",
    "encode_rng",
    "parse",
    "positioned",
    "snapshot",
    "stateful_sampler",
]

FORMAT = 1
"""The version of the checkpoint's layout; a loader refuses a version it does not know."""

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

    number: int
    """Epochs started by the loader so far, this one included: 1 for the first."""
    rng: torch.Tensor
    """The state of the generator the sampler draws from, as the epoch's draws began."""
    seeded: bool = True
    """The epoch's `iter()` drew the workers' base seed (not a persistent iterator's later
    epoch): a resumed epoch draws it again, so that the generator moves on as it did."""
    log: SamplerLog | None = None


@attrs.frozen
class Resume:
    """A checkpoint read back, checked against the loader it is loaded into."""

    raw: Mapping[str, Any]
    """The checkpoint as given: what `state_dict()` returns until an epoch starts from it."""
    epoch: int
    progress: Progress
    complete: bool
    base_seed: int | None
    rng_epoch_start: torch.Tensor | None
    rng_now: torch.Tensor | None
    sampler: Any
    num_yielded: int
    seeded: bool = True
    workers: tuple[Mark | None, ...] | None = None
    """An iterable dataset's: per worker, the mark of its last batch handed over."""


def snapshot(
    facts: Mapping[str, Any],
    *,
    epoch: int,
    progress: Progress,
    complete: bool,
    base_seed: int | None,
    rng_epoch_start: torch.Tensor | None,
    rng_now: torch.Tensor | None,
    sampler: Any,
    num_yielded: int,
    seeded: bool = True,
    workers: list[Mark | None] | None = None,
) -> dict[str, Any]:
    """The checkpoint as plain data (see the module's docstring)."""
    state = {
        _KEY: FORMAT,
        **facts,
        "epoch": epoch,
        "progress": {
            "done": progress.done,
            "also": sorted(progress.also),
            "ended": progress.ended,
            "turn": progress.turn,
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
    if workers is not None:
        state["workers"] = [
            {"since": 0, "state": None} if mark is None else {"since": mark[0], "state": mark[1]}
            for mark in workers
        ]
    return state


def _fail(message: str) -> ValueError:
    return ValueError(f"cannot load this DataLoader state: {message}")


def parse(state: Any, facts: Mapping[str, Any]) -> Resume:
    """Read a checkpoint made by `snapshot`, refusing one taken from a different loader setup.

    `facts` are this loader's own (dataset kind and length, batch size, drop_last): a
    checkpoint of another dataset or batching would resume the wrong epoch, silently.
    """
    if not isinstance(state, Mapping) or _KEY not in state:
        raise _fail(
            f"it is not a statecore DataLoader state_dict (no {_KEY!r} entry); got "
            f"{type(state).__name__} with keys {sorted(map(str, state))[:8]!r}"
            if isinstance(state, Mapping)
            else f"expected the dict that state_dict() returned, got {type(state).__name__}"
        )
    version = state[_KEY]
    if version != FORMAT:
        raise _fail(
            f"it has format version {version!r}, and this statecore reads version {FORMAT}; "
            "load it with the statecore version that wrote it"
        )
    workers = None
    if facts.get("dataset_kind") == "iterable":
        taken, have = state.get("num_workers"), facts["num_workers"]
        if taken != have:
            raise _fail(
                f"it was taken with num_workers={taken!r}, and this loader has "
                f"num_workers={have!r}: each worker of an iterable dataset goes on with its own "
                f"part of the dataset, so it resumes only with num_workers={taken!r}"
            )
        workers = tuple((int(w["since"]), w["state"]) for w in state["workers"])
    for name, mine in facts.items():
        theirs = state.get(name)
        if theirs != mine:
            raise _fail(
                f"it was taken with {name}={theirs!r}, and this loader has {name}={mine!r}; "
                "a checkpoint resumes only the same dataset, batched the same way"
            )
    progress = state["progress"]
    done, also, ended = progress["done"], progress["also"], progress["ended"]
    rng = state["rng"]
    seeded = state.get("seeded", True)
    if type(seeded) is not bool:
        raise _fail(f"its 'seeded' is {seeded!r}, and it must be True or False")
    return Resume(
        raw=state,
        epoch=int(state["epoch"]),
        progress=Progress(
            int(done),
            frozenset(int(p) for p in also),
            bool(ended),
            int(progress.get("turn", 0)),
        ),
        complete=bool(state["complete"]),
        base_seed=None if state["base_seed"] is None else int(state["base_seed"]),
        rng_epoch_start=None if rng["epoch_start"] is None else decode_rng(rng["epoch_start"]),
        rng_now=None if rng["now"] is None else decode_rng(rng["now"]),
        sampler=state["sampler"],
        num_yielded=int(state["num_yielded"]),
        seeded=seeded,
        workers=workers,
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
