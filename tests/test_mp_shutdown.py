"""The multiprocess executor leaves nothing behind, however a loader's life ends.

Each leak test takes a `Snapshot` (child processes, threads, open fds, /dev/shm entries) before
it starts a loader, ends the loader's life one way or another, and waits a bounded time for the
snapshot to come back. Ending a process's life (interpreter exit, SIGKILL, Ctrl-C) is tested
on a script run as a subprocess; its workers are found by the pids they put in their batches
and by a marker on the command line, which fork workers inherit.

Also here: large tensors come back through shared memory, not the result pipe, and every start
method loads a small dataset correctly.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multiprocess
import multiprocess.connection
import multiprocess.process
import pytest
import torch
from _datasets import Items
from _processes import (
    Snapshot,
    alive,
    children,
    cmdline,
    kill_all,
    leaks,
    wait_gone,
    wait_no_leaks,
)
from torch.utils.data import Dataset

import statecore

pytestmark = pytest.mark.timeout(120)

# Bounds for a loaded two-core machine: generous, but a hang still fails in seconds.
GONE_WITHIN = 20.0
PARENT_DEATH_NOTICED_WITHIN = 10.0
SCRIPT_EXITS_WITHIN = 60.0


class Large(Dataset):  # type: ignore[type-arg]
    """Each item is a 64 MiB float32 tensor filled with its index."""

    numel = 16 * 2**20

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((self.numel,), float(index), dtype=torch.float32)


def mp_loader(dataset: Any, **options: Any) -> statecore.DataLoader:
    """A statecore loader on fork workers: two of them, batches of one, unless told otherwise."""
    options.setdefault("num_workers", 2)
    options.setdefault("batch_size", 1)
    options.setdefault("multiprocessing_context", "fork")
    return statecore.DataLoader(dataset, **options)


def pids_of(batches: Any) -> set[int]:
    return {int(batch[0][1]) for batch in batches}


@pytest.fixture(scope="module", autouse=True)
def warmed_up() -> None:
    """One epoch first, so lazy imports and one-off resources are not counted as leaks."""
    assert len(list(mp_loader(Items(4)))) == 4


def assert_nothing_left(before: Snapshot, workers: set[int]) -> None:
    assert workers, "the test learned no worker pids"
    assert not wait_gone(workers, GONE_WITHIN), "workers still running"
    assert wait_no_leaks(before, GONE_WITHIN, workers) == []


def assert_freed(iterator: weakref.ref[Any]) -> None:
    """The iterator went with its last reference, as torch's does, and so closed its workers.

    Checked before waiting for the workers, so that a kept iterator fails at once.
    """
    gone = iterator() is None
    assert gone, (
        "the iterator outlived its last reference: a reference cycle leaves it, and its "
        "workers, to the cyclic garbage collector"
    )


# --- the end of a loop -------------------------------------------------------------------------


def test_breaking_out_of_the_loop_and_dropping_the_iterator_leaves_nothing():
    before = Snapshot.take()
    workers: set[int] = set()
    iterator = iter(mp_loader(Items(64)))
    for batch in iterator:
        workers |= pids_of([batch])
        if len(workers) == 2:
            break
    dropped = weakref.ref(iterator)
    del iterator, batch
    assert_freed(dropped)
    assert_nothing_left(before, workers)


def train(loader: Any, workers: set[int], error: type[BaseException], refs: list[Any]) -> None:
    """A training loop whose body raises an `error` once it has seen both workers.

    The exception is made where it is raised, as in real code: held in a local of this frame,
    which its traceback holds, it would make a reference cycle of its own.
    """
    iterator = iter(loader)
    refs.append(weakref.ref(iterator))
    for batch in iterator:
        workers |= pids_of([batch])
        if len(workers) == 2:
            raise error("loss is nan")


def test_exception_in_the_loop_body_leaves_nothing():
    before = Snapshot.take()
    workers: set[int] = set()
    refs: list[Any] = []
    with pytest.raises(ValueError, match="loss is nan"):
        train(mp_loader(Items(64)), workers, ValueError, refs)
    assert_freed(refs[0])
    assert_nothing_left(before, workers)


def test_keyboard_interrupt_in_the_loop_body_leaves_nothing():
    before = Snapshot.take()
    workers: set[int] = set()
    refs: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        train(mp_loader(Items(64)), workers, KeyboardInterrupt, refs)
    assert_freed(refs[0])
    assert_nothing_left(before, workers)


def test_iterator_reclaimed_by_the_garbage_collector_stops_its_workers_without_terminating(
    monkeypatch: pytest.MonkeyPatch,
):
    gc.collect()  # earlier garbage is not this test's business
    terminated: list[int | None] = []
    terminate = multiprocess.process.BaseProcess.terminate

    def spy(process: Any) -> None:
        terminated.append(process.pid)
        terminate(process)

    monkeypatch.setattr(multiprocess.process.BaseProcess, "terminate", spy)
    before = Snapshot.take()
    iterator = iter(mp_loader(Items(64)))
    workers = pids_of([next(iterator), next(iterator)])
    cycle: list[Any] = [iterator]
    cycle.append(cycle)  # as a traceback or a user's object graph would hold it
    del iterator, cycle
    gc.collect()
    assert_nothing_left(before, workers)
    assert terminated == [], "workers were terminated instead of stopped"


# --- many epochs -------------------------------------------------------------------------------


# Any growth at all fails (`leaks` in tests/_processes.py), so a leak of one thing an epoch
# shows in 25 epochs (50 worker starts) as it does in 100, which the exhaustive tier runs.
@pytest.mark.parametrize("epochs", [25, pytest.param(100, marks=pytest.mark.exhaustive)])
def test_many_short_epochs_do_not_grow_processes_threads_fds_or_shm(epochs):
    loader = mp_loader(Items(4))
    workers = pids_of(loader)
    before = Snapshot.take()
    for _ in range(epochs):
        batches = list(loader)
        assert [int(batch[0][0]) for batch in batches] == [0, 1, 2, 3]
        workers |= pids_of(batches)
    del batches  # their storages hold shared-memory fds
    assert len(workers) == 2 * (epochs + 1)  # fresh workers each epoch, as torch
    assert_nothing_left(before, workers)


def test_many_short_epochs_with_persistent_workers_reuse_them_and_grow_nothing():
    loader = mp_loader(Items(4), persistent_workers=True)
    workers = pids_of(loader)
    before = Snapshot.take()
    for _ in range(100):
        batches = list(loader)
        assert [int(batch[0][0]) for batch in batches] == [0, 1, 2, 3]
        assert pids_of(batches) == workers
    del batches  # their storages hold shared-memory fds
    assert leaks(before, Snapshot.take(), workers) == []


def test_deleting_a_loader_with_persistent_workers_stops_them():
    before = Snapshot.take()
    loader = mp_loader(Items(8), persistent_workers=True)
    iterator = iter(loader)  # with persistent workers, the loader keeps this iterator
    workers = pids_of(iterator)
    assert len(workers) == 2
    assert all(alive(pid) for pid in workers)  # persistent: still there between epochs
    kept = weakref.ref(iterator)
    del loader, iterator
    assert_freed(kept)
    assert_nothing_left(before, workers)


# --- the end of the process --------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import faulthandler
    import os
    import signal
    import sys
    import time

    import multiprocess
    import multiprocess.synchronize
    import torch
    from torch.utils.data import Dataset

    import statecore

    MODE = sys.argv[1]  # sys.argv[2] is the marker that the workers inherit
    # A script that hangs shows where, and ends before the test stops waiting for it.
    faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)


    class Items(Dataset):
        def __init__(self, n, block_from, release):
            self.n, self.block_from, self.release = n, block_from, release

        def __len__(self):
            return self.n

        def __getitem__(self, index):
            if index >= self.block_from:
                self.release.wait()  # never set
            return torch.tensor([index, os.getpid()])


    release = multiprocess.get_context("fork").Event()
    if MODE.startswith("exit-"):
        loader = statecore.DataLoader(
            Items(16, 16, release), num_workers=2, persistent_workers=True,
            multiprocessing_context="fork",
        )
        pids = set()
        for batch in loader:
            pids.add(int(batch[0][1]))
            if MODE == "exit-mid-epoch" and len(pids) == 2:
                break
        print(*sorted(pids), flush=True)
        if MODE == "exit-module-kept":
            # A reference to the loader's module keeps it alive into interpreter teardown,
            # which then clears its globals before the iterator is finalized.
            import statecore.executors._loader as loader_module
        sys.exit(0)  # the loader, its iterator and its workers are still alive

    if MODE == "killed-in-stop-check":
        # Worker 0 is SIGKILLed (as by the OOM killer) while it checks whether shutdown has
        # begun: inside Event.is_set, holding the event's lock. Its death must be reported, and
        # nothing may wait for that lock for ever.
        def die_in_stop_check(worker_id):
            if worker_id == 0:
                def is_set(event):
                    event._cond.acquire()
                    os.kill(os.getpid(), signal.SIGKILL)

                multiprocess.synchronize.Event.is_set = is_set

        loader = statecore.DataLoader(
            Items(16, 16, release), num_workers=2, multiprocessing_context="fork",
            worker_init_fn=die_in_stop_check,
        )
        iterator = iter(loader)
        worker_0, worker_1 = int(next(iterator)[0][1]), int(next(iterator)[0][1])
        print(worker_0, worker_1, flush=True)
        # Worker 0 checks once it has nothing to do. Wait (bounded) until it has died; an
        # executor whose idle workers check no Event gets worker 0 killed while idle instead.
        deadline = time.monotonic() + 3
        while os.path.exists(f"/proc/{worker_0}") and time.monotonic() < deadline:
            with open(f"/proc/{worker_0}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        else:
            if os.path.exists(f"/proc/{worker_0}"):
                os.kill(worker_0, signal.SIGKILL)
        try:
            list(iterator)
        except statecore.WorkerDiedError as error:
            print("raised", type(error).__name__, error, flush=True)
        else:
            print("finished", flush=True)
        sys.exit(0)

    # The rest wait for the test to kill or interrupt them, with workers idle or blocked.
    n, block_from = {"idle": (4, 4), "blocked": (16, 2)}[MODE.split("-")[-1]]
    loader = statecore.DataLoader(
        Items(n, block_from, release), num_workers=2, multiprocessing_context="fork"
    )
    iterator = iter(loader)
    print(int(next(iterator)[0][1]), int(next(iterator)[0][1]), flush=True)
    if MODE.endswith("blocked"):
        next(iterator)  # waits for the blocked workers for ever
    else:
        while True:
            time.sleep(60)  # the workers have answered everything and wait for tasks
    """
)


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str
    left: set[int]
    """Workers, or processes with the marker, still running once the script had exited."""


