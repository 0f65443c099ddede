"""Faults in the multiprocess executor's workers, as the consumer of a DataLoader sees them.

A worker that dies (SIGKILL, os._exit) fails the loader with a WorkerDiedError that names the
worker, its pid and how it ended, leaves no process behind, and keeps failing the same way. An
exception in user code (dataset, IterableDataset iterator, collate_fn, worker_init_fn) is raised
again in the main process with its type and the worker's own traceback; for a map-style dataset
the epoch goes on after it, as in torch. A loader whose workers stop answering times out with
torch's message and leaves no worker behind.

Each test's datasets are defined at module level (here or in _datasets.py) so that they pickle
by reference. Items carry the pid of the worker that made them, which is how the tests learn
worker pids.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import multiprocess
import pytest
import torch
import torch.utils.data
from _datasets import CustomError, Items, UnsendableAt
from _processes import children, kill_all, wait_gone, wait_until
from torch.utils.data import Dataset, IterableDataset

import statecore
from statecore import WorkerDiedError

# Every test here starts worker processes; none may hang the suite.
pytestmark = pytest.mark.timeout(120)

# "Within seconds" for the loaded two-core machines that run this suite: generous, bounded.
DETECTED_WITHIN = 20.0
REAPED_WITHIN = 20.0

FORK = multiprocess.get_context("fork")


# --- user code that fails ----------------------------------------------------------------------


class Blocking(Dataset):  # type: ignore[type-arg]
    """Like Items, but every item from `block_from` on waits for the event `release`."""

    def __init__(self, n: int, block_from: int, release: Any) -> None:
        self.n = n
        self.block_from = block_from
        self.release = release

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index >= self.block_from:
            self.release.wait(300)
        return torch.tensor([index, os.getpid()])


class FailingIter(IterableDataset):  # type: ignore[type-arg]
    """An IterableDataset whose __iter__ raises."""

    def __iter__(self) -> Iterator[int]:
        raise CustomError("cannot start iterating (marker-iter-error)")


class FailingNextIterator:
    """An iterator whose __next__ raises after `good` items."""

    def __init__(self, good: int) -> None:
        self.good = good
        self.made = 0

    def __iter__(self) -> FailingNextIterator:
        return self

    def __next__(self) -> int:
        if self.made == self.good:
            raise CustomError(f"ran into trouble after {self.good} items (marker-next-error)")
        self.made += 1
        return self.made


class FailingNext(IterableDataset):  # type: ignore[type-arg]
    """An IterableDataset whose iterator's __next__ raises after `good` items."""

    def __init__(self, good: int) -> None:
        self.good = good

    def __iter__(self) -> FailingNextIterator:
        return FailingNextIterator(self.good)


def failing_collate(samples: list[Any]) -> Any:
    """A collate_fn that refuses every batch."""
    raise TypeError(f"cannot collate {len(samples)} samples (marker-collate-error)")


def failing_init(worker_id: int) -> None:
    """A worker_init_fn that fails in worker 1 only."""
    if worker_id == 1:
        raise ValueError(f"worker {worker_id} cannot start (marker-init-error)")


# --- helpers -------------------------------------------------------------------------------


def mp_loader(dataset: Any, **options: Any) -> statecore.DataLoader:
    """A statecore loader on fork workers: two of them, batches of one, unless told otherwise."""
    options.setdefault("num_workers", 2)
    options.setdefault("batch_size", 1)
    options.setdefault("multiprocessing_context", "fork")
    return statecore.DataLoader(dataset, **options)


def outcomes(loader: Any, limit: int = 100) -> list[Any]:
    """Every next() of one epoch: the index of each batch, or the type of what was raised.

    Stops at StopIteration, at a worker's death or timeout (which end the loader), or after
    `limit` calls.
    """
    seen: list[Any] = []
    iterator = iter(loader)
    for _ in range(limit):
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except Exception as error:
            seen.append(type(error))
            if isinstance(error, (WorkerDiedError, statecore.LoaderTimeoutError)):
                break
        else:
            seen.append(int(batch[0][0]))
    return seen


def next_error(iterator: Iterator[Any]) -> BaseException:
    """What next(iterator) raises, with its traceback dropped.

    A traceback holds the frames that hold the iterator; kept (as pytest.raises keeps it) it
    would leave the iterator to the cyclic garbage collector instead of closing it on return.
    """
    try:
        batch = next(iterator)
    except BaseException as error:
        return error.with_traceback(None)
    raise AssertionError(f"next() gave a batch, not an error: {batch!r}")


def run_until_death(
    iterator: Iterator[Any], limit: int = 50
) -> tuple[WorkerDiedError, dict[int, int]]:
    """next() until a WorkerDiedError; return it and the worker pid of each index delivered."""
    pids: dict[int, int] = {}
    for _ in range(limit):
        try:
            batch = next(iterator)
        except WorkerDiedError as error:
            return error.with_traceback(None), pids
        pids[int(batch[0][0])] = int(batch[0][1])
    raise AssertionError(f"no WorkerDiedError in {limit} batches; got indices {sorted(pids)}")


# --- a worker that dies ----------------------------------------------------------------------


