"""Lightning's fit loop runs an epoch resumed on another number of ranks to its loader's end,
and the epochs after it in full, with no callback of the user's.

In one process, quickly: the loader is given its DistributedSampler (rank 0 of M), which a
single-device Trainer leaves in place, and the checkpoint's loader state is the merged states
of N ranks: rank 0's, which Lightning saved, and the other ranks', taken by plain loaders at
the same step. Lightning counts the resumed epoch's batches from the old rank's count and
sized the epoch before the state was loaded; statecore's Lightning callback (installed through
Lightning's `lightning.pytorch.callbacks_factory` entry point) sizes it again after the load.
The growth case runs in the default tier; shrinking and the same-size resume in the exhaustive
one, with real DDP jobs through Lightning (tests/test_elastic_lightning.py).
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning
import pytest
import torch
from _frameworks import Marked, MarkedStream, Recorder
from _lightning_elastic_run import STOP, Preempted, StopAfter
from torch.utils.data import DistributedSampler

from statecore import DataLoader
from statecore.executors import merge_state_dicts
from statecore.executors._lightning import ElasticEpochs

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice on num_workers etc.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(120),
]

SAMPLES, BATCH, EPOCHS = 24, 2, 2  # STOP, the step the first run is preempted after: the DDP run's


def _loader(rank: int, world: int) -> DataLoader[Any]:
    sampler = DistributedSampler(Marked(SAMPLES), num_replicas=world, rank=rank, seed=3)
    return DataLoader(Marked(SAMPLES), batch_size=BATCH, sampler=sampler)


def _trainer(where: Path, **options: Any) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=where,
        **{"max_epochs": EPOCHS, **options},
    )


class _Epochs(Recorder):
    """Records the epoch of each batch too."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(lambda: _loader(rank, world))
        self.epochs: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        self.epochs.append(self.current_epoch)
        return super().training_step(batch, batch_index)

    def batches(self, epoch: int) -> list[list[int]]:
        return [b for b, e in zip(self.indices, self.epochs, strict=True) if e == epoch]


def _checkpoint_of(world: int, where: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of rank 0 of `world` at step STOP, its loader state merged with the other
    ranks' at the same step (taken by plain loaders, as those ranks' would be); and that state."""
    saves = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=where / "checkpoints", every_n_train_steps=STOP, save_top_k=-1
    )
    with pytest.raises(Preempted):
        _trainer(where, callbacks=[saves, StopAfter()]).fit(_Epochs(0, world))
    path = next((where / "checkpoints").glob("*.ckpt"))
    checkpoint = torch.load(path, weights_only=False)
    states = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    others = []
    for rank in range(1, world):
        loader = _loader(rank, world)
        batches = iter(loader)
        list(islice(batches, STOP))
        others.append(loader.state_dict(gather=False))
    merged = merge_state_dicts([states[0], *others])
    states[0] = merged
    torch.save(checkpoint, path)
    return path, merged


def _resumed_on(
    old: int, new: int, where: Path, resumed: _Epochs | None = None
) -> tuple[_Epochs, list[list[int]]]:
    """Rank 0 of `new` (`resumed`, or an `_Epochs`) fitted from rank 0 of `old`'s checkpoint;
    and the batches a plain loader of rank 0 of `new` yields from the same state (statecore's
    share, checked elsewhere)."""
    path, state = _checkpoint_of(old, where / "first")
    alone = _loader(0, new)
    alone.load_state_dict(state)
    share = [batch["index"].tolist() for batch in alone]
    resumed = _Epochs(0, new) if resumed is None else resumed
    _trainer(where / "resumed", enable_checkpointing=False).fit(resumed, ckpt_path=path)
    return resumed, share


class _Validated(_Epochs):
    """Validates as well (on two samples), recording the epoch and batches trained so far."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self.validated: list[tuple[int, int]] = []

    def val_dataloader(self) -> Any:
        return DataLoader(Marked(2), batch_size=2)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> None:
        self.validated.append((self.current_epoch, len(self.epochs)))


def _ordinary(rank: int, world: int, epoch: int) -> list[list[int]]:
    sampler = DistributedSampler(range(SAMPLES), num_replicas=world, rank=rank, seed=3)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i : i + BATCH] for i in range(0, len(order), BATCH)]


def test_an_epoch_resumed_on_more_ranks_runs_to_the_end_of_its_share(tmp_path: Path) -> None:
    # 2 ranks to 3: Lightning sized the epoch at 4 batches, 2 of them done; the share is 3.
    resumed, share = _resumed_on(2, 3, tmp_path)
    assert len(share) == 3
    assert resumed.batches(0) == share
    assert resumed.batches(1) == _ordinary(0, 3, 1)


