"""statecore under PyTorch Lightning: the batches torch's loader gives, loaded by statecore.

Lightning rebuilds a loader to put a distributed sampler in it (and, when predicting, a batch
sampler that keeps the indices), either from the arguments it recorded while its dataloader
hook ran or from the attributes of a loader passed to `fit`. The rebuilt loader must be a
statecore loader with the same executor, however the user's module imported statecore.

Every loader here uses the "thread" executor: its samples say they were loaded by a statecore
worker thread, which the "mp" default (what a loader that lost its executor falls back to)
and torch's own loader cannot claim.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _frameworks import ELSEWHERE, STATECORE_THREAD, Marked, Recorder, quiet_trainer

import statecore

RUN = Path(__file__).with_name("_lightning_run.py")
SECONDS = 240  # a fresh interpreter spends most of it importing Lightning, on a loaded machine

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice on num_workers etc.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _environment(**extra: str) -> dict[str, str]:
    # One thread per process for torch: two ranks, each with loader threads, share two cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _run(order: str, mode: str, tmp_path: Path, **extra: str) -> subprocess.Popen[str]:
    out = tmp_path / f"{mode}-{extra.get('RANK', '0')}.json"
    return subprocess.Popen(
        [sys.executable, str(RUN), order, mode, str(out)],
        cwd=tmp_path,
        env=_environment(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(processes: list[subprocess.Popen[str]]) -> list[str]:
    """Each process's output once all have exited; all are killed if one overruns."""
    try:
        outputs = [process.communicate(timeout=SECONDS)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    return outputs


def _results(tmp_path: Path, mode: str, rank: int = 0) -> dict[str, Any]:
    results: dict[str, Any] = json.loads((tmp_path / f"{mode}-{rank}.json").read_text())
    return results


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# --- one process, in this interpreter ------------------------------------------------------------


def _fit(loader_class: type, where: str) -> Recorder:
    statecore_only = {"executor": "thread"} if loader_class is statecore.DataLoader else {}

    def make() -> Any:
        # Two workers for both: under Lightning, even torch's loader shuffles its second epoch
        # differently with workers and without.
        generator = torch.Generator().manual_seed(7)
        return loader_class(
            Marked(12),
            batch_size=3,
            shuffle=True,
            generator=generator,
            num_workers=2,
            **statecore_only,
        )

    module = Recorder(make if where == "hook" else None)
    trainer = quiet_trainer(devices=1, max_epochs=2)
    trainer.fit(module, train_dataloaders=None if where == "hook" else make())
    return module


@pytest.mark.parametrize("where", ["hook", "fit"])
@pytest.mark.timeout(SECONDS)
def test_fit_in_one_process_gets_torchs_batches_loaded_by_statecore(where: str) -> None:
    ours = _fit(statecore.DataLoader, where)
    theirs = _fit(torch.utils.data.DataLoader, where)
    assert ours.indices == theirs.indices
    assert len(ours.indices) == 8  # two epochs of four batches
    assert {mark for batch in ours.loaders for mark in batch} == {STATECORE_THREAD}
    assert {mark for batch in theirs.loaders for mark in batch} == {ELSEWHERE}


# --- fresh interpreters: import order and DDP ----------------------------------------------------

IMPORT_ORDERS = [
    # isort's order in a user's module: statecore sorts before lightning and torch.
    pytest.param("statecore,lightning,torch", id="statecore-first"),
    pytest.param("lightning,torch,statecore", id="statecore-last"),
    # The dataloader hook is the first to import statecore, while Lightning is recording.
    pytest.param("lightning,torch", id="statecore-in-the-hook"),
]


@pytest.mark.parametrize("order", IMPORT_ORDERS)
@pytest.mark.timeout(SECONDS + 30)
def test_a_loader_from_a_hook_survives_lightnings_rebuild_whatever_the_import_order(
    order: str, tmp_path: Path
) -> None:
    _finish([_run(order, "predict", tmp_path)])
    got = _results(tmp_path, "predict")["statecore"]
    assert got["indices"] == [[i, i + 1] for i in range(0, 16, 2)]
    assert {mark for batch in got["loaders"] for mark in batch} == {STATECORE_THREAD}
    assert (got["class"], got["executor"]) == ("statecore.executors._loader.DataLoader", "thread")


@pytest.mark.timeout(SECONDS + 30)
def test_ddp_on_two_processes_gets_torchs_batches_loaded_by_statecore(tmp_path: Path) -> None:
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    ranks = [
        _run(
            "statecore,lightning,torch",
            "ddp",
            tmp_path,
            **rendezvous,
            WORLD_SIZE="2",
            NODE_RANK="0",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
        )
        for rank in range(2)
    ]
    _finish(ranks)
    results = [_results(tmp_path, "ddp", rank) for rank in range(2)]
    for where in ("hook", "fit"):
        ours = [rank[f"statecore loader from the {where}"] for rank in results]
        theirs = [rank[f"torch loader from the {where}"] for rank in results]
        for got, expected in zip(ours, theirs, strict=True):
            assert got["indices"] == expected["indices"], where
            assert {mark for batch in got["loaders"] for mark in batch} == {STATECORE_THREAD}
            assert (got["class"], got["executor"]) == (
                "statecore.executors._loader.DataLoader",
                "thread",
            )
        # Lightning did put in its distributed sampler: each epoch, the ranks split the data.
        for epoch in range(2):
            halves = [
                {i for batch in got["indices"][4 * epoch : 4 * epoch + 4] for i in batch}
                for got in ours
            ]
            assert halves[0].isdisjoint(halves[1])
            assert halves[0] | halves[1] == set(range(16))
