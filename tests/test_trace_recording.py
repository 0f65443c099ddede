"""Recording a trace (`executors/_observe/tracer.py`, and the workers' timings,
`executors/_timing.py`): what the tracer keeps of each batch, wait and mark, and within what
limit.

The real runs load a dataset with one known straggler (tests/_tracing.py) and check that the
trace puts it on the worker that really loaded it, at its index.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import attrs
import pytest
from _tracing import (
    BATCH_SIZE,
    STRAGGLER,
    OneStraggler,
    straggler_record,
    traced_epoch,
)
from torch.utils.data import Dataset

import statecore
from statecore.executors import LoaderStats, Trace
from statecore.executors._observe.tracer import TASK_BITS, TRACE_VARIABLE, Tracer
from statecore.executors._timing import WHOLE_BATCH


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", ["mp", "thread"])
def test_the_trace_shows_the_straggler_on_the_worker_that_loaded_it_at_its_index(
    executor: str,
) -> None:
    loader, loaded_by = traced_epoch(executor, workers=2)
    record = straggler_record(loader.trace_record())
    assert record.worker == loaded_by[STRAGGLER]
    assert record.slowest[0][0] == STRAGGLER
    assert record.slowest[0][1] >= 0.2
    assert record.seconds is not None and record.seconds >= 0.2
    stats = loader.stats()
    assert stats.stragglers[0] == record
    assert stats.slowest[0][:1] == (STRAGGLER,) and stats.slowest[0][2] == record.worker


@pytest.mark.timeout(120)
def test_every_batch_is_traced_from_sent_to_handed_over_in_order_of_time() -> None:
    loader, _ = traced_epoch("thread", workers=2)
    trace = loader.trace_record()
    assert len(trace.batches) == 48 // BATCH_SIZE
    for b in trace.batches:
        assert b.started is not None and b.finished is not None
        assert b.arrived is not None and b.handed is not None
        assert b.sent <= b.started <= b.finished <= b.arrived <= b.handed
    kinds = [mark.kind for mark in trace.marks]
    assert kinds[0] == "epoch start" and kinds[-1] == "epoch end"


@pytest.mark.timeout(60)
def test_loading_in_the_training_loops_thread_is_traced_too() -> None:
    loader, _ = traced_epoch("inline", workers=0)
    record = straggler_record(loader.trace_record())
    assert record.worker == 0 and record.slowest[0][0] == STRAGGLER
    assert "no workers (inline)" in loader.stats().verdict()


def test_the_environment_traces_loaders_made_without_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TRACE_VARIABLE, "1")
    assert statecore.DataLoader(OneStraggler(4)).trace is True
    assert statecore.DataLoader(OneStraggler(4), trace=False).trace is False
    monkeypatch.setenv(TRACE_VARIABLE, "0")
    assert statecore.DataLoader(OneStraggler(4)).trace is False


@pytest.mark.timeout(60)
def test_an_untraced_loaders_workers_send_no_timings() -> None:
    loader = statecore.DataLoader(OneStraggler(8), batch_size=4, num_workers=1, executor="thread")
    seen = []
    original = loader.executor_factory

    def spying(launch: Any) -> Any:
        executor = original(launch)
        poll = executor.poll

        def watched(timeout: float | None) -> Any:
            event = poll(timeout)
            seen.append(event)
            return event

        executor.poll = watched
        return executor

    loader.executor = spying
    list(loader)
    timings = [getattr(event, "timing", None) for event in seen]
    assert timings and all(timing is None for timing in timings)


@pytest.mark.timeout(120)
def test_each_worker_is_marked_ready_before_its_first_batch() -> None:
    loader, _ = traced_epoch("mp", workers=2)
    trace = loader.trace_record()
    ready = {mark.worker: mark.time for mark in trace.marks if mark.kind == "worker ready"}
    assert set(ready) == {0, 1}
    for worker, moment in ready.items():
        first = min(b.started for b in trace.batches if b.worker == worker and b.started)
        assert trace.start <= moment <= first


def one_worker_epoch(traced: Any, batches: int) -> Any:
    """Drive `traced` through an epoch of `batches` two-index batches on one worker, each
    asked for, drawn, sent and answered in turn; the state after it."""
    from statecore import Config, NextRequested, ResetRequested, TaskCompleted, initial_state

    state = initial_state(Config(num_workers=1, prefetch_factor=1, lazy=True))
    state, _ = traced(state, ResetRequested())
    for task in range(batches):
        state, _ = traced(state, NextRequested())
        state, _ = traced(state, statecore.IndexDrawn.fast([task, task + 100]))
        state, _ = traced(state, TaskCompleted(task, 0, task))
    return state


def test_a_tracer_keeps_at_most_its_limit_of_batches() -> None:
    from statecore import step

    tracer = Tracer(1, True, False, "inline", limit=3)
    one_worker_epoch(tracer.wrap(step), 6)
    trace = tracer.trace()
    assert [b.task for b in trace.batches] == [3, 4, 5]
    assert trace.dropped == 3


def test_reading_a_trace_mid_run_changes_nothing_of_what_a_later_read_gives() -> None:
    def records(trace: Trace) -> list[Any]:
        return [(b.task, b.worker, b.epoch, b.index, b.failed) for b in trace.batches]

    once = statecore.DataLoader(OneStraggler(), batch_size=BATCH_SIZE, trace=True)
    list(once)
    twice = statecore.DataLoader(OneStraggler(), batch_size=BATCH_SIZE, trace=True)
    iterator = iter(twice)
    mid = [next(iterator) for _ in range(5)]
    assert len(twice.trace_record().batches) >= 5 and mid
    list(iterator)
    again = twice.trace_record()
    assert records(again) == records(once.trace_record())
    assert len(again.waits) == len(once.trace_record().waits)


def test_an_event_the_scheduler_refuses_leaves_the_trace_as_without_it() -> None:
    from statecore import NextRequested, StatecoreError, TaskCompleted, step

    tracer = Tracer(1, True, False, "inline")
    traced = tracer.wrap(step)
    state = one_worker_epoch(traced, 2)
    with pytest.raises(StatecoreError):
        traced(state, TaskCompleted(77, 0, None))  # no task 77 was sent
    # The driver goes on with the state it had.
    state, _ = traced(state, NextRequested())
    state, _ = traced(state, statecore.IndexDrawn.fast([2, 102]))
    traced(state, TaskCompleted(2, 0, None))
    trace = tracer.trace()
    assert [(b.task, b.index) for b in trace.batches] == [
        (0, [0, 100]),
        (1, [1, 101]),
        (2, [2, 102]),
    ]
    assert all(b.handed is not None for b in trace.batches)


def test_a_wait_counts_as_held_back_the_time_a_later_batch_sat_ready() -> None:
    from statecore import (
        Config,
        DrawIndex,
        NextRequested,
        ResetRequested,
        TaskCompleted,
        initial_state,
        step,
    )

    now = [0.0]
    drawn = itertools.count()
    tracer = Tracer(2, True, False, "mp", clock=lambda: now[0])
    traced = tracer.wrap(step)
    state = initial_state(Config(num_workers=2, prefetch_factor=1))

    def at(moment: float, event: Any) -> None:
        nonlocal state
        now[0] = moment
        state, commands = traced(state, event)
        for command in commands:  # the sampler's indices, drawn as the scheduler asks
            if isinstance(command, DrawIndex):
                at(moment, statecore.IndexDrawn.fast(next(drawn)))

    at(0.0, ResetRequested())  # iter(): tasks 0 and 1 go out; the wait for a batch begins
    at(1.0, NextRequested())
    at(5.0, TaskCompleted(1, 1, "later batch"))  # ready at t=5, held back for the order
    at(8.0, TaskCompleted(0, 0, "first batch"))  # comes at t=8 and is handed over
    (wait,) = tracer.trace().waits
    assert (wait.asked, wait.got, wait.task) == (0.0, 8.0, 0)
    assert wait.held == 3.0  # from t=5, when task 1 was ready, to t=8


# --- how a worker times its samples -----------------------------------------------------------


class FastButFive(Dataset[int]):
    """Samples that cost nothing, except index 5, which takes 2 ms."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        if index == 5:
            time.sleep(0.002)
        return index