class Script:
    """The script above, run in a session of its own; its workers carry `marker` in argv."""

    def __init__(self, tmp_path: Path, mode: str, hang_after: float) -> None:
        self.marker = f"statecore-test-{uuid.uuid4().hex}"
        path = tmp_path / "loader_script.py"
        path.write_text(SCRIPT)
        self.process = subprocess.Popen(
            [sys.executable, str(path), mode, self.marker, str(hang_after)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.workers: set[int] = set()

    def read_workers(self) -> set[int]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # the script prints it, or exits
        if not line:
            _, err = self.process.communicate(timeout=SCRIPT_EXITS_WITHIN)
            raise AssertionError(f"the script printed no pids; stderr:\n{err}")
        self.workers = {int(word) for word in line.split()}
        assert len(self.workers) == 2
        return self.workers

    def marked(self) -> set[int]:
        """Processes that still run with the marker on their command line."""
        return {
            int(entry)
            for entry in os.listdir("/proc")
            if entry.isdigit() and self.marker in cmdline(int(entry)) and alive(int(entry))
        }

    def finish(self) -> Finished:
        """Wait for the script to exit; then for its workers, which would hold its pipes."""
        returncode = self.process.wait(timeout=SCRIPT_EXITS_WITHIN)
        left = wait_gone(self.workers, GONE_WITHIN) | self.marked()
        kill_all(left)
        out, err = self.process.communicate(timeout=SCRIPT_EXITS_WITHIN)
        return Finished(returncode, out, err, left)

    def clean_up(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        kill_all(self.workers | self.marked())


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Any]:
    started: list[Script] = []

    def start(mode: str, hang_after: float = SCRIPT_EXITS_WITHIN * 0.75) -> Script:
        started.append(Script(tmp_path, mode, hang_after))
        return started[-1]

    yield start
    for each in started:
        each.clean_up()


@pytest.mark.parametrize("mode", ["exit-after-epoch", "exit-mid-epoch"])
def test_interpreter_exit_with_persistent_workers_alive_exits_cleanly(script: Any, mode: str):
    run = script(mode)
    run.read_workers()
    finished = run.finish()
    assert finished.returncode == 0, finished.stderr
    assert finished.left == set()
    assert "Traceback" not in finished.stderr, finished.stderr


def test_iterator_finalized_late_in_interpreter_teardown_prints_no_error(script: Any):
    run = script("exit-module-kept")
    run.read_workers()
    finished = run.finish()
    assert finished.returncode == 0, finished.stderr
    assert finished.left == set()
    assert "Exception ignored" not in finished.stderr, finished.stderr


def test_worker_killed_while_checking_for_shutdown_is_reported_and_hangs_nothing(script: Any):
    run = script("killed-in-stop-check", hang_after=15.0)
    run.read_workers()
    finished = run.finish()
    assert finished.returncode == 0, finished.stderr  # 1: it hung, see the stacks in stderr
    assert "raised WorkerDiedError" in finished.stdout, finished.stdout
    assert "SIGKILL" in finished.stdout, finished.stdout
    assert finished.left == set()


def test_parent_killed_while_workers_wait_for_tasks_workers_exit(script: Any):
    run = script("killed-idle")
    workers = run.read_workers()
    os.kill(run.process.pid, signal.SIGKILL)
    run.process.wait()
    assert not wait_gone(workers, PARENT_DEATH_NOTICED_WITHIN)
    assert run.marked() == set()


def test_parent_killed_while_workers_block_in_the_dataset_workers_exit(script: Any):
    run = script("killed-blocked")
    workers = run.read_workers()
    os.kill(run.process.pid, signal.SIGKILL)
    run.process.wait()
    assert not wait_gone(workers, PARENT_DEATH_NOTICED_WITHIN)
    assert run.marked() == set()


def test_ctrl_c_stops_the_main_process_alone_and_leaves_no_worker(script: Any):
    run = script("interrupted-blocked")
    run.read_workers()
    os.killpg(run.process.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    finished = run.finish()
    assert finished.returncode in (-signal.SIGINT, 128 + signal.SIGINT), finished.stderr
    assert finished.left == set()
    # One KeyboardInterrupt, the main process's: no worker died of it or printed it.
    assert finished.stderr.count("KeyboardInterrupt") == 1, finished.stderr
    assert "statecore-worker" not in finished.stderr, finished.stderr


# --- shared memory -----------------------------------------------------------------------------


def test_large_tensor_comes_back_through_shared_memory_not_the_pipe(
    monkeypatch: pytest.MonkeyPatch,
):
    received: list[int] = []
    recv_bytes = multiprocess.connection.Connection.recv_bytes

    def counting(connection: Any, *args: Any) -> bytes:
        message = recv_bytes(connection, *args)
        received.append(len(message))
        return message

    monkeypatch.setattr(multiprocess.connection.Connection, "recv_bytes", counting)
    before = Snapshot.take()
    loader = mp_loader(Large(), batch_size=None, num_workers=1)
    batches = list(loader)
    assert [batch.shape for batch in batches] == [(Large.numel,), (Large.numel,)]
    assert not any(batch.is_shared() for batch in batches)  # in buffers the workers reuse
    assert [float(batch[0]) for batch in batches] == [0.0, 1.0]
    assert [float(batch[-1]) for batch in batches] == [0.0, 1.0]
    size = Large.numel * 4
    assert len(received) >= 2  # each batch was read from the result pipe...
    assert sum(received) < size // 1000, received  # ...as a handle, not as its bytes
    del batches, loader
    assert wait_no_leaks(before, GONE_WITHIN) == []


# --- start methods -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        "fork",
        pytest.param("spawn", marks=pytest.mark.exhaustive),
        pytest.param("forkserver", marks=pytest.mark.exhaustive),
    ],
)
def test_each_start_method_loads_a_small_dataset(method: str):
    loader = mp_loader(Items(6), batch_size=2, multiprocessing_context=method)
    batches = list(loader)
    assert [batch[:, 0].tolist() for batch in batches] == [[0, 1], [2, 3], [4, 5]]
    workers = {int(pid) for batch in batches for pid in batch[:, 1]}
    assert len(workers) == 2
    assert os.getpid() not in workers
    # spawn and forkserver leave helpers of their own (a forkserver, a resource tracker), so
    # only the workers are checked: they must be gone.
    assert not wait_gone(workers, GONE_WITHIN)
    assert children() & workers == set()
