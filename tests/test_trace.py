"""Tracing a loader: the trace, the verdict, the Chrome/Perfetto file, the timeline, `profile`.

The real runs load a dataset with one known straggler (dataset index 37, a sample that takes
far longer than the others) and check that the trace puts it on the worker that really loaded
it, at its index, and that the verdict names it. Which worker loaded it comes from the
dataset itself (`get_worker_info`), not from the trace. The verdict's suggestions are checked
on made-up traces, so that no test depends on this machine's speed.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from torch.utils.data import Dataset, get_worker_info

import statecore
from statecore.executors import LoaderStats, Trace
from statecore.executors._observe.trace import BatchRecord, Moment, Wait
from statecore.executors._observe.tracer import TRACE_VARIABLE, Tracer
from statecore.executors._timing import WHOLE_BATCH
from statecore.tools.timeline import draw_timeline

STRAGGLER = 37
BATCH_SIZE = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parent.parent


class OneStraggler(Dataset[tuple[int, int]]):
    """48 samples; sample 37 waits until `released` is set or 0.2 s pass, the others 1 ms.
    Each sample is (its index, the id of the worker that loaded it, -1 in the main process)."""

    def __init__(self, size: int = 48) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int]:
        time.sleep(0.2 if index == STRAGGLER else 0.001)
        info = get_worker_info()
        return index, -1 if info is None else info.id


def traced_epoch(executor: str, workers: int, **options: Any) -> tuple[Any, dict[int, int]]:
    """One traced epoch; the loader and which worker loaded each sample, as the dataset saw."""
    loader = statecore.DataLoader(
        OneStraggler(),
        batch_size=BATCH_SIZE,
        num_workers=workers,
        executor=executor,
        trace=True,
        **options,
    )
    loaded_by = {}
    for indices, worker_ids in loader:
        for index, worker in zip(indices.tolist(), worker_ids.tolist(), strict=True):
            loaded_by[index] = worker
    return loader, loaded_by


def straggler_record(trace: Trace) -> BatchRecord:
    (record,) = [b for b in trace.batches if STRAGGLER in list(b.index)]
    return record


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


@pytest.mark.timeout(120)
def test_the_verdict_names_the_straggler_by_its_dataset_index() -> None:
    loader, loaded_by = traced_epoch("thread", workers=2)
    verdict = loader.stats().verdict()
    assert f"index {STRAGGLER}:" in verdict
    assert f"worker {loaded_by[STRAGGLER]}" in verdict
    assert "straggler batch" in verdict


@pytest.mark.timeout(60)
def test_loading_in_the_training_loops_thread_is_traced_too() -> None:
    loader, _ = traced_epoch("inline", workers=0)
    record = straggler_record(loader.trace_record())
    assert record.worker == 0 and record.slowest[0][0] == STRAGGLER
    assert "no workers (inline)" in loader.stats().verdict()


# --- Chrome's trace event format ----------------------------------------------------------------

PHASES_WITH_DURATION = {"X"}
INSTANT_SCOPES = {"g", "p", "t"}


def format_problems(document: Any) -> list[str]:
    """What breaks the rules of Chrome's trace event format (JSON object form), as Perfetto
    and chrome://tracing read it; empty if nothing does."""
    problems = []
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return ["the top level must be an object with a traceEvents list"]
    if document.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append("displayTimeUnit must be ms or ns")
    for number, event in enumerate(document["traceEvents"]):
        where = f"event {number} ({event.get('name')!r})"
        if not isinstance(event.get("name"), str):
            problems.append(f"{where}: name must be a string")
        phase = event.get("ph")
        if phase not in {"X", "B", "E", "i", "I", "M", "C"}:
            problems.append(f"{where}: unknown phase {phase!r}")
        for key in ("pid", "tid"):
            if not isinstance(event.get(key), int):
                problems.append(f"{where}: {key} must be an integer")
        if phase != "M":
            ts = event.get("ts")
            if not isinstance(ts, (int, float)) or ts < 0:
                problems.append(f"{where}: ts must be a number of microseconds, not negative")
        if phase in PHASES_WITH_DURATION:
            dur = event.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"{where}: a complete event needs a duration of 0 or more")
        if phase == "i" and event.get("s", "t") not in INSTANT_SCOPES:
            problems.append(f"{where}: an instant event's scope must be g, p or t")
        if phase == "M" and not isinstance(event.get("args"), dict):
            problems.append(f"{where}: a metadata event needs args")
        if "args" in event and not isinstance(event["args"], dict):
            problems.append(f"{where}: args must be an object")
    return problems


def test_the_format_check_catches_what_breaks_the_format() -> None:
    assert format_problems({"events": []})
    bad = {"traceEvents": [{"name": "x", "ph": "X", "pid": 1, "tid": 1, "ts": -1.0}]}
    assert len(format_problems(bad)) == 2  # negative ts, no duration


