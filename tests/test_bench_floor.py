"""The floor of the large-batch workload: its batches made by threads with no loader.

`bench` times it once a round beside the loaders, and gives the threads' figure as a share of
it. No test here asserts on speed: the floor's own run is checked for its work, the rounds'
arithmetic on made-up timings.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from statecore.tools.floor import threads_floor
from statecore.tools.loader_bench import (
    BenchReport,
    Machine,
    Side,
    read_json,
    run_benchmark,
    write_json,
)
from statecore.tools.workloads import Measurement, Workload, select


def large_batches(batches: int = 6) -> Workload:
    return attrs.evolve(select(["large-batches"])[0].resized(batches), warmup=False)


@pytest.mark.timeout(60)
def test_the_floor_makes_the_steady_stretchs_batches_and_counts_their_bytes() -> None:
    workload = large_batches(6)
    run = threads_floor(workload)
    batch_bytes = workload.batch_size * 1_250_000 * 4
    assert run.work == 5 * batch_bytes  # every batch but the first, as the loaders are timed
    assert run.seconds > 0


def test_the_floor_refuses_a_workload_not_measured_in_bytes() -> None:
    with pytest.raises(ValueError, match="inline-b1: a floor is measured in GB/s, not us/batch"):
        threads_floor(select(["inline-b1"])[0])


def test_only_the_large_batch_workload_times_a_floor() -> None:
    assert [workload.name for workload in select() if workload.floor] == ["large-batches"]


def made_up_rounds(rounds: int) -> tuple[BenchReport, list[str]]:
    """`rounds` rounds of large-batches with stand-ins: the floor makes 10 bytes a second,
    threads 9, the others 5; the order of every run is recorded."""
    order: list[str] = []

    def fake(workload: Workload, side: Side) -> Measurement:
        order.append(side.value)
        return Measurement(1.0, 9.0 if side is Side.THREADS else 5.0)

    def floor(workload: Workload) -> Measurement:
        order.append("floor")
        return Measurement(1.0, 10.0)

    report = run_benchmark([large_batches()], rounds, measure=fake, peak=None, floor=floor)
    return report, order


def test_the_floor_runs_once_a_round_last_in_even_rounds_and_first_in_odd_ones() -> None:
    _, order = made_up_rounds(2)
    first, second = order[:4], order[4:]
    assert first == ["torch", "statecore", "threads", "floor"]
    assert second == ["floor", "statecore", "threads", "torch"]


def test_the_table_gives_the_threads_figure_as_a_share_of_the_floor() -> None:
    report, _ = made_up_rounds(3)
    (result,) = report.results
    assert result.floor_shares(Side.THREADS) == pytest.approx((0.9, 0.9, 0.9))
    line = next(line for line in report.table().splitlines() if "floor" in line)
    assert line.startswith("large-batches: floor (its batches made by 2 threads with no loader)")
    assert "threads 90% (90-90), statecore 50% (50-50)" in line
    assert line.endswith("goal for threads: at least 90%")


def test_the_floors_runs_survive_the_json(tmp_path: Path) -> None:
    report, _ = made_up_rounds(2)
    path = tmp_path / "bench.json"
    write_json(report, path)
    assert len(json.loads(path.read_text())["workloads"][0]["floor"]["runs"]) == 2
    again = read_json(path)
    assert again.results[0].floor == report.results[0].floor
    assert isinstance(again.machine, Machine)
