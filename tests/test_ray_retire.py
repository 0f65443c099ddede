"""A tuner retiring a Ray actor mid-epoch (`Driver.retire`) and adding its slot back
(`Driver.add`, a new actor): the retired actor finishes what it holds and is killed, the rest
of the epoch goes to the others, and the epoch hands over what torch's uninterrupted run does
(a map-style dataset whose items do not depend on the worker that loads them).

Against a real local Ray instance (tests/_ray_local.py), as tests/test_ray_restarts.py. The
default tier retires an actor and adds its slot back; the exhaustive tier also retires one and
lets the other finish the epoch.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import Items
from _ray_local import live_actors, local_cluster, settles

import statecore
from statecore import WorkerStatus

ray = pytest.importorskip("ray")

cluster = pytest.fixture(name="cluster")(local_cluster)

OPTIONS: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "prefetch_factor": 2}


def _indices(batches: list[Any]) -> list[list[int]]:
    # An item is [index, pid of the process that loaded it]: a batch, rows of them.
    return [batch[:, 0].tolist() for batch in batches]


def _pids(batches: list[Any]) -> set[int]:
    return {int(pid) for batch in batches for pid in batch[:, 1].tolist()}


def _torchs() -> list[list[int]]:
    return _indices(list(torch.utils.data.DataLoader(Items(40), **OPTIONS)))


def _retired(iterator: Any, worker: int) -> list[Any]:
    """Retire `worker` through the iterator's driver; the batches handed over until it is
    stopped (it answers what it holds, in their turn)."""
    driver = iterator._driver
    driver.retire(worker)
    got = []
    while driver.state.life.workers[worker] is not WorkerStatus.STOPPED:
        got.append(next(iterator))
    return got


@pytest.mark.timeout(180)
def test_an_actor_retired_then_added_back_mid_epoch_leaves_the_epoch_torchs(
    cluster: Any,
) -> None:
    loader = statecore.DataLoader(Items(40), executor="ray", **OPTIONS)
    iterator = iter(loader)
    driver = iterator._driver  # type: ignore[attr-defined]
    got = [next(iterator) for _ in range(3)]
    got += _retired(iterator, 1)
    # The retired actor is killed: one of the two is left.
    assert settles(lambda: len(live_actors()) == 1)
    retired_at = len(got)
    got += [next(iterator) for _ in range(4)]
    before_add = _pids(got)
    driver.add(1)
    # An added slot takes no turn until its actor has started: wait for it, so that it is
    # left some of the rest to load.
    while driver.state.life.workers[1].value != "active":
        driver.wait()
    got += list(iterator)
    assert retired_at < 20 - 4  # retired, then added back, mid-epoch
    assert _indices(got) == _torchs()
    # The slot's new actor is a new process, and it loaded some of the rest.
    assert _pids(got) - before_add
    assert driver.state.life.added == 1 and driver.state.life.replaced == ()
    del iterator, got
    gc.collect()
    assert settles(lambda: not live_actors())


@pytest.mark.exhaustive  # the test above retires too; this one lets the rest finish the epoch
@pytest.mark.timeout(180)
def test_an_actor_retired_mid_epoch_leaves_the_rest_of_the_epoch_to_the_others(
    cluster: Any,
) -> None:
    loader = statecore.DataLoader(Items(40), executor="ray", **OPTIONS)
    iterator = iter(loader)
    got = [next(iterator)]
    got += _retired(iterator, 0)
    retired_at = len(got)
    assert settles(lambda: len(live_actors()) == 1)
    rest = list(iterator)
    assert retired_at < 20 - 4 and rest  # the rest of the epoch came after the stop
    assert _indices(got + rest) == _torchs()
    # Loaded by the two actors, the retired one before its stop: no new one.
    assert len(_pids(got + rest)) == 2
    del iterator, got, rest
    gc.collect()
    assert settles(lambda: not live_actors())
