"""A small training loop whose dataset has one slow sample: the example of docs/profiling.md.

    python -m statecore profile --out statecore-profile docs/examples/profile_example.py

Sample 37 takes 60 ms where the others take 3 ms (a slow read, say); the "training step"
takes 1 ms. Two epochs, two worker processes, the loader's defaults otherwise.
"""

import time

import torch
from torch.utils.data import Dataset

from statecore import DataLoader


class Samples(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.06 if index == 37 else 0.003)
        return torch.full((8,), float(index))


def main() -> None:
    loader = DataLoader(Samples(), batch_size=4, num_workers=2)
    for _epoch in range(2):
        for _batch in loader:
            time.sleep(0.001)  # the training step


if __name__ == "__main__":
    main()
