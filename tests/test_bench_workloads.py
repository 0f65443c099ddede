"""The benchmark's workloads (`statecore.tools.workloads`): what each run measures, in which
unit, and that every dataset is one a worker process can load."""

from __future__ import annotations

import pickle

import attrs
import pytest
import torch
import torch.utils.data
from _side_by_side import WORKERS

from statecore.tools.workloads import (
    WORKLOADS,
    Measurement,
    Timing,
    Unit,
    Workload,
    is_straggler,
    measure,
    select,
)


class FixedWork(torch.utils.data.Dataset[float]):
    """Samples that report a fixed amount of work (0.25 s) without doing any."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> float:
        return 0.25


class SmallTensors(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((1000,), float(index))


def test_efficiency_is_the_ideal_over_the_elapsed_time_and_gb_per_s_counts_bytes() -> None:
    assert Unit.EFFICIENCY.figure(Measurement(2.0, 1.5).throughput) == pytest.approx(75.0)
    assert Unit.GB_PER_S.figure(Measurement(0.5, 2e9).throughput) == pytest.approx(4.0)


@WORKERS
def test_the_ideal_is_the_work_the_samples_measured_spread_over_the_workers() -> None:
    fixed = Workload(
        "fixed",
        "samples that report 0.25 s of work",
        FixedWork,
        batch_size=3,
        num_workers=2,
        unit=Unit.EFFICIENCY,
        timing=Timing.EPOCH,
        batches=4,
        quick_batches=4,
    )
    run = measure(fixed, torch.utils.data.DataLoader)
    assert run.work == pytest.approx(4 * 3 * 0.25 / 2)


def test_the_steady_state_counts_the_batches_and_bytes_after_the_first() -> None:
    large = Workload(
        "small-tensors",
        "4 KB samples",
        SmallTensors,
        batch_size=2,
        num_workers=0,
        unit=Unit.GB_PER_S,
        timing=Timing.STEADY,
        batches=5,
        quick_batches=5,
    )
    assert measure(large, torch.utils.data.DataLoader).work == 4 * 2 * 1000 * 4
    per_batch = attrs.evolve(large, unit=Unit.US_PER_BATCH)
    assert measure(per_batch, torch.utils.data.DataLoader).work == 4


@pytest.mark.parametrize("spec", WORKLOADS, ids=lambda spec: spec.name)
def test_every_dataset_is_defined_at_module_level_and_pickles(spec: Workload) -> None:
    dataset = spec.dataset(8)
    assert "<locals>" not in type(dataset).__qualname__
    copy = pickle.loads(pickle.dumps(dataset))
    assert type(copy) is type(dataset) and len(copy) == 8


def test_stragglers_are_about_one_in_twenty_and_land_on_every_worker() -> None:
    slow = [index for index in range(4000) if is_straggler(index, 20)]
    assert 150 <= len(slow) <= 250
    # batch size 4, 4 workers taking batches round robin: batch b goes to worker b % 4
    assert {(index // 4) % 4 for index in slow} == {0, 1, 2, 3}


def test_an_unknown_workload_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown workload.*nope.*choose from.*inline-b1"):
        select(["inline-b1", "nope"])


def test_the_plain_run_leaves_out_the_studies_that_run_only_when_named() -> None:
    plain = {workload.name for workload in select()}
    named_only = {workload.name for workload in WORKLOADS if workload.when_named}
    assert {"copy-on-read", "images", "big-dataset-spawn"} <= named_only
    assert plain == {workload.name for workload in WORKLOADS} - named_only


def test_a_workload_that_runs_only_when_named_runs_when_named() -> None:
    (workload,) = select(["big-dataset-forkserver"])
    assert workload.when_named


def test_the_straggler_runs_keep_when_each_batch_arrived() -> None:
    fixed = Workload(
        "fixed",
        "samples that report 0.25 s of work",
        FixedWork,
        batch_size=3,
        num_workers=0,
        unit=Unit.EFFICIENCY,
        timing=Timing.EPOCH,
        batches=4,
        quick_batches=4,
        timeline=True,
    )
    run = measure(fixed, torch.utils.data.DataLoader)
    assert len(run.arrivals) == 4
    assert list(run.arrivals) == sorted(run.arrivals) and run.arrivals[-1] == run.seconds
    assert measure(attrs.evolve(fixed, timeline=False), torch.utils.data.DataLoader).arrivals == ()
