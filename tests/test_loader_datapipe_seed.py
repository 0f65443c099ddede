"""Without workers, a shuffled datapipe comes out in torch's order, epoch after epoch.

torch's single-process iterator draws the datapipe's shared seed once when it is built;
drawing it again at the start of the epoch would move the loader's generator on.
"""

from __future__ import annotations

import warnings

import torch

from statecore import DataLoader


def _epochs(loader_type: type, epochs: int) -> list[list[list[int]]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # datapipes are deprecated in torch
        from torch.utils.data.datapipes.iter import IterableWrapper

        pipe = IterableWrapper(range(10)).shuffle()
        loader = loader_type(pipe, batch_size=3, generator=torch.Generator().manual_seed(7))
        return [[batch.tolist() for batch in loader] for _ in range(epochs)]


def test_a_shuffled_datapipe_without_workers_comes_out_in_torchs_order() -> None:
    assert _epochs(DataLoader, 3) == _epochs(torch.utils.data.DataLoader, 3)
