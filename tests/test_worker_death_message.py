"""A dead worker is reported with torch's own sentence first, then statecore's detail.

Logs, alerting rules and torch's own tests match torch's words, so ours start with them.
"""

from __future__ import annotations

import re
import signal

import pytest
from _datasets import DiesAt

from statecore import DataLoader, WorkerDeath, WorkerDiedError
from statecore.executors._driver import death_message

TORCH_SIGNAL = re.compile(r"^DataLoader worker \(pid \d+\) is killed by signal: ")
TORCH_EXIT = re.compile(r"^DataLoader worker \(pid \d+\) exited unexpectedly with exit code \d+")


def test_a_signal_death_starts_with_torchs_sentence() -> None:
    message = death_message(WorkerDeath(worker=1, pid=4321, exitcode=-signal.SIGSEGV))
    assert message.startswith(
        "DataLoader worker (pid 4321) is killed by signal: Segmentation fault. "
    )


def test_a_signal_death_names_the_worker_and_the_signal() -> None:
    message = death_message(WorkerDeath(worker=1, pid=4321, exitcode=-signal.SIGSEGV))
    assert "worker 1" in message
    assert "SIGSEGV" in message


def test_a_bus_error_points_at_shared_memory() -> None:
    message = death_message(WorkerDeath(worker=0, pid=7, exitcode=-signal.SIGBUS))
    assert "shared memory" in message


def test_a_sigkill_points_at_the_out_of_memory_killer() -> None:
    message = death_message(WorkerDeath(worker=0, pid=7, exitcode=-signal.SIGKILL))
    assert "out-of-memory" in message


def test_an_exit_code_starts_with_torchs_sentence() -> None:
    message = death_message(WorkerDeath(worker=2, pid=99, exitcode=3))
    assert TORCH_EXIT.match(message)
    assert "worker 2" in message


def test_a_death_without_a_pid_names_the_worker_thread() -> None:
    message = death_message(WorkerDeath(worker=2, pid=None, exitcode=None))
    assert message.startswith("DataLoader worker (thread 2) exited unexpectedly.")


def test_the_executors_account_of_a_death_is_in_the_message_and_the_core_keeps_it() -> None:
    account = "The actor died unexpectedly before finishing this task."
    message = death_message(WorkerDeath(worker=1, pid=77, exitcode=None, reason=account))
    assert message.startswith("DataLoader worker (pid 77) exited unexpectedly.")
    assert f"The executor reported: {account}" in message
    # Without a pid, an executor with an account of its own is not a thread executor.
    unstarted = death_message(WorkerDeath(worker=1, pid=None, reason=account))
    assert unstarted.startswith("DataLoader worker (worker 1) exited unexpectedly.")
    assert WorkerDeath(1, 77, None, account).describe().endswith(f"unexpectedly: {account}")


@pytest.mark.timeout(120)
def test_a_worker_killed_by_a_signal_raises_torchs_sentence() -> None:
    loader = DataLoader(DiesAt(4, 2, signal.SIGSEGV), batch_size=None, num_workers=1)
    with pytest.raises(WorkerDiedError) as raised:
        list(loader)
    assert TORCH_SIGNAL.match(str(raised.value)), str(raised.value)
    assert raised.value.exitcode == -signal.SIGSEGV
