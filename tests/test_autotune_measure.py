"""What `num_workers="auto"` measures of the cores (executors/_autotune.py): the CPU time of
the loader's processes, and the time they waited in the run queue for a core, which on a
shared machine is the part of what they asked for that they were not given."""

from __future__ import annotations

import os
import threading

import pytest

from statecore.executors import _autotune as autotune


def test_the_cores_used_and_waited_for_are_counted_over_the_processes_in_both_readings() -> None:
    began = {1: (10.0, 1.0), 2: (5.0, 0.5), 3: (7.0, 0.0)}  # 3 stopped before the end
    ended = {1: (10.5, 1.5), 2: (5.3, 1.2), 4: (0.2, 0.2)}  # 4 started after the beginning
    cpu, queued = autotune._cores_used(began, ended, seconds=0.5)
    assert cpu == pytest.approx(1.6)  # (0.5 + 0.3) / 0.5
    assert queued == pytest.approx(2.4)  # (0.5 + 0.7) / 0.5


def test_a_run_queue_delay_not_read_leaves_the_queue_unmeasured_and_the_cpu_measured() -> None:
    began = {1: (10.0, 1.0), 2: (5.0, None)}
    ended = {1: (10.5, 1.5), 2: (5.3, None)}
    assert autotune._cores_used(began, ended, seconds=0.5) == (pytest.approx(1.6), None)


def test_nothing_is_measured_without_two_readings() -> None:
    assert autotune._cores_used(None, {1: (1.0, 0.0)}, seconds=0.5) == (None, None)


class _Threads:
    """An executor whose workers are threads of this process (as `executor="thread"`)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []


@pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"), reason="the kernel keeps no schedstat"
)
def test_each_thread_of_this_process_is_read_with_its_run_queue_delay() -> None:
    # By thread id: a worker thread that ends between two readings is left out of both,
    # rather than taking its whole life's CPU time out of the window.
    used = autotune._cpu_seconds(_Threads())
    assert used is not None
    assert threading.get_native_id() in used
    cpu, waited = used[threading.get_native_id()]
    assert cpu > 0
    assert waited is not None and waited >= 0
