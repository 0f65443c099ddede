"""The images workload of `python -m statecore bench` (`statecore.tools.images`): JPEGs made once
and cached, the sample pipeline, the CPU of a process tree, the loaders side by side, the peers
skipped with their install line when missing, and where the CPU went."""

from __future__ import annotations

import io
import multiprocessing
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from statecore.tools import images, loader_bench
from statecore.tools.cli import main
from statecore.tools.images import (
    CROP,
    Contender,
    Jpegs,
    TreeClock,
    contenders,
    encoded_images,
    run_images,
)
from statecore.tools.workloads import select

pytest.importorskip("PIL")

TINY = 6
"""A handful of images: each loader's epoch is a few batches."""


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def named(*names: str) -> tuple[Contender, ...]:
    return tuple(contender for contender in contenders() if contender.name in names)


def test_the_images_are_made_once_and_read_back_from_the_cache(cache: Path) -> None:
    made = encoded_images(3, cache)
    (kept,) = cache.iterdir()
    written = kept.stat().st_mtime_ns
    assert encoded_images(3, cache) == made
    assert kept.stat().st_mtime_ns == written
    assert all(image[:2] == b"\xff\xd8" for image in made)  # the JPEG start-of-image marker
    assert all(50_000 < len(image) < 200_000 for image in made)


def test_the_cache_folder_is_the_option_else_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("STATECORE_CACHE", str(tmp_path / "from-env"))
    assert images.cache_folder() == tmp_path / "from-env"
    assert images.cache_folder(tmp_path / "given") == tmp_path / "given"


def test_a_sample_is_a_normalised_crop_and_its_label(cache: Path) -> None:
    from PIL import Image

    dataset = Jpegs(3, cache)
    assert Image.open(io.BytesIO(dataset.images[2])).size == (images.WIDTH, images.HEIGHT)
    tensor, label = dataset[2]
    assert tensor.shape == (3, CROP, CROP) and tensor.dtype == torch.float32
    assert label == 2
    # (0 - mean) / std to (255 - mean) / std, for ImageNet's means and deviations
    assert float(tensor.min()) > -2.2 and float(tensor.max()) < 2.7


def test_a_staged_sample_carries_the_cpu_of_each_stage_and_where_it_ran(cache: Path) -> None:
    dataset = Jpegs(2, cache, stages=True)
    _, _, cpu = dataset[0]
    decode, augment, tensor, collate, here = cpu.tolist()
    assert decode > 0 and augment >= 0 and tensor >= 0
    assert collate == 0.0 and here == 1.0


@pytest.mark.timeout(60)
def test_the_tree_clock_counts_a_worker_once_alive_and_once_reaped() -> None:
    clock = TreeClock()
    before = clock.seconds()
    context = multiprocessing.get_context("fork")
    burnt, release = context.Event(), context.Event()
    worker = context.Process(target=_burn, args=(0.4, burnt, release))
    worker.start()
    try:
        assert burnt.wait(30)
        alive = clock.seconds() - before
    finally:
        release.set()
        worker.join(30)
    reaped = clock.seconds() - before
    assert alive >= 0.35  # the child's CPU, counted while it lives
    assert reaped == pytest.approx(alive, abs=0.1)  # and neither lost nor doubled once reaped


def _burn(seconds: float, burnt: Any, release: Any) -> None:
    started = time.process_time()
    while time.process_time() - started < seconds:
        pass
    burnt.set()
    release.wait(30)


