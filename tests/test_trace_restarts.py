"""Restarts and hangs, as the tracer, the Chrome trace, `stats()` and the flight recorder show
them: a worker process lost mid-epoch (killed, or stuck past `worker_timeout`) and replaced in
its slot (`worker_restarts`) is recorded with its pid and how it ended (a hang with its stack),
its track ends where it was lost and its replacement's starts where it started, the tasks it
held are shown sent again and timed from the re-send, and a flight file of the run replays.

The faults are the datasets' own doing, once: a marker file in the test's directory tells the
replacement not to do it again. The hang is `threading.Event().wait()`, the dataset's behaviour
under test, not a synchronisation.
"""

from __future__ import annotations

import io
import json
import re
import signal
import sysconfig
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from _datasets import DiesAt
from torch.utils.data import Dataset

import statecore
from statecore import (
    Config,
    IndexDrawn,
    NextRequested,
    Pending,
    ReplaceWorker,
    ResetRequested,
    SendTask,
    TaskCompleted,
    TaskFailed,
    WorkerDeath,
    WorkerDied,
    WorkerHang,
    WorkerRestartedWarning,
    WorkerStarted,
    WorkerStatus,
    WorkerStuck,
    initial_state,
    step,
)
from statecore.executors._observe import flight
from statecore.executors._observe.flight import DIR_VARIABLE, FlightRecorder, strip_state
from statecore.executors._observe.flightfile import decode, encode, from_json, to_json
from statecore.executors._observe.trace import stuck_at
from statecore.executors._observe.tracer import Tracer
from statecore.tools.replay import replay_file

pytestmark = pytest.mark.timeout(120)

LOST = 5
"""The index whose first load loses its worker."""


class StallsOnceAt(Dataset):  # type: ignore[type-arg]
    """range(n); the first load of `index` (across processes: a marker file) never returns."""

    def __init__(self, n: int, index: int, marker: Path) -> None:
        self.n, self.index, self.marker = n, index, marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.index and not self.marker.exists():
            self.marker.touch()
            threading.Event().wait()  # hangs here, until the worker is killed
        return i


def _run(dataset: Any, **options: Any) -> tuple[statecore.DataLoader[Any], list[Any]]:
    """A fork loader with one restart over `dataset`, and its one epoch's batches."""
    loader = statecore.DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        executor="mp",
        multiprocessing_context="fork",
        worker_restarts=1,
        **options,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WorkerRestartedWarning)
        batches = list(loader)
    return loader, batches


@pytest.fixture
def killed(tmp_path: Path) -> tuple[statecore.DataLoader[Any], list[Any]]:
    """A traced run whose worker loading index 5 is killed by SIGKILL, once."""
    return _run(DiesAt(12, LOST, signal.SIGKILL, tmp_path / "killed"), trace=True)


def test_the_trace_records_a_killed_worker_as_one_restart(killed: Any) -> None:
    loader, batches = killed
    assert len(batches) == 6
    trace = loader.trace_record()
    assert trace.restarts == 1
    (lost,) = trace.losses
    assert lost.restarted and lost.incarnation == 0
    assert lost.worker == LOST // 2 % 2  # batch 2 (indices 4, 5) goes to worker 0
    assert type(lost.loss) is WorkerDeath
    assert lost.loss.exitcode == -signal.SIGKILL and lost.loss.pid is not None
    assert lost.replaced is not None and lost.started is not None
    assert lost.at <= lost.replaced <= lost.started
    assert 2 in lost.held  # the task of indices (4, 5)
    stats = loader.stats()
    assert stats.restarts == 1
    assert stats.restarts_per_worker == tuple(int(w == lost.worker) for w in range(2))
    assert stats.hangs == ()
    verdict = stats.verdict()
    assert "1 restart(s)" in verdict
    assert f"(pid {lost.loss.pid}) was killed by signal {int(signal.SIGKILL)}" in verdict


def test_a_resent_task_counts_from_its_resend_on_the_replacement(killed: Any) -> None:
    loader, _ = killed
    trace = loader.trace_record()
    (lost,) = trace.losses
    resent = [b for b in trace.batches if b.resent]
    assert {b.task for b in resent} == set(lost.held)
    assert len({b.task for b in trace.batches}) == len(trace.batches)  # each task once
    for batch in resent:
        assert batch.first_sent is not None and batch.first_sent < lost.at
        assert batch.sent >= lost.started  # the re-send, after the replacement started
        assert batch.started is not None and batch.started >= batch.sent
        assert batch.incarnation == 1
    assert all(b.incarnation == 0 for b in trace.batches if b.worker != lost.worker)


