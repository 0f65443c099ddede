"""`load_state_dict` checks every field of a state before using any of it.

A corrupted or foreign state must be refused with an error naming the field, what it holds and
what was expected, never resume a wrong epoch, and never reach the workers (a seed out of range
kills them all). A state that passes the checks resumes: a Hypothesis test corrupts fields of
valid states and accepts nothing else.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _checkpoints import run_to_end, take
from _datasets import Augmented, GrowingBatches, Numbers, StatefulIterator
from hypothesis import event, given
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from statecore import DataLoader
from statecore.executors._checkpoint import _ADDED_IN_2, FORMAT

REFUSED = "cannot load this DataLoader state"


def map_state(**options: Any) -> dict[str, Any]:
    """A state of a shuffled map-style loader three batches into its 14."""
    loader = DataLoader(Numbers(40), batch_size=3, shuffle=True, **options)
    iterator = iter(loader)
    take(iterator, 3)
    return loader.state_dict()


def fresh_map(**options: Any) -> DataLoader[Any]:
    return DataLoader(Numbers(40), batch_size=3, shuffle=True, **options)


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (
            ("progress", "done"),
            1000,
            r"progress\.done holds 1000 \(int\); expected an int from 0 to 14",
        ),
        (("progress", "done"), 2.7, r"progress\.done holds 2\.7 \(float\)"),
        (("progress", "done"), True, r"progress\.done holds True \(bool\)"),
        (("progress", "done"), -1, r"progress\.done holds -1"),
        (("progress", "also"), "7", r"progress\.also holds '7' \(str\)"),
        (("progress", "also"), [2], r"progress\.also holds \[2\] \(list\)"),
        (("progress", "ended"), 1, r"progress\.ended holds 1 \(int\); expected True or False"),
        (("complete",), "no", r"complete holds 'no' \(str\); expected True or False"),
        (("progress", "dry"), [0], r"progress\.dry holds \[0\] \(list\); expected \[\]"),
        (("num_yielded",), None, r"num_yielded holds None"),
        (("base_seed",), 2**70, r"base_seed holds 1180591620717411303424 \(int\)"),
        (("base_seed",), -5, r"base_seed holds -5"),
        (("rng", "epoch_start"), "not base64!", r"rng\.epoch_start holds 'not base64!'"),
        (("rng", "epoch_start"), "AAAA", r"rng\.epoch_start holds 'AAAA' .*bytes"),
        (("progress",), [3], r"progress holds \[3\] \(list\); expected a dict"),
    ],
)
def test_a_field_of_the_wrong_type_or_range_is_refused_by_name(
    path: tuple[str, ...], value: Any, named: str
) -> None:
    state = map_state()
    where = state
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    with pytest.raises(ValueError, match=named):
        fresh_map().load_state_dict(state)


@pytest.mark.parametrize(
    "path", [("progress",), ("progress", "done"), ("rng", "now"), ("complete",)]
)
def test_a_missing_field_is_refused_by_name(path: tuple[str, ...]) -> None:
    state = map_state()
    where = state
    for key in path[:-1]:
        where = where[key]
    del where[path[-1]]
    with pytest.raises(ValueError, match=rf"{'.'.join(path)} is missing"):
        fresh_map().load_state_dict(state)


@pytest.mark.parametrize("version", [True, 1.0, "1", 2.0, 3])
def test_a_version_that_only_equals_one_loosely_is_refused(version: Any) -> None:
    state = map_state()
    state["statecore"] = version
    with pytest.raises(ValueError, match="format version"):
        fresh_map().load_state_dict(state)


def as_version_1(state: dict[str, Any]) -> dict[str, Any]:
    """`state` as the statecore before format 2 wrote it."""
    old = {key: value for key, value in state.items() if key not in _ADDED_IN_2}
    old["statecore"] = 1
    old.pop("seeded")
    old["progress"] = {k: v for k, v in state["progress"].items() if k != "dry"}
    return old


def test_a_state_written_by_format_1_resumes_the_same_batches_and_warns_what_it_cannot_check() -> (
    None
):
    original = fresh_map(generator=seeded())
    iterator = iter(original)
    take(iterator, 3)
    state = json.loads(json.dumps(as_version_1(original.state_dict())))
    rest = run_to_end(iterator)
    resumed = fresh_map(generator=seeded())
    with pytest.warns(UserWarning, match="format 1.*sampler_class, batch_sampler_class, shuffle"):
        resumed.load_state_dict(state)
    assert run_to_end(iter(resumed)) == rest


def test_a_format_1_state_is_still_checked_for_what_it_recorded() -> None:
    state = as_version_1(map_state())
    del state["batch_size"]
    with pytest.raises(ValueError, match="batch_size"), pytest.warns(UserWarning):
        fresh_map().load_state_dict(state)


def test_a_state_taken_now_is_format_2() -> None:
    assert map_state()["statecore"] == FORMAT == 2


def test_a_batch_size_of_true_is_not_the_batch_size_one() -> None:
    state = DataLoader(Numbers(10), batch_size=1).state_dict()
    state["batch_size"] = True
    with pytest.raises(ValueError, match="batch_size=True"):
        DataLoader(Numbers(10), batch_size=1).load_state_dict(state)


def test_an_iterable_state_with_the_wrong_number_of_worker_entries_is_refused() -> None:
    loader = DataLoader(StatefulIterator(20), batch_size=2)
    take(iter(loader), 2)
    state = loader.state_dict()
    state["workers"].append({"since": 0, "state": None})
    with pytest.raises(ValueError, match=r"workers holds .*; expected a list of 1 entries"):
        DataLoader(StatefulIterator(20), batch_size=2).load_state_dict(state)


@pytest.mark.parametrize("dry", [[1], [0, 0], [True], "0"])
def test_dry_workers_that_are_not_distinct_worker_numbers_are_refused(dry: Any) -> None:
    loader = DataLoader(StatefulIterator(20), batch_size=2)
    take(iter(loader), 2)
    state = loader.state_dict()
    state["progress"]["dry"] = dry
    with pytest.raises(ValueError, match=r"progress\.dry holds .*; expected a list of distinct"):
        DataLoader(StatefulIterator(20), batch_size=2).load_state_dict(state)


@pytest.mark.parametrize("left_open", [[1], [0, 0], [True], "0"])
def test_open_parts_that_are_not_distinct_worker_numbers_are_refused(left_open: Any) -> None:
    loader = DataLoader(StatefulIterator(20), batch_size=2)
    take(iter(loader), 2)
    state = loader.state_dict()
    state["carried"] = [{"since": 1, "state": None}]
    state["carried_open"] = left_open
    with pytest.raises(ValueError, match=r"carried_open holds .*; expected a list of distinct"):
        DataLoader(StatefulIterator(20), batch_size=2).load_state_dict(state)


def test_open_parts_of_a_map_style_state_are_refused() -> None:
    state = map_state()
    state["carried_open"] = [0]
    with pytest.raises(ValueError, match=r"carried_open holds \[0\] .*an iterable dataset's"):
        fresh_map().load_state_dict(state)


# --- the fingerprint: what a state was taken from ------------------------------------------------


def _distributed(rank: int, world: int = 2, shuffle: bool = True) -> DataLoader[Any]:
    share = DistributedSampler(Numbers(40), num_replicas=world, rank=rank, shuffle=shuffle)
    return DataLoader(Numbers(40), batch_size=3, sampler=share)


def _state_of(loader: DataLoader[Any]) -> dict[str, Any]:
    take(iter(loader), 2)
    return loader.state_dict()


@pytest.mark.parametrize(
    ("original", "other", "named"),
    [
        (
            lambda: fresh_map(),
            lambda: DataLoader(Numbers(40), batch_size=3),
            r"sampler_class='torch\.utils\.data\.sampler\.RandomSampler', and this loader has "
            r"sampler_class='torch\.utils\.data\.sampler\.SequentialSampler'",
        ),
        (
            lambda: fresh_map(),
            lambda: fresh_map(generator=torch.Generator().manual_seed(1)),
            r"generator='global', and this loader has generator='loader'",
        ),
        (
            lambda: DataLoader(
                Numbers(40), batch_size=3, sampler=RandomSampler(Numbers(40), generator=seeded())
            ),
            lambda: fresh_map(),
            r"generator='sampler', and this loader has generator='global'",
        ),
        # Another rank or world size needs every rank's progress (see test_elastic_*.py).
        (
            lambda: _distributed(0),
            lambda: _distributed(1),
            r"progress of rank 0 only, of 2 ranks, and this loader is rank 1 of 2",
        ),
        (
            lambda: _distributed(0),
            lambda: _distributed(0, world=4),
            r"progress of rank 0 only, of 2 ranks, and this loader is rank 0 of 4",
        ),
        (
            lambda: _distributed(0),
            lambda: _distributed(0, shuffle=False),
            r"shuffle=True, and this loader has shuffle=False",
        ),
        (
            lambda: _distributed(0),
            lambda: fresh_map(),
            r"rank 0 of 2 with a DistributedSampler, and this loader's sampler \(RandomSampler\) "
            r"is not distributed-aware",
        ),
        (
            lambda: DataLoader(
                Numbers(40), batch_sampler=BatchSampler(SequentialSampler(range(40)), 3, False)
            ),
            lambda: DataLoader(Numbers(40), batch_sampler=GrowingBatches(40)),
            r"batch_sampler_class='torch\.utils\.data\.sampler\.BatchSampler', and this loader "
            r"has batch_sampler_class='_datasets\.GrowingBatches'",
        ),
    ],
    ids=[
        "shuffle",
        "loader-generator",
        "sampler-generator",
        "rank",
        "world-size",
        "distributed-shuffle",
        "distributed-or-not",
        "batch-sampler",
    ],
)
def test_a_state_taken_from_a_differently_sampled_loader_is_refused_naming_both_values(
    original: Callable[[], DataLoader[Any]], other: Callable[[], DataLoader[Any]], named: str
) -> None:
    state = _state_of(original())
    with pytest.raises(ValueError, match=named):
        other().load_state_dict(state)


def test_an_iterable_state_is_refused_under_another_number_of_workers() -> None:
    state = _state_of(DataLoader(StatefulIterator(30), batch_size=2, num_workers=2))
    other = DataLoader(StatefulIterator(30), batch_size=2, num_workers=3)
    with pytest.raises(ValueError, match=r"num_workers=2, and this loader has num_workers=3"):
        other.load_state_dict(state)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("taken", "resumed"), [(0, 2), (2, 0)])
def test_a_map_style_state_resumes_under_another_number_of_workers(
    taken: int, resumed: int
) -> None:
    original = fresh_map(num_workers=taken, executor="thread" if taken else None)
    iterator = iter(original)
    take(iterator, 4)
    state = original.state_dict()
    after = run_to_end(iterator)
    other = fresh_map(num_workers=resumed, executor="thread" if resumed else None)
    other.load_state_dict(state)
    assert run_to_end(iter(other)) == after


def test_the_fingerprint_is_plain_data() -> None:
    state = _state_of(_distributed(1))
    fields = ("sampler_class", "batch_sampler_class", "shuffle", "generator", "rank", "world_size")
    assert json.loads(json.dumps({name: state[name] for name in fields})) == {
        "sampler_class": "torch.utils.data.distributed.DistributedSampler",
        "batch_sampler_class": "torch.utils.data.sampler.BatchSampler",
        "shuffle": True,
        "generator": "global",
        "rank": 1,
        "world_size": 2,
    }


# --- corrupted at random: refused with a named field, or resumed ----------------------------------

_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**66), max_value=2**66),
    st.integers(min_value=-2, max_value=20),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.lists(st.integers(min_value=-2, max_value=20), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)

_DELETE = object()


def _users(path: tuple[Any, ...]) -> bool:
    """Whether `path` is in what the sampler's, dataset's or iterator's own `state_dict()` gave:
    their own `load_state_dict()` judges that, not the loader."""
    if path[:1] == ("sampler",) and len(path) > 1:
        return True
    return path[:1] == ("workers",) and path[3:4] in (("dataset",), ("iterator",))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a state (into dicts and lists), the state itself and what belongs to
    the user's objects (`_users`) left out."""
    found = []
    children: Any = ()
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    for key, child in children:
        path = (*prefix, key)
        if not _users(path):
            found.append(path)
            found.extend(_paths(child, path))
    return found


