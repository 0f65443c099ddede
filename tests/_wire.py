"""The buffer transport's test kit: a worker's sender and a main process's receiver joined
within one process, where a tensor's memory comes from, and a dataset of large items."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import Dataset

from statecore.executors._mp import BufferReceiver, BufferSender, pool

__all__ = ["NUMEL", "Filled", "LocalHandle", "in_buffer", "origin", "pair"]

NUMEL = 1 << 18
"""Elements of each `Filled` item: 1 MiB of float32."""


class LocalHandle:
    """Stands in for the resource sharer within one process: it hands over a duplicate."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)

    def detach(self) -> int:
        return self.fd


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BufferSender, BufferReceiver]]:
    """A worker's sender and a main process's receiver, joined in this process."""
    monkeypatch.setattr(pool, "DupFd", LocalHandle)
    receiver = BufferReceiver()
    yield BufferSender(), receiver
    receiver.close()


class Filled(Dataset):  # type: ignore[type-arg]
    """Item i: a 1 MiB float32 tensor filled with i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((NUMEL,), float(index))


def origin(tensor: torch.Tensor) -> str:
    """What the memory under the tensor's storage maps, as /proc/self/maps names it."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else ""
    raise AssertionError(f"no mapping holds address {address:#x}")


def in_buffer(tensor: torch.Tensor) -> bool:
    return origin(tensor).startswith("/memfd:statecore-buffer-")
