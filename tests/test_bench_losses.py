"""Where the workers' time went: the bench's account of the time that was not work.

For samples that wait, every worker's elapsed time is its samples' work plus four losses
(starting, within a batch, between batches, the epoch's end); these tests check the
arithmetic on made-up spans, and that a real run's account adds up to its efficiency.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils.data
from _side_by_side import WORKERS

from statecore.tools.loader_bench import (
    BenchReport,
    Machine,
    Side,
    WorkloadResult,
    read_json,
    write_json,
)
from statecore.tools.workloads import (
    Losses,
    Measurement,
    Sleeps,
    Timing,
    Unit,
    Workload,
    losses,
    measure,
)


def spans(*samples: tuple[float, float, int]) -> list[torch.Tensor]:
    """One batch as default collate makes it of `Sleeps` samples: seconds, starts, threads."""
    seconds, starts, threads = zip(*samples, strict=True)
    return [
        torch.tensor(seconds, dtype=torch.float64),
        torch.tensor(starts, dtype=torch.float64),
        torch.tensor(threads),
    ]


def test_each_gap_of_a_worker_is_counted_where_it_falls() -> None:
    # One worker, run from 10.0 to 20.0: starts at 11, two batches of two samples, done at 19.
    notes = [
        spans((2.0, 11.0, 7), (1.0, 13.5, 7)),  # a gap of 0.5 within the batch
        spans((1.0, 16.0, 7), (2.0, 17.0, 7)),  # 1.5 between the batches, none within
    ]
    assert losses(notes, 10.0, 20.0, workers=1) == Losses(
        starting=0.1, in_batch=0.05, between=0.15, ending=0.1
    )


def test_the_losses_and_the_work_add_up_to_every_workers_whole_time() -> None:
    notes = [spans((1.0, 0.5, 1), (0.5, 1.75, 1)), spans((2.0, 0.25, 2))]
    lost = losses(notes, 0.0, 3.0, workers=2)
    assert lost is not None
    work = (1.0 + 0.5 + 2.0) / (2 * 3.0)
    assert work + lost.total == pytest.approx(1.0)


def test_a_worker_that_loaded_nothing_counts_as_starting_the_whole_run() -> None:
    lost = losses([spans((1.0, 0.0, 1))], 0.0, 1.0, workers=2)
    assert lost == Losses(starting=0.5, in_batch=0.0, between=0.0, ending=0.0)


def test_batches_without_spans_have_no_account() -> None:
    assert losses([torch.tensor([0.25, 0.25])], 0.0, 1.0, workers=1) is None
    assert losses([], 0.0, 1.0, workers=1) is None


@WORKERS
@pytest.mark.timeout(120)
def test_a_real_epoch_of_waiting_samples_accounts_for_all_of_its_time() -> None:
    waits = Workload(
        "waits",
        "2 ms samples, 2 workers",
        lambda size: Sleeps(size, seconds=0.002),
        batch_size=2,
        num_workers=2,
        unit=Unit.EFFICIENCY,
        timing=Timing.EPOCH,
        batches=6,
        quick_batches=6,
    )
    run = measure(waits, torch.utils.data.DataLoader)
    assert run.losses is not None
    efficiency = run.throughput
    assert efficiency + run.losses.total == pytest.approx(1.0)
    assert min(run.losses.starting, run.losses.in_batch, run.losses.ending) >= 0.0


def waiting_result() -> WorkloadResult:
    slow = Losses(starting=0.02, in_batch=0.01, between=0.03, ending=0.04)
    fast = Losses(starting=0.01, in_batch=0.0, between=0.01, ending=0.0)
    return WorkloadResult(
        name="io",
        summary="samples that wait, made up",
        unit=Unit.EFFICIENCY,
        timing=Timing.EPOCH,
        batches=10,
        batch_size=2,
        num_workers=2,
        torch=(Measurement(1.0, 0.9, (), slow), Measurement(1.0, 0.8), Measurement(1.0, 0.7)),
        statecore=(
            Measurement(1.0, 0.98, (), fast),
            Measurement(1.0, 0.99),
            Measurement(1.0, 0.97),
        ),
        first=(Side.TORCH, Side.STATECORE, Side.TORCH),
    )


def test_the_account_shown_is_that_of_each_loaders_median_run() -> None:
    result = waiting_result()
    assert result.median_run(Side.TORCH).work == 0.8  # figures 90, 80, 70
    assert result.median_run(Side.STATECORE).work == 0.98


def test_the_table_shows_the_work_and_each_loss_in_percent(tmp_path: Path) -> None:
    result = waiting_result()
    report = BenchReport(results=(result,), machine=Machine.here(), seconds=1.0)
    rows = report.losses_table()
    assert rows[0].startswith("where the workers' time went")
    # torch's median run carries no account, so only statecore's row is shown.
    assert rows[2:] == [
        f"{'io':20} {'statecore':9} {'98.0':>9} {'1.0':>9} {'0.0':>9} {'1.0':>9} {'0.0':>9}"
    ]
    path = tmp_path / "bench.json"
    write_json(report, path)
    assert read_json(path) == report
