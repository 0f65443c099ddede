"""Peak memory of one loader run: the PSS of the loading process and all its descendants.

PSS (proportional set size) counts a page shared by n processes as 1/n in each, so the sum over
a process and its workers counts every page once: forked workers' pages shared with the main
process, and shared-memory batches mapped on both sides, are not counted twice, as they would
be by adding up RSS.

Each measurement runs the workload in a fresh interpreter (`python -m statecore.tools.memory`),
so that neither loader inherits a heap grown by the other, and samples that interpreter's
process tree from this one, which is idle meanwhile: the sampling thread takes no GIL from the
run. The child warms up as the timed runs do (a small untimed run), makes the run's dataset,
says it is ready, and waits; the baseline is its PSS then. It runs the workload once, as
`workloads.measure` times it, while this process samples, and says it is done.

Reading `/proc/PID/smaps_rollup` walks the process's page tables in the kernel: about 4 ms for a
process that has imported torch, on this project's machine. A sample of the whole tree takes a
few times that, so short spikes between samples can be missed; both loaders are sampled alike,
and the steady state of a run (the batches in flight) recurs with every batch.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs

from statecore.tools.workloads import WARMUP_BATCHES, Side, Workload, measure, select

__all__ = [
    "AVAILABLE",
    "INTERVAL",
    "TRIES",
    "Peak",
    "descendants",
    "measure_peak",
    "pss",
    "tree_pss",
]

AVAILABLE = Path("/proc/self/smaps_rollup").exists()
"""PSS is read from /proc (Linux 4.14 and later); elsewhere memory is not measured."""
INTERVAL = 0.005
"""Seconds between the end of one sample of the tree and the start of the next."""
TIMEOUT = 600.0
"""Seconds a measurement may take, start-up of the interpreter included."""


def pss(pid: int) -> int:
    """The PSS of process `pid` in bytes; 0 if it is gone (a worker that just exited)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    found = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for thread in threads:  # a process started from any thread is that thread's child
        try:
            text = Path(f"/proc/{pid}/task/{thread}/children").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        found += [int(child) for child in text.split()]
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`: its workers, and theirs (a fork server's forks)."""
    found: list[int] = []
    todo = _children(pid)
    while todo:
        child = todo.pop()
        if child not in found:
            found.append(child)
            todo += _children(child)
    return found


TRIES = 20
"""Samples of a tree `tree_pss` takes at most until one sees the same processes throughout."""


def tree_pss(pid: int) -> int:
    """The PSS of `pid` and every process below it, in bytes: a sample during which no process
    of the tree started or ended (else the last of `TRIES` samples).

    A fork while the tree is read counts the pages it shares twice: the parent's PSS, read
    before, holds a larger share of them than it does once the child maps them too, and the
    child's PSS, read after, holds its share. A tree of a 330 MB process and 4 workers started
    one by one (statecore's mp executor starts each with its first task) read 100-200 MB above
    its real size that way during the starts, more than the whole run added; a process that
    ends mid-sample leaves its share uncounted instead.
    """
    total = 0
    for _ in range(TRIES):
        tree = descendants(pid)
        total = pss(pid) + sum(pss(child) for child in tree)
        if descendants(pid) == tree:
            break
    return total


@attrs.frozen
class Peak:
    """One loader's memory on one workload."""

    side: Side
    before: int
    """Bytes: the PSS of the loading process (and any process it had) after the warm-up."""
    peak: int
    """Bytes: the highest PSS of the process and its workers sampled during the run."""
    samples: int

    @property
    def added(self) -> int:
        """Bytes the run added at its peak: workers, batches in flight, buffers."""
        return self.peak - self.before

    def to_json(self) -> dict[str, object]:
        return {
            "side": self.side.value,
            "before": self.before,
            "peak": self.peak,
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Peak:
        return cls(
            Side(data["side"]),
            int(str(data["before"])),
            int(str(data["peak"])),
            int(str(data["samples"])),
        )


class MemoryRunFailed(RuntimeError):
    """The interpreter that ran the workload for a memory measurement failed."""


def measure_peak(workload: Workload, side: Side) -> Peak:
    """Run `workload` once with `side`'s loader in a fresh interpreter; its peak memory.

    The workload must be one of `workloads.WORKLOADS` (the child looks it up by name), at
    any number of batches. Raises MemoryRunFailed with the child's last words if it fails.
    """
    if not AVAILABLE:
        raise MemoryRunFailed("peak memory is read from /proc/PID/smaps_rollup (Linux only)")
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "statecore.tools.memory",
            workload.name,
            str(workload.batches),
            side.value,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        if child.stdout.readline().strip() != "ready":
            raise MemoryRunFailed(_last_words(child))
        before = tree_pss(child.pid)
        done = threading.Event()
        answer: list[str] = []

        def wait_for_done() -> None:
            assert child.stdout is not None
            answer.append(child.stdout.readline().strip())
            done.set()

        listener = threading.Thread(target=wait_for_done, daemon=True)
        listener.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        peak, samples = before, 0
        deadline = time.monotonic() + TIMEOUT
        while not done.is_set() and time.monotonic() < deadline:
            peak = max(peak, tree_pss(child.pid))
            samples += 1
            done.wait(INTERVAL)
        listener.join(timeout=1.0)
        if answer != ["done"]:
            raise MemoryRunFailed(_last_words(child))
        child.stdin.close()
        child.wait(timeout=60)
        return Peak(side, before, peak, samples)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _last_words(child: subprocess.Popen[str]) -> str:
    if child.poll() is None:
        child.kill()
    _, err = child.communicate(timeout=60)
    lines = (err or "").strip().splitlines()
    return lines[-1] if lines else f"the memory run exited with status {child.returncode}"


def _child(name: str, batches: int, side: Side) -> int:
    """The measured interpreter: warm up, say ready, wait for go, run once, say done."""
    (workload,) = select([name])
    workload = workload.resized(batches)
    if workload.warmup:
        small = attrs.evolve(
            workload,
            batches=min(workload.batches, WARMUP_BATCHES),
            num_workers=min(workload.num_workers, 1),
        )
        measure(small, side.loader_class(), side.options())
    # Made before the baseline: an in-memory dataset's own tensors are not the loader's doing.
    dataset = workload.dataset_for_run()
    gc.collect()
    # The warm-up's workers left their buffers for the next ones (the mp executor keeps them,
    # and the thread executor its storages, docs/architecture.md): in the baseline, the run's
    # own buffers would not count.
    from statecore.executors._mp.leases import KEPT
    from statecore.executors._thread.storages import SHELF

    KEPT.release()
    SHELF.release()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    measure(workload, side.loader_class(), side.options(), dataset)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), Side(sys.argv[3])))
