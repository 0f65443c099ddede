"""`python -m statecore bench`: a fair A/B harness, whose figures add up and survive the trip.

No test here asserts on speed: the real runs are tiny, and only check that every figure is
there, positive, and that no worker outlives its run. The arithmetic is checked on made-up
timings. The workloads themselves are tested in tests/test_bench_workloads.py, the memory
readings in tests/test_bench_memory.py.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import sys
from pathlib import Path
from typing import Any

import attrs
import multiprocess
import pytest
from _side_by_side import WORKERS

from statecore.tools import loader_bench, memory
from statecore.tools.cli import main
from statecore.tools.loader_bench import (
    INSTALL_HINT,
    BenchReport,
    Machine,
    MissingDependency,
    Side,
    WorkloadResult,
    pair_ratios,
    plot,
    read_json,
    round_order,
    run_benchmark,
    write_json,
)
from statecore.tools.memory import Peak
from statecore.tools.workloads import (
    Measurement,
    Timing,
    Unit,
    Workload,
    measure,
    select,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def workload(name: str, batches: int = 4) -> Workload:
    return select([name])[0].resized(batches)


def result(
    name: str = "inline-b1",
    unit: Unit = Unit.US_PER_BATCH,
    torch_runs: tuple[Measurement, ...] = (Measurement(1.0, 100.0),),
    statecore_runs: tuple[Measurement, ...] = (Measurement(0.5, 100.0),),
) -> WorkloadResult:
    return WorkloadResult(
        name=name,
        summary=f"{name}, made up",
        unit=unit,
        timing=Timing.STEADY,
        batches=100,
        batch_size=1,
        num_workers=0,
        torch=torch_runs,
        statecore=statecore_runs,
        first=tuple(round_order(number)[0] for number in range(len(torch_runs))),
    )


def made_up_report() -> BenchReport:
    """A report with every kind of figure, and a straggler timeline, without running anything."""
    arrivals = tuple(0.1 + 0.01 * number for number in range(20))
    late = tuple(0.1 + 0.02 * number for number in range(20))
    return BenchReport(
        results=(
            result(),
            attrs.evolve(
                result(
                    "io",
                    Unit.EFFICIENCY,
                    (Measurement(1.0, 0.9), Measurement(1.0, 0.8), Measurement(1.1, 0.95)),
                    (Measurement(1.0, 0.95), Measurement(1.2, 0.9), Measurement(1.0, 0.97)),
                ),
                threads=(Measurement(1.0, 0.99), Measurement(1.0, 0.98), Measurement(1.0, 0.97)),
                memory=(
                    Peak(Side.TORCH, 200_000_000, 340_000_000, 50),
                    Peak(Side.STATECORE, 200_000_000, 300_000_000, 60),
                    Peak(Side.THREADS, 200_000_000, 201_000_000, 70),
                ),
            ),
            result(
                "large-batches", Unit.GB_PER_S, (Measurement(2.0, 3e9),), (Measurement(1.0, 3e9),)
            ),
            result("startup-fork", Unit.MS, (Measurement(0.08, 1.0),), (Measurement(0.1, 1.0),)),
            attrs.evolve(
                result(
                    "stragglers-in-order",
                    Unit.EFFICIENCY,
                    (Measurement(late[-1], 0.2, late),),
                    (Measurement(arrivals[-1], 0.2, arrivals),),
                ),
                batches=20,
            ),
        ),
        machine=Machine.here(),
        seconds=12.5,
        command="python -m statecore bench --made-up",
    )


def recording(calls: list[tuple[str, int, Side]]) -> loader_bench.Measure:
    """A stand-in for one run: records who ran what, and takes no time at all."""

    def fake(workload: Workload, side: Side) -> Measurement:
        calls.append((workload.name, workload.batches, side))
        return Measurement(1.0, 10.0)

    return fake


# --- alternation --------------------------------------------------------------------------------


def test_each_loader_runs_equally_often_taking_turns_at_going_first() -> None:
    calls: list[tuple[str, int, Side]] = []
    no_warmup = attrs.evolve(workload("inline-b1", 50), warmup=False)
    report = run_benchmark([no_warmup], rounds=4, measure=recording(calls), peak=None)
    t, s = Side.TORCH, Side.STATECORE
    assert [side for _, _, side in calls] == [t, s, s, t, t, s, s, t]
    assert report.results[0].first == (t, s, t, s)
    assert len(report.results[0].torch) == len(report.results[0].statecore) == 4
    assert report.results[0].threads == ()


def test_with_workers_threads_run_too_and_the_order_rotates_each_round() -> None:
    calls: list[tuple[str, int, Side]] = []
    no_warmup = attrs.evolve(workload("processes-b64", 50), warmup=False)
    report = run_benchmark([no_warmup], rounds=3, measure=recording(calls), peak=None)
    t, s, h = Side.TORCH, Side.STATECORE, Side.THREADS
    assert [side for _, _, side in calls] == [t, s, h, s, h, t, h, t, s]
    assert report.results[0].first == (t, s, h)
    assert len(report.results[0].threads) == 3


def test_the_threads_side_is_statecore_with_the_thread_executor() -> None:
    assert Side.THREADS.loader_class() is Side.STATECORE.loader_class()
    assert Side.THREADS.options() == {"executor": "thread"}
    assert Side.STATECORE.options() == Side.TORCH.options() == {}


def test_the_warm_up_is_one_small_untimed_run_of_each_loader_before_the_pairs() -> None:
    calls: list[tuple[str, int, Side]] = []
    report = run_benchmark(
        [workload("inline-b1", 50)], rounds=1, measure=recording(calls), peak=None
    )
    assert calls == [
        ("inline-b1", 4, Side.TORCH),
        ("inline-b1", 4, Side.STATECORE),
        ("inline-b1", 50, Side.TORCH),
        ("inline-b1", 50, Side.STATECORE),
    ]
    assert len(report.results[0].torch) == 1


def test_a_workload_with_its_own_rounds_runs_that_many_pairs() -> None:
    calls: list[tuple[str, int, Side]] = []
    spawn = attrs.evolve(workload("startup-spawn"), rounds=2)
    report = run_benchmark(
        [spawn, workload("inline-b1")], rounds=3, measure=recording(calls), peak=None
    )
    assert [len(item.ratios) for item in report.results] == [2, 3]


def test_a_run_that_raises_fails_its_workload_and_the_others_still_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def breaks_on_io(workload: Workload, side: Side) -> Measurement:
        if workload.name == "io" and side is Side.STATECORE and workload.batches > 4:
            raise RuntimeError("worker 0 fell over\nmore detail")
        return Measurement(1.0, 10.0)

    report = run_benchmark(
        [workload("io", 8), workload("inline-b1", 8)], rounds=2, measure=breaks_on_io, peak=None
    )
    broken, fine = report.results
    assert broken.error == "statecore raised RuntimeError: worker 0 fell over"
    assert not broken.ok and broken.torch == broken.statecore == ()
    assert fine.ok and len(fine.ratios) == 2
    assert f"{'io':20} {'% ideal':8} FAILED: statecore raised" in report.table()


# --- arithmetic ---------------------------------------------------------------------------------


def test_the_ratio_is_statecore_throughput_over_torch_throughput_in_each_pair() -> None:
    torch_runs = (Measurement(1.0, 100.0), Measurement(2.0, 100.0))
    statecore_runs = (Measurement(0.5, 100.0), Measurement(2.0, 50.0))
    assert pair_ratios(torch_runs, statecore_runs) == (2.0, 0.5)


def test_the_reported_ratio_is_the_median_of_the_pairs_not_a_ratio_of_medians() -> None:
    made_up = result(
        torch_runs=(Measurement(1.0, 1.0), Measurement(1.0, 1.0), Measurement(10.0, 1.0)),
        statecore_runs=(Measurement(2.0, 1.0), Measurement(0.8, 1.0), Measurement(8.0, 1.0)),
    )
    assert made_up.ratios == (0.5, 1.25, 1.25)
    assert made_up.ratio == 1.25


def test_times_are_reported_lower_is_better_and_the_ratio_still_favours_the_faster() -> None:
    made_up = result(
        unit=Unit.US_PER_BATCH,
        torch_runs=(Measurement(0.002, 100.0),),
        statecore_runs=(Measurement(0.001, 100.0),),
    )
    assert made_up.median(Side.TORCH) == pytest.approx(20.0)  # us per batch
    assert made_up.median(Side.STATECORE) == pytest.approx(10.0)
    assert made_up.ratio == pytest.approx(2.0)
    assert Unit.MS.figure(Measurement(0.25, 1.0).throughput) == pytest.approx(250.0)


def test_each_side_reports_its_median_and_range() -> None:
    made_up = made_up_report().results[1]
    assert made_up.figures(Side.TORCH) == pytest.approx((90.0, 80.0, 95.0 / 1.1))
    assert made_up.median(Side.TORCH) == pytest.approx(95.0 / 1.1)
    assert (made_up.low(Side.TORCH), made_up.high(Side.TORCH)) == pytest.approx((80.0, 90.0))


# --- real runs, tiny ----------------------------------------------------------------------------


@WORKERS
def test_a_tiny_real_run_reports_every_figure_present_and_positive() -> None:
    report = run_benchmark([workload("inline-b1"), workload("processes-b64")], rounds=1)
    assert [item.name for item in report.results] == ["inline-b1", "processes-b64"]
    for item, sides in zip(report.results, (2, 3), strict=True):
        figures = [figure for side in item.sides for figure in item.figures(side)]
        figures += [ratio for side in item.sides for ratio in item.ratios_of(side)]
        assert len(figures) == 2 * sides
        assert all(math.isfinite(figure) and figure > 0 for figure in figures)
    assert "inline-b1" in report.table() and "processes-b64" in report.table()
    assert report.machine.memcpy_gb_per_s > 0


@WORKERS
def test_no_worker_outlives_its_run_persistent_ones_included() -> None:
    run_benchmark([workload("epoch2-persistent"), workload("io", 8)], rounds=1, peak=None)
    assert multiprocessing.active_children() == []
    assert multiprocess.active_children() == []


def fake_peak(workload: Workload, side: Side) -> Peak:
    return Peak(
        side, before=100_000_000, peak=100_000_000 + 10_000_000 * (1 + len(side.value)), samples=3
    )


def test_workloads_that_ask_for_it_get_a_memory_row_for_each_loader() -> None:
    report = run_benchmark(
        [workload("epoch2-persistent"), workload("inline-b1")],
        rounds=1,
        measure=recording([]),
        peak=fake_peak,
    )
    measured, unmeasured = report.results
    # Ray's side is opt-in, and its memory is not measured (see loader_bench._peaked).
    assert [peak.side for peak in measured.memory] == [Side.TORCH, Side.STATECORE, Side.THREADS]
    assert unmeasured.memory == ()
    lines = report.table().splitlines()
    row = lines[lines.index(next(line for line in lines if line.startswith("peak memory"))) + 2]
    assert row.split() == ["epoch2-persistent", "60", "(160)", "100", "(200)", "80", "(180)"]


def test_a_memory_run_that_fails_is_reported_and_the_timings_stand() -> None:
    def broken(workload: Workload, side: Side) -> Peak:
        raise memory.MemoryRunFailed("MemoryError: out of memory")

    report = run_benchmark(
        [workload("epoch2-persistent")], rounds=1, measure=recording([]), peak=broken
    )
    (only,) = report.results
    assert only.ok and only.memory == ()
    assert only.memory_error == "torch raised MemoryRunFailed: MemoryError: out of memory"
    assert f"{'epoch2-persistent':20} FAILED: torch raised MemoryRunFailed" in report.table()


# --- output -------------------------------------------------------------------------------------


def test_the_json_reads_back_with_the_same_figures(tmp_path: Path) -> None:
    report = made_up_report()
    path = tmp_path / "bench.json"
    write_json(report, path)
    assert read_json(path) == report
    raw = json.loads(path.read_text())
    io = raw["workloads"][1]
    assert io["ratio"] == report.results[1].ratio
    assert io["torch"]["median"] == report.results[1].median(Side.TORCH)
    assert io["statecore"]["runs"][0] == {
        "seconds": 1.0,
        "work": 0.95,
        "arrivals": [],
        "losses": None,
    }
    assert io["threads"]["median"] == report.results[1].median(Side.THREADS)
    assert io["threads"]["memory"] == {
        "side": "threads",
        "before": 200_000_000,
        "peak": 201_000_000,
        "samples": 70,
    }


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "bench.png"
    plot(made_up_report(), path)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_plotting_without_matplotlib_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependency, match=r"pip install -e '\.\[bench\]'"):
        plot(made_up_report(), "never-written.png")


def test_bench_plot_without_matplotlib_fails_before_running_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def must_not_run(*args: Any, **kwargs: Any) -> BenchReport:
        raise AssertionError("the benchmark ran although --plot cannot work")

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(loader_bench, "run_benchmark", must_not_run)
    code = main(["bench", "--only", "inline-b1", "--plot", str(tmp_path / "bench.png")])
    assert code == 2
    assert INSTALL_HINT in capsys.readouterr().err
    assert not (tmp_path / "bench.png").exists()


def test_the_table_has_a_row_per_workload_with_both_medians_and_the_ratio() -> None:
    table = made_up_report().table()
    row = next(line for line in table.splitlines() if line.startswith("inline-b1 "))
    # torch: 100 batches in 1 s = 10000 us/batch; statecore twice as fast
    assert row.split() == [
        "inline-b1",
        "us/batch",
        "10000",
        "(10000-10000)",
        "5000",
        "(5000-5000)",
        "2.00x",
        "-",
        "-",
        "1",
    ]


def test_the_threads_column_has_its_median_range_and_ratio_against_torch() -> None:
    table = made_up_report().table()
    row = next(line for line in table.splitlines() if line.startswith("io ") and "x" in line)
    # threads: 99, 98, 97 % of the ideal; torch 90, 80, 86.4: per-round ratios 1.1, 1.225, 1.12
    assert row.split()[-4:-1] == ["98.0", "(97.0-99.0)", "1.12x"]


# --- the command line ---------------------------------------------------------------------------


def test_the_cli_passes_quick_only_rounds_and_paths_to_bench(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def fake(**options: Any) -> int:
        seen.update(options)
        return 0

    monkeypatch.setattr(loader_bench, "bench", fake)
    argv = ["bench", "--quick", "--only", "io,cpu", "--rounds", "3", "--json", "out.json"]
    assert main([*argv, "--plot", "out.png"]) == 0
    assert seen["quick"] is True
    assert seen["only"] == ["io", "cpu"]
    assert seen["rounds"] == 3
    assert (seen["json_path"], seen["plot_path"]) == ("out.json", "out.png")
    assert seen["command"] == "python -m statecore " + " ".join([*argv, "--plot", "out.png"])


def test_quick_shrinks_the_epochs_and_explicit_rounds_apply_to_every_workload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[tuple[Workload, ...], int]] = []

    def fake(workloads: Any, rounds: int, **options: Any) -> BenchReport:
        seen.append((tuple(workloads), rounds))
        return made_up_report()

    monkeypatch.setattr(loader_bench, "run_benchmark", fake)
    assert loader_bench.bench(quick=True, only=["inline-b1", "startup-spawn"]) == 0
    assert loader_bench.bench(quick=True, only=["inline-b1", "startup-spawn"], rounds=2) == 0
    (default, default_pairs), (explicit, explicit_pairs) = seen
    assert [item.batches for item in default] == [
        spec.quick_batches for spec in select(["inline-b1", "startup-spawn"])
    ]
    assert default_pairs == loader_bench.QUICK_ROUNDS and default[1].rounds == 1
    assert explicit_pairs == 2 and [item.rounds for item in explicit] == [None, None]


def test_bench_refuses_an_unknown_workload_or_too_few_batches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--only", "nope"]) == 2
    assert "unknown workload(s) nope" in capsys.readouterr().err
    assert main(["bench", "--batches", "1"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--rounds", "0"])


def _must_not_run(*args: Any, **kwargs: Any) -> BenchReport:
    raise AssertionError("the benchmark ran although its output cannot be written")


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_refuses_a_path_in_a_missing_folder_before_running_anything(
    option: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(loader_bench, "run_benchmark", _must_not_run)
    path = tmp_path / "no" / "such" / "out.file"
    assert main(["bench", "--only", "inline-b1", option, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"bench: cannot write {option} {path}: the folder {path.parent} does not exist"
    ]


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_refuses_a_path_that_is_a_folder_or_under_a_file_before_running_anything(
    option: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(loader_bench, "run_benchmark", _must_not_run)
    assert main(["bench", "--only", "inline-b1", option, str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"bench: cannot write {option} {tmp_path}: it is a folder"
    ]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert main(["bench", "--only", "inline-b1", option, str(a_file / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"bench: cannot write {option} {a_file / 'out'}: {a_file} is not a folder"
    ]


def test_bench_refuses_json_and_plot_to_the_same_file_before_running_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(loader_bench, "run_benchmark", _must_not_run)
    path = str(tmp_path / "out")
    assert main(["bench", "--only", "inline-b1", "--json", path, "--plot", path]) == 2
    assert "--json and --plot name the same file" in capsys.readouterr().err


def test_an_output_that_fails_after_the_run_is_one_line_and_the_table_is_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def disk_full(report: BenchReport, path: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loader_bench, "run_benchmark", lambda *args, **kwargs: made_up_report())
    monkeypatch.setattr(loader_bench, "write_json", disk_full)
    path = tmp_path / "bench.json"
    assert main(["bench", "--only", "inline-b1", "--json", str(path)]) == 2
    printed = capsys.readouterr()
    assert "inline-b1" in printed.out
    assert printed.err.splitlines() == [
        f"bench: cannot write --json {path}: No space left on device; "
        "the table above has the figures"
    ]


def test_bench_writes_the_json_and_the_png_it_was_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--only", "inline-b1", "--rounds", "1", "--batches", "4"]
    assert main([*argv, "--json", str(json_path), "--plot", str(png_path)]) == 0
    printed = capsys.readouterr().out
    assert "inline-b1" in printed and "ratio" in printed
    report = read_json(json_path)
    assert [item.name for item in report.results] == ["inline-b1"]
    assert report.command.startswith("python -m statecore bench --only inline-b1")
    assert png_path.read_bytes().startswith(PNG_MAGIC)


# --- the Ray side (bench --ray) -----------------------------------------------------------------


def test_ray_runs_only_when_asked_for_and_only_on_workloads_with_workers() -> None:
    assert Side.RAY not in workload("processes-b64").sides  # the default output is unchanged
    assert workload("processes-b64").with_ray().sides == (
        Side.TORCH,
        Side.STATECORE,
        Side.THREADS,
        Side.RAY,
    )
    assert workload("inline-b1").with_ray().sides == (Side.TORCH, Side.STATECORE)
    assert Side.RAY.loader_class() is Side.STATECORE.loader_class()
    assert Side.RAY.options() == {"executor": "ray"}


def test_with_ray_every_loader_takes_its_turn_in_rotating_rounds() -> None:
    calls: list[tuple[str, int, Side]] = []
    no_warmup = attrs.evolve(workload("processes-b64", 50), warmup=False).with_ray()
    report = run_benchmark([no_warmup], rounds=4, measure=recording(calls), peak=None)
    t, s, h, r = Side.TORCH, Side.STATECORE, Side.THREADS, Side.RAY
    assert [side for _, _, side in calls] == [t, s, h, r, s, h, r, t, h, r, t, s, r, t, s, h]
    result = report.results[0]
    assert result.first == (t, s, h, r)
    assert len(result.ray) == 4 and result.sides == (t, s, h, r)
    assert result.ratio_of(Side.RAY) == 1.0


def test_the_ray_columns_and_json_appear_only_when_ray_ran(tmp_path: Path) -> None:
    plain = made_up_report()
    assert "ray" not in plain.table().splitlines()[0]
    assert all("ray" not in entry for entry in plain.to_json()["workloads"])
    io = plain.results[1]
    # ray: 45, 40, 43.2 % of the ideal against torch's 90, 80, 86.4: 0.5x in every round
    ray_runs = (Measurement(1.0, 0.45), Measurement(1.0, 0.40), Measurement(1.1, 0.475))
    with_ray = attrs.evolve(plain, results=(plain.results[0], attrs.evolve(io, ray=ray_runs)))
    table = with_ray.table()
    assert table.splitlines()[0].split()[-4:] == ["rounds", "ray", "(min-max)", "ratio"]
    row = next(line for line in table.splitlines() if line.startswith("io ") and "x" in line)
    assert row.split()[-3:] == ["43.2", "(40.0-45.0)", "0.50x"]
    inline_row = next(line for line in table.splitlines() if line.startswith("inline-b1 "))
    assert inline_row.split()[-2:] == ["-", "-"]
    assert 'ray: statecore with executor="ray"' in table
    path = tmp_path / "figures.json"
    write_json(with_ray, str(path))
    again = BenchReport.from_json(json.loads(path.read_text()))
    assert again.results[1].ray == ray_runs
    assert again.results[1].ratio_of(Side.RAY) == pytest.approx(0.5)


def test_the_cli_passes_ray_to_bench_and_bench_adds_the_ray_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}
    bench = loader_bench.bench

    def fake(**options: Any) -> int:
        seen.update(options)
        return 0

    monkeypatch.setattr(loader_bench, "bench", fake)
    assert main(["bench", "--ray", "--only", "io"]) == 0
    assert seen["ray"] is True
    assert main(["bench", "--only", "io"]) == 0
    assert seen["ray"] is False

    ran: list[tuple[Workload, ...]] = []

    def run(workloads: Any, rounds: int, **options: Any) -> BenchReport:
        ran.append(tuple(workloads))
        return made_up_report()

    monkeypatch.setattr(loader_bench, "run_benchmark", run)
    monkeypatch.setattr(loader_bench, "_importable", lambda name: True)
    assert bench(only=["io", "inline-b1"], ray=True) == 0
    assert [item.ray for item in ran[0]] == [True, True]
    assert {item.name: Side.RAY in item.sides for item in ran[0]} == {
        "io": True,
        "inline-b1": False,
    }


# --- the auto side (bench --auto) ----------------------------------------------------------------


def test_auto_runs_only_when_asked_for_on_map_style_workloads_with_workers() -> None:
    assert Side.AUTO not in workload("processes-b64").sides  # the default run is unchanged
    assert workload("processes-b64").with_auto().sides == (
        Side.TORCH,
        Side.STATECORE,
        Side.THREADS,
        Side.AUTO,
    )
    assert Side.AUTO not in workload("inline-b1").with_auto().sides  # no workers
    assert Side.AUTO not in workload("processes-iterable").with_auto().sides  # refused there
    assert Side.AUTO.loader_class() is Side.STATECORE.loader_class()
    assert Side.AUTO.options() == {"num_workers": "auto"}


@WORKERS
def test_an_auto_run_builds_its_loader_with_num_workers_auto() -> None:
    import statecore

    built: list[object] = []

    class Recording(statecore.DataLoader):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(kwargs["num_workers"])
            super().__init__(*args, **kwargs)

    measure(workload("processes-b64", 4).with_auto(), Recording, Side.AUTO.options())
    assert built == ["auto"]


def test_the_auto_columns_and_json_appear_only_when_auto_ran(tmp_path: Path) -> None:
    plain = made_up_report()
    assert "auto" not in plain.table().splitlines()[0]
    io = plain.results[1]
    auto_runs = (Measurement(1.0, 0.45), Measurement(1.0, 0.40), Measurement(1.1, 0.475))
    with_auto = attrs.evolve(plain, results=(plain.results[0], attrs.evolve(io, auto=auto_runs)))
    table = with_auto.table()
    assert table.splitlines()[0].split()[-4:] == ["rounds", "auto", "(min-max)", "ratio"]
    row = next(line for line in table.splitlines() if line.startswith("io ") and "x" in line)
    assert row.split()[-3:] == ["43.2", "(40.0-45.0)", "0.50x"]
    assert 'auto: statecore with num_workers="auto"' in table
    path = tmp_path / "figures.json"
    write_json(with_auto, str(path))
    again = BenchReport.from_json(json.loads(path.read_text()))
    assert again.results[1].auto == auto_runs
    assert "auto" not in json.loads(json.dumps(plain.to_json()))["workloads"][1]


def test_the_cli_passes_auto_to_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(loader_bench, "bench", lambda **options: seen.update(options) or 0)
    assert main(["bench", "--auto", "--only", "io"]) == 0
    assert seen["auto"] is True
    assert main(["bench", "--only", "io"]) == 0
    assert seen["auto"] is False


def test_bench_ray_without_ray_installed_names_the_extra_before_running_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.setattr(loader_bench, "run_benchmark", lambda *a, **k: pytest.fail("ran"))
    assert loader_bench.bench(only=["io"], ray=True) == 2
    assert "--ray needs ray, which is not installed: pip install -e '.[ray]'" in (
        capsys.readouterr().err
    )


def test_with_ray_the_memory_runs_are_the_other_loaders_and_every_run_is_counted() -> None:
    heard: list[tuple[str, int, int]] = []
    spec = attrs.evolve(workload("epoch2-persistent"), warmup=False).with_ray()
    report = run_benchmark(
        [spec],
        rounds=1,
        measure=recording([]),
        peak=fake_peak,
        on_run=lambda name, done, total: heard.append((name, done, total)),
    )
    result = report.results[0]
    assert len(result.ray) == 1
    assert [peak.side for peak in result.memory] == [Side.TORCH, Side.STATECORE, Side.THREADS]
    # 4 timed runs and 3 memory runs, all counted: the bar ends full
    assert heard[-1] == ("epoch2-persistent", 7, 7)
