"""statecore under HF accelerate: `accelerator.prepare` keeps statecore loading.

`accelerator.prepare(loader)` hands back accelerate's own wrapper around a plain torch loader
built from the original's arguments. Once accelerate and statecore are both imported, in either
order, statecore's hook on `Accelerator.prepare_data_loader` puts a statecore loader with the
original's executor inside that wrapper; `prepare_with_accelerate`, the way before the hook,
does the same. The batches must be the ones accelerate gives for torch's loader, and
statecore's worker threads must load them.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _frameworks import ELSEWHERE, STATECORE_THREAD, Marked, MarkedStream
from _side_by_side import WORKERS
from accelerate import Accelerator

import statecore
from statecore.executors.frameworks import keep_statecore_under_accelerate, prepare_with_accelerate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    return Accelerator(cpu=True)


def two_epochs(loader: Any) -> tuple[list[list[int]], set[int]]:
    """The indices of every batch of two epochs, and who loaded their samples."""
    indices, marks = [], set()
    for _ in range(2):
        for batch in loader:
            indices.append(batch["index"].tolist())
            marks.update(batch["loader"].tolist())
    return indices, marks


def loaders(dataset: Any, **arguments: Any) -> tuple[Any, Any]:
    """A statecore loader with the thread executor, and torch's loader with the same arguments."""
    ours = statecore.DataLoader(
        dataset, generator=torch.Generator().manual_seed(3), executor="thread", **arguments
    )
    theirs = torch.utils.data.DataLoader(
        dataset, generator=torch.Generator().manual_seed(3), **arguments
    )
    return ours, theirs


@WORKERS
def test_a_prepared_loader_gets_torchs_batches_loaded_by_statecore(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(Marked(10), batch_size=3, shuffle=True, num_workers=2)
    model, prepared = prepare_with_accelerate(accelerator, torch.nn.Linear(1, 1), ours)
    reference = accelerator.prepare(theirs)
    assert isinstance(model, torch.nn.Module)  # the other objects are prepared as usual
    got, marks = two_epochs(prepared)
    expected, reference_marks = two_epochs(reference)
    assert got == expected
    assert marks == {STATECORE_THREAD}
    assert reference_marks == {ELSEWHERE}
    assert len(prepared) == len(reference) == 4


@WORKERS
def test_a_prepared_loader_stays_accelerates_wrapper_around_a_statecore_loader(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(Marked(10), batch_size=3, num_workers=2)
    prepared = prepare_with_accelerate(accelerator, ours)
    # type() sees through the wrapper, which claims its inner loader's class.
    assert type(prepared) is type(accelerator.prepare(theirs))
    assert isinstance(prepared, statecore.DataLoader)
    assert prepared.executor == "thread"
    for _ in prepared:
        pass
    assert prepared.end_of_dataloader  # accelerate's end-of-epoch bookkeeping still runs


@WORKERS
def test_a_prepared_loader_over_an_iterable_dataset_is_loaded_by_statecore(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(MarkedStream(11), batch_size=2, num_workers=2)
    got, marks = two_epochs(prepare_with_accelerate(accelerator, ours))
    assert got == two_epochs(accelerator.prepare(theirs))[0]
    assert marks == {STATECORE_THREAD}


# --- the plain prepare, through statecore's hook ------------------------------------------------


def inside(prepared: Any) -> Any:
    """The loader inside accelerate's wrapper (vars(): the wrapper forwards attributes)."""
    return vars(prepared)["base_dataloader"]


@WORKERS
def test_a_plainly_prepared_loader_gets_torchs_batches_loaded_by_statecore(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(Marked(10), batch_size=3, shuffle=True, num_workers=2)
    model, prepared = accelerator.prepare(torch.nn.Linear(1, 1), ours)
    reference = accelerator.prepare(theirs)
    assert isinstance(model, torch.nn.Module)
    assert type(inside(prepared)) is statecore.DataLoader
    assert inside(prepared).executor == "thread"
    assert type(inside(reference)) is torch.utils.data.DataLoader  # torch's loaders stay torch's
    got, marks = two_epochs(prepared)
    expected, reference_marks = two_epochs(reference)
    assert got == expected
    assert marks == {STATECORE_THREAD}
    assert reference_marks == {ELSEWHERE}


@WORKERS
def test_prepare_data_loader_keeps_the_loaders_statecore_arguments(
    accelerator: Accelerator,
) -> None:
    ours = statecore.DataLoader(
        Marked(6),
        batch_size=2,
        num_workers=2,
        executor="thread",
        trace=True,
        snapshot_every_n_steps=4,
    )
    kept = inside(accelerator.prepare_data_loader(ours))
    assert type(kept) is statecore.DataLoader
    assert (kept.executor, kept.trace, kept.snapshot_every_n_steps) == ("thread", True, 4)


@WORKERS
def test_a_loader_prepared_twice_is_the_same_wrapper_around_the_same_statecore_loader(
    accelerator: Accelerator,
) -> None:
    prepared = accelerator.prepare(loaders(Marked(6), batch_size=2, num_workers=2)[0])
    kept = inside(prepared)
    assert accelerator.prepare(prepared) is prepared
    assert inside(prepared) is kept


@WORKERS
def test_prepare_with_accelerate_after_the_hook_warns_nothing_and_keeps_statecore(
    accelerator: Accelerator,
) -> None:
    ours, theirs = loaders(Marked(10), batch_size=3, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = prepare_with_accelerate(accelerator, ours)
    assert type(inside(prepared)) is statecore.DataLoader
    got, marks = two_epochs(prepared)
    assert got == two_epochs(accelerator.prepare(theirs))[0]
    assert marks == {STATECORE_THREAD}


def test_the_hook_wraps_prepare_data_loader_once() -> None:
    wrapped = Accelerator.prepare_data_loader
    keep_statecore_under_accelerate()
    assert Accelerator.prepare_data_loader is wrapped
    assert wrapped.__wrapped__.__name__ == "prepare_data_loader"  # accelerate's own, inside


def test_an_accelerate_without_the_method_to_wrap_gets_a_warning_naming_the_remedy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(Accelerator, "prepare_data_loader")
    with pytest.warns(UserWarning, match="prepare them with .*prepare_with_accelerate"):
        keep_statecore_under_accelerate()


IMPORT_ORDERS = {
    "statecore-first": "import statecore\nimport accelerate\n",
    "accelerate-first": "import accelerate\nimport statecore\n",
}
PREPARE = """
import torch
from accelerate import Accelerator

loader = statecore.DataLoader(range(10), batch_size=3, num_workers=2, executor="thread")
prepared = Accelerator(cpu=True).prepare(loader)
inner = vars(prepared)["base_dataloader"]
print(type(inner).__module__, inner.executor, [batch.tolist() for batch in prepared])
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_a_plain_prepare_keeps_statecore_whatever_the_import_order(order: str) -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", IMPORT_ORDERS[order] + PREPARE],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "statecore.executors._loader thread [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]"
    ]
