"""What a test process holds, read from /proc: child processes, threads, open fds, /dev/shm.

The leak tests take a `Snapshot` before they start a loader and another once it is gone, and
compare the two. Processes end asynchronously, so `wait_until` polls (for a bounded time, in
short steps) instead of sleeping for a guessed time: it returns as soon as the condition holds.

A fault test's dataset ends its worker on a chosen load, once: `load_number` counts the loads
across processes and threads with files, and `faulted` reads back which workers a fault ended.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Snapshot",
    "alive",
    "children",
    "cmdline",
    "faulted",
    "kill_all",
    "leaks",
    "load_number",
    "open_fds",
    "release_kept_buffers",
    "shm_entries",
    "state",
    "thread_names",
    "wait_gone",
    "wait_no_leaks",
    "wait_until",
]

# How often the wait loops look again; they return as soon as what they wait for holds.
POLL_INTERVAL = 0.02


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def state(pid: int) -> str | None:
    """The process state letter (R, S, Z, ...), or None once there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[0]


def alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is not a zombie waiting for its parent to reap it."""
    return state(pid) not in (None, "Z", "X")


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as line:
            return line.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def children(pid: int | None = None) -> set[int]:
    """The direct children of `pid` (default: this process), zombies included.

    A zombie child is a process nobody reaped, which is a leak, so it counts.
    """
    parent = os.getpid() if pid is None else pid
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None and int(fields[1]) == parent:
            found.add(int(entry))
    return found


def thread_names() -> list[str]:
    """The names of this process's Python threads, sorted."""
    return sorted(thread.name for thread in threading.enumerate())


def open_fds() -> dict[int, str]:
    """This process's open file descriptors, each with what it points to."""
    fds: dict[int, str] = {}
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
    return fds


def shm_entries() -> set[str]:
    """The names in /dev/shm (POSIX shared memory segments and named semaphores)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@dataclass(frozen=True)
class Snapshot:
    """What this process holds at one moment."""

    children: frozenset[int]
    threads: tuple[str, ...]
    fds: dict[int, str]
    shm: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(
            children=frozenset(children()),
            threads=tuple(thread_names()),
            fds=open_fds(),
            shm=frozenset(shm_entries()),
        )


def leaks(before: Snapshot, after: Snapshot, pids: Iterable[int] = ()) -> list[str]:
    """What `after` holds that `before` did not, as readable lines; empty when nothing leaked.

    /dev/shm is shared with every other process on the machine, so only entries whose names
    carry one of `pids` (this process, its workers) count: torch names its segments
    `torch_<pid>_...` after the process that made them.
    """
    found: list[str] = []
    new_children = after.children - before.children
    if new_children:
        described = ", ".join(
            f"{pid} ({state(pid)}: {cmdline(pid)[:80]!r})" for pid in sorted(new_children)
        )
        found.append(f"child processes left: {described}")
    if len(after.threads) > len(before.threads):
        found.append(f"threads grew from {list(before.threads)} to {list(after.threads)}")
    new_fds = {fd: target for fd, target in after.fds.items() if fd not in before.fds}
    if len(after.fds) > len(before.fds):
        found.append(f"open fds grew from {len(before.fds)} to {len(after.fds)}: {new_fds}")
    marks = {f"_{pid}_" for pid in (os.getpid(), *pids)}
    new_shm = sorted(
        name for name in after.shm - before.shm if any(mark in f"{name}_" for mark in marks)
    )
    if new_shm:
        found.append(f"/dev/shm entries left: {new_shm}")
    return found


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL)


def wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait until none of `pids` runs; return the ones still running after `timeout` seconds."""
    pids = set(pids)
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout)
    return {pid for pid in pids if alive(pid)}


def release_kept_buffers() -> None:
    """Let go of the buffers statecore's mp executor keeps for the next workers (a cache with
    bounds and an idle release of its own, tested in tests/test_mp_buffers_kept.py), so that
    what a test leaves behind is judged without it."""
    leases = sys.modules.get("statecore.executors._mp.leases")
    if leases is not None:
        leases.KEPT.release()


def wait_no_leaks(before: Snapshot, timeout: float, pids: Iterable[int] = ()) -> list[str]:
    """Wait until nothing has leaked since `before`; return what still has after `timeout`.
    The buffers kept for the next workers are released first (`release_kept_buffers`)."""
    release_kept_buffers()
    pids = tuple(pids)
    found: list[str] = []

    def clean() -> bool:
        nonlocal found
        found = leaks(before, Snapshot.take(), pids)
        return not found

    wait_until(clean, timeout)
    return found


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL whichever of `pids` still run: cleanup after a test that found them left over."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)


# --- faults a dataset brings about in its worker, once ------------------------------------------


def load_number(marker: Path) -> int:
    """Count this load of the chosen index (or item) across every process and thread: 1 for
    the first. Files next to `marker` keep the count, so that a replacement worker, which
    loads it again, is told it is not the first."""
    count = 1
    while True:
        try:
            Path(f"{marker}-{count}").touch(exist_ok=False)
        except FileExistsError:
            count += 1
            continue
        return count


def faulted(marker: Path, how: str) -> list[tuple[int, int]]:
    """(pid, worker id) of each worker a dataset faulted (`how`: "kill", "hang", ...), from
    the file each fault leaves next to `marker`, `<marker>-<how>-<pid>`, holding the worker
    id; in no particular order."""
    prefix = f"{marker.name}-{how}-"
    return [
        (int(path.name[len(prefix) :]), int(path.read_text()))
        for path in marker.parent.iterdir()
        if path.name.startswith(prefix)
    ]


def true_in_a_fork(question: Callable[[], bool]) -> bool:
    """`question()` asked in a child forked from this process (what a fork inherits, or lets
    go of as it starts), its answer sent back through a pipe."""
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and exits
        try:
            os.close(reader)
            os.write(writer, b"1" if question() else b"0")
        finally:
            os._exit(0)
    os.close(writer)
    try:
        answer = os.read(reader, 1)
    finally:
        os.close(reader)
        os.waitpid(child, 0)
    return answer == b"1"