def test_the_chrome_trace_ends_the_lost_track_and_starts_the_replacements(killed: Any) -> None:
    loader, _ = killed
    trace = loader.trace_record()
    (lost,) = trace.losses
    chrome = json.loads(json.dumps(trace.chrome()))
    names = {
        e["tid"]: e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "thread_name"
    }
    w = lost.worker
    old = next(t for t, n in names.items() if n == f"worker {w} (incarnation 0)")
    new = next(t for t, n in names.items() if n == f"worker {w} (incarnation 1)")
    other = 1 - w
    assert names[other + 1] == f"worker {other}"
    (end,) = [e for e in chrome["traceEvents"] if e["name"].startswith("worker lost")]
    assert not [e for e in chrome["traceEvents"] if e["name"].startswith("worker died")]
    assert end["tid"] == old and end["ph"] == "i"
    assert end["args"]["signal"] == signal.SIGKILL and end["args"]["pid"] == lost.loss.pid
    (starting,) = [e for e in chrome["traceEvents"] if e["name"].startswith("starting")]
    assert starting["tid"] == new and starting["ph"] == "X"
    on_old = [e for e in chrome["traceEvents"] if e["tid"] == old and e.get("cat") == "batch"]
    on_new = [e for e in chrome["traceEvents"] if e["tid"] == new and e.get("cat") == "batch"]
    assert on_new and all(e["ts"] >= starting["ts"] for e in on_new)
    assert all(e["ts"] <= end["ts"] for e in on_old)
    assert any("(re-sent)" in e["name"] for e in on_new)


def test_stats_counts_the_restart_untraced(tmp_path: Path) -> None:
    loader, batches = _run(DiesAt(12, LOST, signal.SIGKILL, tmp_path / "killed"))
    assert len(batches) == 6
    stats = loader.stats()
    assert not stats.traced
    assert stats.counters is not None and stats.counters.restarts == 1
    assert "1 lost worker(s) replaced" in stats.verdict()


def test_the_counters_count_the_loaders_restarts_over_its_iterators(tmp_path: Path) -> None:
    """Without persistent workers each epoch has its own scheduler, which counts only its own
    restarts: the loader's budget is what counts them all."""
    loader, _ = _run(DiesAt(12, LOST, signal.SIGKILL, tmp_path / "killed"))
    list(loader)  # a second epoch, a new scheduler, no loss
    counters = loader.stats().counters
    assert counters is not None and counters.restarts == 1


def test_a_flight_file_of_a_run_with_a_restart_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DIR_VARIABLE, str(tmp_path / "flight"))
    monkeypatch.setattr(flight, "_files_written", 0)
    loader = statecore.DataLoader(
        DiesAt(12, LOST, signal.SIGKILL, tmp_path / "killed"),
        batch_size=2,
        num_workers=2,
        executor="mp",
        multiprocessing_context="fork",
        worker_restarts=1,
        persistent_workers=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WorkerRestartedWarning)
        iterator = iter(loader)
        batches = list(iterator)
    assert len(batches) == 6
    driver = iterator._driver  # type: ignore[attr-defined]
    (recorder,) = [o.owner for o in driver.observers if isinstance(o.owner, FlightRecorder)]
    error = RuntimeError("written by the test")
    recorder.attach(error, driver.state)
    found = re.search(r"scheduler events are in (\S+\.json); replay with", str(error))
    assert found is not None, str(error)
    text = Path(found.group(1)).read_text()
    recording = from_json(text)
    events = [recorded.event for recorded in recording.steps]
    assert any(type(e) is WorkerDied and e.exitcode == -signal.SIGKILL for e in events)
    assert any(type(e) is WorkerStarted and e.incarnation == 1 for e in events)
    assert any(type(e) is TaskCompleted and e.incarnation == 1 for e in events)
    commands = [c for recorded in recording.steps for c in recorded.commands or ()]
    assert any(type(c) is ReplaceWorker and c.incarnation == 1 for c in commands)
    out = io.StringIO()
    assert replay_file(found.group(1), out) == 0, out.getvalue()
    del iterator, loader


def test_a_hang_is_recorded_with_its_stack(tmp_path: Path) -> None:
    loader, batches = _run(
        StallsOnceAt(12, LOST, tmp_path / "stalled"), worker_timeout=1, trace=True
    )
    assert len(batches) == 6
    (lost,) = loader.trace_record().losses
    assert lost.hang and lost.restarted
    assert type(lost.loss) is WorkerHang and lost.loss.task == 2
    assert lost.stack is not None and "threading.Event().wait()" in lost.stack
    stats = loader.stats()
    assert stats.hangs == (lost,)
    assert "; stuck at test_trace_restarts.py:" in stats.verdict()
    assert "in __getitem__: threading.Event().wait()" in stats.verdict()
    chrome = loader.trace_record().chrome()
    (end,) = [e for e in chrome["traceEvents"] if e["name"].startswith("worker lost")]
    assert "threading.Event().wait()" in end["args"]["stack"]
    assert end["args"]["task"] == 2


# --- the tracer and the flight file, driven by hand ------------------------------------------

