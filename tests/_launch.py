"""A `Launch` for a map-style dataset, to build executors directly in tests."""

from __future__ import annotations

from typing import Any

from torch.utils.data import default_collate
from torch.utils.data.dataloader import _DatasetKind

from statecore.executors import Launch
from statecore.executors._worker import WorkerSetup

__all__ = ["launch"]


def launch(dataset: Any, workers: int) -> Launch:
    """`workers` workers loading `dataset` one index a batch, collated as torch does."""
    setup = WorkerSetup(
        dataset=dataset,
        dataset_kind=_DatasetKind.Map,
        auto_collation=True,
        collate_fn=default_collate,
        drop_last=False,
        base_seed=0,
        num_workers=workers,
    )
    return Launch(setup, workers)
