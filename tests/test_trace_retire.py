"""Workers retired and added back mid-epoch (`Driver.retire`, `Driver.add`), as the tracer, the
Chrome trace, `stats()` and the verdict show them: when each was retired, holding which tasks,
when it stopped, when its slot was added back and when the new incarnation started; the
retired incarnation's track ends with its stop and the new one's begins with its start.

The tracer is driven by hand through the real core first (a clock that ticks once a reading),
then traced on a real loader (threads) retired and added back through its driver.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _datasets import Numbers
from _tracing import format_problems

import statecore
from statecore import (
    AddRequested,
    Config,
    IndexDrawn,
    NextRequested,
    ResetRequested,
    RetireRequested,
    SamplerExhausted,
    State,
    TaskCompleted,
    WorkerDied,
    WorkerStarted,
    WorkerStatus,
    initial_state,
    step,
)
from statecore.executors import Trace
from statecore.executors._observe.trace import RetiredWorker
from statecore.executors._observe.tracer import Tracer

_TWO = Config(num_workers=2, prefetch_factor=1)


def _tracer() -> Tracer:
    times = iter(float(t) for t in range(1000))
    return Tracer(2, True, False, "thread", clock=lambda: next(times))


def _feed(watched: Any, state: State, *events: Any) -> State:
    for event in events:
        state = watched(state, event).state
    return state


def _done(task: int, worker: int, incarnation: int = 0) -> TaskCompleted:
    """`worker`'s answer to `task`, with a timing (the worker's clock: a made-up one, late
    enough to follow every moment of the scheduler's up to it)."""
    timing = (100.0 + task, 100.5 + task, None, (), None)
    return TaskCompleted(task, worker, "data", timing=timing, incarnation=incarnation)


def _retired_and_added(tracer: Tracer) -> Trace:
    """Two workers, one task each; worker 1 retired holding task 1, stopped once it answered
    it, added back as incarnation 1, which starts and loads task 3; then the epoch ends."""
    watched = tracer.wrap(step)
    state = _feed(
        watched,
        initial_state(_TWO),
        ResetRequested(),
        IndexDrawn.fast([0]),
        IndexDrawn.fast([1]),
        NextRequested(),
        _done(0, 0),
        IndexDrawn.fast([2]),
        RetireRequested(1),
        NextRequested(),
        _done(1, 1),  # its last task: it is stopped
        AddRequested(1),
        NextRequested(),
        WorkerStarted(1, 1),  # it takes turns once started: task 3 is drawn for it
        _done(2, 0),
        IndexDrawn.fast([3]),
        _done(3, 1, incarnation=1),
        NextRequested(),
        SamplerExhausted(),
        NextRequested(),
    )
    assert state.life.added == 1 and state.life.workers == (WorkerStatus.STOPPED,) * 2
    return tracer.trace()


def test_the_trace_lists_a_retirement_with_its_stop_and_its_slots_return() -> None:
    trace = _retired_and_added(_tracer())
    (retired,) = trace.retirements
    assert (retired.worker, retired.incarnation, retired.held) == (1, 0, (1,))
    assert retired.stopped is not None and retired.added is not None
    assert retired.started is not None and not retired.lapsed
    assert retired.at < retired.stopped < retired.added < retired.started
    assert retired.back and (trace.retired, trace.added) == (1, 1)
    # The slot's batches before its retirement are incarnation 0's, the one after it 1's.
    by_task = {b.task: b for b in trace.batches}
    assert (by_task[1].worker, by_task[1].incarnation) == (1, 0)
    assert (by_task[3].worker, by_task[3].incarnation) == (1, 1)
    assert by_task[3].sent >= retired.started
    assert trace.losses == () and trace.restarts == 0  # an add is no restart


def test_a_worker_retired_holding_nothing_stops_as_it_is_retired() -> None:
    tracer = _tracer()
    watched = tracer.wrap(step)
    _feed(
        watched,
        initial_state(_TWO),
        ResetRequested(),
        IndexDrawn.fast([0]),
        IndexDrawn.fast([1]),
        NextRequested(),
        TaskCompleted(0, 0, "a"),
        IndexDrawn.fast([2]),
        NextRequested(),
        TaskCompleted(1, 1, "b"),
        SamplerExhausted(),
        RetireRequested(1),  # it holds nothing now
    )
    (retired,) = tracer.trace().retirements
    assert retired.held == () and retired.stopped == retired.at
    assert retired.added is None and not retired.back
    assert "worker 1 retired holding 0 tasks; stopped at once" in retired.describe()


