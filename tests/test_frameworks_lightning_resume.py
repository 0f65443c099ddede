"""Lightning saves a statecore loader's state in its checkpoints and resumes from it mid-epoch.

Lightning keeps the `state_dict()` of every training loader that has one in the checkpoint, and
loads it into the new loader when `fit(ckpt_path=...)` resumes. A run stopped mid-epoch and
resumed must then train on exactly the batches an uninterrupted run trains on after that step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from _frameworks import Marked, Recorder

from statecore import DataLoader

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice on num_workers etc.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(240),
]

STOP = 7  # the step after which the first run is "preempted"


def _loader(executor: str, workers: int) -> Any:
    return DataLoader(
        Marked(40),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(11),
        num_workers=workers,
        executor=executor,
    )


def _trainer(tmp_path: Path, **options: Any) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **options,
    )


class _Preempted(Exception):
    """Ends the first run right after its checkpoint, as a preemption would."""


class _StopAfter(lightning.Callback):
    # At the start of the next step: Lightning runs checkpoint callbacks last at a step's end.
    def on_train_batch_start(self, trainer: lightning.Trainer, *args: Any) -> None:
        if trainer.global_step == STOP:
            raise _Preempted


@pytest.mark.parametrize(("executor", "workers"), [("inline", 0), ("thread", 2), ("mp", 2)])
def test_a_run_resumed_from_a_mid_epoch_checkpoint_trains_on_the_batches_of_an_unbroken_run(
    tmp_path: Path, executor: str, workers: int
) -> None:
    unbroken = Recorder(lambda: _loader(executor, workers))
    _trainer(tmp_path / "unbroken", max_epochs=2, enable_checkpointing=False).fit(unbroken)
    assert len(unbroken.indices) == 20

    saves = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", every_n_train_steps=STOP, save_top_k=-1
    )
    first = Recorder(lambda: _loader(executor, workers))
    with pytest.raises(_Preempted):
        _trainer(tmp_path / "first", max_epochs=2, callbacks=[saves, _StopAfter()]).fit(first)
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))
    assert "combined_loader" in str(torch.load(checkpoint, weights_only=False)["loops"])

    resumed = Recorder(lambda: _loader(executor, workers))
    trainer = _trainer(tmp_path / "resumed", max_epochs=2, enable_checkpointing=False)
    trainer.fit(resumed, ckpt_path=checkpoint)

    assert first.indices == unbroken.indices[:STOP]
    assert resumed.indices == unbroken.indices[STOP:]


class _Drawing(Recorder):
    """Also draws from torch's global generator at every step, as dropout would."""

    def __init__(self, make_loader: Any) -> None:
        super().__init__(make_loader)
        self.draws: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        self.draws.append(torch.rand(1).item())
        return super().training_step(batch, batch_index)


def _on_global(executor: str, workers: int) -> Any:
    return DataLoader(
        Marked(40), batch_size=4, shuffle=True, num_workers=workers, executor=executor
    )


@pytest.mark.parametrize(("executor", "workers"), [("inline", 0), ("mp", 2)])
def test_a_resumed_run_goes_on_with_the_unbroken_runs_global_random_stream(
    tmp_path: Path, executor: str, workers: int
) -> None:
    # Shuffled from torch's global generator, which Lightning does not restore on a resume:
    # the loader's state puts it back, so the training code's draws and the later epochs'
    # shuffles are the unbroken run's.
    unbroken = _Drawing(lambda: _on_global(executor, workers))
    torch.manual_seed(5)
    _trainer(tmp_path / "unbroken", max_epochs=3, enable_checkpointing=False).fit(unbroken)

    saves = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", every_n_train_steps=STOP, save_top_k=-1
    )
    first = _Drawing(lambda: _on_global(executor, workers))
    torch.manual_seed(5)
    with pytest.raises(_Preempted):
        _trainer(tmp_path / "first", max_epochs=3, callbacks=[saves, _StopAfter()]).fit(first)
    checkpoint = next((tmp_path / "checkpoints").glob("*.ckpt"))

    resumed = _Drawing(lambda: _on_global(executor, workers))
    torch.manual_seed(999)  # the restarted program's global generator is elsewhere
    trainer = _trainer(tmp_path / "resumed", max_epochs=3, enable_checkpointing=False)
    trainer.fit(resumed, ckpt_path=checkpoint)

    assert first.indices + resumed.indices == unbroken.indices
    assert first.draws + resumed.draws == unbroken.draws