def spdl_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if spdl were not installed: importing it raises ImportError."""
    for name in [module for module in sys.modules if module.split(".")[0] == "spdl"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "spdl", None)


def test_a_missing_peer_is_skipped_with_its_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spdl_missing(monkeypatch)
    heard: list[str] = []
    asked = named("torch", "spdl-process", "spdl-thread")
    running = images.available_contenders(asked, heard.append)
    assert [contender.name for contender in running] == ["torch"]
    assert heard == [
        f"images: {name} skipped, spdl is not installed: pip install 'spdl==0.8.*' "
        "(or pip install -e '.[peers]' in the statecore checkout)"
        for name in ("spdl-process", "spdl-thread")
    ]


@pytest.mark.timeout(120)
def test_a_run_without_a_peer_says_so_in_its_table_and_times_the_others(
    monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    spdl_missing(monkeypatch)
    report = run_images(
        TINY, 1, batch_size=2, cache=cache, every=named("torch", "spdl-thread"), say=print
    )
    assert list(report.runs) == ["torch"]
    row = next(line for line in report.table().splitlines() if line.startswith("spdl-thread"))
    assert "skipped: spdl is not installed: pip install 'spdl==0.8.*'" in row


def _refuses(dataset: Jpegs, arguments: dict[str, Any]) -> Any:
    raise RuntimeError("no loader today\nsecond line")


@pytest.mark.timeout(120)
def test_a_loader_that_raises_is_reported_and_the_others_still_run(cache: Path) -> None:
    broken = Contender("broken", _refuses)
    report = run_images(TINY, 2, batch_size=2, cache=cache, every=(*named("torch"), broken))
    assert list(report.runs) == ["torch"] and len(report.runs["torch"]) == 2
    row = next(line for line in report.table().splitlines() if line.startswith("broken"))
    assert row.split(None, 1)[1] == "FAILED: raised RuntimeError: no loader today"


def everyone_available() -> tuple[Contender, ...]:
    return tuple(contender for contender in contenders() if contender.missing() is None)


@pytest.mark.timeout(180)
def test_a_tiny_run_times_every_loader_taking_turns_with_positive_figures(cache: Path) -> None:
    every = everyone_available()
    report = run_images(TINY, 2, batch_size=2, cache=cache, every=every, say=print)
    assert list(report.runs) == [contender.name for contender in every]
    for name, runs in report.runs.items():
        assert [run.images for run in runs] == [TINY, TINY], name
        assert all(run.seconds > 0 and run.cpu > 0 for run in runs), name
        assert report.speed(name) > 0 and report.cpu(name) > 0
    assert report.speed("torch") == report.cpu("torch") == 1.0
    table = report.table()
    assert all(f"\n{name} " in table for name in report.runs)
    assert "goals, statecore's best column" in table


@pytest.mark.timeout(120)
def test_the_breakdown_splits_each_loaders_cpu_by_stage_and_process(cache: Path) -> None:
    report = run_images(
        TINY, 1, batch_size=2, cache=cache, breakdown=True, every=named("statecore", "threads")
    )
    processes, threads = report.breakdown["statecore"].stages, report.breakdown["threads"].stages
    assert processes is not None and threads is not None
    for stages in (processes, threads):
        assert stages.decode > 0 and stages.collate > 0
        assert sum(stages.shares()) == pytest.approx(1.0)
    assert threads.workers < 0.05  # thread workers: no worker process had any CPU to count
    assert "where the CPU went" in report.table()


@pytest.mark.timeout(120)
def test_the_breakdown_counts_the_page_faults_of_collating_into_fresh_memory(
    cache: Path,
) -> None:
    # torch's workers collate every batch into a shared-memory segment of its own, whose pages
    # fault as collate first writes them: a batch of two samples is 1.2 MB, about 290 pages.
    report = run_images(TINY, 1, batch_size=2, cache=cache, breakdown=True, every=named("torch"))
    pages = 2 * 3 * CROP * CROP * 4 // 4096
    assert report.breakdown["torch"].collate_faults >= (TINY // 2) * pages // 2
    assert "faults" in report.table()


def test_the_workload_is_listed_and_runs_itself() -> None:
    (workload,) = select(["images"])
    assert workload.own_bench == "statecore.tools.images"
    assert (workload.batch_size, workload.num_workers) == (64, 2)


@pytest.fixture
def only_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(images, "contenders", lambda: named("torch"))
    yield


@pytest.mark.timeout(120)
def test_bench_only_images_prints_the_images_table(
    only_torch: None, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = io.StringIO()
    code = loader_bench.bench(
        only=["images"], batches=2, rounds=1, cache=str(cache), stream=stream, memory=False
    )
    assert code == 0
    lines = stream.getvalue().splitlines()
    assert lines[0] == "$ python -m statecore bench"
    assert lines[1].startswith("images: 128 JPEGs of about 100 kB")
    assert any(line.startswith("torch ") for line in lines)


def test_without_pillow_the_workload_names_what_to_install_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    heard: list[str] = []
    (workload,) = select(["images"])
    assert images.bench_workload(workload, 1, say=heard.append) == 2
    assert heard == [
        "bench: the images workload needs Pillow, which is not installed: "
        "pip install -e '.[peers]' in the statecore checkout"
    ]


def test_the_cli_passes_the_cache_and_the_breakdown_to_bench(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, Any] = {}

    def fake(**options: Any) -> int:
        seen.update(options)
        return 0

    monkeypatch.setattr(loader_bench, "bench", fake)
    assert main(["bench", "--only", "images", "--cache", "/tmp/x", "--breakdown"]) == 0
    assert (seen["cache"], seen["breakdown"]) == ("/tmp/x", True)
