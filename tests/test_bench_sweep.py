"""`python -m statecore bench --sweep` (`statecore.tools.sweep`): fixed worker counts and
`num_workers="auto"` side by side. No timing is asserted: only the report's shape and the
arithmetic of its figures."""

from __future__ import annotations

import io
import json
import multiprocessing
import statistics
from pathlib import Path

import attrs
import multiprocess
import pytest
from _side_by_side import WORKERS

from statecore.tools import sweep
from statecore.tools.loader_bench import rotated
from statecore.tools.sweep import AUTO, COUNTS, SweepResult, SweepRun, TuningSummary


def _result(medians: dict[sweep.Count, list[float]]) -> SweepResult:
    tuning = TuningSummary(True, 3, ((20, "add", 3, "the loop waited"),), 0.5, "settled")
    runs = {
        count: tuple(SweepRun(100, 100 / rate, tuning if count == AUTO else None) for rate in rates)
        for count, rates in medians.items()
    }
    return SweepResult(sweep.SWEEP[0], runs, tuple(COUNTS[:1]))


def test_the_best_fixed_count_is_the_one_with_the_highest_median_and_auto_is_not_a_candidate() -> (
    None
):
    result = _result({1: [10, 11, 12], 2: [30, 20, 25], 4: [22, 23, 24], AUTO: [40, 41, 42]})
    assert result.best == 2


def test_autos_ratio_is_its_median_over_the_best_counts_median() -> None:
    result = _result({1: [10, 11, 12], 2: [30, 20, 25], AUTO: [20, 24, 30]})
    assert result.ratio == pytest.approx(24 / 25)


def test_the_table_gives_each_counts_lowest_and_highest_run_under_its_median() -> None:
    result = _result({1: [10, 11, 12], 2: [30, 20, 25], AUTO: [20, 24, 30]})
    result = attrs.evolve(result, first=(1, 2, AUTO))
    lines = sweep.SweepReport((result,), 1.0, 2).table().splitlines()
    assert lines[3].split() == ["lowest", "10.0", "20.0", "20.0"]
    assert lines[4].split() == ["highest", "12.0", "30.0", "30.0"]
    assert result.to_json()["spread"] == {
        "1": [10.0, 12.0],
        "2": [20.0, 30.0],
        "auto": [20.0, 30.0],
    }


def test_a_run_timed_from_iter_counts_the_first_batch_and_the_start_up_before_it() -> None:
    run = SweepRun(99, 1.5, started=0.5)
    assert run.throughput == pytest.approx(99 / 1.5)
    assert run.from_iter == pytest.approx(100 / 2.0)


def test_from_iter_the_best_count_and_autos_ratio_are_judged_on_the_start_up_too() -> None:
    # 16 workers are fastest once started, but take 1.5 s to start; auto starts in 0.1 s.
    runs = {
        2: (SweepRun(99, 2.0, started=0.1),),
        16: (SweepRun(99, 1.0, started=1.5),),
        AUTO: (SweepRun(99, 1.2, TuningSummary(True, 16, (), 0.0, "settled"), started=0.1),),
    }
    result = SweepResult(sweep.SWEEP[0], runs, (2,))
    assert (result.best, result.best_from_iter) == (16, 2)
    assert result.ratio == pytest.approx(1.0 / 1.2)
    assert result.ratio_from_iter == pytest.approx(2.1 / 1.3)
    assert result.to_json()["ratio_from_iter"] == pytest.approx(2.1 / 1.3)
    table = sweep.SweepReport((result,), 1.0, 2).table()
    assert "from iter(), start-up in every count's clock: best fixed 2; auto/best = 1.62" in table


def test_the_memory_sampler_takes_at_most_a_fifth_of_a_core() -> None:
    took = 0.05  # 10 workers' page tables walked
    pause = sweep.sampler_pause(took)
    assert took / (took + pause) == pytest.approx(sweep.SAMPLER_SHARE)
    assert sweep.SAMPLER_SHARE <= 0.2
    assert sweep.sampler_pause(0.0) == sweep.INTERVAL


def test_the_rounds_rotate_so_each_count_and_auto_go_first_in_turn() -> None:
    taking = (*COUNTS, AUTO)
    firsts = [rotated(number, taking)[0] for number in range(len(taking))]
    assert firsts == list(taking)


