"""Training frameworks that replace the DataLoader they are given.

Lightning needs nothing from here: it rebuilds a loader by calling its class again, with the
arguments it recorded or read back from the loader's attributes, so the rebuilt loader is a
statecore loader with the same executor.

HF accelerate does not call the class again. `Accelerator.prepare` wraps each DataLoader in one
of its own (`DataLoaderShard`, or `DataLoaderDispatcher` when batches are dispatched from the
main process) around a fresh loader it builds from the original's torch arguments: a plain
torch DataLoader, or torchdata's `StatefulDataLoader` with `use_stateful_dataloader=True`. A
statecore loader handed to `accelerator.prepare` therefore stops running statecore.
`prepare_with_accelerate` prepares through accelerate exactly as before, then puts a statecore
loader, built from the arguments accelerate chose (its sharded batch sampler included) and the
original's executor, in place of the torch loader inside accelerate's wrapper. The wrapper
keeps doing its part: device placement, end-of-epoch bookkeeping, `set_epoch`, gradient
accumulation. See docs/frameworks.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.utils.data

from statecore.executors._loader import DataLoader

__all__ = ["prepare_with_accelerate"]

# The torch arguments that a built loader keeps as attributes of the same name.
_KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def prepare_with_accelerate(
    accelerator: Any, *objects: Any, device_placement: list[bool] | None = None
) -> Any:
    """`accelerator.prepare(*objects)`, with every statecore DataLoader still loading through
    statecore.

    Takes and returns what `Accelerator.prepare` does (models, optimizers and schedulers pass
    through to it untouched); each prepared loader that came from a statecore loader is
    accelerate's own wrapper, as usual, around a statecore loader with the original's executor.
    """
    prepared = accelerator.prepare(*objects, device_placement=device_placement)
    results = prepared if len(objects) > 1 else (prepared,)
    for original, result in zip(objects, results, strict=True):
        if isinstance(original, DataLoader) and result is not original:
            _put_statecore_inside(result, original)
    return prepared


def _put_statecore_inside(wrapper: Any, original: DataLoader[Any]) -> None:
    # vars(), not getattr(): accelerate's wrappers forward unknown attributes to what they wrap.
    inner = vars(wrapper).get("base_dataloader")
    if inner is None:
        warnings.warn(
            f"accelerate replaced a statecore DataLoader by a {type(wrapper).__name__}, which "
            "wraps no base_dataloader that statecore could stand in for: its batches will not "
            "be loaded by statecore",
            stacklevel=3,
        )
        return
    if type(inner) is not torch.utils.data.DataLoader:
        # torchdata's StatefulDataLoader (use_stateful_dataloader=True) keeps a state_dict
        # that statecore cannot produce; say so rather than load through it unannounced.
        warnings.warn(
            f"accelerate built a {type(inner).__name__} in place of a statecore DataLoader and "
            "statecore cannot stand in for it (with use_stateful_dataloader=True, accelerate "
            "needs torchdata's state_dict): its batches will not be loaded by statecore",
            stacklevel=3,
        )
        return
    wrapper.base_dataloader = DataLoader(**_torch_arguments(inner), executor=original.executor)


def _torch_arguments(loader: torch.utils.data.DataLoader[Any]) -> dict[str, Any]:
    """Arguments that build a loader handing over what `loader` hands over, read back from it."""
    arguments = {name: getattr(loader, name) for name in _KEPT}
    arguments["dataset"] = loader.dataset
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        # torch refuses a sampler for an iterable dataset, and builds its own batcher.
        arguments.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is None and loader.batch_sampler is not None:
        # A batch sampler was given: torch then keeps batch_size=None and drop_last=False.
        arguments.update(batch_sampler=loader.batch_sampler)
    else:
        arguments.update(
            sampler=loader.sampler, batch_size=loader.batch_size, drop_last=loader.drop_last
        )
    return arguments
