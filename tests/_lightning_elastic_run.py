"""One rank of a Lightning DDP fit on CPU (gloo), checkpointed mid-epoch or resumed from it.

    python tests/_lightning_elastic_run.py MODE WORLD DIR

MODE: "first" fits until the step after its checkpoint at step STOP, then stops as a
    preemption would; "resumed" fits from that checkpoint (`ckpt_path`) to the end.
WORLD: the number of ranks (the test sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT, so Lightning starts no processes of its own).
DIR: where the checkpoint goes, and `<MODE>-<RANK>.json`: this rank's batches, each with the
    epoch it was trained in.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning
import torch
from _frameworks import Marked, Recorder, close_group, quiet_trainer
from lightning.pytorch.strategies import DDPStrategy

import statecore

SAMPLES = 24
BATCH = 2
STOP = 2  # the step after which the first run is preempted
EPOCHS = 2


def loader() -> Any:
    # Lightning puts a DistributedSampler in it (seed 0, shuffled) for each rank.
    return statecore.DataLoader(Marked(SAMPLES), batch_size=BATCH, shuffle=True)


class Epochs(Recorder):
    """Records the epoch of each batch too."""

    def __init__(self) -> None:
        super().__init__(loader)
        self.epochs: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_index: int) -> torch.Tensor:
        self.epochs.append(self.current_epoch)
        return super().training_step(batch, batch_index)


class Preempted(Exception):
    """Ends the first run right after its checkpoint."""


class StopAfter(lightning.Callback):
    # At the start of the next step: Lightning runs checkpoint callbacks last at a step's end.
    def on_train_batch_start(self, trainer: lightning.Trainer, *args: Any) -> None:
        if trainer.global_step == STOP:
            raise Preempted


def main(mode: str, world: int, where: Path) -> None:
    module = Epochs()
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
    if mode == "first":
        saves = lightning.pytorch.callbacks.ModelCheckpoint(
            dirpath=where / "checkpoints", every_n_train_steps=STOP, save_top_k=-1
        )
        trainer = lightning.Trainer(
            accelerator="cpu",
            devices=world,
            max_epochs=EPOCHS,
            strategy=strategy,
            callbacks=[saves, StopAfter()],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=where,
        )
        with contextlib.suppress(Preempted):
            trainer.fit(module)
    else:
        checkpoint = next((where / "checkpoints").glob("*.ckpt"))
        # No callback of ours: statecore's own (its Lightning entry point) sizes the epoch.
        trainer = quiet_trainer(devices=world, max_epochs=EPOCHS, strategy=strategy)
        trainer.fit(module, ckpt_path=checkpoint)
    rank = os.environ["RANK"]
    record = {"indices": module.indices, "epochs": module.epochs}
    (where / f"{mode}-{rank}.json").write_text(json.dumps(record))
    close_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