@pytest.mark.timeout(120)
def test_the_chrome_trace_follows_the_format_and_puts_the_straggler_on_its_workers_track(
    tmp_path: Path,
) -> None:
    loader, loaded_by = traced_epoch("mp", workers=2)
    path = loader.trace_record().write_chrome(tmp_path / "loader.trace.json")
    document = json.loads(path.read_text())
    assert format_problems(document) == []
    names = {
        (event["tid"], event["args"]["name"])
        for event in document["traceEvents"]
        if event["name"] == "thread_name"
    }
    assert names == {(0, "consumer (training loop)"), (1, "worker 0"), (2, "worker 1")}
    (straggler,) = [e for e in document["traceEvents"] if e.get("cat") == "straggler"]
    assert straggler["tid"] == loaded_by[STRAGGLER] + 1
    assert straggler["args"]["slowest_samples"][0]["index"] == STRAGGLER
    waits = [e for e in document["traceEvents"] if e.get("cat") == "wait"]
    assert waits and all(e["tid"] == 0 for e in waits)


@pytest.mark.timeout(120)
def test_the_timeline_is_a_png(tmp_path: Path) -> None:
    loader, _ = traced_epoch("thread", workers=2)
    path = draw_timeline(loader.trace_record(), tmp_path / "timeline.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


# --- switching it on ------------------------------------------------------------------------------


def test_an_untraced_loader_says_how_to_trace_it() -> None:
    loader = statecore.DataLoader(OneStraggler(4), batch_size=2)
    assert loader.trace is False
    with pytest.raises(RuntimeError, match="trace=True, or set STATECORE_TRACE=1"):
        loader.trace_record()
    assert "trace=True, or STATECORE_TRACE=1" in loader.stats().verdict()


# --- stats() always answers: the scheduler's counters, traced or not ----------------------------


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


# --- the verdict's suggestions, on made-up traces -------------------------------------------------


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


class Written:
    """A stand-in stdout or stderr that keeps what is written to it; a terminal if told so."""

    def __init__(self, terminal: bool = False) -> None:
        self.text = ""
        self.terminal = terminal

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.terminal


# --- python -m statecore profile ----------------------------------------------------------------

SCRIPT = f"""
import sys, time
import torch
from torch.utils.data import Dataset
from statecore import DataLoader

class Samples(Dataset):
    def __len__(self):
        return 32
    def __getitem__(self, index):
        time.sleep(0.15 if index == {STRAGGLER - 16} else 0.001)
        return index

if __name__ == "__main__":
    for batch in DataLoader(Samples(), batch_size=4, num_workers=2):
        pass
    print("arguments", sys.argv[1:])
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.timeout(180)
def test_profile_runs_the_script_with_its_arguments_and_writes_three_outputs_per_loader(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment.pop(TRACE_VARIABLE, None)
    done = subprocess.run(
        [sys.executable, "-m", "statecore", "profile", "--out", str(out), str(script), "3"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=170,
    )
    assert done.returncode == 3, done.stderr  # the script's own exit status
    assert "arguments ['3']" in done.stdout
    assert sorted(path.name for path in out.iterdir()) == [
        "loader-0.timeline.png",
        "loader-0.trace.json",
        "loader-0.verdict.txt",
    ]
    assert format_problems(json.loads((out / "loader-0.trace.json").read_text())) == []
    verdict = (out / "loader-0.verdict.txt").read_text()
    assert f"index {STRAGGLER - 16}:" in verdict
    assert verdict in done.stdout + "\n"


FORKING_SCRIPT = """
import os, sys
from statecore import DataLoader

for batch in DataLoader(range(8), batch_size=2):  # loader-0, traced in both after the fork
    pass
child = os.fork()
if child == 0:
    for batch in DataLoader(range(12), batch_size=2):  # the child's own loader
        pass
    print("child done", flush=True)
    sys.exit(0)  # through runpy and the profiler, as a script's end is
_, status = os.waitpid(child, 0)  # the child has ended, and written, before the parent does
print("child status", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.timeout(180)
def test_profile_writes_only_for_the_profiled_process_not_for_a_child_it_forks(
    tmp_path: Path,
) -> None:
    script = tmp_path / "forks.py"
    script.write_text(FORKING_SCRIPT)
    out = tmp_path / "out"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment.pop(TRACE_VARIABLE, None)
    done = subprocess.run(
        [sys.executable, "-m", "statecore", "profile", "--out", str(out), str(script)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr
    assert "child done" in done.stdout and "child status 0" in done.stdout
    assert sorted(path.name for path in out.iterdir()) == [
        "loader-0.timeline.png",
        "loader-0.trace.json",
        "loader-0.verdict.txt",
    ]
    assert done.stdout.count("== loader-") == 1, done.stdout
    assert "4 batches" in (out / "loader-0.verdict.txt").read_text()


@pytest.mark.timeout(60)
def test_profile_says_so_when_the_script_makes_no_statecore_loader(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("print('no loader here')\n")
    from statecore.tools.profile import profile

    errors = Written()
    assert profile(str(script), (), tmp_path / "out", Written(), errors) == 1  # type: ignore[arg-type]
    assert "made no statecore DataLoader" in errors.text


def test_profile_refuses_a_script_that_is_not_there(tmp_path: Path) -> None:
    from statecore.tools.profile import profile

    assert profile(str(tmp_path / "missing.py"), (), tmp_path / "out") == 2


# --- how a worker times its samples ---------------------------------------------------------------


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


SLOW_SCRIPT = """
import time
from torch.utils.data import Dataset
from statecore import DataLoader

class Samples(Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, index):
        time.sleep(0.05)
        return index

for batch in DataLoader(Samples(), batch_size=2, num_workers=2, executor="thread"):
    pass
"""


def profile_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: Any) -> str:
    """Profile SLOW_SCRIPT with stderr a terminal outside CI; what went to stderr."""
    from statecore.tools.profile import profile

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SCRIPT)
    errors = Written(terminal=True)
    status = profile(str(script), (), tmp_path / "out", Written(), errors, **options)  # type: ignore[arg-type]
    assert status == 0
    return errors.text


@pytest.mark.timeout(120)
def test_profile_on_a_terminal_counts_the_batches_traced_on_a_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = profile_on_a_terminal(tmp_path, monkeypatch)
    assert "profile: 1 loader" in shown and "batch" in shown


@pytest.mark.timeout(120)
def test_profile_with_no_progress_draws_no_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "profile: 1 loader" not in profile_on_a_terminal(
        tmp_path, monkeypatch, progress_bar=False
    )


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


def test_the_cpu_share_is_taken_over_the_batches_whose_cpu_time_was_read() -> None:
    trace = made_up()
    unread = tuple(attrs.evolve(b, cpu=None) if b.task % 2 else b for b in trace.batches)
    assert attrs.evolve(trace, batches=unread).stats().cpu_share == pytest.approx(0.9)
    assert trace.stats().cpu_share == pytest.approx(0.9)


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


@pytest.mark.timeout(60)
def test_the_cost_tool_times_a_workload_with_tracing_off_and_on_in_turns() -> None:
    from statecore.tools.trace_cost import compare
    from statecore.tools.workloads import select

    cost = compare(select(["inline-b1"])[0].resized(20), rounds=2)
    assert len(cost.off) == len(cost.on) == 2
    assert all(ratio > 0 for ratio in cost.ratios)
    assert cost.describe().startswith("inline-b1: off ")
    assert "95% interval" in cost.describe()


def test_the_cost_tools_interval_holds_the_median_within_the_rounds_seen() -> None:
    from statecore.tools.trace_cost import median_interval

    ratios = [1.02, 1.11, 0.97, 1.08, 1.05, 1.31, 1.04, 0.99, 1.07]
    low, high = median_interval(ratios)
    assert min(ratios) <= low <= statistics.median(ratios) <= high <= max(ratios)
    assert median_interval(ratios) == (low, high)  # seeded: the same rounds, the same interval


def test_the_cost_tools_interval_narrows_as_rounds_are_added() -> None:
    from statecore.tools.trace_cost import median_interval

    draw = random.Random(7)
    few = [draw.gauss(1.07, 0.05) for _ in range(9)]
    many = few + [draw.gauss(1.07, 0.05) for _ in range(391)]
    few_low, few_high = median_interval(few)
    many_low, many_high = median_interval(many)
    assert many_high - many_low < (few_high - few_low) / 2
    assert many_low < 1.07 < many_high


def test_the_cost_tools_interval_refuses_no_rounds() -> None:
    from statecore.tools.trace_cost import median_interval

    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_the_cost_tools_interval_refuses_a_confidence_outside_0_to_1() -> None:
    from statecore.tools.trace_cost import median_interval

    with pytest.raises(ValueError, match="between 0 and 1"):
        median_interval([1.0, 1.1], confidence=1.0)


@pytest.mark.timeout(120)
def test_each_worker_is_marked_ready_before_its_first_batch() -> None:
    loader, _ = traced_epoch("mp", workers=2)
    trace = loader.trace_record()
    ready = {mark.worker: mark.time for mark in trace.marks if mark.kind == "worker ready"}
    assert set(ready) == {0, 1}
    for worker, moment in ready.items():
        first = min(b.started for b in trace.batches if b.worker == worker and b.started)
        assert trace.start <= moment <= first


# --- long runs: what the tracer keeps and what forgetting costs ---------------------------------


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


def test_the_long_runs_tool_prints_each_quarter_and_the_goals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from statecore.tools.trace_long_runs import main

    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    for shape in ("long:", "epochs:", "epochs-small:"):
        assert shape in out
    assert out.count("quarter 4:") == 3
    assert out.count("stats() took") == 3
    assert "last 2,000 batches / first 2,000:" in out


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
