"""Workers, and the helper processes started for them, do not outlive a killed main process.

A script starts a loader whose dataset blocks in `__getitem__`, prints the pids of its workers
and of the fork server and resource tracker that `multiprocess` started for them, and waits;
the test SIGKILLs it, so that nothing in it can clean up, and waits (bounded, polling the pids)
until every one of those processes is gone. Under forkserver the workers are the fork server's
children, not the main process's, so a worker that watched its parent would wait for ever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _processes import kill_all, wait_gone

pytestmark = pytest.mark.timeout(180)

# Workers are to exit within a second or two of the main process; this bounds a loaded
# two-core machine and a regression.
GONE_WITHIN = 15.0

SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import time

    import multiprocess.forkserver
    import multiprocess.resource_tracker
    import torch
    from torch.utils.data import Dataset

    import statecore

    if sys.argv[2] == "without-pidfd":
        # As on systems without process descriptors (macOS, Linux before 5.3). At the top
        # level, so that a fork server, which imports this module, forks workers without it.
        del os.pidfd_open


    class Blocks(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            if index >= 2:
                time.sleep(600)  # a long __getitem__, in the worker's main thread
            return torch.tensor([index, os.getpid()])


    if __name__ == "__main__":
        if sys.argv[2] == "with-a-bystander":
            # A process of the user's own from the same fork server: it holds the server
            # alive, so the workers' parent, the server, outlives the main process.
            bystander = multiprocess.get_context(sys.argv[1]).Process(
                target=time.sleep, args=(600,), daemon=True
            )
            bystander.start()
        loader = statecore.DataLoader(
            Blocks(), batch_size=1, num_workers=2, multiprocessing_context=sys.argv[1]
        )
        iterator = iter(loader)
        workers = [int(next(iterator)[0][1]), int(next(iterator)[0][1])]
        helpers = [
            multiprocess.forkserver._forkserver._forkserver_pid,
            multiprocess.resource_tracker._resource_tracker._pid,
        ]
        print(*workers, flush=True)
        if sys.argv[2] == "with-a-bystander":
            helpers.append(bystander.pid)
        print(*[pid for pid in helpers if pid is not None], flush=True)
        next(iterator)  # both workers are inside __getitem__ for the next ten minutes
    """
)


def run_and_kill(tmp_path: Path, method: str, variant: str = "plain") -> tuple[set[int], set[int]]:
    """Run the script under `method`, SIGKILL it once its workers block; their pids and the
    helpers' pids."""
    path = tmp_path / "orphans.py"
    path.write_text(SCRIPT)
    # Not a pipe: orphans would hold its writing end, and reading it to the end would wait
    # for them.
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(path), method, variant],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    assert process.stdout is not None
    try:
        workers = {int(pid) for pid in process.stdout.readline().split()}
        helpers = {int(pid) for pid in process.stdout.readline().split()}
        if len(workers) != 2:
            process.kill()
            process.wait(timeout=60)
            raise AssertionError(f"the script printed no worker pids:\n{errors.read_text()}")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stdout.close()
    return workers, helpers


@pytest.fixture(scope="module")
def killed(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], tuple[set[int], set[int]]]]:
    """`run_and_kill` with the plain script, once per start method for the whole module: the
    test of the workers' exit and that of the helpers' share the run (each run starts an
    interpreter that imports torch). Whatever still runs is killed when the module ends."""
    runs: dict[str, tuple[set[int], set[int]]] = {}

    def under(method: str) -> tuple[set[int], set[int]]:
        if method not in runs:
            runs[method] = run_and_kill(tmp_path_factory.mktemp(method), method)
        return runs[method]

    try:
        yield under
    finally:
        for workers, helpers in runs.values():
            kill_all(workers | helpers)


@pytest.mark.parametrize(
    "method", ["fork", "forkserver", pytest.param("spawn", marks=pytest.mark.exhaustive)]
)
def test_workers_exit_when_their_loader_process_is_killed(
    killed: Callable[[str], tuple[set[int], set[int]]], method: str
) -> None:
    workers, _ = killed(method)
    assert wait_gone(workers, GONE_WITHIN) == set()


@pytest.mark.parametrize(
    "method", ["forkserver", pytest.param("spawn", marks=pytest.mark.exhaustive)]
)
def test_the_fork_server_and_resource_tracker_exit_when_the_loader_process_is_killed(
    killed: Callable[[str], tuple[set[int], set[int]]], method: str
) -> None:
    _, helpers = killed(method)
    assert helpers, "the script started no helper process"
    assert wait_gone(helpers, GONE_WITHIN) == set()


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_exit_when_their_loader_process_is_killed_even_without_process_descriptors(
    tmp_path: Path, method: str
) -> None:
    workers, helpers = run_and_kill(tmp_path, method, "without-pidfd")
    try:
        assert wait_gone(workers, GONE_WITHIN) == set()
        assert wait_gone(helpers, GONE_WITHIN) == set()
    finally:
        kill_all(workers | helpers)


def test_forkserver_workers_exit_when_their_loader_is_killed_while_the_fork_server_lives_on(
    tmp_path: Path,
) -> None:
    # The workers' parent is alive: only the loader's own process tells them to go.
    workers, others = run_and_kill(tmp_path, "forkserver", "with-a-bystander")
    try:
        assert wait_gone(workers, GONE_WITHIN) == set()
    finally:
        kill_all(workers | others)
