"""Helpers of the checkpoint tests: take batches, run to the end, save a state as a file would."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _side_by_side import as_lists


def take(iterator: Iterator[Any], n: int) -> list[Any]:
    """The next `n` batches, as lists."""
    return [as_lists(next(iterator)) for _ in range(n)]


def run_to_end(iterator: Iterator[Any]) -> list[Any]:
    """Every batch to the end of the epoch, as lists."""
    return [as_lists(batch) for batch in iterator]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """The state as it comes back from a checkpoint file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def resumed_between_epochs(build: Callable[[], Any]) -> tuple[list[Any], list[Any]]:
    """(the uninterrupted run's second epoch, what a loader resumed from a state saved after a
    first epoch's end gives): the loaders come from `build`, which must give equal ones."""
    uninterrupted = build()
    epochs = [run_to_end(iter(uninterrupted)) for _ in range(2)]
    original = build()
    run_to_end(iter(original))
    state = roundtrip(original.state_dict())
    resumed = build()
    resumed.load_state_dict(state)
    return epochs[1], run_to_end(iter(resumed))
