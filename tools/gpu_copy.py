"""Large batches to the GPU: torch's `pin_memory=True` against statecore's pinned stage.

    python -m statecore.tools.gpu_copy [--rounds N] [--batches N] [--workers N]

The `large-batches` dataset (20 MB float32 batches, 4 samples of 5 MB, 2 worker processes
unless `--workers` says otherwise), loaded three ways, taking turns in rounds as `bench` does:

- torch: `torch.utils.data.DataLoader(..., pin_memory=True)`, each batch then copied with
  `.to("cuda", non_blocking=True)` in the loop, as a training loop does;
- pinned: statecore's `DataLoader(..., pin_memory=True)`, copied in the loop the same way;
- side stream: statecore with `executor=pinned("mp", device="cuda")`: the stage copies each
  batch on a side stream as soon as it is pinned, and the loop gets device tensors.

Each run reads one value of each device batch (the least a consumer does, and what makes the
loop wait for its copy), from the first batch to the last, and reports the bytes that reached
the device per second (GB/s), with the median of the per-round ratios against torch, and its
share of the link: what copying one batch over and over reaches with no loader at all, from
pinned memory and from ordinary (pageable) memory, measured in the same run. It needs CUDA;
without it, it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.data

import statecore
from statecore.executors import pinned
from statecore.tools.loader_bench import rotated
from statecore.tools.workloads import Floats, close

__all__ = ["LOADERS", "link", "main", "one_run"]

BATCH_SIZE = 4
FLOATS = 1_250_000
WORKERS = 2

Build = Callable[[torch.utils.data.Dataset[Any], torch.device, int], Any]


def _torch(dataset: torch.utils.data.Dataset[Any], device: torch.device, workers: int) -> Any:
    return torch.utils.data.DataLoader(
        dataset, batch_size=BATCH_SIZE, num_workers=workers, pin_memory=True
    )


def _pinned(dataset: torch.utils.data.Dataset[Any], device: torch.device, workers: int) -> Any:
    return statecore.DataLoader(
        dataset, batch_size=BATCH_SIZE, num_workers=workers, pin_memory=True
    )


def _side_stream(dataset: torch.utils.data.Dataset[Any], device: torch.device, workers: int) -> Any:
    return statecore.DataLoader(
        dataset, batch_size=BATCH_SIZE, num_workers=workers, executor=pinned("mp", device=device)
    )


LOADERS: dict[str, Build] = {"torch": _torch, "pinned": _pinned, "side stream": _side_stream}
"""Each loader by the name the report gives it."""


def one_run(
    build: Build, batches: int, device: torch.device, workers: int = WORKERS
) -> tuple[int, float]:
    """The bytes that reached `device` over one epoch of `batches` batches, the first not
    counted, and the seconds they took."""
    loader = build(Floats(batches * BATCH_SIZE, FLOATS), device, workers)
    iterator = iter(loader)
    try:
        next(iterator).to(device, non_blocking=True).reshape(-1)[-1].item()
        torch.cuda.synchronize(device)
        moved = 0
        started = time.perf_counter()
        for batch in itertools.islice(iterator, batches - 1):
            on_device = batch.to(device, non_blocking=True)  # as it is, if already there
            on_device.reshape(-1)[-1].item()
            moved += on_device.nbytes
        torch.cuda.synchronize(device)
        return moved, time.perf_counter() - started
    finally:
        close(iterator)


def link(device: torch.device, pinned_memory: bool, copies: int = 50) -> float:
    """GB/s of copying one batch to `device` `copies` times with no loader: the ceiling any
    loader's figure is read against."""
    batch = torch.ones(BATCH_SIZE * FLOATS)
    if pinned_memory:
        batch = batch.pin_memory()
    batch.to(device, non_blocking=True)  # the first copy pays for the device's allocation
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(copies):
        batch.to(device, non_blocking=True)
    torch.cuda.synchronize(device)
    return copies * batch.nbytes / (time.perf_counter() - started) / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m statecore.tools.gpu_copy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=150, help="batches per epoch")
    parser.add_argument("--workers", type=int, default=WORKERS, help="worker processes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_copy: CUDA is not available here; run it on a machine with a GPU",
            file=sys.stderr,
        )
        return 2
    if args.batches < 2 or args.rounds < 1 or args.workers < 1:
        print("gpu_copy: at least 2 batches, 1 round and 1 worker are needed", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    figures: dict[str, list[float]] = {name: [] for name in LOADERS}
    links: dict[str, list[float]] = {"pinned": [], "pageable": []}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for build in LOADERS.values():  # an untimed warm-up each
            one_run(build, 4, device, args.workers)
        for number in range(args.rounds):
            for kind, runs in links.items():
                runs.append(link(device, pinned_memory=kind == "pinned"))
            for name in rotated(number, tuple(LOADERS)):
                moved, seconds = one_run(LOADERS[name], args.batches, device, args.workers)
                figures[name].append(moved / seconds / 1e9)
    print(
        f"host to {torch.cuda.get_device_name(device)}, {args.batches} batches of 20 MB, "
        f"{args.workers} worker processes:"
    )
    ceiling = statistics.median(links["pinned"])
    for kind, runs in links.items():
        print(
            f"link, {kind:8} {statistics.median(runs):6.2f} GB/s "
            f"({min(runs):.2f}-{max(runs):.2f}), one batch copied over and over, no loader"
        )
    for name, runs in figures.items():
        ratios = [ours / theirs for ours, theirs in zip(runs, figures["torch"], strict=True)]
        print(
            f"{name:12} {statistics.median(runs):6.2f} GB/s ({min(runs):.2f}-{max(runs):.2f}), "
            f"{statistics.median(ratios):.2f}x torch (median of {len(runs)} rounds), "
            f"{statistics.median(runs) / ceiling:.0%} of the pinned link"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
