"""statecore loaders in accelerate's checkpoints: `save_state` / `load_state` resume them exactly.

accelerate saves every object registered with `register_for_checkpointing` through its
`state_dict()` and loads it back with `load_state_dict()`, which is how a training script
keeps an object accelerate does not know. A statecore loader registered so, saved mid-epoch
and loaded into a fresh loader by a fresh accelerator (the restarted job), goes on with exactly
the batches the original had not handed over.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpoints import run_to_end, take
from _datasets import Numbers, ShardedRange
from _side_by_side import WORKERS
from accelerate import Accelerator

import statecore


def resumed_through_accelerate(
    build: Callable[[], statecore.DataLoader[Any]], at: int, directory: Path
) -> tuple[list[Any], list[Any]]:
    """(what the original yields after `at` batches, what the loader accelerate restored yields)."""
    original = build()
    accelerator = Accelerator(cpu=True)
    accelerator.register_for_checkpointing(original)
    iterator = iter(original)
    take(iterator, at)
    accelerator.save_state(str(directory))
    after = run_to_end(iterator)

    restarted = Accelerator(cpu=True)
    fresh = build()
    restarted.register_for_checkpointing(fresh)
    restarted.load_state(str(directory))
    return after, run_to_end(iter(fresh))


@WORKERS
@pytest.mark.parametrize(("executor", "workers"), [("thread", 2), ("mp", 2)])
def test_a_shuffled_loader_saved_by_accelerate_mid_epoch_resumes_exactly(
    executor: str, workers: int, tmp_path: Path
) -> None:
    def build() -> statecore.DataLoader[Any]:
        return statecore.DataLoader(
            Numbers(30),
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(11),
            num_workers=workers,
            executor=executor,
        )

    after, again = resumed_through_accelerate(build, 3, tmp_path)
    assert again == after
    assert len(after) == 5


@WORKERS
def test_an_iterable_loader_saved_by_accelerate_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    def build() -> statecore.DataLoader[Any]:
        return statecore.DataLoader(ShardedRange(26), batch_size=3, num_workers=2, executor="mp")

    after, again = resumed_through_accelerate(build, 4, tmp_path)
    assert again == after
    assert after