def test_a_retiring_worker_lost_before_it_stops_is_shown_replaced() -> None:
    config = Config(num_workers=2, prefetch_factor=1, restarts=1)
    tracer = _tracer()
    watched = tracer.wrap(step)
    state = _feed(
        watched,
        initial_state(config),
        ResetRequested(),
        IndexDrawn.fast([0]),
        IndexDrawn.fast([1]),
        RetireRequested(1),
        WorkerDied(1, pid=7, exitcode=-9),
    )
    assert state.life.workers[1] is WorkerStatus.STARTING  # replaced, as a running worker
    trace = tracer.trace()
    (retired,) = trace.retirements
    assert retired.lapsed and retired.stopped is None
    assert retired.describe().endswith("lost before it stopped, and replaced")
    (lost,) = trace.losses
    assert lost.worker == 1 and lost.restarted


def test_the_chrome_trace_ends_the_retired_track_and_begins_the_added_ones() -> None:
    trace = _retired_and_added(_tracer())
    (retired,) = trace.retirements
    chrome = json.loads(json.dumps(trace.chrome()))
    assert format_problems(chrome) == []
    events = chrome["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    old = next(t for t, n in names.items() if n == "worker 1 (incarnation 0)")
    new = next(t for t, n in names.items() if n == "worker 1 (incarnation 1)")
    assert names[1] == "worker 0"  # the slot that was not retired keeps its one track
    (retiring,) = [e for e in events if e["name"] == "worker retiring"]
    assert retiring["tid"] == old and retiring["ph"] == "i"
    assert retiring["args"] == {"worker": 1, "incarnation": 0, "tasks_held": [1]}
    (stopped,) = [e for e in events if e["name"] == "worker retired (stopped)"]
    assert stopped["tid"] == old and stopped["ts"] > retiring["ts"]
    (starting,) = [e for e in events if e["name"].startswith("starting (added back")]
    assert starting["tid"] == new and starting["ph"] == "X"
    assert starting["args"] == {"worker": 1, "incarnation": 1}
    (started,) = [e for e in events if e["name"] == "worker started"]
    assert started["tid"] == new and started["ts"] == starting["ts"] + starting["dur"]
    assert retired.started is not None  # the slice runs from the add to the start
    # Every batch lies on a named track: the added incarnation's on its own.
    batches = [e for e in events if e.get("cat") == "batch"]
    assert {e["tid"] for e in batches} <= set(names)
    assert [e["args"]["task"] for e in batches if e["tid"] == new] == [3]
    assert all(e["ts"] >= started["ts"] for e in batches if e["tid"] == new)


def test_stats_and_the_verdict_count_retirements_and_returns() -> None:
    stats = _retired_and_added(_tracer()).stats()
    assert (stats.retired, stats.added) == (1, 1)
    verdict = stats.verdict()
    assert "1 worker(s) retired, 1 added back:" in verdict
    assert "- worker 1 retired holding 1 task; stopped 2.00 s later; added back 1.00 s" in verdict
    assert "as incarnation 1, started" in verdict


# --- a real loader, retired and added back through its driver -------------------------------


def _run(trace: bool) -> tuple[statecore.DataLoader[Any], list[Any], Any]:
    """A thread loader's epoch, worker 1 retired after 3 batches and added back 4 after its
    stop (it takes turns again once started, so the epoch leaves it batches to load); the
    loader, the batches and the driver."""
    loader = statecore.DataLoader(
        Numbers(200), batch_size=2, num_workers=3, prefetch_factor=2, executor="thread", trace=trace
    )
    iterator = iter(loader)
    driver = iterator._driver  # type: ignore[attr-defined]
    got = [next(iterator) for _ in range(3)]
    driver.retire(1)
    while driver.state.life.workers[1] is not WorkerStatus.STOPPED:
        got.append(next(iterator))
    got += [next(iterator) for _ in range(4)]
    driver.add(1)
    got += list(iterator)
    return loader, got, driver


@pytest.mark.timeout(120)
def test_a_real_loaders_trace_shows_its_worker_retired_and_added_back() -> None:
    loader, got, _ = _run(trace=True)
    assert len(got) == 100
    trace = loader.trace_record()
    (retired,) = trace.retirements
    assert isinstance(retired, RetiredWorker)
    assert (retired.worker, retired.incarnation) == (1, 0)
    assert retired.stopped is not None and retired.added is not None
    assert retired.started is not None
    assert retired.at <= retired.stopped <= retired.added <= retired.started
    later = [b for b in trace.batches if b.worker == 1 and b.sent > retired.added]
    assert later and all(b.incarnation == 1 for b in later)
    stats = loader.stats()
    assert (stats.retired, stats.added) == (1, 1)
    assert stats.counters is not None and stats.counters.added == 1
    assert "1 worker(s) retired, 1 added back:" in stats.verdict()
    assert format_problems(trace.chrome()) == []


@pytest.mark.timeout(120)
def test_the_counters_count_a_slot_added_back_untraced() -> None:
    loader, got, driver = _run(trace=False)
    assert len(got) == 100
    counters = loader.stats().counters
    assert counters is not None and counters.added == 1
    assert "1 retired worker(s) added back." in loader.stats().verdict()
    del driver
