"""Real DDP on CPU (gloo): an epoch checkpointed mid-way on N ranks is finished on M.

The state rank 0 saves was gathered from every rank by `state_dict()`; every new rank loads it.
Over the interrupted epoch, the samples consumed across all ranks are the epoch's, each once,
apart from DistributedSampler's padding (see docs/checkpointing.md, "Changing the number of
GPUs"); the epoch after it is an uninterrupted M-rank run's.
"""

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _elastic_ranks import BATCH, LENGTH, build, run_job

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

AT = 2  # the batches each old rank takes before the checkpoint


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def interrupted_epoch(
    tmp_path: Path, old: int, new: int, **options: Any
) -> tuple[Counter[int], list[list[list[int]]], dict[str, Any]]:
    """(every sample consumed over epoch 1, what each new rank's epoch 2 gave, the options)."""
    job = {"shuffle": True, "drop_last": False, "workers": 0, "executor": "thread", **options}
    job.update(state=str(tmp_path / "state.pt"), out=str(tmp_path), at=AT)
    before = run_job(old, tmp_path, {**job, "phase": "before"})
    if "port" in job:
        job["port"] = free_port()  # the first job's may linger a moment
    after = run_job(new, tmp_path, {**job, "phase": "after"})
    rest = [rank["after"] for rank in after]
    assert len({len(batches) for batches in rest}) == 1, "the new ranks are not in lock-step"
    seen = Counter(i for rank in before for batch in rank["before"] for i in batch) + Counter(
        i for batches in rest for batch in batches for i in batch
    )
    return seen, [rank["next"] for rank in after], job


def uninterrupted_next_epoch(new: int, job: dict[str, Any]) -> list[list[list[int]]]:
    epochs = []
    for rank in range(new):
        loader = build(new, rank, {**job, "workers": 0})
        loader.sampler.set_epoch(2)  # type: ignore[attr-defined]
        epochs.append([batch.tolist() for batch in loader])
    return epochs


def check(tmp_path: Path, old: int, new: int, **options: Any) -> None:
    seen, following, job = interrupted_epoch(tmp_path, old, new, **options)
    if job["drop_last"]:
        # Nothing repeated; left out: at most new - 1 samples by the new split's cut, and each
        # new rank's last incomplete batch (the loader's drop_last).
        assert max(seen.values()) == 1
        assert LENGTH - len(seen) <= new * BATCH - 1
    else:
        # Every sample; repeated: padding, up to old - 1 by the old split, new - 1 by the new.
        assert set(seen) == set(range(LENGTH))
        assert sum(seen.values()) - LENGTH <= old + new - 2
    assert following == uninterrupted_next_epoch(new, job)


@pytest.mark.timeout(180)
def test_an_epoch_checkpointed_on_2_ranks_finishes_on_3(tmp_path: Path) -> None:
    check(tmp_path, 2, 3)


@pytest.mark.timeout(180)
def test_an_epoch_checkpointed_on_3_ranks_finishes_on_2_with_workers_and_drop_last(
    tmp_path: Path,
) -> None:
    check(tmp_path, 3, 2, workers=2, drop_last=True)


@pytest.mark.exhaustive
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2), (2, 1), (1, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("workers", "executor"), [(0, "thread"), (2, "thread"), (2, "mp")])
def test_every_change_of_ranks_finishes_the_epoch_exactly(
    tmp_path: Path, old: int, new: int, drop_last: bool, workers: int, executor: str
) -> None:
    check(tmp_path, old, new, drop_last=drop_last, workers=workers, executor=executor)


@pytest.mark.exhaustive
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2)])
def test_accelerates_save_state_and_load_state_finish_the_epoch_on_other_ranks(
    tmp_path: Path, old: int, new: int
) -> None:
    check(tmp_path, old, new, via="accelerate", port=free_port())
