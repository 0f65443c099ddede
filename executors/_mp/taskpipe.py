"""The main process's end of a worker's task pipe: writes that never block the main thread.

Run by the main process: its main thread (or the pin stage's) puts, and a flusher thread of
its own writes what the pipe had no room for.

A task is a few hundred bytes and most of the time the pipe has room for it, so the main
thread writes it at once, without waking a thread (a `multiprocess` queue hands every message
to a feeder thread, which then competes with the main thread for the GIL on every batch). When
the pipe is full (a worker busy with a long batch, and tasks large or many), what does not fit
waits in a backlog that a flusher thread writes as the worker reads. Blocking the main thread
instead could deadlock it: the worker it waits for may itself be blocked sending a batch that
only the main thread would read.

Messages are framed as `multiprocess.connection.Connection` frames them, so the worker reads
them with `Connection.recv_bytes`.
"""

from __future__ import annotations

import collections
import os
import select
import struct
import threading

__all__ = ["TaskWriter", "frame"]

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
# How long the flusher waits for room before checking whether the writer was closed.
_FLUSH_POLL = 0.1


def frame(message: bytes) -> bytes:
    """`message` as one Connection frame: its length, then the message."""
    if len(message) > 0x7FFFFFFF:
        return _SHORT.pack(-1) + _LONG.pack(len(message)) + message
    return _SHORT.pack(len(message)) + message


class TaskWriter:
    """Writes framed messages to a pipe in order, never blocking the caller.

    `fd` is the pipe's writing end; the writer owns it from now on and closes it in `close`.
    Once the reader is gone every message is dropped: a dead worker's death is reported by its
    sentinel, not by the writer.
    """

    def __init__(self, fd: int, name: str) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.name = name
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._broken = False
        self._room = select.poll()
        self._room.register(fd, select.POLLOUT)

    @property
    def backlog(self) -> int:
        """Bytes written by `put` that are not in the pipe yet."""
        with self._lock:
            return sum(len(part) for part in self._backlog)

    def put(self, message: bytes) -> None:
        """Queue `message` behind every earlier one; write what the pipe has room for now."""
        data = memoryview(frame(message))
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.name} is closed")
            if self._broken:
                return
            if not self._backlog:
                data = data[self._write(data) :]
                if not data:
                    return
            self._backlog.append(data)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush, name=self.name, daemon=True)
                self._flusher.start()
            self._more.notify()

    def close(self) -> None:
        """Stop the flusher, dropping what it has not written, and close the pipe. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._more.notify()
            flusher = self._flusher
        if flusher is not None:
            flusher.join()
        os.close(self.fd)

    def _write(self, data: memoryview) -> int:
        """Write what fits now, with the lock held; the bytes written."""
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, OSError):
            self._broken = True
            self._backlog.clear()
            return len(data)

    def _flush(self) -> None:
        try:
            self._flush_backlog()
        except BaseException:
            # Nothing more will be written: later messages are dropped rather than left
            # waiting behind a backlog nobody flushes. The worker's death or a timeout tells.
            with self._lock:
                self._broken = True
                self._backlog.clear()
            raise

    def _flush_backlog(self) -> None:
        while True:
            with self._lock:
                while not self._backlog and not self._closed:
                    self._more.wait()
                if self._closed:
                    self._backlog.clear()
                    return
            # Wait for room without the lock, so that `put` and `close` never wait on a worker.
            # poll, not select: select refuses descriptors numbered 1024 and above.
            self._room.poll(_FLUSH_POLL * 1000)
            with self._lock:
                while self._backlog and not self._closed:
                    head = self._backlog[0]
                    written = self._write(head)
                    if self._broken:
                        break
                    if written < len(head):  # the pipe is full again
                        self._backlog[0] = head[written:]
                        break
                    self._backlog.popleft()