_RESTARTS = Config(num_workers=1, prefetch_factor=1, restarts=1, persistent_workers=True)


def _lost_and_replaced(watched: Any) -> Any:
    """One worker, one task sent (index [7, 8]), the worker found stuck, replaced, started."""
    state = initial_state(_RESTARTS)
    state, _ = watched(state, ResetRequested())
    state, out = watched(state, IndexDrawn.fast([7, 8]))
    assert any(type(c) is SendTask for c in out)
    state, _ = watched(state, NextRequested())
    state, out = watched(state, WorkerStuck(0, 0, 1.0, pid=42, stack='  File "x.py"\n    hang()'))
    assert any(type(c) is ReplaceWorker for c in out)
    state, _ = watched(state, TaskCompleted(0, 0, "late", incarnation=0))  # the lost one's
    state, out = watched(state, WorkerStarted(0, 1))
    assert [type(c) for c in out] == [SendTask]
    return watched(state, TaskCompleted(0, 0, "batch", incarnation=1))[0]


def test_a_lost_incarnations_late_answer_is_not_the_resent_tasks() -> None:
    times = iter(float(t) for t in range(100))
    tracer = Tracer(1, True, True, "mp", clock=lambda: next(times))
    _lost_and_replaced(tracer.wrap(step))
    (batch,) = tracer.trace().batches
    (lost,) = tracer.trace().losses
    assert batch.first_sent == 1.0 and batch.sent == 5.0  # the draw's time; WorkerStarted's
    assert batch.arrived == 6.0  # the replacement's answer, not the lost one's (at 4)
    assert batch.incarnation == 1
    assert (lost.at, lost.replaced, lost.started, lost.held) == (3.0, 3.0, 5.0, (0,))
    assert lost.stack is not None and "hang()" in lost.stack


def test_the_flight_file_round_trips_a_restart() -> None:
    recorder = FlightRecorder(_RESTARTS)
    state = _lost_and_replaced(recorder.wrap(step))
    recording, replayed = recorder.recording(state, "a test")
    assert [done for done in replayed if done.violations or done.divergence] == []
    again = from_json(to_json(recording))
    assert again == recording
    events = [recorded.event for recorded in again.steps]
    assert WorkerStuck(0, 0, 1.0, pid=42, stack='  File "x.py"\n    hang()') in events
    assert TaskCompleted(0, 0, incarnation=1) in events
    assert again.end.life.replaced[0].stack == '  File "x.py"\n    hang()'


def test_a_pending_index_is_written_as_its_text() -> None:
    """A pending slot keeps the sampler's index where restarts are on; a list is no value the
    file holds, so a state is written with its repr, as a drawn index is."""
    state = initial_state(_RESTARTS)
    for event in (ResetRequested(), IndexDrawn.fast([7, 8]), NextRequested()):
        state = step(state, event).state
    stuck = step(state, WorkerStuck(0, 0, 1.0)).state
    assert stuck.life.workers == (WorkerStatus.STARTING,)
    (slot,) = stuck.window
    assert type(slot) is Pending and slot.index == [7, 8]
    written = decode(json.loads(json.dumps(encode(strip_state(stuck)))))
    assert written == stuck
    assert written.window[0].index == "[7, 8]"
    assert written.life.workers == (WorkerStatus.STARTING,)


def test_the_flight_file_keeps_a_replacements_error_with_its_incarnation() -> None:
    recorder = FlightRecorder(_RESTARTS)
    watched = recorder.wrap(step)
    state = initial_state(_RESTARTS)
    for event in (
        ResetRequested(),
        IndexDrawn.fast([7, 8]),
        NextRequested(),
        WorkerStuck(0, 0, 1.0),
        WorkerStarted(0, 1),
        TaskFailed(0, 0, ValueError("bad sample"), incarnation=1),
    ):
        state = watched(state, event).state
    assert state.rcvd_idx == 1  # the error was handed over in its turn, not dropped as late
    recording, replayed = recorder.recording(state, "a test")
    assert [done for done in replayed if done.violations or done.divergence] == []
    assert recording.steps[-1].event.incarnation == 1  # type: ignore[attr-defined]


def test_where_a_worker_was_stuck_is_its_innermost_frame_outside_pythons_library() -> None:
    library = sysconfig.get_paths()["stdlib"]
    stack = (
        "Traceback (most recent call last):\n"
        '  File "/data/loading.py", line 12, in read\n'
        "    return fetch(path)\n"
        '  File "/data/fetch.py", line 40, in fetch\n'
        "    lock.wait()\n"
        f'  File "{library}/threading.py", line 327, in wait\n'
        "    waiter.acquire()\n"
    )
    assert stuck_at(stack) == "fetch.py:40 in fetch: lock.wait()"
    assert stuck_at(f'  File "{library}/threading.py", line 327, in wait\n') == (
        "threading.py:327 in wait"
    )
    assert stuck_at("no frame here") == ""