@pytest.mark.exhaustive
def test_the_epoch_after_one_resumed_on_fewer_ranks_is_the_ordinary_epoch_in_full(
    tmp_path: Path,
) -> None:
    # 3 ranks to 2: the resumed epoch is 5 batches (2 done, a share of 3), the next one 6.
    resumed, share = _resumed_on(3, 2, tmp_path)
    assert resumed.batches(0) == share
    assert resumed.batches(1) == _ordinary(0, 2, 1)


@pytest.mark.exhaustive
def test_validation_at_the_end_of_the_epoch_comes_at_the_end_of_the_resumed_epoch(
    tmp_path: Path,
) -> None:
    # val_check_interval=1.0 (Lightning's default) is sized in batches with the epoch.
    resumed, share = _resumed_on(2, 3, tmp_path, _Validated(0, 3))
    assert isinstance(resumed, _Validated)
    ends = len(share), len(share) + len(_ordinary(0, 3, 1))
    assert resumed.validated == [(0, ends[0]), (1, ends[1])]


@pytest.mark.exhaustive
def test_a_resume_on_as_many_ranks_is_left_to_lightning(tmp_path: Path) -> None:
    resumed, share = _resumed_on(2, 2, tmp_path)
    assert resumed.batches(0) == share == _ordinary(0, 2, 0)[STOP:]
    assert resumed.batches(1) == _ordinary(0, 2, 1)


def test_every_trainer_gets_statecores_callback_with_no_user_code() -> None:
    callbacks = lightning.Trainer(accelerator="cpu", logger=False).callbacks
    assert any(isinstance(c, ElasticEpochs) for c in callbacks), (
        "statecore's Lightning entry point is not registered: reinstall statecore "
        "(pip install -e .), and remove a stale statecore.egg-info from the working directory"
    )


def test_a_lightning_whose_loop_it_cannot_size_gets_a_warning_not_an_error() -> None:
    states = []
    for rank in range(2):
        loader = _loader(rank, 2)
        list(islice(iter(loader), STOP))
        states.append(loader.state_dict(gather=False))
    grown = _loader(0, 3)
    grown.load_state_dict(merge_state_dicts(states))
    batches = iter(grown)  # noqa: F841 (its epoch is the one resumed on 3 ranks)
    callback = ElasticEpochs()
    unknown = SimpleNamespace(callbacks=[callback], train_dataloader=grown, fit_loop=object())
    with pytest.warns(UserWarning, match="cannot size Lightning's epoch .* Resume on as many"):
        callback.on_train_start(unknown, None)  # type: ignore[arg-type]


def test_a_fit_on_a_stream_without_a_length_is_left_alone(tmp_path: Path) -> None:
    # Lightning calls the callback on every fit: a loader with no len() is no elastic epoch.
    module = Recorder(lambda: DataLoader(MarkedStream(8), batch_size=2))
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=False).fit(module)
    assert module.indices == [[0, 1], [2, 3], [4, 5], [6, 7]]


class _StopAt(lightning.Callback):
    """Preempts the run at the start of the step after `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: lightning.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise Preempted


@pytest.mark.exhaustive
def test_an_epoch_resumed_on_more_ranks_and_checkpointed_again_resumes_on_fewer(
    tmp_path: Path,
) -> None:
    # 2 ranks to 3 at step STOP, checkpointed again one step later, resumed on 1: Lightning
    # counts 3 batches done; the share is 5 batches, the next epoch 12.
    first, state = _checkpoint_of(2, tmp_path / "first")
    again = STOP + 1
    saves = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "again", every_n_train_steps=again, save_top_k=-1
    )
    with pytest.raises(Preempted):
        _trainer(tmp_path / "grown", callbacks=[saves, _StopAt(again)]).fit(
            _Epochs(0, 3), ckpt_path=first
        )
    path = next((tmp_path / "again").glob("*.ckpt"))
    checkpoint = torch.load(path, weights_only=False)
    states = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    others = []
    for rank in (1, 2):
        loader = _loader(rank, 3)
        loader.load_state_dict(state)
        batches = iter(loader)
        next(batches)
        others.append(loader.state_dict(gather=False))
    states[0] = merge_state_dicts([states[0], *others])
    torch.save(checkpoint, path)
    alone = _loader(0, 1)
    alone.load_state_dict(states[0])
    share = [batch["index"].tolist() for batch in alone]

    resumed = _Epochs(0, 1)
    _trainer(tmp_path / "resumed", enable_checkpointing=False).fit(resumed, ckpt_path=path)
    assert len(share) == 5
    assert resumed.batches(0) == share
    assert resumed.batches(1) == _ordinary(0, 1, 1)