def _at(state: dict[str, Any], path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key]
    return state


def _replacing(value: Any) -> st.SearchStrategy[Any]:
    """Anything, or often a value of the same type that may well be valid: so that the states
    accepted, and resumed, are many too, not only the refused ones."""
    similar: st.SearchStrategy[Any] = st.nothing()
    if type(value) is bool:
        similar = st.booleans()
    elif type(value) is int:
        similar = st.integers(min_value=0, max_value=max(20, value + 2))
    elif isinstance(value, list):
        similar = st.lists(st.integers(min_value=0, max_value=20), max_size=3)
    return st.one_of(similar, similar, st.just(_DELETE), _VALUES)


def _corrupt(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    where: Any = state
    for key in path[:-1]:
        where = where[key]
    if value is _DELETE and isinstance(where, dict):
        del where[path[-1]]
    elif value is not _DELETE:
        where[path[-1]] = value


def _iterable_state(**options: Any) -> dict[str, Any]:
    loader = DataLoader(StatefulIterator(30), batch_size=2, **options)
    take(iter(loader), 4)
    return loader.state_dict()


def _augmented_state() -> dict[str, Any]:
    loader = DataLoader(Augmented(30), batch_size=2, num_workers=2, executor="thread")
    take(iter(loader), 4)
    return loader.state_dict()


_SOURCES: dict[str, tuple[dict[str, Any], Callable[[], DataLoader[Any]]]] = {
    "map-inline": (map_state(), fresh_map),
    "map-thread": (
        map_state(num_workers=2, executor="thread"),
        lambda: fresh_map(num_workers=2, executor="thread"),
    ),
    "stateful-map-thread": (
        _augmented_state(),
        lambda: DataLoader(Augmented(30), batch_size=2, num_workers=2, executor="thread"),
    ),
    "iterable-thread": (
        _iterable_state(num_workers=2, executor="thread"),
        lambda: DataLoader(StatefulIterator(30), batch_size=2, num_workers=2, executor="thread"),
    ),
}


@pytest.mark.timeout(120)
@given(
    source=st.sampled_from(sorted(_SOURCES)),
    data=st.data(),
)
def test_a_corrupted_state_is_refused_with_a_named_field_or_resumes(
    source: str, data: st.DataObject
) -> None:
    valid, build = _SOURCES[source]
    state = copy.deepcopy(valid)
    for _ in range(data.draw(st.integers(min_value=1, max_value=2), label="fields")):
        paths = _paths(state)
        path = data.draw(st.sampled_from(paths), label="path")
        _corrupt(state, path, data.draw(_replacing(_at(state, path)), label="value"))
    loader = build()
    try:
        loader.load_state_dict(state)
    except ValueError as refusal:
        assert str(refusal).startswith(REFUSED), refusal
        event("refused")
        return
    event("resumed")
    # Accepted: it must resume as some epoch of this loader, to its end, with no other error.
    batches = run_to_end(iter(loader))
    assert all(isinstance(batch, list) for batch in batches)
