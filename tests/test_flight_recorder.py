"""The flight recorder keeps a driver's last events without their data, writes them out when
the driver fails, and `python -m statecore replay` drives the scheduler through them again."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data

from statecore import (
    RESOLVED,
    Config,
    Deliver,
    DrawIndex,
    Event,
    ExecutorError,
    IndexDrawn,
    InternalError,
    LoaderTimeoutError,
    NextRequested,
    ResetRequested,
    ResumeWorker,
    SendTask,
    State,
    TaskCompleted,
    Transition,
    initial_state,
    step,
)
from statecore.executors import DataLoader, Driver
from statecore.executors._loader import observers
from statecore.executors._observe import flight
from statecore.executors._observe.flight import DIR_VARIABLE, MAX_FILES, FlightRecorder, strip_state
from statecore.executors._observe.flightfile import decode, encode
from statecore.models.explorer import default_scenarios, explore
from statecore.tools.replay import replay_file
from statecore.tools.step_bench import record_trace

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def flight_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder the files go to in this test; the per-process count of files starts over."""
    folder = tmp_path / "flight"
    monkeypatch.setenv(DIR_VARIABLE, str(folder))
    monkeypatch.setattr(flight, "_files_written", 0)
    return folder


class Scripted:
    """An executor that answers each poll with the next of `answers`, then with nothing."""

    def __init__(self, answers: Callable[[list[SendTask]], Event | None] | None = None) -> None:
        self.sent: list[SendTask] = []
        self.answers = answers

    def start(self) -> None:
        pass

    def dispatch(self, command: SendTask) -> None:
        self.sent.append(command)

    def resume(self, command: ResumeWorker) -> None:
        pass

    def poll(self, timeout: float | None) -> Event | None:
        return None if self.answers is None else self.answers(self.sent)

    def stop_worker(self, worker: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _draw(n: int) -> Callable[[State], Any]:
    indices = iter(range(n))
    return lambda state: next(indices)


def _answer_in_turn(sent: list[SendTask]) -> Event:
    command = sent.pop(0)
    return TaskCompleted(command.task, command.worker, payload=[command.index])


def _named_file(text: str) -> Path:
    found = re.search(r"scheduler events are in (\S+\.json); replay with", text)
    assert found is not None, text
    return Path(found.group(1))


def _drive(recorded: Callable[[State, Event], Transition], state: State, *events: Event) -> State:
    for event in events:
        state = recorded(state, event).state
    return state


def recorded_driver(config: Config, executor: Any, draw: Any, timeout: float) -> Driver:
    """A driver with a flight recorder attached, as a loader's is."""
    return Driver(config, executor, draw, timeout, observers=[FlightRecorder(config).observer()])


def _written(flight_dir: Path, batches: int = 3) -> Path:
    """A file written by a driver that loaded `batches` batches, then waited on an executor
    that owed nothing: an internal error."""
    polls = iter(range(batches))

    def answer(sent: list[SendTask]) -> Event | None:
        return None if next(polls, None) is None else _answer_in_turn(sent)

    driver = recorded_driver(Config(num_workers=1), Scripted(answer), _draw(10), timeout=0)
    driver.start_epoch()
    for _ in range(batches):
        driver.next()
    with pytest.raises(InternalError) as caught:
        driver.next()
    return _named_file(str(caught.value))


# --- what the ring holds ---------------------------------------------------------------------


def test_the_ring_holds_a_bounded_number_of_events_and_a_replayable_tail() -> None:
    config = Config(num_workers=2, prefetch_factor=2)
    recorder = FlightRecorder(config)
    events = record_trace(4000, workers=2)
    state = _drive(recorder.wrap(step), initial_state(config), *events)
    assert len(events) > 2 * recorder.size
    assert len(recorder.ring) == recorder.size
    recording, replayed = recorder.recording(state, "a test")
    assert len(recording.steps) >= recorder.size // 2
    assert recording.steps[-1].event == events[-1]
    assert [done for done in replayed if done.violations or done.divergence] == []


def test_the_ring_keeps_no_batch_alive() -> None:
    class Batch:
        pass

    config = Config(num_workers=2, prefetch_factor=1)
    recorder = FlightRecorder(config)
    recorded = recorder.wrap(step)
    state = _drive(recorded, initial_state(config), ResetRequested(), IndexDrawn(0), IndexDrawn(1))
    first, second = Batch(), Batch()
    alive = weakref.ref(first), weakref.ref(second)
    # Task 1 answers first and waits in the window, where the keyframe taken before task 0's
    # answer finds it.
    state = _drive(recorded, state, TaskCompleted(1, 1, second), TaskCompleted(0, 0, first))
    handed = []
    for event in (NextRequested(), IndexDrawn(2), NextRequested()):
        transition = recorded(state, event)
        state = transition.state
        handed += [command for command in transition.commands if type(command) is Deliver]
    assert [command.payload for command in handed] == [first, second]
    del first, second, handed, transition  # the consumer is done with both batches
    assert [ref() for ref in alive] == [None, None]
    assert (0, 0) in recorder.ring and (1, 1) in recorder.ring


def test_the_ring_keeps_only_the_ends_and_length_of_a_batch_samplers_list() -> None:
    config = Config(num_workers=1, prefetch_factor=1)
    recorder = FlightRecorder(config)
    drawn = list(range(1000, 2000))
    state = _drive(recorder.wrap(step), initial_state(config), ResetRequested(), IndexDrawn(drawn))
    assert recorder.ring[-1] == (1000, 1999, 1000)
    recording, _ = recorder.recording(state, "a test")
    assert recording.steps[-1].event == IndexDrawn("[1000, ..., 1999] (1000 indices)")


def test_a_driver_records_through_the_step_function_it_is_given() -> None:
    seen: list[Event] = []

    def traced(state: State, event: Event) -> Transition:
        seen.append(event)
        return step(state, event)

    recorder = FlightRecorder(Config(num_workers=1))
    driver = Driver(
        Config(num_workers=1),
        Scripted(_answer_in_turn),
        _draw(3),
        0,
        step=traced,
        observers=[recorder.observer()],
    )
    driver.start_epoch()
    assert [driver.next() for _ in range(3)] == [[0], [1], [2]]
    assert recorder.events() == len(seen) > 0


def test_only_a_scheduler_that_loads_in_the_calling_thread_goes_without_a_recorder() -> None:
    def recorders(config: Config) -> list[object]:
        return [
            watcher.owner
            for watcher in observers(config, tracer=None)
            if type(watcher.owner) is FlightRecorder
        ]

    assert len(recorders(Config(num_workers=1))) == 1
    assert recorders(Config(num_workers=1, lazy=True)) == []


def test_a_driver_builds_no_observer_of_its_own() -> None:
    # The loader attaches them (`observers`); a driver given none calls `step` itself.
    driver = Driver(Config(num_workers=1), Scripted(), _draw(1), 0)
    assert driver.observers == ()
    assert driver.step is step


# --- when it writes, and what the error says -------------------------------------------------


def test_an_internal_error_writes_the_file_and_names_it(flight_dir: Path) -> None:
    driver = recorded_driver(Config(num_workers=1), Scripted(), _draw(4), timeout=0)
    driver.start_epoch()
    with pytest.raises(InternalError, match="the executor owes nothing") as caught:
        driver.next()
    path = _named_file(str(caught.value))
    assert path.parent == flight_dir
    assert f"`python -m statecore replay {path}`" in str(caught.value)
    data = json.loads(path.read_text())
    assert (data["format"], data["version"]) == ("statecore-flight", 1)
    assert data["reason"].startswith("InternalError: the scheduler waits")
    assert [step["event"]["type"] for step in data["steps"]] == [
        "ResetRequested",
        "IndexDrawn",
        "IndexDrawn",
        "NextRequested",
    ]


def test_an_executor_reporting_the_impossible_writes_the_file_and_names_it(
    flight_dir: Path,
) -> None:
    driver = recorded_driver(
        Config(num_workers=1), Scripted(lambda sent: TaskCompleted(99, 0)), _draw(4), 1
    )
    driver.start_epoch()
    with pytest.raises(ExecutorError, match="task 99 is not awaiting an answer") as caught:
        driver.next()
    data = json.loads(_named_file(str(caught.value)).read_text())
    assert data["steps"][-1]["event"] == {"type": "TaskCompleted", "task": 99, "worker": 0}
    assert data["steps"][-1]["raised"]["kind"] == "ExecutorError"


class BlocksOn(torch.utils.data.Dataset[int]):
    """The numbers up to `n`, except that loading `index` waits for `gate`."""

    def __init__(self, n: int, index: int, gate: threading.Event) -> None:
        self.n, self.index, self.gate = n, index, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.index:
            self.gate.wait()
        return index


@pytest.mark.timeout(120)
def test_a_timeout_writes_the_file_and_names_it_under_torchs_message(flight_dir: Path) -> None:
    gate = threading.Event()
    loader = DataLoader(
        BlocksOn(8, 2, gate), batch_size=None, num_workers=2, executor="thread", timeout=0.5
    )
    iterator = iter(loader)
    try:
        with pytest.raises(LoaderTimeoutError) as caught:
            for _ in iterator:
                pass
    finally:
        gate.set()
        iterator._shutdown()  # type: ignore[attr-defined]
    error = caught.value
    assert str(error) == "DataLoader timed out after 0.5 seconds"  # as torch's, for the logs
    (note,) = error.__notes__
    path = _named_file(note)
    assert path.parent == flight_dir
    out = io.StringIO()
    assert replay_file(str(path), out) == 0
    assert "TimedOut(seconds=0.5) -> " in out.getvalue()


def test_a_timeout_raised_again_names_the_same_file(flight_dir: Path) -> None:
    driver = recorded_driver(Config(num_workers=1), Scripted(), _draw(4), timeout=1.0)
    driver.start_epoch()
    notes = []
    for _ in range(2):
        with pytest.raises(LoaderTimeoutError) as caught:
            driver.next()
        notes += caught.value.__notes__
    assert notes[0] == notes[1]
    assert list(flight_dir.iterdir()) == [_named_file(notes[0])]


def test_a_file_that_cannot_be_written_leaves_the_error_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(DIR_VARIABLE, str(blocker / "flight"))
    monkeypatch.setattr(flight, "_files_written", 0)
    driver = recorded_driver(Config(num_workers=1), Scripted(), _draw(4), timeout=0)
    driver.start_epoch()
    with pytest.raises(InternalError) as caught:
        driver.next()
    message = str(caught.value)
    assert message.startswith("the scheduler waits in State(")
    assert f"could not write the last 4 scheduler events to {blocker / 'flight'}" in message
    assert f"set {DIR_VARIABLE} to a writable folder" in message


def test_a_process_writes_a_bounded_number_of_files(
    flight_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flight, "_files_written", MAX_FILES)
    driver = recorded_driver(Config(num_workers=1), Scripted(), _draw(4), timeout=0)
    driver.start_epoch()
    with pytest.raises(InternalError, match=f"already wrote \\(or tried to write\\) {MAX_FILES}"):
        driver.next()
    assert not flight_dir.exists()


# --- the file and its replay -------------------------------------------------------------------


def _states_of_real_epochs() -> Iterator[State]:
    # The explorer's worlds: failures, resumes, iterable datasets, closes and interrupts.
    scenarios = list(default_scenarios())
    for scenario in scenarios[::23]:
        yield from explore(scenario).states
    state = initial_state(Config(num_workers=3, prefetch_factor=2))
    for event in record_trace(200, workers=3):
        state = step(state, event).state
        yield state


def test_states_of_real_epochs_come_back_from_the_file_format_as_they_were(
    flight_dir: Path,
) -> None:
    count = 0
    for state in _states_of_real_epochs():
        stripped = strip_state(state)
        back = decode(json.loads(json.dumps(encode(stripped))))
        assert back == state
        assert type(back) is State
        # The core tells a resolved slot by identity.
        assert [slot is RESOLVED for slot in back.window] == [
            slot is RESOLVED for slot in state.window
        ]
        count += 1
    assert count > 500


def test_replay_of_a_written_file_exits_0_and_prints_the_trace(flight_dir: Path) -> None:
    path = _written(flight_dir)
    done = subprocess.run(
        [sys.executable, "-m", "statecore", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "    1  ResetRequested(seed=None, resume=None) -> DrawIndex()" in lines
    completed = r" +\d+  TaskCompleted\(task=2, worker=0, incarnation=0\) -> "
    assert any(re.match(completed, line) for line in lines)
    assert lines[-1].startswith("replay: 13 steps; every invariant holds")


def test_replay_into_a_reader_that_went_away_ends_quietly(flight_dir: Path) -> None:
    # `replay FILE | head`: the reader closes its end before the trace is all written
    path = _written(flight_dir)
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "statecore", "replay", str(path)],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=100,
            cwd=ROOT,
        )
    finally:
        os.close(writer)
    assert done.returncode == 128 + signal.SIGPIPE
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr


def _edited(path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _problems(out: str, mark: str) -> tuple[str, str]:
    """The line of the first step marked `mark`, and the mark's own line."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(mark))
    above = next(line for line in reversed(lines[:at]) if not line.startswith("       "))
    return above, lines[at]


def test_replay_of_a_file_edited_to_break_an_invariant_exits_1_naming_the_step(
    flight_dir: Path,
) -> None:
    path = _written(flight_dir)
    number = next(
        number
        for number, step in enumerate(json.loads(path.read_text())["steps"], 1)
        if "before" in step and number > 1
    )

    def overload(data: dict[str, Any]) -> None:
        data["steps"][number - 1]["before"]["loads"] = [5]

    out = io.StringIO()
    assert replay_file(str(_edited(path, overload)), out) == 1
    above, violation = _problems(out.getvalue(), "VIOLATION:")
    assert above.startswith(f"{number:5}  TaskCompleted(")
    assert "loads (4,) do not match the window, which gives (1,)" in violation


def test_replay_of_a_file_whose_commands_were_edited_exits_1_naming_the_step(
    flight_dir: Path,
) -> None:
    path = _written(flight_dir)
    steps = json.loads(path.read_text())["steps"]
    number = next(
        n
        for n, step in enumerate(steps, 1)
        if any(command["type"] == "Deliver" for command in step["commands"])
    )

    def forget_the_commands(data: dict[str, Any]) -> None:
        data["steps"][number - 1]["commands"] = []

    out = io.StringIO()
    assert replay_file(str(_edited(path, forget_the_commands)), out) == 1
    above, divergence = _problems(out.getvalue(), "DIVERGES:")
    assert above.startswith(f"{number:5}  ")
    assert "Deliver(task=0, worker=0)" in above
    assert divergence.endswith("the live run's commands were none")
    assert out.getvalue().splitlines()[-1].startswith("replay: 0 broken invariant(s) and 1 div")


@pytest.mark.parametrize(
    "text",
    [
        None,
        "not JSON {",
        '{"format": "something else"}',
        '{"format": "statecore-flight", "version": 99}',
        '{"format": "statecore-flight", "version": 1, "steps": []}',
        '{"format": "statecore-flight", "version": 1, "reason": "", "written": "", "pid": 1, '
        '"statecore": "", "dropped": 0, "start": {"type": "Nonsense"}, "steps": [], "end": null}',
    ],
    ids=["missing", "not-json", "other-format", "other-version", "fields-missing", "bad-state"],
)
def test_a_file_that_is_not_a_flight_recording_exits_2(
    text: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "recording.json"
    if text is not None:
        path.write_text(text)
    assert replay_file(str(path)) == 2
    assert f"replay: cannot read {path} as a flight recording: " in capsys.readouterr().err


def test_a_recorded_command_is_payload_free() -> None:
    # DrawIndex and SendTask carry the index as its text, so that JSON can hold it.
    assert encode(SendTask(0, 1, "[3, 4]")) == {
        "type": "SendTask",
        "worker": 0,
        "task": 1,
        "index": "[3, 4]",
    }
    assert decode(encode(DrawIndex())) == DrawIndex()
