"""Reading a trace (`executors/_observe/trace.py`): `Trace`, `LoaderStats` and its counters
(`DataLoader.stats()` answers traced or not), and the verdict in words. The verdict's
suggestions are checked on made-up traces, so that no test depends on this machine's speed.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from _tracing import (
    STRAGGLER,
    OneStraggler,
    traced_epoch,
)

import statecore
from statecore.executors import Trace
from statecore.executors._observe.trace import BatchRecord, Moment, Wait


@pytest.mark.timeout(120)
def test_the_verdict_names_the_straggler_by_its_dataset_index() -> None:
    loader, loaded_by = traced_epoch("thread", workers=2)
    verdict = loader.stats().verdict()
    assert f"index {STRAGGLER}:" in verdict
    assert f"worker {loaded_by[STRAGGLER]}" in verdict
    assert "straggler batch" in verdict


def test_an_untraced_loader_says_how_to_trace_it() -> None:
    loader = statecore.DataLoader(OneStraggler(4), batch_size=2)
    assert loader.trace is False
    with pytest.raises(RuntimeError, match="trace=True, or set STATECORE_TRACE=1"):
        loader.trace_record()
    assert "trace=True, or STATECORE_TRACE=1" in loader.stats().verdict()


# --- stats() always answers: the scheduler's counters, traced or not --------------------------


def test_an_untraced_loaders_stats_count_what_its_scheduler_handed_over_so_far() -> None:
    loader = statecore.DataLoader(list(range(8)), batch_size=2)
    batches = iter(loader)
    next(batches), next(batches), next(batches)
    stats = loader.stats()
    assert stats.traced is False
    assert stats.counters is not None
    assert (stats.counters.epoch, stats.counters.phase) == (1, statecore.Phase.RUNNING)
    assert stats.counters.handed_over == 3
    assert stats.counters.waiting is False
    # Nothing traced: no figures, and the verdict says so and what to do.
    assert (stats.batches, stats.seconds, stats.busy) == (0, 0.0, ())
    assert stats.verdict().startswith("Not traced; no workers (inline)")
    assert "3 handed over" in stats.verdict()


def test_a_loader_not_iterated_yet_has_stats_that_say_so() -> None:
    stats = statecore.DataLoader(list(range(8)), batch_size=2, num_workers=2).stats()
    assert stats.counters is not None
    assert (stats.counters.epoch, stats.counters.phase) == (0, None)
    assert stats.counters.tasks_per_worker == (0, 0)
    assert "Not iterated yet." in stats.verdict()


@pytest.mark.timeout(120)
def test_the_counters_of_a_finished_epoch_outlive_its_iterator() -> None:
    loader = statecore.DataLoader(list(range(8)), batch_size=2, num_workers=2, executor="thread")
    assert len(list(loader)) == 4
    counters = loader.stats().counters
    assert counters is not None
    assert (counters.epoch, counters.handed_over, counters.in_flight) == (1, 4, 0)


@pytest.mark.timeout(120)
def test_the_counters_hold_each_workers_tasks_not_yet_handed_over() -> None:
    loader = statecore.DataLoader(
        list(range(16)), batch_size=2, num_workers=2, executor="thread", prefetch_factor=2
    )
    batches = iter(loader)
    next(batches)
    counters = loader.stats().counters
    assert counters is not None
    assert len(counters.tasks_per_worker) == 2
    assert sum(counters.tasks_per_worker) == counters.in_flight + counters.buffered > 0
    assert counters.workers == (statecore.WorkerStatus.ACTIVE,) * 2
    del batches


def test_a_traced_loaders_stats_carry_the_counters_beside_the_figures() -> None:
    loader = statecore.DataLoader(list(range(8)), batch_size=2, trace=True)
    assert len(list(loader)) == 4
    stats = loader.stats()
    assert stats.traced is True
    assert stats.batches == 4
    assert stats.counters is not None
    assert stats.counters.handed_over == 4


# --- the verdict's suggestions, on made-up traces ---------------------------------------------


def made_up(
    *,
    in_order: bool = True,
    persistent: bool = False,
    executor: str = "mp",
    cpu: float = 0.009,
    waits: tuple[tuple[float, float, int], ...] = (),
    batches: tuple[BatchRecord, ...] | None = None,
    epochs: tuple[float, ...] = (0.0,),
) -> Trace:
    """Two workers; by default each loads five 10 ms batches back to back from t=0.01."""
    if batches is None:
        made = []
        for task in range(10):
            worker, turn = task % 2, task // 2
            start = 0.01 + 0.01 * turn
            made.append(
                BatchRecord(
                    task,
                    worker,
                    1,
                    [task],
                    0.0,
                    start,
                    start + 0.01,
                    start + 0.0101,
                    start + 0.0102,
                    cpu,
                    (((task), 0.01),),
                )
            )
        batches = tuple(made)
    marks = tuple(Moment(t, "epoch start", None, f"epoch {n + 1}") for n, t in enumerate(epochs))
    return Trace(
        num_workers=2,
        in_order=in_order,
        persistent_workers=persistent,
        executor=executor,
        batches=batches,
        waits=tuple(Wait(asked, got, task) for asked, got, task in waits),
        marks=marks,
    )


def test_a_loop_that_hardly_waits_is_told_loading_is_not_what_holds_it_back() -> None:
    trace = made_up(waits=((0.0, 0.0005, 0),))
    stats = trace.stats()
    assert stats.suggestions() == ()
    assert "loading is not what holds it back" in stats.verdict()


def test_busy_workers_whose_samples_wait_are_told_to_add_workers() -> None:
    trace = made_up(waits=((0.0, 0.03, 0),), cpu=0.0005)
    (tip, *_) = trace.stats().suggestions()
    assert tip.startswith("more workers (num_workers=2 now)")


def test_samples_that_wait_in_worker_processes_are_told_about_threads() -> None:
    trace = made_up(waits=((0.0, 0.03, 0),), cpu=0.0005)
    assert any(tip.startswith('executor="thread"') for tip in trace.stats().suggestions())
    computing = made_up(waits=((0.0, 0.03, 0),), cpu=0.0095)
    assert not any(tip.startswith('executor="thread"') for tip in computing.stats().suggestions())


def test_workers_idle_behind_another_workers_slow_batch_are_told_in_order_false() -> None:
    # Worker 1's task 1 takes 100 ms; worker 0 finishes task 0 and task 2, then sits idle with
    # them ready (its prefetch full) while the loop waits for task 1.
    batches = (
        BatchRecord(0, 0, 1, [0], 0.0, 0.0, 0.01, 0.01, 0.011, 0.001),
        BatchRecord(1, 1, 1, [1], 0.0, 0.0, 0.10, 0.10, 0.101, 0.001),
        BatchRecord(2, 0, 1, [2], 0.0, 0.01, 0.02, 0.02, 0.102, 0.001),
        BatchRecord(3, 1, 1, [3], 0.0, 0.10, 0.11, 0.11, 0.112, 0.001),
        BatchRecord(4, 0, 1, [4], 0.011, 0.10, 0.11, 0.11, 0.113, 0.001),
    )
    trace = made_up(batches=batches, waits=((0.0, 0.011, 0), (0.011, 0.101, 1)))
    stats = trace.stats()
    assert stats.idle_behind_order == pytest.approx(0.08)  # worker 0, from 0.02 to 0.10
    assert any(tip.startswith("in_order=False") for tip in stats.suggestions())
    out_of_order = made_up(
        batches=batches, waits=((0.0, 0.011, 0), (0.011, 0.101, 1)), in_order=False
    )
    assert not any(tip.startswith("in_order") for tip in out_of_order.stats().suggestions())


def test_epochs_that_wait_for_new_workers_are_told_persistent_workers() -> None:
    second = 1.0
    later = tuple(
        BatchRecord(
            10 + t,
            t % 2,
            2,
            [t],
            second,
            second + 0.05,
            second + 0.06,
            second + 0.06,
            second + 0.061,
            0.009,
        )
        for t in range(2)
    )
    trace = made_up(
        epochs=(0.0, second),
        batches=made_up().batches + later,
        waits=((0.0, 0.0202, 0), (second, second + 0.061, 10)),
    )
    tips = trace.stats().suggestions()
    assert any(tip.startswith("persistent_workers=True") for tip in tips)
    kept = attrs_evolve(trace, persistent_workers=True)
    assert not any(tip.startswith("persistent") for tip in kept.stats().suggestions())


def attrs_evolve(trace: Trace, **changes: Any) -> Trace:
    import attrs

    return attrs.evolve(trace, **changes)


def test_the_cpu_share_is_taken_over_the_batches_whose_cpu_time_was_read() -> None:
    trace = made_up()
    unread = tuple(attrs.evolve(b, cpu=None) if b.task % 2 else b for b in trace.batches)
    assert attrs.evolve(trace, batches=unread).stats().cpu_share == pytest.approx(0.9)
    assert trace.stats().cpu_share == pytest.approx(0.9)
