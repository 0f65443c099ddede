"""The loader draws from the sampler when torch does, and a sampler's error comes in its turn.

Compared with torch's DataLoader as tests/_side_by_side.py says, except where statecore
deliberately differs (each such test says how).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import BrokenSampler, LoggingSampler, Numbers
from _side_by_side import QUIET, WORKERS, as_lists, close

import statecore

pytestmark = QUIET

# Samplers may have side effects or adapt to the training loop, so the loader must draw indices
# when torch does: without workers, one batch per next(); with workers, prefetch_factor batches
# per worker ahead.


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="in-process"),
        pytest.param({"num_workers": 1, "prefetch_factor": 1}, id="w1-p1"),
        pytest.param({"num_workers": 2}, id="w2"),
        pytest.param({"num_workers": 3, "prefetch_factor": 3}, id="w3-p3"),
    ],
)
@WORKERS
def test_the_sampler_is_drawn_from_when_torch_draws(kwargs: dict[str, Any]) -> None:
    def drawn_after_each_step(loader_class: type) -> list[int]:
        sampler = LoggingSampler(16)
        iterator = iter(loader_class(Numbers(16), sampler=sampler, batch_size=2, **kwargs))
        drawn = [len(sampler.drawn)]
        for _ in iterator:
            drawn.append(len(sampler.drawn))
        return drawn

    assert drawn_after_each_step(statecore.DataLoader) == drawn_after_each_step(
        torch.utils.data.DataLoader
    )


def steps(loader: Any, count: int) -> list[Any]:
    """`count` calls of next() on one iterator: batches, "end", or [error type, message]."""
    iterator = iter(loader)
    result: list[Any] = []
    for _ in range(count):
        try:
            result.append(as_lists(next(iterator)))
        except StopIteration:
            result.append("end")
        except Exception as error:
            result.append([type(error).__name__, str(error)])
    close(iterator)
    return result


def test_in_process_a_sampler_error_comes_in_its_turn_like_torchs() -> None:
    def run_with(loader_class: type) -> list[Any]:
        return steps(loader_class(Numbers(12), sampler=BrokenSampler(12, 5), batch_size=2), 4)

    expected = run_with(torch.utils.data.DataLoader)
    assert expected == [[0, 1], [2, 3], ["ValueError", "sampler failed at 5"], "end"]
    assert run_with(statecore.DataLoader) == expected


@pytest.mark.parametrize("fails_at", [3, 5])
@WORKERS
def test_with_workers_the_batch_in_hand_when_the_sampler_fails_is_still_delivered(
    fails_at: int,
) -> None:
    # torch draws the next batch's indices before handing over the batch in hand, and loses
    # that batch when the sampler raises; statecore hands it over, then raises, then ends.
    # (Batches still in flight on other workers are dropped, in both.)
    loader = statecore.DataLoader(
        Numbers(12),
        sampler=BrokenSampler(12, fails_at),
        batch_size=2,
        num_workers=1,
        prefetch_factor=1,
    )
    whole = [[i, i + 1] for i in range(0, fails_at - 1, 2)]
    assert steps(loader, len(whole) + 2) == [
        *whole,
        ["ValueError", f"sampler failed at {fails_at}"],
        "end",
    ]
