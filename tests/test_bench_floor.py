"""The floor of the large-batch workload: its batches made by threads with no loader.

`bench` times it, and the floor with a hand-over (the same threads handing each batch to the
main thread, still no loader), once a round beside the loaders, and gives the threads' figure
as a share of each. No test here asserts on speed: the floors' own runs are checked for their
work, the rounds' arithmetic on made-up timings.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import attrs
import pytest
import torch

from statecore.executors._thread.storages import new_storage
from statecore.tools import floor as floors
from statecore.tools.floor import handover_floor, threads_floor
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


def made_storages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the storages the floors make with the thread executor's `new_storage`,
    from now on."""
    sizes: list[int] = []

    def recorded(nbytes: int) -> torch.UntypedStorage:
        sizes.append(nbytes)
        return new_storage(nbytes)

    monkeypatch.setattr(floors, "new_storage", recorded)
    return sizes


@pytest.mark.timeout(60)
def test_the_floors_batches_are_made_as_the_thread_executor_makes_its_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes = made_storages(monkeypatch)
    threads_floor(large_batches(6))
    assert sizes == [4 * 1_250_000 * 4] * 2  # one batch tensor a thread


@pytest.mark.timeout(60)
def test_the_floor_with_a_hand_over_makes_its_pool_as_the_thread_executor_makes_its_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes = made_storages(monkeypatch)
    handover_floor(large_batches(6))
    assert sizes == [4 * 1_250_000 * 4] * (2 * floors.PREFETCH + 1)


def test_the_floor_refuses_a_workload_not_measured_in_bytes() -> None:
    with pytest.raises(ValueError, match="inline-b1: a floor is measured in GB/s, not us/batch"):
        threads_floor(select(["inline-b1"])[0])


@pytest.mark.timeout(60)
def test_the_floor_with_a_hand_over_makes_the_steady_stretchs_batches_and_counts_their_bytes() -> (
    None
):
    workload = large_batches(7)
    run = handover_floor(workload)
    batch_bytes = workload.batch_size * 1_250_000 * 4
    assert run.work == 6 * batch_bytes
    assert run.seconds > 0


@pytest.mark.timeout(60)
def test_the_floor_with_a_hand_over_gives_the_threads_their_batches_in_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Batch k to thread k mod threads, as torch's loaders give batch k to worker k mod
    # num_workers: a thread done early waits for its turn, as a loader's worker does.
    made: list[tuple[str, int]] = []
    real = floors.torch.stack

    def stack(samples: list[torch.Tensor], **kwargs: object) -> torch.Tensor:
        first_index = int(samples[0][0].item())
        made.append((threading.current_thread().name, first_index // len(samples)))
        return real(samples, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(floors.torch, "stack", stack)
    workload = large_batches(9)
    handover_floor(workload)
    # This thread writes the pool's tensors before the clock: not batches of the run.
    taken = [(name, batch) for name, batch in made if name.startswith("handover-floor")]
    by_thread = {(name, batch % workload.workers) for name, batch in taken}
    assert len(by_thread) == workload.workers == len({name for name, _ in taken})
    assert sorted(batch for _, batch in taken) == list(range(9))


def test_the_floor_with_a_hand_over_refuses_a_workload_not_measured_in_bytes() -> None:
    with pytest.raises(ValueError, match="inline-b1: a floor is measured in GB/s, not us/batch"):
        handover_floor(select(["inline-b1"])[0])


class Broken(Exception):
    pass


@pytest.mark.timeout(60)
def test_the_floor_with_a_hand_over_raises_what_a_thread_raised_and_stops_its_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def stack(*args: object, **kwargs: object) -> None:
        raise Broken("no room")

    monkeypatch.setattr(floors.torch, "stack", stack)
    before = threading.active_count()
    with pytest.raises(Broken, match="no room"):
        handover_floor(large_batches(6))
    assert threading.active_count() == before


def test_only_the_large_batch_workload_times_a_floor() -> None:
    assert [workload.name for workload in select() if workload.floor] == ["large-batches"]


def made_up_rounds(rounds: int, workload: Workload | None = None) -> tuple[BenchReport, list[str]]:
    """`rounds` rounds of large-batches with stand-ins: the floor makes 10 bytes a second, the
    floor with a hand-over 9.6, threads 9, the others 5; the order of every run is recorded."""
    order: list[str] = []

    def fake(workload: Workload, side: Side) -> Measurement:
        order.append(side.value)
        return Measurement(1.0, 9.0 if side is Side.THREADS else 5.0)

    def floor(workload: Workload) -> Measurement:
        order.append("floor")
        return Measurement(1.0, 10.0)

    def handover(workload: Workload) -> Measurement:
        order.append("handover")
        return Measurement(1.0, 9.6)

    report = run_benchmark(
        [workload or large_batches()],
        rounds,
        measure=fake,
        peak=None,
        floor=floor,
        handover=handover,
    )
    return report, order


def test_the_floors_run_once_a_round_on_either_side_of_the_threads_run() -> None:
    _, order = made_up_rounds(2)
    first, second = order[:5], order[5:]
    assert first == ["torch", "statecore", "floor", "threads", "handover"]
    assert second == ["statecore", "handover", "threads", "floor", "torch"]


def test_the_warm_up_runs_the_floors_too() -> None:
    _, order = made_up_rounds(1, attrs.evolve(large_batches(), warmup=True))
    assert order[:5] == ["torch", "statecore", "floor", "threads", "handover"]
    assert len(order) == 10


def test_a_floor_that_raises_is_named_in_the_workloads_error() -> None:
    def fake(workload: Workload, side: Side) -> Measurement:
        return Measurement(1.0, 5.0)

    def handover(workload: Workload) -> Measurement:
        raise Broken("no room")

    report = run_benchmark(
        [large_batches()],
        1,
        measure=fake,
        peak=None,
        floor=lambda workload: Measurement(1.0, 10.0),
        handover=handover,
    )
    assert report.results[0].error == "the floor with a hand-over raised Broken: no room"


def test_the_table_gives_the_threads_figure_as_a_share_of_the_floor() -> None:
    report, _ = made_up_rounds(3)
    (result,) = report.results
    assert result.floor_shares(Side.THREADS) == pytest.approx((0.9, 0.9, 0.9))
    line = next(line for line in report.table().splitlines() if "floor" in line)
    assert line.startswith("large-batches: floor (its batches made by 2 threads with no loader)")
    assert "threads 90% (90-90), statecore 50% (50-50)" in line
    assert line.endswith("goal for threads: at least 90%")


def test_the_table_gives_the_floor_with_a_hand_over_as_a_share_of_the_floor() -> None:
    report, _ = made_up_rounds(3)
    (result,) = report.results
    assert result.handover_shares() == pytest.approx((0.96, 0.96, 0.96))
    assert result.handover_shares(Side.THREADS) == pytest.approx((0.9375,) * 3)
    line = next(line for line in report.table().splitlines() if "with a hand-over" in line)
    assert line.startswith("large-batches: floor with a hand-over (")
    assert line.endswith("96% (96-96) of the floor; threads 94% (94-94) of it")


def test_the_floors_runs_survive_the_json(tmp_path: Path) -> None:
    report, _ = made_up_rounds(2)
    path = tmp_path / "bench.json"
    write_json(report, path)
    written = json.loads(path.read_text())["workloads"][0]
    assert len(written["floor"]["runs"]) == len(written["handover"]["runs"]) == 2
    again = read_json(path)
    assert again.results[0].floor == report.results[0].floor
    assert again.results[0].handover == report.results[0].handover
    assert isinstance(again.machine, Machine)
