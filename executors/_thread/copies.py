"""Each worker thread's own dataset: a copy, made in the consumer's `iter()`.

Run in the main process. A worker process unpickles the dataset (and with it `worker_init_fn`
and `collate_fn`, when they are its methods); a thread does by hand what unpickling does: see
the package docstring for what is copied and how deeply.
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any

import attrs
import torch
from torch.utils.data import Dataset, IterDataPipe, MapDataPipe

from statecore.executors._worker import DATAPIPE_GRAPH, WorkerSetup

__all__ = ["own_copy", "rebound"]


def own_copy(dataset: Any) -> Any:
    """What one worker loads from. Raises if a datapipe cannot be copied (sharing one breaks
    it); warns and shares anything else that cannot."""
    if isinstance(dataset, IterDataPipe | MapDataPipe):
        with DATAPIPE_GRAPH:
            return copy.deepcopy(dataset)
    if isinstance(dataset, torch.Tensor) or not (
        isinstance(dataset, Dataset) or hasattr(dataset, "__dict__")
    ):
        return dataset
    try:
        return copy.copy(dataset)
    except Exception as error:
        warnings.warn(
            f"The thread executor could not copy the dataset ({type(dataset).__name__}) for "
            f"each worker: {error!r}. Its worker threads share the one object, so what a worker "
            "or worker_init_fn sets on it is seen by every worker. Make the dataset copyable "
            '(copy.copy), or load in worker processes with executor="mp".',
            RuntimeWarning,
            stacklevel=2,
        )
        return dataset


def rebound(setup: WorkerSetup, dataset: Any) -> WorkerSetup:
    """`setup` whose worker_init_fn and collate_fn, if methods of the loader's dataset, are
    methods of the worker's copy `dataset` instead.

    A worker process unpickles the dataset and these functions together, so `ds.init` given as
    worker_init_fn sets its attributes on the worker's copy; a thread must do the same by hand.
    """
    original = setup.dataset
    if dataset is original:
        return setup

    def mine(function: Any) -> Any:
        if getattr(function, "__self__", None) is original and hasattr(function, "__func__"):
            return types.MethodType(function.__func__, dataset)
        return function

    return attrs.evolve(
        setup, worker_init_fn=mine(setup.worker_init_fn), collate_fn=mine(setup.collate_fn)
    )
