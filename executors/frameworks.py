"""Training frameworks that replace the DataLoader they are given.

Lightning rebuilds a loader by calling its class again, with the arguments it recorded or read
back from the loader's attributes, so the rebuilt loader is a statecore loader with the same
executor. It needs one callback, for an epoch resumed on another number of ranks, whose length
it would take from before the state was loaded: `lightning_callbacks` gives it to every Trainer
through Lightning's entry point (executors/_lightning.py).

HF accelerate does not call the class again. `Accelerator.prepare` wraps each DataLoader in one
of its own (`DataLoaderShard`, or `DataLoaderDispatcher` when batches are dispatched from the
main process) around a fresh loader it builds from the original's torch arguments: a plain
torch DataLoader, or torchdata's `StatefulDataLoader` with `use_stateful_dataloader=True`. A
statecore loader handed to `accelerator.prepare` would therefore stop running statecore.

So once accelerate and statecore are both imported (statecore/_frameworks.py's import hook,
whichever comes first), `Accelerator.prepare_data_loader`, which `prepare` calls for every
loader, is wrapped (`keep_statecore_under_accelerate`): it prepares exactly as before, then puts
a statecore loader, built from the arguments accelerate chose (its sharded batch sampler
included) and the original's statecore arguments (`executor`, `trace`,
`snapshot_every_n_steps`), in place of the torch loader inside accelerate's wrapper. The
wrapper keeps doing its part: device placement, end-of-epoch bookkeeping, `set_epoch`,
gradient accumulation. Loaders that are not statecore's are left as accelerate makes them.

Why the wrapping is safe: accelerate 1.0 and 1.15 (the oldest the `frameworks` extra allows and
the one tested) both route `prepare` through that method, return a loader prepared already as
it is, and keep the loader they build as the wrapper's `base_dataloader`. Where that does not
hold (an accelerate without the method, XLA's loader, torchdata's `StatefulDataLoader`),
statecore warns and leaves accelerate's loader in place, never silently.

`prepare_with_accelerate` (the way before the hook) does the same through `prepare` and stays
for code that calls it. See docs/frameworks.md.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

import torch.utils.data

from statecore.executors._loader import DataLoader

__all__ = ["keep_statecore_under_accelerate", "lightning_callbacks", "prepare_with_accelerate"]

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


_KEEPS = "__statecore_keeps_its_loaders__"
"""Marks the wrapped `prepare_data_loader`, so that the hook wraps it once."""


def keep_statecore_under_accelerate() -> None:
    """Have `Accelerator.prepare` and `Accelerator.prepare_data_loader` keep statecore loaders
    loading through statecore; called by statecore's import hook once accelerate is imported.

    Idempotent. Never raises: an accelerate without the method to wrap gets a warning naming
    `prepare_with_accelerate`.
    """
    try:
        # The hook runs once accelerate is imported: take it from there (importing it here would
        # make it look like a dependency of the plain install, which it is not).
        Accelerator = sys.modules["accelerate"].Accelerator
        prepare = Accelerator.prepare_data_loader
    except Exception as error:  # an accelerate that is not the one this was written against
        warnings.warn(
            f"statecore cannot keep its DataLoaders inside accelerate's prepare ({error!r}): "
            "`accelerator.prepare` will load their batches through torch's DataLoader; prepare "
            "them with statecore.executors.frameworks.prepare_with_accelerate",
            stacklevel=2,
        )
        return
    if getattr(prepare, _KEEPS, False):
        return

    @functools.wraps(prepare)
    def prepare_data_loader(self: Any, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = prepare(self, data_loader, *args, **kwargs)
        # A loader prepared already comes back as it is (and claims its inner loader's class).
        if isinstance(data_loader, DataLoader) and prepared is not data_loader:
            _put_statecore_inside(prepared, data_loader)
        return prepared

    setattr(prepare_data_loader, _KEEPS, True)
    Accelerator.prepare_data_loader = prepare_data_loader


def lightning_callbacks() -> list[Any]:
    """The callbacks statecore puts on every Lightning Trainer, through Lightning's entry point
    `lightning.pytorch.callbacks_factory` (see pyproject.toml): `ElasticEpochs`, which sizes
    Lightning's epoch for a loader resumed on another number of ranks and does nothing
    otherwise (executors/_lightning.py). An install without statecore's entry points (a copy
    on `sys.path`) passes them by hand: `Trainer(callbacks=lightning_callbacks())`.
    """
    from statecore.executors._lightning import ElasticEpochs  # imports Lightning

    return [ElasticEpochs()]


def prepare_with_accelerate(
    accelerator: Any, *objects: Any, device_placement: list[bool] | None = None
) -> Any:
    """`accelerator.prepare(*objects)`, with every statecore DataLoader still loading through
    statecore: what the plain `accelerator.prepare` does too once statecore's hook is in place
    (`keep_statecore_under_accelerate`); kept for code written before it.

    Takes and returns what `Accelerator.prepare` does (models, optimizers and schedulers pass
    through to it untouched); each prepared loader that came from a statecore loader is
    accelerate's own wrapper, as usual, around a statecore loader with the original's executor
    (and its other statecore arguments).
    """
    keep_statecore_under_accelerate()
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
    if isinstance(inner, DataLoader):
        return  # statecore's already: the hook put it there
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
    wrapper.base_dataloader = DataLoader(
        **_torch_arguments(inner),
        executor=original.executor,
        snapshot_every_n_steps=original.snapshot_every_n_steps,
        trace=original.trace,
    )


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
