"""Soak: many short epochs with interrupts, breaks and worker deaths leave nothing behind.

Opt-in, not part of the default run (the `soak` marker is deselected in pyproject.toml):

    pytest -m soak tests/test_soak.py              # 1,000 epochs, a few minutes on two cores
    STATECORE_SOAK_EPOCHS=200 STATECORE_SOAK_SEED=7 pytest -m soak tests/test_soak.py

Each epoch takes one loader at random (processes or threads, persistent workers or not, or no
workers) and does one thing to it at random: run the epoch through, break out of it, press
Ctrl-C while `next()` waits and go on, press Ctrl-C and abandon the epoch, or have a worker
killed. Every completed epoch must hand over exactly its batches. Afterwards, with the loaders
gone, nothing may be left: no child process, no thread, no file descriptor, no shared-memory
segment of ours, no entry in the temporary directory, and the resident memory may have grown
by at most `RSS_GROWTH_BOUND` since the warm-up.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _interrupting import interrupt_main_once, shared_flag, watched
from _processes import Snapshot, wait_no_leaks
from torch.utils.data import Dataset

from statecore import DataLoader, WorkerDiedError

EPOCHS = int(os.environ.get("STATECORE_SOAK_EPOCHS", "1000"))
SEED = int(os.environ.get("STATECORE_SOAK_SEED", "0"))
WARM_UP = min(50, EPOCHS // 4)
RSS_GROWTH_BOUND = 64 << 20
"""Resident memory a loader may gain over the run after its warm-up: allocator slack, not a
leak of batches (1,000 epochs of leaked batches here would be over 100 MB)."""
ITEMS = 8

pytestmark = [pytest.mark.soak, pytest.mark.timeout(1800)]


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Planned(Dataset[tuple[int, int]]):
    """(index, pid) for range(ITEMS); what to do to the epoch is read from a plan file, since
    persistent workers keep the copy of the dataset they started with."""

    def __init__(self, folder: Path, polling: Any, loader: str) -> None:
        self.folder, self.polling, self.loader = folder, polling, loader
        self.main = os.getpid()

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> tuple[int, int]:
        # Persistent workers may still load tasks of an epoch abandoned earlier: a plan is for
        # one loader only (a thread worker obeying "kill" would kill the main process).
        plan = (self.folder / "plan").read_text().split()
        if plan and int(plan[1]) == index and plan[3] == self.loader:
            action, _, epoch, _ = plan
            marker = self.folder / f"done-{epoch}"
            if action == "kill" and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "interrupt":
                interrupt_main_once(self.main, self.polling, marker, signal.SIGINT)
        return index, os.getpid()


def _loaders(folder: Path, polling: Any) -> dict[str, DataLoader[Any]]:
    def make(executor: str, workers: int, persistent: bool) -> DataLoader[Any]:
        name = executor + ("-persistent" if persistent else "")
        return DataLoader(
            Planned(folder, polling, name),
            batch_size=2,
            num_workers=workers,
            persistent_workers=persistent,
            executor=watched(executor, polling),
        )

    return {
        "mp": make("mp", 2, False),
        "mp-persistent": make("mp", 2, True),
        "thread": make("thread", 2, False),
        "thread-persistent": make("thread", 2, True),
        "inline": make("inline", 0, False),
    }


def _run_epoch(loader: DataLoader[Any], action: str, at: int) -> list[int]:
    """Carry out `action` on one epoch; return the indices handed over.

    An interrupt may also land in `iter()` (persistent workers still loading an abandoned
    epoch read the current plan), and is then met as a user would: by running it again.
    """
    got: list[int] = []
    while True:
        try:
            iterator = iter(loader)
            break
        except KeyboardInterrupt:
            continue
    while True:
        if action == "break" and len(got) >= at:
            return got
        try:
            indices, _ = next(iterator)
        except StopIteration:
            return got
        except KeyboardInterrupt:
            if action == "interrupt-abandon":
                return got
            continue
        got.extend(int(i) for i in indices)


@pytest.mark.soak
def test_many_short_epochs_leave_nothing_behind(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    polling = shared_flag()  # its arena stays mapped for the life of the process: before
    before = Snapshot.take()
    temp_before = set(os.listdir(tempfile.gettempdir()))
    (tmp_path / "plan").write_text("")
    loaders = _loaders(tmp_path, polling)
    counts: dict[str, int] = {}
    rss_after_warm_up = 0
    for epoch in range(EPOCHS):
        name = rng.choice(sorted(loaders))
        choices = ["full", "break", "interrupt", "interrupt-abandon"]
        if name.startswith("mp"):
            choices.append("kill")
        action = rng.choice(choices)
        index = rng.randrange(ITEMS)
        plan = {"kill": "kill", "interrupt": "interrupt", "interrupt-abandon": "interrupt"}
        words = f"{plan[action]} {index} {epoch} {name}" if action in plan else ""
        (tmp_path / "plan").write_text(words)
        counts[action] = counts.get(action, 0) + 1
        where = f"epoch {epoch}: {action} at {index} on {name}"
        if action == "kill":
            with pytest.raises(WorkerDiedError):
                _run_epoch(loaders[name], action, index)
            continue
        got = _run_epoch(loaders[name], action, index // 2)
        if action in ("full", "interrupt"):
            assert got == list(range(ITEMS)), where
        else:
            assert got == list(range(len(got))), where
        if epoch == WARM_UP:
            rss_after_warm_up = _rss()
    rss_growth = _rss() - rss_after_warm_up
    del loaders
    gc.collect()
    leaked = wait_no_leaks(before, timeout=30.0)
    temp_left = sorted(set(os.listdir(tempfile.gettempdir())) - temp_before)
    ours = [name for name in temp_left if name.startswith(("pymp-", "statecore"))]
    print(f"\nsoak: {EPOCHS} epochs, seed {SEED}: {counts}; RSS grew {rss_growth >> 20} MiB")
    assert leaked == []
    assert ours == []
    assert rss_growth <= RSS_GROWTH_BOUND, f"RSS grew by {rss_growth >> 20} MiB"
