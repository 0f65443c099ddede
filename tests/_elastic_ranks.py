"""The ranks of a real DDP job on CPU (gloo), for the elastic resume tests.

`run_job` starts `world` processes (torch.multiprocessing), each a rank of a process group,
which either take `at` batches of epoch 1 and checkpoint (rank 0 saves the state, which
`state_dict()` has gathered from every rank), or load that state, finish epoch 1 and run epoch
2. Each rank writes what its consumer got to `out/<phase>-<rank>.json`. With `via="accelerate"`
the process group is accelerate's and the state goes through its `save_state`/`load_state`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from _datasets import Numbers
from torch.utils.data import DistributedSampler

from statecore import DataLoader

LENGTH = 23
SEED = 7
BATCH = 2


def build(world: int, rank: int, job: dict[str, Any]) -> DataLoader[Any]:
    sampler = DistributedSampler(
        Numbers(LENGTH),
        num_replicas=world,
        rank=rank,
        shuffle=job["shuffle"],
        seed=SEED,
        drop_last=job["drop_last"],
    )
    workers = job["workers"]
    return DataLoader(
        Numbers(LENGTH),
        batch_size=BATCH,
        sampler=sampler,
        drop_last=job["drop_last"],
        num_workers=workers,
        executor=job["executor"] if workers else None,
    )


def _epoch(loader: DataLoader[Any], epoch: int) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
    return [batch.tolist() for batch in loader]


def _rank(rank: int, world: int, init: str, job: dict[str, Any]) -> None:
    if job.get("via") == "accelerate":
        _through_accelerate(rank, world, job)
        return
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        loader = build(world, rank, job)
        record: dict[str, Any] = {}
        if job["phase"] == "before":
            loader.sampler.set_epoch(1)  # type: ignore[attr-defined]
            batches = iter(loader)
            record["before"] = [next(batches).tolist() for _ in range(job["at"])]
            state = loader.state_dict()  # every rank calls it: it gathers their progress
            if rank == 0:
                torch.save(state, job["state"])
            del batches
        else:
            loader.load_state_dict(torch.load(job["state"], weights_only=True))
            record["after"] = _epoch(loader, 1)
            record["next"] = _epoch(loader, 2)
        Path(job["out"], f"{job['phase']}-{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _through_accelerate(rank: int, world: int, job: dict[str, Any]) -> None:
    """The same, with accelerate's process group and its save_state / load_state (the loader
    registered for checkpointing, iterated by the program itself)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["port"]),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert (accelerator.num_processes, accelerator.process_index) == (world, rank)
    loader = build(accelerator.num_processes, accelerator.process_index, job)
    accelerator.register_for_checkpointing(loader)
    record: dict[str, Any] = {}
    if job["phase"] == "before":
        loader.sampler.set_epoch(1)  # type: ignore[attr-defined]
        batches = iter(loader)
        record["before"] = [next(batches).tolist() for _ in range(job["at"])]
        accelerator.save_state(job["state"])
        del batches
    else:
        accelerator.load_state(job["state"])
        record["after"] = _epoch(loader, 1)
        record["next"] = _epoch(loader, 2)
    Path(job["out"], f"{job['phase']}-{rank}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def run_job(world: int, tmp: Path, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Run `job` on `world` ranks; what each rank's consumer got, by rank."""
    init = tmp / f"init-{job['phase']}"
    # Forked: a rank starts in well under a second, where a spawned one imports torch again
    # (half a minute on a loaded machine). The ranks run only torch and statecore, and the
    # tests' timeouts bound a hang.
    # accelerate keeps its process state in a singleton, which a forked rank would inherit from
    # a test process that made an Accelerator before: its ranks start afresh.
    start = "spawn" if job.get("via") == "accelerate" else "fork"
    torch.multiprocessing.start_processes(
        _rank, args=(world, str(init), job), nprocs=world, join=True, start_method=start
    )
    return [
        json.loads(Path(job["out"], f"{job['phase']}-{rank}.json").read_text())
        for rank in range(world)
    ]
