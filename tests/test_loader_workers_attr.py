"""`iter(loader)._workers`: the workers, as torch's multi-process iterator lists its processes.

Code written against torch's DataLoader reaches into its iterator for them, most often to check
that no worker outlives it: `for w in it._workers: w.join(timeout)`, then `w.is_alive()`,
`w.pid`, `w.exitcode` (torch's own tests do). A statecore iterator lists its mp executor's
worker processes there, with those methods, also once it was shut down; its thread executor's
threads; nothing when loading in the calling thread.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from typing import Any

import pytest
from _datasets import WorkerPids
from _processes import wait_gone
from _side_by_side import WORKERS

from statecore import DataLoader, WorkerDiedError
from statecore.models.loader import Switchboard


def started(executor: Any, workers: int, **options: Any) -> Any:
    """An iterator that has handed its first batch (every worker has had a task)."""
    loader = DataLoader(
        WorkerPids(), batch_size=4, num_workers=workers, executor=executor, **options
    )
    iterator = iter(loader)
    next(iterator)
    return iterator


@WORKERS
def test_the_mp_iterator_lists_its_worker_processes_with_the_pids_that_load_the_batches() -> None:
    iterator = started("mp", 2)
    workers = iterator._workers
    assert len(workers) == 2
    assert all(worker.is_alive() for worker in workers)
    loaded_by = {pid for batch in iterator for pid in batch.tolist()}
    assert loaded_by == {worker.pid for worker in workers}


@WORKERS
@pytest.mark.parametrize("persistent", [False, True])
def test_the_mp_iterators_processes_can_be_joined_once_it_is_dropped(persistent: bool) -> None:
    # torch's way of checking that no worker outlives its iterator: the handles, taken while
    # it runs, still answer once the iterator has closed its processes.
    iterator = started("mp", 2, persistent_workers=persistent)
    workers = iterator._workers
    pids = [worker.pid for worker in workers]
    iterator._shutdown()
    del iterator
    gc.collect()
    for worker in workers:
        worker.join(30)
    assert [worker.is_alive() for worker in workers] == [False, False]
    assert [worker.pid for worker in workers] == pids
    assert all(isinstance(worker.exitcode, int) for worker in workers)


@WORKERS
def test_a_shut_down_iterator_still_lists_the_processes_it_had() -> None:
    iterator = started("mp", 2)
    pids = [worker.pid for worker in iterator._workers]
    iterator._shutdown()
    workers = iterator._workers
    assert [worker.pid for worker in workers] == pids
    assert not any(worker.is_alive() for worker in workers)


@WORKERS
def test_a_wrapping_executors_workers_are_those_of_the_executor_it_wraps() -> None:
    # The pin stage and a plug-in's wrapper keep the executor they wrap as `inner`.
    board = Switchboard()
    iterator = started(board.factory("mp"), 2)
    assert sorted(worker.pid for worker in iterator._workers) == sorted(board.worker_pids())


@WORKERS
def test_the_thread_iterator_lists_its_worker_threads() -> None:
    iterator = started("thread", 2)
    workers = iterator._workers
    assert len(workers) == 2
    assert all(isinstance(worker, threading.Thread) and worker.is_alive() for worker in workers)
    iterator._shutdown()
    for worker in workers:
        worker.join(30)
    assert not any(worker.is_alive() for worker in workers)


def test_loading_in_the_calling_thread_lists_no_workers() -> None:
    iterator = started("inline", 0)
    assert iterator._workers == []


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """A local Ray instance (tests/_ray_local.py); skipped where Ray is not installed."""
    pytest.importorskip("ray")
    from _ray_local import local_cluster

    yield from local_cluster()


@pytest.mark.exhaustive
@pytest.mark.timeout(300)
def test_the_ray_iterator_lists_its_actor_handles(ray_cluster: Any) -> None:
    import ray

    iterator = started("ray", 2)
    workers = iterator._workers
    assert len(workers) == 2
    assert all(isinstance(worker, ray.actor.ActorHandle) for worker in workers)
    iterator._shutdown()


@WORKERS
def test_an_iterator_failed_by_a_worker_death_still_shuts_down_and_lists_ended_processes() -> None:
    # The failure shut the executor down (its processes closed) before anyone asked for the
    # handles: shutting the iterator down still works, and its processes are listed as ended.
    board = Switchboard()
    iterator = started(board.factory("mp"), 2)
    [pid, *_] = board.worker_pids()
    os.kill(pid, signal.SIGKILL)
    assert not wait_gone([pid], 30)
    with pytest.raises(WorkerDiedError):
        for _ in iterator:
            pass
    iterator._shutdown()
    workers = iterator._workers
    assert workers
    assert not any(worker.is_alive() for worker in workers)
    assert all(isinstance(worker.pid, int) for worker in workers)
