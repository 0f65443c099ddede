"""Lightning in a fresh interpreter, with the modules imported in a chosen order.

    python tests/_lightning_run.py ORDER MODE OUT

ORDER: the modules to import first, comma-separated, in that order, as a user's module would.
    Leave statecore out and the dataloader hook imports it, inside Lightning's call to it.
MODE: "predict", in this one process (Lightning rebuilds every predict loader), or "ddp", one
    rank of a two-process DDP fit on CPU with gloo (the test sets RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT, so Lightning starts no processes of its own).
OUT: the JSON file to write: for each case, the batches the module was given and the class and
    executor of the loader Lightning ended up with.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

for _name in filter(None, sys.argv[1].split(",")):
    importlib.import_module(_name)

import torch  # noqa: E402
from _frameworks import Marked, Recorder, close_group, quiet_trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

SAMPLES = 16
BATCH = 2


def statecore_loader(shuffle: bool) -> Any:
    # Imported here, not above: with statecore left out of ORDER this is its first import.
    statecore = importlib.import_module("statecore")
    return statecore.DataLoader(
        Marked(SAMPLES), batch_size=BATCH, shuffle=shuffle, num_workers=2, executor="thread"
    )


def torch_loader(shuffle: bool) -> Any:
    return torch.utils.data.DataLoader(Marked(SAMPLES), batch_size=BATCH, shuffle=shuffle)


def outcome(module: Recorder, loader: Any) -> dict[str, Any]:
    return {
        "indices": module.indices,
        "loaders": module.loaders,
        "class": f"{type(loader).__module__}.{type(loader).__qualname__}",
        "executor": getattr(loader, "executor", None),
    }


def predict() -> dict[str, Any]:
    module = Recorder(lambda: statecore_loader(shuffle=False))
    trainer = quiet_trainer(devices=1)
    trainer.predict(module, return_predictions=False)
    return {"statecore": outcome(module, trainer.predict_dataloaders)}


def ddp() -> dict[str, Any]:
    outcomes = {}
    for name, build in (("statecore", statecore_loader), ("torch", torch_loader)):
        for where in ("hook", "fit"):
            make: Callable[[], Any] = lambda build=build: build(shuffle=True)  # noqa: E731
            module = Recorder(make if where == "hook" else None)
            trainer = quiet_trainer(
                devices=2,
                max_epochs=2,
                strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
            )
            trainer.fit(module, train_dataloaders=None if where == "hook" else make())
            outcomes[f"{name} loader from the {where}"] = outcome(module, trainer.train_dataloader)
    close_group()
    return outcomes


if __name__ == "__main__":
    results = predict() if sys.argv[2] == "predict" else ddp()
    with open(sys.argv[3], "w") as out:
        json.dump(results, out)
