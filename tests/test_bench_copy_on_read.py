"""The copy-on-read workloads of `statecore bench` (pytorch#13246) and their footprint table.

The two workloads load the same records, once from a list of dicts and once from a
`statecore.SharedSequence`, with 4 forked workers, and measure the tree's memory; the table
divides each loader's peak by the one process it started from. No test here measures memory:
the figures come from the bench (docs/performance.md, "Copy-on-read memory").
"""

from __future__ import annotations

import attrs
import pytest

from statecore import SharedSequence
from statecore.tools.copy_on_read import Records
from statecore.tools.loader_bench import BenchReport, Machine, Side, WorkloadResult
from statecore.tools.memory import Peak
from statecore.tools.workloads import Measurement, Timing, Unit, select


def test_the_shared_records_are_the_listed_records_kept_in_a_shared_sequence() -> None:
    listed, shared = Records(300), Records(300, shared=True)
    assert isinstance(listed.records, list) and isinstance(shared.records, SharedSequence)
    assert [shared[i] for i in range(300)] == [listed[i] for i in range(300)]


def test_the_two_workloads_differ_only_in_the_dataset_and_fork_four_workers() -> None:
    plain, shared = select(["copy-on-read", "copy-on-read-shared"])
    assert plain.memory and plain.num_workers == 4
    assert plain.options["multiprocessing_context"] == "fork"
    assert (
        attrs.evolve(shared, name=plain.name, summary=plain.summary, dataset=plain.dataset) == plain
    )
    assert plain.batches * plain.batch_size == pytest.approx(2_000_000, rel=0.01)


def footprint_rows(memory: tuple[Peak, ...]) -> list[str]:
    result = WorkloadResult(
        name="copy-on-read",
        summary="",
        unit=Unit.US_PER_BATCH,
        timing=Timing.EPOCH,
        batches=10,
        batch_size=256,
        num_workers=4,
        torch=(Measurement(1.0, 10.0),),
        statecore=(Measurement(1.0, 10.0),),
        first=(Side.TORCH,),
        threads=(Measurement(1.0, 10.0),),
        memory=memory,
    )
    machine = Machine(cpus=2, platform="", python="", torch="", statecore="")
    lines = BenchReport((result,), machine, 1.0).table().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("peak of the tree")))
    return lines[start + 1 : start + 3]


def test_the_footprint_table_gives_each_loaders_peak_over_the_process_it_started_from() -> None:
    header, row = footprint_rows(
        (
            Peak(Side.TORCH, 700_000_000, 1_960_000_000, 9),
            Peak(Side.STATECORE, 700_000_000, 2_100_000_000, 9),
            Peak(Side.THREADS, 710_000_000, 781_000_000, 9),
        )
    )
    assert header.split() == ["workload", "torch", "statecore", "threads"]
    assert " ".join(row.split()) == "copy-on-read 2.80x of 700 3.00x of 700 1.10x of 710"
