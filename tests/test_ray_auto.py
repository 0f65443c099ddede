"""`num_workers="auto"` on Ray: the actors of the slots past the first two are made only when
the tuner adds a worker there, and whatever it does the epoch is torch's. Against a real local
Ray instance (tests/_ray_local.py); the tuner's policy is a script, as in
tests/test_loader_auto.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import Numbers
from _ray_local import live_actors, local_cluster

import statecore
from statecore import LoadWindow, Tuner, TuningDecision, TuningMove, WorkerBudget
from statecore.executors._autotune import AutoTuner

ray = pytest.importorskip("ray")

cluster = pytest.fixture(name="cluster")(local_cluster)

pytestmark = pytest.mark.timeout(300)


def _add_then_retire(
    tuner: Tuner, window: LoadWindow, budget: WorkerBudget
) -> tuple[Tuner, TuningDecision]:
    move = (TuningMove.ADD, TuningMove.RETIRE)[tuner.changes] if tuner.changes < 2 else None
    if move is None:
        return tuner, TuningDecision(TuningMove.HOLD, "scripted hold")
    return Tuner(changes=tuner.changes + 1), TuningDecision(move, f"scripted {move.value}")


def test_an_auto_loader_on_ray_starts_two_actors_and_its_epoch_is_torchs(cluster: Any) -> None:
    loader = statecore.DataLoader(Numbers(120), batch_size=2, num_workers="auto", executor="ray")
    loader._autotuner = AutoTuner(loader.num_workers, decide=_add_then_retire, window_seconds=0)
    iterator = iter(loader)
    got = [next(iterator)]
    assert len(live_actors()) == 2
    got += list(iterator)
    expected = list(torch.utils.data.DataLoader(Numbers(120), batch_size=2))
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected, strict=True):
        assert torch.equal(ours, theirs)
    tuning = loader.stats().tuning
    assert tuning is not None
    # The added actor takes no turn until it has started, and no window is measured before:
    # whether the retire comes before the epoch ends depends on how fast the actor starts.
    scripted = [(TuningMove.ADD, 3), (TuningMove.RETIRE, 2)]
    made = [(r.move, r.workers) for r in tuning.decisions]
    assert made and made == scripted[: len(made)]
