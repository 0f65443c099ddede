"""Datasets and a collate function that say who loaded each sample, and a Lightning module
that records the batches it is given.

Shared by tests/test_frameworks_*.py and by the processes they start (tests/_lightning_run.py).
It imports Lightning and torch but not statecore: those processes choose when statecore is
imported.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import multiprocess
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

ELSEWHERE = 0
"""Loaded by the calling thread, or by one of torch's worker processes."""
STATECORE_THREAD = 1
"""Loaded by a worker thread of statecore's "thread" executor."""
STATECORE_PROCESS = 2
"""Loaded by a worker process of statecore's "mp" executor."""


def who_loads() -> int:
    """Which of the above is running the calling code.

    statecore starts its worker processes with the `multiprocess` package, torch with the
    standard library's `multiprocessing`: each package knows only the parents it started. A
    worker info in a process that no one started is a worker thread, which only statecore has.
    """
    if multiprocess.parent_process() is not None:
        return STATECORE_PROCESS
    if get_worker_info() is not None and multiprocessing.parent_process() is None:
        return STATECORE_THREAD
    return ELSEWHERE


class Marked(Dataset):  # type: ignore[type-arg]
    """Sample i: its index, a feature to train on, and who loaded it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "x": float(index), "loader": who_loads()}


class MarkedStream(IterableDataset):  # type: ignore[type-arg]
    """Samples 0..n-1 as `Marked` gives them, split between the workers by index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, self.n, step):
            yield {"index": index, "x": float(index), "loader": who_loads()}


def collate_marked(samples: list[Any]) -> Any:
    """torch's default collation, plus who collated the batch under the key "loader"."""
    batch = default_collate(samples)
    batch["loader"] = torch.tensor([who_loads()])
    return batch


class Recorder(lightning.LightningModule):
    """Trains a single weight, keeping the indices and loader marks of every batch it is given.

    `make_loader`, if given, is what its train and predict dataloader hooks return.
    """

    def __init__(self, make_loader: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.make_loader = make_loader
        self.indices: list[list[int]] = []
        self.loaders: list[list[int]] = []

    def train_dataloader(self) -> Any:
        assert self.make_loader is not None, "pass the loader to fit, or a make_loader"
        return self.make_loader()

    def predict_dataloader(self) -> Any:
        return self.train_dataloader()

    def _record(self, batch: dict[str, torch.Tensor]) -> None:
        self.indices.append(batch["index"].tolist())
        self.loaders.append(batch["loader"].tolist())

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        self._record(batch)
        loss: torch.Tensor = self.layer(batch["x"].float().unsqueeze(1)).sum()
        return loss

    def predict_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> None:
        self._record(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def quiet_trainer(**options: Any) -> lightning.Trainer:
    """A CPU trainer that writes nothing: no logger, checkpoint, progress bar or summary."""
    return lightning.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def close_group() -> None:
    """Ends a rank of a DDP fit: once every rank is here, they close the process group together.

    Lightning leaves the gloo group up. Left to the interpreter's exit, its threads were torn
    down while another rank's end still talked to them, and a rank aborted ("terminate called
    without an active exception") after its work was done.
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
