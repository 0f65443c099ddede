"""A worker's buffer sender and a main process's receiver, joined within one process."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from statecore.executors import _buffers
from statecore.executors._buffers import BufferReceiver, BufferSender

__all__ = ["LocalHandle", "pair"]


class LocalHandle:
    """Stands in for the resource sharer within one process: it hands over a duplicate."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)

    def detach(self) -> int:
        return self.fd


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BufferSender, BufferReceiver]]:
    """A worker's sender and a main process's receiver, joined in this process."""
    monkeypatch.setattr(_buffers, "DupFd", LocalHandle)
    receiver = BufferReceiver()
    yield BufferSender(), receiver
    receiver.close()