def test_worker_killed_by_sigkill_in_getitem_raises_worker_died_naming_worker_pid_and_signal():
    # Round robin in order: index i goes to worker i % 2, so index 5 kills worker 1.
    iterator = iter(mp_loader(Items(16, fail_at=5, how="sigkill")))
    started = time.monotonic()
    error, pids = run_until_death(iterator)
    assert time.monotonic() - started < DETECTED_WITHIN
    # Batches in order up to the dead worker's turn at most. Fewer may come: a batch worker 1
    # sent before it died but that was not read yet dies with it (its tensors are fetched from
    # the sender), and a death fails the loader even while other workers' batches are pending.
    delivered = sorted(pids)
    assert delivered == list(range(len(delivered)))
    assert 2 <= len(delivered) <= 5
    worker_1 = pids[1]  # task 5 was sent only once batch 1 was delivered
    assert isinstance(error, RuntimeError)
    assert (error.worker, error.pid, error.exitcode) == (1, worker_1, -signal.SIGKILL)
    message = str(error)
    assert "worker 1" in message
    assert f"pid {worker_1}" in message
    assert "SIGKILL" in message


def test_worker_killed_from_outside_mid_epoch_is_detected_within_seconds():
    iterator = iter(mp_loader(Items(200), prefetch_factor=2))
    victim = int(next(iterator)[0][1])  # index 0 came from worker 0
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    # Batches the victim sent before it died may still come; its death comes right after.
    error, _ = run_until_death(iterator, limit=10)
    assert time.monotonic() - killed < DETECTED_WITHIN
    assert (error.worker, error.pid, error.exitcode) == (0, victim, -signal.SIGKILL)
    assert f"pid {victim}" in str(error)
    assert "SIGKILL" in str(error)


def test_worker_calling_os_exit_reports_its_exit_code():
    # Task 4 goes to worker 0 once batch 0 is delivered, so batch 0 names worker 0's pid.
    iterator = iter(mp_loader(Items(16, fail_at=4, how="exit3")))
    error, pids = run_until_death(iterator)
    assert (error.worker, error.exitcode) == (0, 3)
    assert error.pid == pids[0]
    assert "exit code 3" in str(error)
    assert f"pid {pids[0]}" in str(error)


def test_worker_death_leaves_no_child_process():
    before = children()
    iterator = iter(mp_loader(Items(16, fail_at=5, how="sigkill")))
    error, pids = run_until_death(iterator)
    workers = set(pids.values()) | {error.pid}
    assert len(workers) == 2
    assert wait_until(lambda: children() <= before, REAPED_WITHIN), children() - before
    assert not wait_gone(workers, REAPED_WITHIN)


def test_worker_death_is_sticky_every_next_raises_it_again():
    iterator = iter(mp_loader(Items(16, fail_at=3, how="sigkill")))
    first, _ = run_until_death(iterator)
    for _ in range(3):
        again = next_error(iterator)
        assert type(again) is WorkerDiedError
        assert (again.worker, again.pid, again.exitcode) == (
            first.worker,
            first.pid,
            first.exitcode,
        )
        assert str(again) == str(first)


# --- exceptions in user code -------------------------------------------------------------------


def test_getitem_exception_is_reraised_with_its_type_worker_index_and_traceback():
    # batch_size=None: the dataset index is the task's index itself.
    iterator = iter(mp_loader(Items(8, fail_at=3, how="value"), batch_size=None))
    delivered = [int(next(iterator)[1]) for _ in range(3)]
    error = next_error(iterator)
    assert type(error) is ValueError
    message = str(error)
    assert "marker-value-error" in message
    assert "worker 1" in message  # index 3 is worker 1's in round robin
    assert f"pid {delivered[1]}" in message
    assert "index 3" in message
    assert "Original traceback" in message
    assert "in __getitem__" in message  # the worker's frames, by name
    assert "in fail" in message


def test_getitem_exception_in_a_batch_names_the_batch_indices():
    iterator = iter(mp_loader(Items(8, fail_at=3, how="value"), batch_size=2))
    next(iterator)  # indices 0, 1
    error = next_error(iterator)
    assert type(error) is ValueError
    assert "index [2, 3]" in str(error)


def test_custom_exception_class_keeps_its_type():
    iterator = iter(mp_loader(Items(8, fail_at=0, how="custom")))
    error = next_error(iterator)
    assert type(error) is CustomError
    assert "marker-custom-error" in str(error)
    assert "worker 0" in str(error)


def test_exception_that_cannot_be_rebuilt_from_a_message_becomes_runtime_error_naming_it():
    iterator = iter(mp_loader(Items(8, fail_at=0, how="two-argument")))
    error = next_error(iterator)
    assert type(error) is RuntimeError
    assert "TwoArgumentError" in str(error)
    assert "two-argument failure at 0" in str(error)


def test_loader_goes_on_after_a_getitem_exception_as_torch_does():
    dataset = Items(8, fail_at=3, how="value")
    ours = outcomes(mp_loader(dataset))
    theirs = outcomes(
        torch.utils.data.DataLoader(
            dataset, batch_size=1, num_workers=2, multiprocessing_context="fork"
        )
    )
    assert ours == [0, 1, 2, ValueError, 4, 5, 6, 7]
    assert ours == theirs


