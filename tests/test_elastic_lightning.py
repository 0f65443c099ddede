"""Lightning DDP on CPU (gloo): a fit checkpointed mid-epoch on N processes resumes with
`ckpt_path` on M (tests/_lightning_elastic_run.py runs each rank): 2 -> 3, 3 -> 2 and 2 -> 1.

Lightning puts its DistributedSampler in the loader, saves rank 0's `state_dict()` (gathered
from every rank) in its checkpoint and loads it into each new rank's loader; the new ranks' fit
has no callback of the test's: statecore's own, installed through Lightning's entry point,
sizes the resumed epoch. One process checks the same in the default tier
(tests/test_elastic_lightning_loop.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DistributedSampler

RUN = Path(__file__).with_name("_lightning_elastic_run.py")
SECONDS = 400  # two fresh Lightning jobs, 5 interpreters, on a loaded machine
SAMPLES, BATCH = 24, 2  # as the run's


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _job(mode: str, world: int, where: Path) -> list[dict[str, Any]]:
    """Run `mode` on `world` ranks; each rank's record."""
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "NODE_RANK": "0"}
    tests = str(Path(__file__).parent)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RUN), mode, str(world), str(where)],
            env={
                **os.environ,
                **rendezvous,
                "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": "1",
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        outputs = [rank.communicate(timeout=SECONDS / 2)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, output[-4000:]
    return [json.loads((where / f"{mode}-{rank}.json").read_text()) for rank in range(world)]


def _entry_point_installed() -> None:
    # An install whose metadata predates the entry point (an old editable install) runs the
    # resumed fit without ElasticEpochs: say so, rather than fail on the batches.
    names = {e.value for e in entry_points(group="lightning.pytorch.callbacks_factory")}
    assert "statecore.executors.frameworks:lightning_callbacks" in names, (
        "statecore's Lightning entry point is not installed: reinstall statecore (pip install -e .)"
    )


def _batches(record: dict[str, Any], epoch: int) -> list[list[int]]:
    return [b for b, e in zip(record["indices"], record["epochs"], strict=True) if e == epoch]


@pytest.mark.exhaustive
@pytest.mark.timeout(SECONDS)
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (2, 1)])
def test_a_fit_checkpointed_mid_epoch_finishes_its_epoch_on_another_number_of_processes(
    tmp_path: Path, old: int, new: int
) -> None:
    _entry_point_installed()
    first = _job("first", old, tmp_path)
    resumed = _job("resumed", new, tmp_path)
    rest = [_batches(rank, 0) for rank in resumed]
    assert len({len(batches) for batches in rest}) == 1, "the new ranks are not in lock-step"
    seen = Counter(i for rank in first for batch in rank["indices"] for i in batch)
    seen.update(i for batches in rest for batch in batches for i in batch)
    assert set(seen) == set(range(SAMPLES))
    # DistributedSampler's padding, of the old ranks' split and of the remainder's.
    assert sum(seen.values()) - SAMPLES <= (old - 1) + (new - 1)
    for rank, record in enumerate(resumed):
        sampler = DistributedSampler(range(SAMPLES), num_replicas=new, rank=rank, seed=0)  # type: ignore[arg-type]
        sampler.set_epoch(1)
        order = list(sampler)
        expected = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
        assert _batches(record, 1) == expected
