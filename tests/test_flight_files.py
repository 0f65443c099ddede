"""`python -m statecore replay FILE` on files that are not what a flight recorder writes.

Exit 2 and one line naming the field, what it holds and what was expected, whatever the file
holds; 1 stays for a well-formed recording whose replay breaks an invariant or leaves the live
run. Nothing in a file is executed or unpickled.
"""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statecore import Config, WorkerDied, initial_state, step
from statecore.executors._observe.flight import FlightRecorder
from statecore.executors._observe.flightfile import to_json
from statecore.tools.cli import main
from statecore.tools.step_bench import record_trace

ROOT = Path(__file__).resolve().parent.parent


def _recording() -> dict[str, Any]:
    """A valid file's data: two workers' epoch of six batches, cut short by a worker's death."""
    config = Config(num_workers=2, prefetch_factor=2)
    recorder = FlightRecorder(config)
    recorded = recorder.wrap(step)
    state = initial_state(config)
    for event in [*record_trace(6, workers=2)[:12], WorkerDied(1, pid=4242, exitcode=-9)]:
        state = recorded(state, event).state
    recording, _ = recorder.recording(state, "InternalError: a test")
    data: dict[str, Any] = json.loads(to_json(recording))
    return data


VALID = _recording()


def _replay(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> tuple[int, str, str]:
    """The command's exit status, stdout and stderr on a file holding `text`, in-process: an
    exception that escapes fails the test, as it would print a traceback."""
    path = tmp_path / "recording.json"
    path.write_text(text)
    status = main(["replay", str(path)])
    out, err = capsys.readouterr()
    return status, out, err


def _edited(edit: Callable[[dict[str, Any]], None]) -> str:
    data = copy.deepcopy(VALID)
    edit(data)
    return json.dumps(data)


def _one_line_naming(err: str, *words: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("replay: cannot read "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_the_valid_file_of_these_tests_replays_with_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _replay(tmp_path, capsys, json.dumps(VALID))
    assert (status, err) == (0, ""), out
    assert "failure=WorkerDeath(worker=1, pid=4242, exitcode=-9" in out


def test_a_file_nested_past_the_interpreters_depth_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    depth = 100_000
    text = json.dumps(VALID).replace('"reason": "', '"reason": ' + "[" * depth + '"', 1)
    text = text.replace('", "written"', '"' + "]" * depth + ', "written"', 1)
    status, _, err = _replay(tmp_path, capsys, text)
    assert status == 2
    _one_line_naming(err, "nested too deeply")


def test_a_nested_value_where_a_string_belongs_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def nest(data: dict[str, Any]) -> None:
        value: Any = "deep"
        for _ in range(500):
            value = [value]
        data["reason"] = value

    status, _, err = _replay(tmp_path, capsys, _edited(nest))
    assert status == 2
    _one_line_naming(err, '"reason" holds [[[', "expected a string")


def test_a_pid_of_infinity_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = json.dumps(VALID).replace(f'"pid": {VALID["pid"]}', '"pid": 1e999', 1)
    status, _, err = _replay(tmp_path, capsys, text)
    assert status == 2
    _one_line_naming(err, '"pid" holds Infinity', "expected an integer of at least 0")


def test_a_window_that_is_a_number_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _replay(tmp_path, capsys, _edited(lambda d: d["start"].update(window=5)))
    assert status == 2
    _one_line_naming(err, '"start.window" holds 5', "expected a list")


def test_a_task_counter_that_is_a_string_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _replay(tmp_path, capsys, _edited(lambda d: d["end"].update(rcvd_idx="0")))
    assert status == 2
    _one_line_naming(err, '"end.rcvd_idx" holds "0"', "expected an integer")


def test_a_hundred_million_workers_exit_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["end"]["config"]["num_workers"] = 10**8

    status, _, err = _replay(tmp_path, capsys, _edited(edit))
    assert status == 2
    _one_line_naming(err, '"end.config.num_workers" holds 100000000', "at most 65536 workers")


def test_per_worker_entries_that_do_not_match_the_workers_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = _replay(tmp_path, capsys, _edited(lambda d: d["start"].update(loads=[0])))
    assert status == 2
    _one_line_naming(err, '"start.loads" holds 1 entries', "one per worker, 2")


def test_an_unhashable_item_of_a_set_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["start"]["life"]["stale"] = {"frozenset": [[0, [1, 2]]]}

    status, _, err = _replay(tmp_path, capsys, _edited(edit))
    assert status == 2
    _one_line_naming(err, '"start.life.stale[0][1]" holds [1, 2]', "expected an integer")


def test_an_unhashable_enum_name_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["start"]["life"]["phase"] = {"enum": ["Phase"], "name": {"IDLE": 1}}

    status, _, err = _replay(tmp_path, capsys, _edited(edit))
    assert status == 2
    _one_line_naming(err, '"start.life.phase" holds {"enum": ["Phase"]', '"enum": "Phase"')


def test_an_event_of_a_class_outside_the_core_exits_2_and_nothing_is_imported_or_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A name that a reader importing classes by name, or unpickling, would obey.
    def edit(data: dict[str, Any]) -> None:
        data["steps"][0]["event"] = {"type": "os.system", "command": "touch pwned"}
        data["steps"][1]["event"] = {"py/reduce": [{"py/function": "os.system"}, ["touch x"]]}

    before = sorted(sys.modules)
    status, _, err = _replay(tmp_path, capsys, _edited(edit))
    assert status == 2
    _one_line_naming(err, '"steps[0].event" holds {"type": "os.system"', "names an event")
    assert sorted(sys.modules) == before
    assert list(tmp_path.iterdir()) == [tmp_path / "recording.json"]


def test_a_pickle_in_a_file_is_read_as_nothing_but_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle

    class Planted:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (Path.touch, (str(tmp_path / "planted"),))  # type: ignore[return-value]

    status, _, err = _replay(tmp_path, capsys, pickle.dumps(Planted()).decode("latin-1"))
    assert status == 2
    _one_line_naming(err, "not JSON")
    assert not (tmp_path / "planted").exists()


def test_a_malformed_file_exits_2_from_the_command_line_without_a_traceback(
    tmp_path: Path,
) -> None:
    path = tmp_path / "recording.json"
    path.write_text(_edited(lambda d: d["start"].update(window=5)))
    done = subprocess.run(
        [sys.executable, "-m", "statecore", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f'replay: cannot read {path} as a flight recording: "start.window" holds 5; expected a '
        'list, each item an object whose "type" is "Pending", "Ready", "Failed" or "Resolved"'
    ]


def test_a_text_no_output_can_print_is_replayed_escaped(tmp_path: Path) -> None:
    # JSON may hold a lone surrogate ("\\ud800"), which Python reads but cannot write out.
    def edit(data: dict[str, Any]) -> None:
        data["reason"] = "InternalError: \ud800"
        data["steps"][1]["event"]["index"] = data["steps"][1]["commands"][0]["index"] = "\udcff"

    path = tmp_path / "recording.json"
    path.write_text(_edited(edit))
    done = subprocess.run(
        [sys.executable, "-m", "statecore", "replay", str(path)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert "  because of InternalError: \\ud800" in done.stdout.splitlines()
    assert "IndexDrawn(index='\\\\udcff')" in done.stdout


# --- any mutation of a valid file: 0, 1 or 2, never a crash ------------------------------------

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, 3, -1, 2**17, 10**8])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["State", "Pending", "Ready", "Resolved", "TaskCompleted", "IDLE"])
    # A lone surrogate, a record separator and a line separator: text that splits or breaks lines.
    | st.sampled_from(["\ud800", "a\x1eb", "\u2028"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value, the value itself first."""
    found = [at]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*at, index))
    return found


PLACES = _paths(VALID)[1:]


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    data = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        place = draw(st.sampled_from(PLACES))
        parent: Any = data
        try:
            for key in place[:-1]:
                parent = parent[key]
            if type(parent) not in (dict, list):
                continue  # an earlier mutation took this place away
            current = parent[place[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # likewise
        how = draw(st.sampled_from(["replace", "delete", "wrap", "retype", "shift"]))
        if how == "delete":
            del parent[place[-1]]
        elif how == "wrap":
            parent[place[-1]] = [current]
        elif how == "retype":
            parent[place[-1]] = json.dumps(current) if not isinstance(current, str) else 7
        elif how == "shift" and type(current) is int:
            parent[place[-1]] = current + draw(st.sampled_from([-(2**64), -2, -1, 1, 2, 2**64]))
        else:
            parent[place[-1]] = draw(_JSON)
    return json.dumps(data)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(text=_mutated())
def test_any_mutation_of_a_valid_file_exits_0_1_or_2_without_a_traceback(
    text: str, tmp_path: Path
) -> None:
    path = tmp_path / "recording.json"
    path.write_text(text)
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", err)
        status = main(["replay", str(path)])  # an exception escaping fails the test
    assert status in (0, 1, 2)
    if status == 2:
        assert len(err.getvalue().splitlines()) == 1, err.getvalue()
    else:
        assert err.getvalue() == ""
