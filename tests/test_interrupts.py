"""Ctrl-C (or a signal handler raising) inside `next()` or `iter()` leaves a loader that works.

The notebook user's everyday case: interrupt a cell, run it again. After an interrupt the next
`next()` goes on with the epoch and the next `iter()` starts a new one; no batch is lost or
repeated. The interrupts here are real signals sent to this process while it waits on real
workers; to interrupt a wait and not the test's own code, the workers send the signal only
once the executor's `poll` is blocked (a flag the test's executor wrapper raises around it).

The worker answers as soon as it has sent the signal, so its answer may come in the very
instant the interrupt lands; the executors' hand-off to the driver must lose nothing then.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _datasets import InterruptingSampler, InterruptsAt, InterruptsInMainThread, InterruptsResume
from _interrupting import WAIT, TimeLimit, collector_off, shared_flag, time_limit, watched
from _processes import wait_until

from statecore import DataLoader


@pytest.fixture(autouse=True)
def _no_collection_while_interrupts_land() -> Iterator[None]:
    with collector_off():
        yield


def _consume(iterator: Iterator[Any], interrupt: type[BaseException]) -> tuple[list[int], int]:
    """Every batch, going on after each interrupt; and how many interrupts there were."""
    got: list[int] = []
    interrupts = 0
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return got, interrupts
        except interrupt:
            interrupts += 1
            continue
        got.append(int(batch))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", ["mp", "thread"])
def test_next_after_ctrl_c_in_next_goes_on_with_the_epoch(executor: str, tmp_path: Path) -> None:
    polling = shared_flag()
    dataset = InterruptsAt(12, 5, tmp_path / "fired", polling, signal.SIGINT)
    loader = DataLoader(
        dataset, batch_size=None, num_workers=2, executor=watched(executor, polling)
    )
    got, interrupts = _consume(iter(loader), KeyboardInterrupt)
    assert interrupts == 1
    assert got == list(range(12))


@pytest.mark.timeout(120)
def test_a_persistent_loader_interrupted_in_next_runs_its_next_epochs(tmp_path: Path) -> None:
    polling = shared_flag()
    dataset = InterruptsAt(8, 2, tmp_path / "fired", polling, signal.SIGINT)
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        executor=watched("mp", polling),
    )
    iterator = iter(loader)
    with pytest.raises(KeyboardInterrupt):
        while True:
            next(iterator)
    # The notebook user runs the cell again: a new epoch, complete, on the same workers.
    assert [int(x) for x in loader] == list(range(8))
    assert [int(x) for x in loader] == list(range(8))


@pytest.mark.timeout(120)
def test_iter_after_ctrl_c_while_workers_resume_starts_the_epoch(tmp_path: Path) -> None:
    polling = shared_flag()
    dataset = InterruptsResume(10, tmp_path / "fired", polling)
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        executor=watched("mp", polling),
    )
    first = [int(x) for x in loader]
    with pytest.raises(KeyboardInterrupt):
        iter(loader)  # interrupted while waiting for the workers to resume
    assert [int(x) for x in loader] == first
    assert [int(x) for x in loader] == first


@pytest.mark.timeout(120)
def test_an_exception_from_a_signal_handler_is_an_interrupt_not_a_failure(
    tmp_path: Path,
) -> None:
    previous = signal.signal(signal.SIGALRM, time_limit)
    try:
        polling = shared_flag()
        dataset = InterruptsAt(10, 4, tmp_path / "fired", polling, signal.SIGALRM)
        loader = DataLoader(
            dataset, batch_size=None, num_workers=2, executor=watched("mp", polling)
        )
        got, interrupts = _consume(iter(loader), TimeLimit)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert interrupts == 1
    assert got == list(range(10))


def test_ctrl_c_inside_the_dataset_without_workers_loads_that_batch_again() -> None:
    # torch skips the batch whose loading was interrupted; its index is not drawn again.
    loader = DataLoader(InterruptsInMainThread(7, 3), batch_size=None)
    got, interrupts = _consume(iter(loader), KeyboardInterrupt)
    assert interrupts == 1
    assert got == list(range(7))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ctrl_c_while_the_sampler_is_read_loses_no_batch(num_workers: int) -> None:
    # With workers the sampler is read ahead, in the same call that hands a batch over: that
    # batch must reach the consumer with the next request, not be lost with the interrupt.
    loader = DataLoader(
        torch.arange(9), sampler=InterruptingSampler(9, 4), batch_size=None, num_workers=num_workers
    )
    got, interrupts = _consume(iter(loader), KeyboardInterrupt)
    assert interrupts == 1
    assert got == list(range(9))


@pytest.mark.timeout(120)
def test_an_interrupted_loader_leaves_no_thread_behind(tmp_path: Path) -> None:
    before = {thread.ident for thread in threading.enumerate()}
    polling = shared_flag()
    dataset = InterruptsAt(6, 1, tmp_path / "fired", polling, signal.SIGINT)
    loader = DataLoader(
        dataset, batch_size=None, num_workers=2, executor=watched("thread", polling)
    )
    iterator = iter(loader)
    with pytest.raises(KeyboardInterrupt):
        while True:
            next(iterator)
    del iterator  # the user gives up on the epoch
    assert wait_until(lambda: {thread.ident for thread in threading.enumerate()} <= before, WAIT), (
        "worker threads outlived the abandoned iterator"
    )