def a_timed_fetch() -> Any:
    from torch.utils.data.dataloader import _DatasetKind

    from statecore.executors._timing import TimedFetch

    fetcher = _DatasetKind.create_fetcher(
        _DatasetKind.Map, FastButFive(), True, lambda samples: samples, False
    )
    return TimedFetch(fetcher, map_style=True)


def test_a_workers_first_batch_is_timed_sample_by_sample() -> None:
    fetch = a_timed_fetch()
    assert fetch([0, 1, 2, 3]) == [0, 1, 2, 3]
    ((index, _),) = fetch.slowest
    assert index in (0, 1, 2, 3)


def test_samples_too_fast_to_time_one_by_one_are_timed_by_their_batch() -> None:
    fetch = a_timed_fetch()
    fetch([0, 1, 2, 3])
    assert fetch([8, 9, 10, 11]) == [8, 9, 10, 11]
    ((index, _),) = fetch.slowest
    assert index is WHOLE_BATCH  # the main process knows the batch's indices


def test_a_slow_batch_of_fast_samples_brings_back_the_time_of_each_sample() -> None:
    fetch = a_timed_fetch()
    fetch([0, 1, 2, 3])
    fetch([4, 5, 6, 7])
    ((batch, took),) = fetch.slowest
    assert batch is WHOLE_BATCH and took >= 0.002
    fetch([5, 12])  # the next batch is timed sample by sample, and finds index 5
    ((index, took),) = fetch.slowest
    assert index == 5 and took >= 0.002


