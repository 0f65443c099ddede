"""Ray actors that come and go: with `worker_restarts`, an actor that dies mid-epoch is replaced
by a new actor in its slot, through the scheduler's own policy (Ray's actor restarts stay off),
and the epoch hands over what torch's uninterrupted run does.

Against a real local Ray instance (tests/_ray_local.py). The default tier runs one restart; the
exhaustive tier runs persistent workers, restarts spent, and a stuck actor killed and replaced
here, and the conformance kit's replacement cases on Ray with the rest of the kit
(tests/test_ray_executor.py).
"""

from __future__ import annotations

import gc
import os
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data
from _ray_local import live_actors, local_cluster, settles
from torch.utils.data import Dataset

import statecore
from statecore import WorkerDiedError, WorkerRestartedWarning

ray = pytest.importorskip("ray")

cluster = pytest.fixture(name="cluster")(local_cluster)


class Loaded(Dataset[tuple[int, int]]):
    """(index, pid of the actor's process loading it): a test learns from it whom to kill."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, os.getpid()


def restarts_in(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, WorkerRestartedWarning)]


def kill_the_actor_of(batch: Any) -> int:
    """Kill the actor that loaded `batch` (SIGKILL to its process, as the kernel's OOM killer
    would); its pid."""
    victim = int(batch[1][0])
    os.kill(victim, signal.SIGKILL)
    return victim


def indices(batches: list[Any]) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


@pytest.mark.timeout(180)
def test_an_actor_killed_mid_epoch_is_replaced_and_the_epoch_is_torchs(cluster: Any) -> None:
    options: dict[str, Any] = {"batch_size": 2, "num_workers": 2}
    expected = indices(list(torch.utils.data.DataLoader(Loaded(40), **options)))
    loader = statecore.DataLoader(Loaded(40), executor="ray", worker_restarts=1, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = iter(loader)
        first = next(batches)  # task 0: worker 0's
        victim = kill_the_actor_of(first)
        got = [first, *batches]
    assert indices(got) == expected
    # Worker 0 loads the even tasks: its last one came from the actor that replaced the victim.
    assert int(got[-2][1][0]) != victim
    (warned,) = restarts_in(caught)
    assert f"pid {victim}" in warned and "0 restart(s) left" in warned
    del batches, got, first
    gc.collect()
    assert settles(lambda: not live_actors())


@pytest.mark.exhaustive
@pytest.mark.timeout(300)
def test_a_persistent_actor_killed_in_a_later_epoch_is_replaced_for_that_epoch(
    cluster: Any,
) -> None:
    def options() -> dict[str, Any]:
        generator = torch.Generator().manual_seed(5)
        return {"batch_size": 2, "num_workers": 2, "shuffle": True, "generator": generator}

    theirs = torch.utils.data.DataLoader(Loaded(20), persistent_workers=True, **options())
    expected = [indices(list(theirs)) for _ in range(3)]
    loader = statecore.DataLoader(
        Loaded(20), executor="ray", worker_restarts=1, persistent_workers=True, **options()
    )
    got: list[list[list[int]]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got.append(indices(list(loader)))
        batches = iter(loader)
        first = next(batches)
        kill_the_actor_of(first)
        got.append(indices([first, *batches]))
        got.append(indices(list(loader)))
    assert got == expected
    assert len(restarts_in(caught)) == 1
    del loader, batches, first
    gc.collect()
    assert settles(lambda: not live_actors())


@pytest.fixture
def actors_killed_twice() -> Iterator[None]:
    yield
    gc.collect()
    assert settles(lambda: not live_actors())


@pytest.mark.exhaustive
@pytest.mark.timeout(300)
def test_restarts_spent_fail_the_loader_naming_every_death(
    cluster: Any, actors_killed_twice: None
) -> None:
    loader = statecore.DataLoader(
        Loaded(60), batch_size=2, num_workers=2, executor="ray", worker_restarts=1
    )
    victims: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = iter(loader)
        with pytest.raises(WorkerDiedError) as raised:
            for batch in batches:
                # Worker 0's first batch, then the first batch of its replacement.
                if int(batch[0][0]) // 2 % 2 == 0 and int(batch[1][0]) not in victims:
                    victims.append(kill_the_actor_of(batch))
    assert len(victims) == 2
    message = str(raised.value)
    assert raised.value.pid == victims[1]
    assert "restart(s) (worker_restarts) were spent" in message
    assert all(f"pid {victim}" in message for victim in victims)
    assert len(restarts_in(caught)) == 1
    del batches, loader


class SleepsOnceAt(Dataset[tuple[int, int]]):
    """`Loaded`, except that the first load of `index` (on any actor: the `marker` file says
    it happened) sleeps for an hour, as a read stuck on a dead mount would."""

    def __init__(self, size: int, index: int, marker: Path) -> None:
        self.size = size
        self.index = index
        self.marker = marker

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int]:
        if index == self.index and not self.marker.exists():
            self.marker.touch()
            time.sleep(3600)
        return index, os.getpid()


@pytest.mark.exhaustive
@pytest.mark.timeout(300)
def test_a_stuck_actor_is_killed_and_replaced_and_the_epoch_is_torchs(
    cluster: Any, tmp_path: Path
) -> None:
    options: dict[str, Any] = {"batch_size": None, "num_workers": 2}
    expected = [int(i) for i, _ in torch.utils.data.DataLoader(Loaded(24), **options)]
    loader = statecore.DataLoader(
        SleepsOnceAt(24, 17, tmp_path / "slept"),
        executor="ray",
        worker_restarts=1,
        # Shorter than an actor's start (a process importing torch): an actor still starting
        # reports so, and is watched again rather than declared stuck.
        worker_timeout=2,
        **options,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [(int(i), int(pid)) for i, pid in loader]
    assert [i for i, _ in got] == expected
    (warned,) = restarts_in(caught)
    stuck_pid = next(pid for i, pid in got if i == 15)  # worker 1's before 17
    assert "worker 1" in warned and f"pid {stuck_pid}" in warned
    assert "no answer to task 17" in warned
    gc.collect()
    assert settles(lambda: not live_actors())
