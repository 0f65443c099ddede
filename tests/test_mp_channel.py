"""The main process's end of a worker's task pipe (executors/_mp/taskpipe.py).

The writer must never block the main thread, must keep messages in order whether or not they
fitted in the pipe at once, and must frame them so that the worker's `Connection` reads them.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Iterator

import multiprocess.connection
import pytest

from statecore.executors._mp import TaskWriter

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pipe() -> Iterator[tuple[multiprocess.connection.Connection, TaskWriter]]:
    read_end, write_end = os.pipe()
    reader = multiprocess.connection.Connection(read_end, writable=False)
    writer = TaskWriter(write_end, "test-tasks")
    try:
        yield reader, writer
    finally:
        writer.close()
        reader.close()


def _read(reader: multiprocess.connection.Connection, count: int) -> list[bytes]:
    return [reader.recv_bytes() for _ in range(count)]


def test_a_message_the_pipe_has_room_for_is_written_at_once(pipe) -> None:
    reader, writer = pipe
    writer.put(b"task")
    assert writer.backlog == 0
    assert reader.poll(0)
    assert reader.recv_bytes() == b"task"


def test_an_empty_message_arrives_as_an_empty_frame(pipe) -> None:
    # The worker reads an empty message as the stop message.
    reader, writer = pipe
    writer.put(b"")
    assert reader.recv_bytes() == b""


def test_put_returns_while_nobody_reads_a_full_pipe(pipe) -> None:
    reader, writer = pipe
    big = bytes(range(256)) * 1024  # 256 KiB: four times what a Linux pipe holds by default
    for _ in range(4):
        writer.put(big)  # would block for ever if put waited for room
    assert writer.backlog > 0
    assert _read(reader, 4) == [big] * 4


def test_messages_arrive_in_order_across_the_backlog(pipe) -> None:
    reader, writer = pipe
    sizes = [70_000, 10, 200_000, 1, 0, 65_536, 3]
    messages = [bytes([k]) * size for k, size in enumerate(sizes)]
    for message in messages:
        writer.put(message)
    got: list[bytes] = []
    reading = threading.Thread(target=lambda: got.extend(_read(reader, len(messages))))
    reading.start()
    writer.put(b"after")  # queued behind the backlog, though the pipe may have room now
    reading.join(30)
    assert got == messages
    assert reader.recv_bytes() == b"after"


def test_puts_after_the_reader_is_gone_are_dropped_silently(pipe) -> None:
    # A worker's death is reported by its sentinel; the writer only must not raise or block.
    reader, writer = pipe
    reader.close()
    writer.put(b"lost")
    writer.put(bytes(1 << 20))
    assert writer.backlog == 0


def test_close_drops_the_backlog_and_stops_the_flusher(pipe) -> None:
    _, writer = pipe
    writer.put(bytes(1 << 20))
    flusher = writer._flusher
    assert flusher is not None and flusher.is_alive()
    writer.close()
    assert not flusher.is_alive()
    writer.close()  # idempotent


def test_put_after_close_is_refused(pipe) -> None:
    _, writer = pipe
    writer.close()
    with pytest.raises(ValueError, match="test-tasks is closed"):
        writer.put(b"late")


def test_a_writer_on_a_descriptor_above_1024_still_flushes_its_backlog() -> None:
    # select() refuses descriptors from 1024 up; a busy main process easily has that many.
    high = 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= high:
        if hard != resource.RLIM_INFINITY and hard <= high:
            pytest.skip(f"the descriptor limit ({hard}) is too low for this test")
        resource.setrlimit(resource.RLIMIT_NOFILE, (high + 1, hard))
    read_end, write_end = os.pipe()
    os.dup2(write_end, high)
    os.close(write_end)
    reader = multiprocess.connection.Connection(read_end, writable=False)
    writer = TaskWriter(high, "high-tasks")
    try:
        big = b"x" * 200_000  # more than the pipe holds: the flusher must wait for room
        for _ in range(3):
            writer.put(big)
        assert _read(reader, 3) == [big] * 3
    finally:
        writer.close()
        reader.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