class Sleepy(Dataset[int]):
    """Samples that each take at least 1 ms: every task is slower than `FAST_TASK`."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> int:
        time.sleep(0.001)
        return index


def test_every_task_slow_enough_has_its_cpu_time_read() -> None:
    loader = statecore.DataLoader(Sleepy(), batch_size=1, trace=True)
    list(loader)
    batches = loader.trace_record().batches
    assert len(batches) == 20 and all(b.cpu is not None for b in batches)


def test_fast_tasks_have_their_cpu_time_read_one_in_so_many() -> None:
    from statecore.executors._timing import CPU_SAMPLED_EVERY

    dataset = list(range(4 * CPU_SAMPLED_EVERY))
    loader = statecore.DataLoader(dataset, batch_size=1, trace=True)
    list(loader)
    batches = sorted(loader.trace_record().batches, key=lambda b: b.task)
    read = [b.task for b in batches if b.cpu is not None]
    # The first task is read; a task that was slow after all (the machine busy) has the next
    # one read too, so there may be more, never fewer.
    assert read[0] == 0 and len(read) >= 4
    assert len(read) < len(dataset)


def test_another_machines_clock_is_aligned_by_the_fastest_answer_seen() -> None:
    from statecore.executors._timing import ClockSkew

    skew = ClockSkew()
    # The worker's clock reads 1000 s ahead; answers take 3 ms, then 1 ms, to arrive.
    started, finished, cpu, slowest, ready = skew.shifted(
        (1010.0, 1010.5, 0.4, (), 1009.0), arrived=10.503
    )
    assert (started, finished, ready) == pytest.approx((10.003, 10.503, 9.003))
    assert (cpu, slowest) == (0.4, ())
    started, finished, cpu, slowest, ready = skew.shifted(
        (1011.0, 1011.5, None, ((7, 0.1),), None), arrived=11.501
    )
    assert (started, finished) == pytest.approx((11.001, 11.501))
    assert (cpu, slowest, ready) == (None, ((7, 0.1),), None)
    # A slower answer later changes nothing: the estimate keeps the fastest transit.
    assert skew.shifted((1012.0, 1012.5, 0.1, (), None), arrived=12.6)[1] == pytest.approx(12.501)


def test_a_batch_timed_whole_is_named_in_the_trace_by_its_indices() -> None:
    loader = statecore.DataLoader(FastButFive(), batch_size=4, trace=True)
    list(loader)
    batches = sorted(loader.trace_record().batches, key=lambda b: b.task)
    # The first batch is timed sample by sample; the next, of fast samples, as a whole.
    assert batches[1].slowest[0][0] == [4, 5, 6, 7]


def test_a_batch_timed_whole_costs_the_tracer_no_entry_for_its_slowest_sample() -> None:
    # Fast samples, the common case, are timed by their batch: the tracer keeps only the
    # seconds, in the batch's row, and the reader names the batch by its indices.
    loader = statecore.DataLoader(FastButFive(), batch_size=4, trace=True)
    list(loader)
    batches = loader.trace_record().batches
    one_by_one = {b.task for b in batches if not isinstance(b.slowest[0][0], list)}
    whole = {b.task for b in batches if isinstance(b.slowest[0][0], list)}
    assert one_by_one and whole
    kept = {key & ((1 << TASK_BITS) - 1) for key in loader._tracer.tasks.slowest_index}
    assert kept == one_by_one


class AnyKey(Dataset[int]):
    """Loads 0 for any key: the batches' keys are what a test looks at."""

    def __getitem__(self, key: object) -> int:
        return 0


@pytest.mark.parametrize(
    "batches",
    [
        [[3, 1, 2], [-5, 2**40], [7]],
        [["a", "b"], ["c"]],
        [[1, 2], [2**70, 4], [5]],  # a list that will not pack, after one that did
    ],
    ids=["ints", "strings", "beyond-64-bits"],
)
def test_each_batchs_indices_come_back_as_the_sampler_gave_them(batches: list[list[Any]]) -> None:
    loader = statecore.DataLoader(AnyKey(), batch_sampler=batches, trace=True)
    list(loader)
    traced = sorted(loader.trace_record().batches, key=lambda b: b.task)
    assert [b.index for b in traced] == batches


# --- long runs: what the tracer keeps and what forgetting costs -------------------------------


