"""A tuner retiring a worker mid-epoch and adding it back, through a live iterator's driver, on
a real executor: the epoch's batches are still exactly torch's uninterrupted run's (a map-style
dataset whose items do not depend on the worker that loads them)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import Numbers

import statecore
from statecore import WorkerStatus

pytestmark = pytest.mark.timeout(120)

EXECUTORS = [{"executor": "mp", "multiprocessing_context": "fork"}, {"executor": "thread"}]


def _torchs(options: dict[str, Any]) -> list[torch.Tensor]:
    return list(torch.utils.data.DataLoader(Numbers(40), batch_size=2, **options))


@pytest.mark.parametrize("where", EXECUTORS, ids=lambda where: where["executor"])
def test_a_worker_retired_then_added_back_mid_epoch_leaves_the_epoch_torchs(
    where: dict[str, Any],
) -> None:
    options: dict[str, Any] = {"num_workers": 3, "prefetch_factor": 2}
    loader = statecore.DataLoader(Numbers(40), batch_size=2, **options, **where)
    iterator = iter(loader)
    driver = iterator._driver  # type: ignore[attr-defined]
    got = [next(iterator) for _ in range(3)]
    driver.retire(1)
    while driver.state.life.workers[1] is not WorkerStatus.STOPPED:
        got.append(next(iterator))
    retired_at = len(got)
    got += [next(iterator) for _ in range(4)]
    driver.add(1)
    got += list(iterator)
    expected = _torchs(options)
    assert retired_at < len(expected) - 4  # the slot was retired, then added, mid-epoch
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.equal(ours, theirs)
    assert driver.state.life.added == 1 and driver.state.life.replaced == ()