@WORKERS
def test_the_quickest_sweep_runs_every_count_and_auto_and_reports_them(tmp_path: Path) -> None:
    out, errors = io.StringIO(), io.StringIO()
    path = tmp_path / "sweep.json"
    code = sweep.sweep(
        quick=True,
        only=["io-4ms"],
        rounds=1,
        batches=3,
        json_path=str(path),
        stream=out,
        errors=errors,
    )
    assert code == 0, errors.getvalue()
    (result,) = json.loads(path.read_text())["results"]
    assert set(result["medians"]) == {*map(str, COUNTS), AUTO}
    assert all(len(runs) == 1 for runs in result["runs"].values())
    fixed = {count: result["medians"][str(count)] for count in COUNTS}
    assert result["best"] == max(fixed, key=fixed.__getitem__)
    assert result["ratio"] == pytest.approx(result["medians"][AUTO] / fixed[result["best"]])
    (auto_run,) = result["runs"][AUTO]
    assert auto_run["tuning"] is not None and result["settled_on"] == [
        auto_run["tuning"]["workers"]
    ]
    medians = [run["batches"] / run["seconds"] for run in result["runs"]["1"]]
    assert fixed[1] == pytest.approx(statistics.median(medians))
    whole = [
        (run["batches"] + 1) / (run["started"] + run["seconds"]) for run in result["runs"]["1"]
    ]
    assert result["medians_from_iter"]["1"] == pytest.approx(statistics.median(whole))
    assert all(run["started"] > 0 for runs in result["runs"].values() for run in runs)
    table = out.getvalue()
    assert "io-4ms" in table and "auto/best" in table and "best fixed" in table
    if sweep.AVAILABLE:
        assert set(result["memory"]) == {*map(str, COUNTS), AUTO}
        assert "peak memory added" in table
    assert multiprocessing.active_children() == [] and multiprocess.active_children() == []


def test_an_unknown_sweep_workload_is_refused_with_the_names_there_are() -> None:
    errors = io.StringIO()
    assert sweep.sweep(only=["nope"], stream=io.StringIO(), errors=errors) == 2
    assert "nope" in errors.getvalue() and "io-4ms" in errors.getvalue()


def test_a_training_step_spins_its_cpu_time() -> None:
    import time

    started = time.thread_time()
    sweep.spin(0.01)
    assert time.thread_time() - started >= 0.01


@WORKERS
def test_the_lengths_study_runs_each_length_with_the_counts_and_auto_in_turn() -> None:
    results = sweep.lengths(sweep.select_sweep(["io-4ms"]), batches=(3, 4), counts=(1, 2))
    assert [result.workload.batches for result in results] == [3, 4]
    for result in results:
        assert tuple(result.runs) == (1, 2, AUTO)
        assert all(len(runs) == 2 for runs in result.runs.values())
        assert result.first == (1, 2)  # two rounds, rotated
        assert all(run.batches == result.workload.batches - 1 for run in result.runs[1])
    table = sweep.study_table(results, "n")
    assert "n=1" in table and "auto/best" in table
    assert multiprocessing.active_children() == [] and multiprocess.active_children() == []


@WORKERS
def test_the_prefetch_study_keys_its_runs_by_prefetch_factor_and_reports_autos_bound() -> None:
    workload = sweep.select_sweep(["io-4ms"])[0].resized(3)
    (result,) = sweep.prefetch([workload], workers=2, factors=(1, 2), rounds=1)
    assert tuple(result.runs) == (1, 2, AUTO)
    assert result.best in (1, 2)
    (auto_run,) = result.runs[AUTO]
    assert auto_run.tuning is not None and auto_run.tuning.prefetch is not None
    assert all(run.tuning is None for run in result.runs[1])
    assert "pf=1" in sweep.study_table([result], "pf")


def test_a_prefetch_change_is_summarised_with_the_bound_it_set_not_the_workers() -> None:
    from types import SimpleNamespace

    from statecore import TuningMove
    from statecore.executors._autotune import AutoTuning, TuningRecord

    raised = TuningRecord(17, 0, TuningMove.RAISE_PREFETCH, 16, "the loop waited", 0, 4)
    tuning = AutoTuning(16, 2, None, 16, True, (raised,), "held", prefetch=4, tunes_workers=False)
    loader = SimpleNamespace(stats=lambda: SimpleNamespace(tuning=tuning))
    summary = sweep._tuning(loader, [0.0, 1.0] * 10)  # type: ignore[arg-type]
    assert summary.changes == ((17, "raise prefetch", 4, "the loop waited"),)
    assert summary.prefetch == 4
    assert "b17 raise prefetch->4" in summary.describe()


@WORKERS
def test_the_studies_command_prints_a_line_per_workload_and_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = sweep.main(["lengths", "--only", "io-4ms", "--batches", "3", "--counts", "1"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("io-4ms") and " 3 " in line for line in lines)
    assert sweep.main(["prefetch", "--only", "nope"]) == 2
