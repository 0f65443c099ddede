"""Lightning's fit loop, told how long an epoch resumed on another number of ranks is.

Lightning (2.x) resumes a stateful training loader in `FitLoop.setup_data`: it reads every
loader's `len()` and keeps it as the loader's limit, then loads the checkpoint's loader state,
then sizes the epoch from the loaders' lengths capped by those limits (`max_batches`, and its
data fetcher's `length`), and counts the epoch's batches on from the old rank's count
(`batch_progress`, restored from the checkpoint). On as many ranks as before that is right. On
M ranks after N, a statecore loader's `len()` is this rank's resumed epoch, the batches before
the checkpoint and its share of the rest (executors/_loader.py), which the limit read before
the load does not know:

- on more ranks, the epoch can be longer than the limit: Lightning ends it before the share
  is done (its fetcher says "last batch" at the limit);
- on fewer ranks, it is shorter: Lightning's epoch length is right for it, but Lightning never
  sizes an epoch again, so every later epoch stops at the resumed epoch's length.

`ElasticEpochs` sizes the resumed epoch from the loaders' `len()` after the load
(`on_train_start`, once setup_data is done), and the first epoch after it from the limits
Lightning read (at its first batch); where `val_check_interval` is a fraction of the epoch,
`val_check_batch` goes with the epoch's length. It does nothing in a run with no loader resumed
on another number of ranks. Installed on every Trainer through Lightning's entry point
`lightning.pytorch.callbacks_factory` (pyproject.toml), so no user code is needed.

`trainer.fit_loop.max_batches`, the combined loader's `limits` and `trainer.val_check_batch`
are public; the fit loop's `_combined_loader` and `_data_fetcher` are not. Where a Lightning
has none of these, it warns, naming what it missed, and leaves the loop as it is.
"""

from __future__ import annotations

import warnings
from importlib.metadata import version
from typing import Any

import lightning.pytorch as pl
import torch.utils.data

from statecore.executors._loader import DataLoader

__all__ = ["ElasticEpochs"]


def _resumed_elsewhere(loader: object) -> bool:
    """A statecore loader whose current epoch was resumed on another number of ranks: its
    `len()` (this rank's resumed epoch) is not torch's, the ordinary epoch's."""
    if not isinstance(loader, DataLoader):
        return False
    try:
        return len(loader) != torch.utils.data.DataLoader.__len__(loader)
    except TypeError:  # an iterable dataset without a length: never resumed elsewhere
        return False


def _flattened(loaders: Any) -> list[Any]:
    """The loaders of what `Trainer.train_dataloader` gives: one, or lists and dicts of them."""
    if isinstance(loaders, dict):
        return [dl for value in loaders.values() for dl in _flattened(value)]
    if isinstance(loaders, list | tuple):
        return [dl for value in loaders for dl in _flattened(value)]
    return [loaders]


class ElasticEpochs(pl.Callback):
    """Lets Lightning's fit loop run an epoch resumed on another number of ranks to its
    loaders' end, and the epochs after it at their ordinary length (see the module's doc)."""

    def __init__(self) -> None:
        self._kept: list[int | float] | None = None
        """The limits Lightning read before the load, while the resumed epoch runs."""
        self._after = False
        """The resumed epoch ended: the next epoch is sized at its first batch."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Looked for through the public `train_dataloader` first: a Lightning whose loop this
        # was not written against is told so only where there is an epoch to size.
        if not self._first_of_its_kind(trainer) or not any(
            map(_resumed_elsewhere, _flattened(trainer.train_dataloader))
        ):
            return
        loop = trainer.fit_loop
        try:
            combined = loop._combined_loader
            fetcher = loop._data_fetcher
            assert combined is not None and fetcher is not None
            loaders = list(combined.flattened)
            if combined.limits is None:  # Lightning's setup_data sets them; just in case
                combined.limits = [float("inf")] * len(loaders)
            kept = list(combined.limits)
            # In place: the epoch's iterator, made already, holds this list.
            combined.limits[:] = [
                # A limit below the ordinary epoch is the user's (limit_train_batches): kept.
                len(dl)
                if _resumed_elsewhere(dl) and limit >= torch.utils.data.DataLoader.__len__(dl)
                else limit
                for dl, limit in zip(loaders, kept, strict=True)
            ]
            batches = len(combined)
            self._size(trainer, batches)
            fetcher.length = batches
            self._kept = kept
        except (AttributeError, TypeError, RuntimeError, AssertionError) as error:
            self._cannot(error)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._kept is None:
            return
        try:
            combined = trainer.fit_loop._combined_loader
            assert combined is not None
            assert combined.limits is not None
            combined.limits[:] = self._kept
        except (AttributeError, TypeError, AssertionError) as error:
            self._cannot(error)
        self._kept, self._after = None, True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._after:
            return
        self._after = False
        # The next epoch's iterators are made: the loaders' len() are their ordinary epochs'.
        try:
            combined = trainer.fit_loop._combined_loader
            assert combined is not None
            self._size(trainer, len(combined))
        except (AttributeError, TypeError, RuntimeError, AssertionError) as error:
            self._cannot(error)

    def _first_of_its_kind(self, trainer: pl.Trainer) -> bool:
        # Registered by the entry point and by hand as well: one instance does the work.
        mine = [c for c in getattr(trainer, "callbacks", ()) if isinstance(c, ElasticEpochs)]
        return bool(mine) and mine[0] is self

    @staticmethod
    def _size(trainer: pl.Trainer, batches: int) -> None:
        loop = trainer.fit_loop
        old = loop.max_batches
        loop.max_batches = batches
        interval = trainer.val_check_interval
        # A fraction of the epoch (1.0 by default) was turned into batches of the old length.
        if isinstance(interval, float) and trainer.val_check_batch == max(1, int(old * interval)):
            trainer.val_check_batch = max(1, int(batches * interval))

    @staticmethod
    def _cannot(error: BaseException) -> None:
        warnings.warn(
            "statecore cannot size Lightning's epoch for a loader resumed on another number of "
            f"ranks with this Lightning ({version('lightning')}: {error!r}): the resumed epoch may "
            "end before this rank's share of it is done, or a later epoch early. Resume on as many "
            "ranks as the checkpoint was taken on, or report this Lightning version to statecore",
            stacklevel=2,
        )
