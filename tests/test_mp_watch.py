"""The mp executor's watch over its workers' result pipes and sentinels (`_mp.watch.Watch`):
what `multiprocess.connection.wait` answers, from a poll object registered once."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import multiprocess
import pytest

from statecore.executors._mp.watch import Watch


@pytest.fixture
def fds() -> Iterator[list[int]]:
    """Descriptors to close after the test (both ends of each os.pipe)."""
    opened: list[int] = []
    yield opened
    for fd in opened:
        with contextlib.suppress(OSError):
            os.close(fd)


def _os_pipe(fds: list[int]) -> tuple[int, int]:
    read, write = os.pipe()
    fds += (read, write)
    return read, write


def test_a_connection_with_a_message_and_a_readable_fd_are_what_is_ready(fds: list[int]) -> None:
    reader, writer = multiprocess.Pipe(duplex=False)
    quiet, _quiet_writer = multiprocess.Pipe(duplex=False)
    sentinel, sentinel_end = _os_pipe(fds)
    watched = {reader: "answer", quiet: "answer", sentinel: "exit"}
    watch = Watch()
    assert watch.wait(watched, 0) == []
    writer.send_bytes(b"batch")
    os.write(sentinel_end, b"x")
    assert set(watch.wait(watched, 0)) == {reader, sentinel}


def test_a_wait_with_nothing_ready_ends_no_earlier_than_its_timeout() -> None:
    reader, _writer = multiprocess.Pipe(duplex=False)
    started = time.monotonic()
    assert Watch().wait({reader: "answer"}, 0.05) == []
    assert time.monotonic() - started >= 0.05


def test_a_pipe_whose_writer_closed_is_ready_as_a_hang_up() -> None:
    # A worker that died mid-message: the pipe's end is what tells the executor.
    reader, writer = multiprocess.Pipe(duplex=False)
    writer.close()
    assert Watch().wait({reader: "answer"}, 0) == [reader]


def test_a_handle_replaced_under_the_same_fd_number_is_the_one_answered() -> None:
    watch = Watch()
    old, old_writer = multiprocess.Pipe(duplex=False)
    assert watch.wait({old: "answer"}, 0) == []
    number = old.fileno()
    old.close()
    old_writer.close()
    # The lowest free number: the one the closed reader had.
    new, new_writer = multiprocess.Pipe(duplex=False)
    assert number in (new.fileno(), new_writer.fileno())
    new_writer.send_bytes(b"batch")
    assert watch.wait({new: "answer"}, 0) == [new]


def test_handles_dropped_from_the_set_are_no_longer_watched(fds: list[int]) -> None:
    watch = Watch()
    kept, kept_writer = multiprocess.Pipe(duplex=False)
    dropped, dropped_end = _os_pipe(fds)
    assert watch.wait({kept: "answer", dropped: "exit"}, 0) == []
    os.write(dropped_end, b"x")
    assert watch.wait({kept: "answer"}, 0) == []
    kept_writer.send_bytes(b"batch")
    assert watch.wait({kept: "answer"}, 0) == [kept]
