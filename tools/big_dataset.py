"""A big in-memory dataset for the start-up workloads under spawn and forkserver.

`Catalogue` stands for what pytorch#139792 describes: a dataset object of hundreds of
megabytes, a tensor of samples plus a Python index over them, which torch pickles once per
worker, one worker after the other, when it starts spawn or forkserver workers. Its pickle is
the whole object (no `__getstate__` shortcut), so every loader sends what a user's dataset
would make it send: the tensor's storage and every entry of the index.

Defined at module level, so that spawn and forkserver workers unpickle it by name.
"""

from __future__ import annotations

import torch
import torch.utils.data

__all__ = ["ROW_FLOATS", "Catalogue"]

ROW_FLOATS = 448
"""float32 values per sample: 1,792 bytes, so 262,144 samples make a 470 MB tensor."""


class Catalogue(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """`size` samples: rows of one float32 tensor, found through a Python index.

    `names` lists a name per sample and `index` maps each name to its row and label, as a
    dataset built from a manifest file holds them: with 262,144 samples the tensor is 470 MB
    and the index about 50 MB of Python objects. Sample i is (row, label) of the i-th name;
    row r holds the values r * ROW_FLOATS onwards, so a sample says where it came from.
    """

    def __init__(self, size: int, row_floats: int = ROW_FLOATS) -> None:
        self.names = [f"sample-{number:08d}" for number in range(size)]
        # Rows in an order of their own, so the index is not the identity a loader could skip.
        rows = torch.randperm(size, generator=torch.Generator().manual_seed(size)).tolist()
        self.index = {name: (row, row % 1000) for name, row in zip(self.names, rows, strict=True)}
        # arange then reshape: every page written, as a loaded dataset's are.
        self.data = torch.arange(size * row_floats, dtype=torch.float32).reshape(size, row_floats)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, number: int) -> tuple[torch.Tensor, int]:
        row, label = self.index[self.names[number]]
        return self.data[row], label

    @property
    def nbytes(self) -> int:
        """The tensor's bytes (the index comes on top)."""
        return self.data.nbytes