def traced_epochs(limit: int, epochs: int, batches: int = 1) -> tuple[Any, Tracer]:
    """An inline loader traced with `limit`, run through `epochs` epochs of `batches`."""
    from statecore.tools.trace_long_runs import traced_loader
    from statecore.tools.workloads import Indices

    loader = traced_loader(Indices(batches), limit)
    for _ in range(epochs):
        for _ in loader:
            pass
    return loader, loader._tracer


def test_many_short_epochs_keep_waits_marks_and_batches_within_the_limit() -> None:
    limit = 40
    _, tracer = traced_epochs(limit, 600)
    # Between two reads, batches, waits and marks may run a quarter of the limit over it.
    assert tracer.kept <= limit + limit // 4
    assert len(tracer.marks) <= limit + limit // 4
    assert len(tracer.tasks.got) <= limit + limit // 4
    trace = tracer.trace()
    assert 0 < len(trace.batches) <= limit
    assert 0 < len(trace.waits) <= limit
    assert 0 < len(trace.marks) <= limit
    assert len(trace.batches) + trace.dropped == 600
    assert len(trace.waits) + trace.dropped_waits == 2 * 600  # iter() and the last next()


def test_what_a_tracer_holds_stops_growing_at_its_limit_however_many_epochs() -> None:
    from statecore.tools.trace_long_runs import kept_bytes

    loader, tracer = traced_epochs(40, 400)
    at_400 = kept_bytes(tracer)
    for _ in range(1200):
        for _ in loader:
            pass
    # Nothing is kept per iterator: 1,200 more of them leave the tracer's size where it was
    # (a table per iterator added 3.7 kB each).
    assert kept_bytes(tracer) <= 1.25 * at_400


def test_forgetting_costs_a_few_steps_for_each_thing_traced_in_one_long_epoch() -> None:
    _, tracer = traced_epochs(limit=500, epochs=1, batches=20_000)
    traced = 20_000 + 20_001 + 2  # batches, waits, the epoch's start and end
    assert tracer.dropped > 15_000
    assert tracer.forget_work <= 8 * traced


def test_forgetting_costs_a_few_steps_for_each_thing_traced_over_many_epochs() -> None:
    _, tracer = traced_epochs(limit=40, epochs=2_000)
    traced = 2_000 * (1 + 2 + 3)  # a batch, two waits and three marks an epoch
    assert tracer.dropped > 1_900
    assert tracer.forget_work <= 8 * traced


def test_the_figures_of_a_long_epoch_past_the_limit_span_only_the_stretch_kept() -> None:
    _, tracer = traced_epochs(limit=100, epochs=1, batches=1_000)
    trace = tracer.trace()
    stats = trace.stats()
    # The epoch's start went with its first batches: the time counted begins with those kept.
    assert [mark.kind for mark in trace.marks] == ["epoch end"]
    assert trace.start == min(trace.batches[0].sent, trace.waits[0].asked)
    assert trace.epochs_dropped == 1
    assert stats.epochs == 1
    assert {b.epoch for b in trace.batches} == {1}
    assert stats.startup_waits == ()


def test_stats_over_a_trimmed_trace_count_what_was_forgotten_and_describe_what_was_kept() -> None:
    _, tracer = traced_epochs(limit=20, epochs=30, batches=4)
    trace = tracer.trace()
    stats = trace.stats()
    assert stats.batches == 120
    assert stats.epochs == 30
    assert stats.dropped == trace.dropped == 120 - len(trace.batches)
    # The kept batches are the last ones, numbered by the epochs they were loaded in.
    assert [(b.epoch, b.task) for b in trace.batches] == [
        (epoch, task) for epoch in range(31 - len(trace.batches) // 4, 31) for task in range(4)
    ][-len(trace.batches) :]
    # Per kept epoch start, one wait for its first batch; the figures cover the kept stretch.
    assert len(stats.startup_waits) == sum(1 for m in trace.marks if m.kind == "epoch start")
    assert stats.seconds == trace.end - trace.start
    assert f"forgot the {stats.dropped} before them" in stats.verdict()
    assert stats.verdict().startswith("120 batches in 30 epochs; no workers (inline)")


@pytest.mark.timeout(120)
def test_a_tracers_figures_from_its_tables_are_those_of_its_traces_records() -> None:
    # Two epochs with two workers and a straggler each, past a limit: every figure has
    # something to count (stragglers, slowest samples, idle workers, forgotten batches).
    loader = statecore.DataLoader(
        OneStraggler(), batch_size=BATCH_SIZE, num_workers=2, executor="thread", trace=True
    )
    loader._tracer = tracer = Tracer(2, loader.in_order, False, "thread", limit=20)
    for _ in range(2):
        for _ in loader:
            pass
    trace = tracer.trace()
    stats = tracer.stats()
    assert stats.dropped > 0 and stats.stragglers and stats.slowest
    assert stats == LoaderStats.of(trace)
    assert attrs.evolve(loader.stats(), counters=None) == stats
