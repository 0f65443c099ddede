"""The benchmark's memory readings (`statecore.tools.memory`): a process tree's proportional
set size, and each loader's peak measured in an interpreter of its own."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from subprocess import PIPE

import multiprocess
import pytest
from _side_by_side import WORKERS

from statecore.tools import memory
from statecore.tools.workloads import select


@WORKERS
@pytest.mark.skipif(not memory.AVAILABLE, reason="PSS is read from /proc (Linux)")
def test_peak_memory_is_measured_for_every_loader_in_a_fresh_interpreter() -> None:
    small = select(["epoch2-persistent"])[0].resized(4)
    for side in small.sides:
        peak = memory.measure_peak(small, side)
        assert peak.side is side and peak.samples >= 1
        assert 0 < peak.before <= peak.peak
    assert multiprocessing.active_children() == [] and multiprocess.active_children() == []


def test_the_tree_of_a_process_counts_its_children_and_theirs() -> None:
    # a child that starts a grandchild, then both wait for their stdin to close; the child
    # names the grandchild only once it says it is idle, so neither is still importing (and
    # growing) between the measurements below
    script = (
        "import subprocess, sys; "
        "grandchild = subprocess.Popen([sys.executable, '-c', "
        "'import sys; print(flush=True); sys.stdin.read()'], "
        "stdin=subprocess.PIPE, stdout=subprocess.PIPE); grandchild.stdout.readline(); "
        "print(grandchild.pid, flush=True); sys.stdin.read(); grandchild.communicate(b'')"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=PIPE, stdout=PIPE)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= set(memory.descendants(os.getpid()))
        assert memory.pss(grandchild) > 0
        # PSS splits shared pages among every process mapping them, so another test's process
        # starting or ending moves these figures; the sum is taken on both sides of the tree's
        # figure, and a reading is kept once the two sides agree
        for _ in range(20):
            before = memory.pss(child.pid) + memory.pss(grandchild)
            tree = memory.tree_pss(child.pid)
            after = memory.pss(child.pid) + memory.pss(grandchild)
            if abs(before - after) < 1 << 16:
                break
        assert abs(tree - before) < 1 << 20  # idle: a page or so moves
    finally:
        child.communicate(b"")
    assert memory.pss(child.pid) == 0 and memory.descendants(child.pid) == []


class _Forking:
    """A main process of 10 private and 300 shared units whose one child is forked just after
    the main process's PSS is first read: each of k processes then holds 300/k of the shared
    units, so the tree is 320 however it is split."""

    def __init__(self) -> None:
        self.children: list[int] = []
        self.reads = 0

    def pss(self, pid: int) -> int:
        share = 10 + 300 // (1 + len(self.children))
        self.reads += 1
        if self.reads == 1:
            self.children = [2]  # the fork, between this read and the next
        return share

    def descendants(self, pid: int) -> list[int]:
        return list(self.children) if pid == 1 else []


def test_a_fork_while_the_tree_is_read_does_not_count_its_shared_pages_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = _Forking()
    monkeypatch.setattr(memory, "pss", tree.pss)
    monkeypatch.setattr(memory, "descendants", tree.descendants)
    assert memory.tree_pss(1) == 320  # not 310 + 160: the main process's share before the fork
