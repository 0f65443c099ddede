"""statecore loads an HF `datasets` table in torch format as torch's loader does.

The dataset is built in memory (`Dataset.from_dict`): nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import datasets
import pytest
import torch
from _frameworks import ELSEWHERE, STATECORE_PROCESS, STATECORE_THREAD, collate_marked

import statecore

MARKS = {"mp": STATECORE_PROCESS, "thread": STATECORE_THREAD}


def table() -> datasets.Dataset:
    rows = 20
    columns = {
        "features": [[float(i), float(-i), i / 2] for i in range(rows)],
        "label": [i % 3 for i in range(rows)],
        "text": [f"row {i}" for i in range(rows)],
    }
    return datasets.Dataset.from_dict(columns).with_format("torch")


def plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else value


def loaded(loader: Any) -> tuple[list[dict[str, Any]], set[int]]:
    """Every batch of two epochs, as plain lists, and who collated them."""
    batches, marks = [], set()
    for _ in range(2):
        for batch in loader:
            marks.update(batch.pop("loader").tolist())
            batches.append(
                {key: getattr(value, "tolist", lambda v=value: v)() for key, value in batch.items()}
            )
    return batches, marks


@pytest.mark.parametrize("executor", ["mp", "thread"])
@pytest.mark.timeout(120)
def test_a_torch_formatted_table_loads_as_torchs_loader_loads_it(executor: str) -> None:
    def loader(loader_class: type, **extra: Any) -> Any:
        return loader_class(
            table(),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            collate_fn=collate_marked,
            generator=torch.Generator().manual_seed(11),
            **extra,
        )

    got, marks = loaded(loader(statecore.DataLoader, executor=executor))
    expected, reference_marks = loaded(loader(torch.utils.data.DataLoader))
    assert got == expected
    assert len(got) == 10
    assert marks == {MARKS[executor]}
    assert reference_marks == {ELSEWHERE}
