"""The programs that read traces (statecore/tools/): the timeline, `python -m statecore
profile`, the cost of tracing (`trace_cost`) and the long runs' figures (`trace_long_runs`)."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _tracing import (
    STRAGGLER,
    format_problems,
    traced_epoch,
)

from statecore.executors._observe.tracer import TRACE_VARIABLE
from statecore.tools.timeline import draw_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_the_timeline_is_a_png(tmp_path: Path) -> None:
    loader, _ = traced_epoch("thread", workers=2)
    path = draw_timeline(loader.trace_record(), tmp_path / "timeline.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


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


# --- python -m statecore profile --------------------------------------------------------------


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


# --- the cost of tracing (python -m statecore.tools.trace_cost) -------------------------------


@pytest.mark.timeout(60)
def test_the_cost_tool_times_a_workload_with_tracing_off_and_on_in_turns() -> None:
    from statecore.tools.trace_cost import compare
    from statecore.tools.workloads import select

    cost = compare(select(["inline-b1"])[0].resized(20), rounds=2)
    assert len(cost.off) == len(cost.on) == 2
    assert all(ratio > 0 for ratio in cost.ratios)
    assert cost.describe().startswith("inline-b1: off ")
    assert "95% interval" in cost.describe()


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_the_cost_tool_prints_the_three_goals_of_tracing_each_with_its_goal() -> None:
    from statecore.tools.trace_cost import goals

    result = goals(rounds=1, batches=6)
    assert set(result.steady) == {"torch", "off", "on"}
    assert all(run.batches == 5 and run.cpu_seconds >= 0 for run in result.steady["on"])
    assert [cost.workload.name for cost in result.costs] == [
        "io", "stragglers-in-order", "stragglers-any-order"
    ]  # fmt: skip
    lines = result.describe().splitlines()
    assert lines[0].startswith("main-process CPU per batch, processes-b64: ")
    assert "goal at most 10 us" in lines[0]
    assert lines[1].startswith("processes-b64: torch untraced ") and "goal at least 3x" in lines[1]
    assert all("goal under 1%" in line for line in lines[2:5])


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


# --- long runs (python -m statecore.tools.trace_long_runs) ------------------------------------


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
