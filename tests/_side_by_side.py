"""Running torch's DataLoader and statecore's on the same arguments, to compare what they yield.

The tests/test_loader_*.py files that specify statecore.DataLoader as "what torch does" build a
torch loader and a statecore loader from the same arguments (with a fresh, identically seeded
generator each), run both, and compare the batches as nested Python lists: exactly, in order,
for in_order=True; as a multiset for in_order=False. The datasets are in _datasets.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
import torch.utils.data
from _datasets import RandomDraws

import statecore
from statecore.executors._loader import _Iterator as StatecoreIterator

__all__ = [
    "LOADERS",
    "QUIET",
    "SEED",
    "WORKERS",
    "Kwargs",
    "as_lists",
    "assert_same_as_torch",
    "assert_same_multiset_as_torch",
    "close",
    "generator",
    "kw",
    "multiset",
    "out_of_order",
    "release",
    "run",
    "threaded",
    "with_thread_workers",
]

# The warnings both loaders give for these arguments: more workers than cores, pinning without
# an accelerator, and a dataset that the standard pickle refuses.
QUIET = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
    pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning"),
]

SEED = 20240611

# For every test that starts workers.
WORKERS = pytest.mark.timeout(120)

LOADERS = [
    pytest.param(torch.utils.data.DataLoader, id="torch"),
    pytest.param(statecore.DataLoader, id="statecore"),
]

Kwargs = Callable[[torch.Generator], dict[str, Any]]


def as_lists(value: Any) -> Any:
    """A batch as nested Python values: tensors and arrays become lists, tuples become lists."""
    if isinstance(value, torch.Tensor | numpy.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {key: as_lists(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [as_lists(item) for item in value]
    return value


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def run(
    loader_class: type[torch.utils.data.DataLoader],  # type: ignore[type-arg]
    dataset: Any,
    kwargs: Kwargs,
    epochs: int = 1,
    stop_after: dict[int, int] | None = None,
) -> list[list[Any]]:
    """Every epoch's batches as nested lists; `stop_after` maps an epoch to where it breaks off."""
    loader = loader_class(dataset, **kwargs(generator()))
    stop_after = stop_after or {}
    result = []
    try:
        for epoch in range(epochs):
            batches = []
            for batch in loader:
                batches.append(as_lists(batch))
                if len(batches) == stop_after.get(epoch):
                    break
            result.append(batches)
    finally:
        release(loader)
    return result


def release(loader: torch.utils.data.DataLoader) -> None:  # type: ignore[type-arg]
    """Stop a loader's persistent workers now rather than when the loader is collected."""
    if loader._iterator is not None:
        close(loader._iterator)


def close(iterator: Any) -> None:
    """Stop an iterator's workers now, for the tests that keep an iterator alive on purpose."""
    if isinstance(iterator, torch.utils.data.dataloader._MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()
    elif isinstance(iterator, StatecoreIterator):
        iterator._shutdown()


def multiset(batches: list[Any]) -> Counter[str]:
    return Counter(repr(batch) for batch in batches)


def kw(**fixed: Any) -> Kwargs:
    """Loader arguments; `shuffle=True` also passes the fresh generator."""

    def make(gen: torch.Generator) -> dict[str, Any]:
        made = dict(fixed)
        if made.get("shuffle"):
            made["generator"] = gen
        return made

    return make


def out_of_order(kwargs: Kwargs) -> Kwargs:
    """The same loader arguments with in_order=False."""

    def make(gen: torch.Generator) -> dict[str, Any]:
        return {**kwargs(gen), "in_order": False}

    return make


def assert_same_as_torch(dataset: Any, kwargs: Kwargs, epochs: int = 1, **options: Any) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs, epochs, **options)
    got = run(statecore.DataLoader, dataset, kwargs, epochs, **options)
    assert got == expected


def assert_same_multiset_as_torch(dataset: Any, kwargs: Kwargs, epochs: int = 1) -> None:
    expected = run(torch.utils.data.DataLoader, dataset, kwargs, epochs)
    got = run(statecore.DataLoader, dataset, kwargs, epochs)
    assert [multiset(epoch) for epoch in got] == [multiset(epoch) for epoch in expected]


# --- the thread executor -----------------------------------------------------------------------


def threaded(dataset: Any, num_workers: int = 2, **options: Any) -> Any:
    """statecore's DataLoader with worker threads: two unless told otherwise."""
    return statecore.DataLoader(dataset, num_workers=num_workers, executor="thread", **options)


def with_thread_workers(rows: list[Any]) -> list[Any]:
    """The rows that load in workers, for the thread executor (it needs num_workers > 0).

    Rows whose samples draw from the process-wide RNGs are left out: threads share those
    generators, so they cannot be seeded per worker (docs/architecture.md says so).
    """
    return [
        pytest.param(*row.values, id=f"thread-{row.id}")
        for row in rows
        if row.values[1](torch.Generator()).get("num_workers", 0) > 0
        and not isinstance(row.values[0], RandomDraws)
    ]
