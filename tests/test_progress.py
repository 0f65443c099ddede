"""Progress bars: drawn by tqdm on a terminal, never anywhere else (`statecore.tools.progress`).

`bench` runs for real, in a subprocess, once with stderr a pipe and once with stderr a
pseudo-terminal. `check` takes a minute and a half, so its exploration is replaced by a
made-up one here, and the explorer's callback is tested on a few tiny scenarios instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import pytest

from statecore import Config
from statecore.models.explorer import Bounds, Report, default_scenarios, explore_all
from statecore.models.reference import MapSpec
from statecore.models.world import Scenario
from statecore.tools import cli, loader_bench
from statecore.tools.memory import Peak
from statecore.tools.progress import Bar, wanted
from statecore.tools.workloads import Measurement, Side, Workload, select

ROOT = Path(__file__).resolve().parent.parent
BENCH = ["bench", "--batches", "4", "--rounds", "1", "--only", "inline-b1", "--no-memory"]
BAR = re.compile(r"inline-b1: +\d+%\|.*\| \d/4 \[")
"""tqdm's bar over inline-b1's four runs (two warm-up runs, one round of two loaders)."""
TERMINAL_ENV = {**{k: v for k, v in os.environ.items() if k != "CI"}, "TERM": "xterm"}


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Terminal:
    """A terminal, in an environment that does not ask for quiet.

    Tests put it in place of stderr themselves (`contextlib.redirect_stderr`): pytest's capture
    sets sys.stderr again when the test proper starts, after the fixtures.
    """
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    return Terminal()


# --- when a bar is wanted -----------------------------------------------------------------------


def test_a_bar_is_wanted_on_a_terminal() -> None:
    assert wanted(Terminal(), {"TERM": "xterm"})


def test_no_bar_is_wanted_when_stderr_is_not_a_terminal() -> None:
    assert not wanted(io.StringIO(), {"TERM": "xterm"})


@pytest.mark.parametrize("environ", [{"CI": "true"}, {"CI": "1"}, {"TERM": "dumb"}])
def test_no_bar_is_wanted_in_ci_or_on_a_dumb_terminal(environ: dict[str, str]) -> None:
    assert not wanted(Terminal(), environ)


@pytest.mark.parametrize("value", ["", "0", "false", "False", "no"])
def test_ci_set_to_a_false_value_still_wants_a_bar(value: str) -> None:
    assert wanted(Terminal(), {"CI": value, "TERM": "xterm"})


def test_a_closed_stderr_wants_no_bar() -> None:
    stream = io.StringIO()
    stream.close()
    assert not wanted(stream, {})


# --- the bar ------------------------------------------------------------------------------------


def test_a_bar_off_a_terminal_prints_only_its_notes() -> None:
    stream = io.StringIO()
    with Bar(3, unit="step", description="work", stream=stream) as bar:
        bar.advance()
        bar.note("one line")
        bar.goto(3, 3, "done")
    assert not bar.live
    assert stream.getvalue() == "one line\n"


def test_a_bar_on_a_terminal_is_drawn_by_tqdm_with_the_notes_above(terminal: Terminal) -> None:
    with Bar(4, unit="step", description="work", stream=terminal) as bar:
        bar.goto(2, description="halfway")
        bar.note("one line")
    assert bar.live
    drawn = terminal.getvalue()
    assert re.search(r"halfway: +50%\|.*\| 2/4 \[", drawn), drawn
    assert "one line\n" in drawn


def test_a_bar_that_is_not_to_be_shown_draws_nothing_on_a_terminal(terminal: Terminal) -> None:
    with Bar(4, unit="step", show=False, stream=terminal) as bar:
        bar.advance(2)
    assert not bar.live and terminal.getvalue() == ""


def test_closing_a_bar_twice_is_harmless(terminal: Terminal) -> None:
    bar = Bar(1, stream=terminal)
    bar.close()
    bar.close()


# --- bench: the callback ------------------------------------------------------------------------


def _instant(workload: Workload, side: Side) -> Measurement:
    return Measurement(1.0, 10.0)


def _workload(name: str) -> Workload:
    return select([name])[0].resized(4)


def test_run_benchmark_counts_every_run_up_to_the_total() -> None:
    heard: list[tuple[str, int, int]] = []
    workloads = [_workload("inline-b1"), attrs.evolve(_workload("processes-b64"), warmup=False)]
    loader_bench.run_benchmark(
        workloads, rounds=2, measure=_instant, peak=None, on_run=lambda *a: heard.append(a)
    )
    # inline-b1: 2 warm-up runs and 2 rounds of 2 loaders; processes-b64: 2 rounds of 3.
    assert heard == [
        *[("inline-b1", done, 12) for done in range(7)],
        *[("processes-b64", done, 12) for done in range(6, 13)],
    ]


def test_run_benchmark_counts_the_memory_runs_too() -> None:
    heard: list[tuple[str, int, int]] = []
    io_workload = attrs.evolve(_workload("io"), warmup=False)
    assert io_workload.memory

    def peak(workload: Workload, side: Side) -> Peak:
        return Peak(side, before=1, peak=2, samples=1)

    loader_bench.run_benchmark(
        [io_workload], rounds=1, measure=_instant, peak=peak, on_run=lambda *a: heard.append(a)
    )
    total = 2 * len(io_workload.sides)  # a timed run and a memory run of each loader
    assert heard == [("io", done, total) for done in range(total + 1)]


def test_a_failed_workload_counts_its_remaining_runs_as_done() -> None:
    heard: list[tuple[str, int, int]] = []

    def breaks(workload: Workload, side: Side) -> Measurement:
        raise RuntimeError("no")

    loader_bench.run_benchmark(
        [_workload("inline-b1")],
        rounds=3,
        measure=breaks,
        peak=None,
        on_run=lambda *a: heard.append(a),
    )
    assert heard == [("inline-b1", 0, 8), ("inline-b1", 8, 8)]


# --- bench: the command -------------------------------------------------------------------------


def _bench(stderr: int, *options: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "statecore", *BENCH, *options],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        cwd=ROOT,
        env=TERMINAL_ENV,
    )


def _bench_on_a_terminal(*options: str) -> str:
    """What `bench` draws on stderr when stderr is a pseudo-terminal."""
    leader, follower = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, and tqdm fits its bar to that: nothing.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        with _bench(follower, *options) as process:
            os.close(follower)
            follower = -1
            chunks = []
            while True:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # EIO: the command has ended and closed its end
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            assert process.wait(timeout=60) == 0
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    return b"".join(chunks).decode()


@pytest.mark.timeout(120)
def test_bench_off_a_terminal_prints_its_plain_lines_and_no_bar() -> None:
    with _bench(subprocess.PIPE) as process:
        out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    lines = err.decode().splitlines()
    assert lines[0] == "bench: inline-b1: 1 round(s) of 4-batch runs ..."
    assert lines[1].startswith("bench: inline-b1: statecore/torch ")
    assert len(lines) == 2 and "\r" not in err.decode()
    assert "inline-b1" in out.decode()


@pytest.mark.timeout(120)
def test_bench_on_a_terminal_draws_a_bar_over_the_runs() -> None:
    drawn = _bench_on_a_terminal()
    assert BAR.search(drawn), drawn
    assert "bench: inline-b1: statecore/torch " in drawn


@pytest.mark.timeout(120)
def test_bench_with_no_progress_draws_no_bar_on_a_terminal() -> None:
    drawn = _bench_on_a_terminal("--no-progress")
    assert not BAR.search(drawn), drawn
    assert "%|" not in drawn and "bench: inline-b1: statecore/torch " in drawn


# --- check --------------------------------------------------------------------------------------


def _tiny_scenarios() -> list[Scenario]:
    """Three scenarios the explorer covers in a fraction of a second."""
    return [
        Scenario(
            Config(num_workers=1, prefetch_factor=1),
            MapSpec(batches),
            deaths=0,
            timeouts=False,
            closes=False,
        )
        for batches in (1, 2, 3)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [1, 2])
def test_the_explorer_tells_of_each_report_in_order(processes: int) -> None:
    heard: list[Report] = []
    reports = explore_all(_tiny_scenarios(), processes=processes, on_progress=heard.append)
    assert heard == reports
    assert [report.scenario for report in heard] == _tiny_scenarios()


def _made_up(
    scenarios: Iterable[Scenario],
    processes: int = 1,
    on_progress: Callable[[Report], None] | None = None,
) -> list[Report]:
    """An exploration that finds nothing wrong, at once, and tells of each scenario.

    It takes a moment over the last one, so that tqdm (which redraws at most ten times a
    second) draws the bar complete.
    """
    reports = []
    scenarios = list(scenarios)
    for n, scenario in enumerate(scenarios, 1):
        if n == len(scenarios):
            time.sleep(0.15)
        reports.append(Report(scenario, worlds=1, states=frozenset({0}), transitions=0))
        if on_progress is not None:
            on_progress(reports[-1])
    return reports


def test_check_off_a_terminal_prints_nothing_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "explore_all", _made_up)
    assert cli.main(["check", "--processes", "1"]) == 0
    assert capsys.readouterr().err == ""


def test_check_on_a_terminal_draws_a_bar_over_the_configurations(
    monkeypatch: pytest.MonkeyPatch, terminal: Terminal
) -> None:
    monkeypatch.setattr(cli, "explore_all", _made_up)
    with contextlib.redirect_stderr(terminal):
        assert cli.main(["check", "--processes", "1"]) == 0
    total = len(list(default_scenarios(Bounds())))
    bar = re.compile(rf"check: +100%\|.*\| {total}/{total} \[")
    assert bar.search(terminal.getvalue()), terminal.getvalue()


def test_check_with_no_progress_draws_no_bar_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, terminal: Terminal
) -> None:
    monkeypatch.setattr(cli, "explore_all", _made_up)
    with contextlib.redirect_stderr(terminal):
        assert cli.main(["check", "--processes", "1", "--no-progress"]) == 0
    assert terminal.getvalue() == ""