def test_iterable_dataset_iter_exception_is_reraised_with_worker_and_traceback():
    iterator = iter(mp_loader(FailingIter(), batch_size=None))
    error = next_error(iterator)
    assert type(error) is CustomError
    message = str(error)
    assert "marker-iter-error" in message
    assert "worker 0" in message
    assert "Original traceback" in message
    assert "in __iter__" in message


def test_iterable_dataset_next_exception_is_reraised_with_worker_and_traceback():
    # Each worker iterates its own copy: two good items each, round robin, then worker 0 fails.
    iterator = iter(mp_loader(FailingNext(good=2), batch_size=None))
    assert [int(next(iterator)) for _ in range(4)] == [1, 1, 2, 2]
    error = next_error(iterator)
    assert type(error) is CustomError
    message = str(error)
    assert "marker-next-error" in message
    assert "worker 0" in message
    assert "Original traceback" in message
    assert "in __next__" in message


def test_collate_fn_exception_is_reraised_with_worker_and_traceback():
    iterator = iter(mp_loader(Items(8), batch_size=2, collate_fn=failing_collate))
    error = next_error(iterator)
    assert type(error) is TypeError
    message = str(error)
    assert "marker-collate-error" in message
    assert "worker 0" in message
    assert "Original traceback" in message
    assert "in failing_collate" in message


def test_worker_init_fn_exception_is_reraised_with_worker_and_traceback():
    iterator = iter(mp_loader(Items(8), worker_init_fn=failing_init))
    assert int(next(iterator)[0][0]) == 0  # worker 0 started fine
    error = next_error(iterator)  # index 1: worker 1's turn
    assert type(error) is ValueError
    message = str(error)
    assert "marker-init-error" in message
    assert "worker 1" in message
    assert "worker_init_fn" in message
    assert "Original traceback" in message
    assert "in failing_init" in message


# --- timeout -------------------------------------------------------------------------------


def blocked_loader(**options: Any) -> tuple[Iterator[Any], set[int]]:
    """An iterator whose workers block in __getitem__ from the first index, and the processes
    that ran before it (the workers are the children started since).

    The event is never set: waiters terminated inside Event.wait would leave its condition
    waiting for them to wake, and set() would block.
    """
    before = children()
    return iter(mp_loader(Blocking(16, block_from=0, release=FORK.Event()), **options)), before


def test_timeout_raises_torch_message():
    iterator, before = blocked_loader(timeout=0.5)
    try:
        error = next_error(iterator)
        assert type(error) is statecore.LoaderTimeoutError
        assert isinstance(error, RuntimeError)
        assert str(error) == "DataLoader timed out after 0.5 seconds"
    finally:
        kill_all(children() - before)


def test_timeout_leaves_no_worker_behind():
    iterator, before = blocked_loader(timeout=0.5)
    workers: set[int] = set()
    try:
        assert isinstance(next_error(iterator), statecore.LoaderTimeoutError)
        workers = children() - before
        # The workers are still blocked in __getitem__: stopping them is the loader's job.
        assert not wait_gone(workers, REAPED_WITHIN)
        assert wait_until(lambda: children() <= before, REAPED_WITHIN), children() - before
    finally:
        kill_all(workers | (children() - before))


def test_timeout_is_sticky():
    iterator, before = blocked_loader(timeout=0.5)
    try:
        first = next_error(iterator)
        assert isinstance(first, statecore.LoaderTimeoutError)
        again = next_error(iterator)
        assert type(again) is type(first)
        assert str(again) == str(first)
    finally:
        kill_all(children() - before)


# --- sending answers ---------------------------------------------------------------------------


class CannotPickle(Exception):
    """Raised by a batch that refuses to be pickled."""


def test_a_batch_the_worker_cannot_send_raises_in_its_turn_and_the_epoch_goes_on() -> None:
    loader = mp_loader(UnsendableAt(4, at=1, make_error=CannotPickle), batch_size=None)
    iterator = iter(loader)
    assert next(iterator)[0] == 0
    error = next_error(iterator)
    assert type(error) is CannotPickle
    assert "while sending the batch back" in str(error)
    assert [index for index, _ in iterator] == [2, 3]


SIGPIPE_SCRIPT = """
import os, signal, time
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as command-line tools piping to `head` do
import torch
import statecore
from statecore import SendTask

loader = statecore.DataLoader(
    list(range(8)), batch_size=None, num_workers=1, multiprocessing_context="fork"
)
iterator = iter(loader)
executor = iterator._driver.executor
(process,) = executor.processes.values()
os.kill(process.pid, signal.SIGKILL)
process.join(30)
# What the driver does when an answer and the death arrive together: it dispatches again.
executor.dispatch(SendTask(0, 99, 0))
print("survived", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_task_sent_to_a_worker_that_just_died_does_not_kill_the_main_process(
    tmp_path: Any,
) -> None:
    script = tmp_path / "sigpipe.py"
    script.write_text(SIGPIPE_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "survived" in done.stdout
