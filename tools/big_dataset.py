"""A big in-memory dataset for the start-up workloads under spawn and forkserver.

`Catalogue` stands for what pytorch#139792 describes: a dataset object of hundreds of
megabytes, a tensor of samples plus a Python index over them, which torch pickles once per
worker, one worker after the other, when it starts spawn or forkserver workers. Its pickle is
the whole object (no `__getstate__` shortcut), so every loader sends what a user's dataset
would make it send: the tensor's storage and every entry of the index.

Defined at module level, so that spawn and forkserver workers unpickle it by name.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.utils.data

__all__ = ["FULL_SIZE", "ROW_FLOATS", "Catalogue", "Part", "breakdown", "main", "serial_estimate"]

ROW_FLOATS = 448
"""float32 values per sample: 1,792 bytes, so 262,144 samples make a 470 MB tensor."""
FULL_SIZE = 262_144
"""Samples of the full-size dataset (the bench's `big-dataset-*` workloads)."""


class Catalogue(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """`size` samples: rows of one float32 tensor, found through a Python index.

    `names` lists a name per sample and `index` maps each name to its row and label, as a
    dataset built from a manifest file holds them: with 262,144 samples the tensor is 470 MB
    and the index about 50 MB of Python objects. Sample i is (row, label) of the i-th name;
    row r holds the values r * ROW_FLOATS onwards, so a sample says where it came from.
    """

    def __init__(self, size: int, row_floats: int = ROW_FLOATS) -> None:
        self.names = [f"sample-{number:08d}" for number in range(size)]
        # Rows in an order of their own, so the index is not the identity a loader could skip.
        rows = torch.randperm(size, generator=torch.Generator().manual_seed(size)).tolist()
        self.index = {name: (row, row % 1000) for name, row in zip(self.names, rows, strict=True)}
        # arange then reshape: every page written, as a loaded dataset's are.
        self.data = torch.arange(size * row_floats, dtype=torch.float32).reshape(size, row_floats)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, number: int) -> tuple[torch.Tensor, int]:
        row, label = self.index[self.names[number]]
        return self.data[row], label

    @property
    def nbytes(self) -> int:
        """The tensor's bytes (the index comes on top)."""
        return self.data.nbytes


# --- where the time to the first batch goes ------------------------------------------------------


@attrs.frozen
class Part:
    """One part of starting workers on a `Catalogue`: seconds, torch's and statecore's."""

    name: str
    torch: float
    statecore: float
    how: str
    """How it was measured, in a few words."""


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _import_time(module: str) -> float:
    """Seconds for a fresh interpreter to import `module` and exit: a spawned worker's start."""
    command = [sys.executable, "-c", f"import {module}"]
    return _timed(lambda: subprocess.run(command, check=True, timeout=600))


def breakdown(size: int, workers: int = 4) -> tuple[Part, ...]:
    """The parts of starting `workers` spawn workers on a `Catalogue` of `size` samples, each
    measured on its own in this process (the interpreter start in a fresh one).

    Pickling is per worker for torch (it pickles the dataset for each), once for statecore; the
    shared-memory copy (moving the tensor's storage to shared memory) is once for both.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the reductions torch sends with
    from torch.utils.data import default_collate

    from statecore.executors._mp.wire import Shipment, unpack_setup
    from statecore.executors._worker import WorkerSetup

    # By its module's name even when this module runs as `__main__`: statecore pickles code of
    # `__main__` with dill (a worker may not find it by name), as for a dataset of a script.
    from statecore.tools.big_dataset import Catalogue as ByName

    dataset = ByName(size)
    copy = _timed(dataset.data.share_memory_)  # the tensor is shared from now on
    torch_pickle = ForkingPickler.dumps(dataset)
    torch_pickling = workers * _timed(lambda: ForkingPickler.dumps(dataset))
    setup = WorkerSetup(
        dataset=dataset,
        dataset_kind=0,
        auto_collation=True,
        collate_fn=default_collate,
        drop_last=False,
        base_seed=0,
        num_workers=workers,
    )
    shipment = Shipment.pack(setup)
    ours_pickling = _timed(lambda: Shipment.pack(setup)) + workers * _timed(shipment.for_worker)
    torch_unpickling = _timed(lambda: pickle.loads(torch_pickle))
    ours_unpickling = _timed(lambda: unpack_setup(*shipment.for_worker()))
    torch_start = _import_time("torch.utils.data")
    ours_start = _import_time("statecore.executors._mp.worker")
    batch = _timed(lambda: default_collate([dataset[number] for number in range(64)]))
    return (
        Part("pickling the dataset", torch_pickling, ours_pickling, f"{workers} pickles / 1"),
        Part("shared-memory copy of the tensor", copy, copy, "once each"),
        Part("worker interpreter start (spawn)", torch_start, ours_start, "one, alone"),
        Part("unpickling in a worker", torch_unpickling, ours_unpickling, "one worker's"),
        Part("first batch (64 samples)", batch, batch, "fetch and collate"),
    )


def serial_estimate(parts: Sequence[Part], workers: int) -> tuple[float, float]:
    """What the parts add up to before the first batch under spawn, torch's and statecore's.

    torch starts the workers one after another, each start waiting until the worker has
    imported torch and read its pickle, and sends the first task once all have started: the
    copy, every pickle, then per worker a start and an unpickling, then the batch. statecore
    starts the first worker, pickles while it imports, and sends it the first task at once:
    the longer of (copy and pickling) and a start, then one unpickling and the batch.
    """
    by_name = {part.name: part for part in parts}
    pickling, copy, start, unpickling, batch = (
        by_name[name]
        for name in (
            "pickling the dataset",
            "shared-memory copy of the tensor",
            "worker interpreter start (spawn)",
            "unpickling in a worker",
            "first batch (64 samples)",
        )
    )
    torch_total = (
        copy.torch + pickling.torch + workers * (start.torch + unpickling.torch) + batch.torch
    )
    ours_total = (
        max(copy.statecore + pickling.statecore, start.statecore)
        + unpickling.statecore
        + batch.statecore
    )
    return torch_total, ours_total


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m statecore.tools.big_dataset [--quick]`: the breakdown, as a table."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m statecore.tools.big_dataset",
        description="where the time to the first batch of a big dataset goes, part by part",
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the dataset")
    parser.add_argument("--workers", type=int, default=4)
    arguments = parser.parse_args(argv)
    size = FULL_SIZE // 4 if arguments.quick else FULL_SIZE
    parts = breakdown(size, arguments.workers)
    print(
        f"{size} samples, {size * ROW_FLOATS * 4 / 1e6:.0f} MB tensor, {arguments.workers} workers"
    )
    print(f"{'part':36} {'torch s':>9} {'statecore s':>12}  measured")
    for part in parts:
        print(f"{part.name:36} {part.torch:9.3f} {part.statecore:12.3f}  {part.how}")
    torch_total, ours_total = serial_estimate(parts, arguments.workers)
    print(
        f"{'sum as each starts workers (spawn)':36} {torch_total:9.3f} {ours_total:12.3f}  "
        f"ratio {torch_total / ours_total:.2f}x (bench measures the real thing)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
