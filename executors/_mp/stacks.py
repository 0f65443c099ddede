"""Where a worker process is stuck: its Python stack, dumped on a signal and read back.

Run by both sides. Each worker registers `faulthandler` on `STACK_SIGNAL` (`listen`), writing
to a file of its own in the executor's directory: the handler is C code, so it answers while
the worker's main thread is blocked anywhere (a lock, a read, `Event.wait()`), where a Python
signal handler would never run. The main process (`ask`) sends the signal, waits a bounded
time for the dump to land, and turns the worker's main thread's part of it into a traceback
(`traceback_of`): innermost call last, each frame with its source line, as Python prints one.

The file opens with one line naming the worker's main thread, written once the handler is
registered: until it is there, the signal's default action would kill the worker, so the
main process sends nothing.

A real-time signal, not SIGUSR1: job schedulers (SLURM's `--signal`) and frameworks
(Lightning's requeue) send SIGUSR1 to whole process groups, and a worker would dump its stack
on each. Where there are no real-time signals, SIGUSR2.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import re
import signal
import threading
import time
from typing import IO

__all__ = ["ASK_WITHIN", "STACK_SIGNAL", "ask", "listen", "stack_file", "traceback_of"]

STACK_SIGNAL: int = int(signal.SIGRTMIN) + 4 if hasattr(signal, "SIGRTMIN") else int(signal.SIGUSR2)
# How long the main process waits for a worker's dump: the handler writes it at once, unless
# the worker's process is not scheduled (a loaded machine), or cannot take signals at all.
ASK_WITHIN = 1.0
# How often it looks at the file meanwhile, and for how long the dump must stop growing.
_LOOK_EVERY = 0.01
_HEADER = "statecore worker main thread "
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')

# The body of a worker process: a forked worker's stack goes on below it into the frames of
# the main process that forked it, which the worker never returns to.
_BODY = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py"), "worker_main")

_listening: IO[str] | None = None
"""The worker's open dump file: faulthandler writes to its descriptor for as long as it lives."""


def stack_file(tempdir: str, worker: int, incarnation: int) -> str:
    """Where incarnation `incarnation` of worker `worker` dumps its stack."""
    return os.path.join(tempdir, f"stack-{worker}-{incarnation}")


def listen(path: str) -> None:
    """In a worker: dump every thread's stack to `path` on `STACK_SIGNAL`, from now on."""
    global _listening
    dump = open(path, "w")  # noqa: SIM115 - open for as long as the worker lives
    faulthandler.register(STACK_SIGNAL, file=dump, all_threads=True, chain=False)
    # Written only now, unbuffered: the main process signals only once it reads this.
    os.write(dump.fileno(), f"{_HEADER}{threading.get_ident():#x}\n".encode())
    _listening = dump


def listening(path: str) -> bool:
    """Whether the worker dumping to `path` got as far as listening: before, it is starting
    (a spawned one importing its modules), and not stuck on any task."""
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def ask(path: str, pid: int) -> str | None:
    """In the main process: the stack of the worker `pid` that dumps to `path`, as a traceback;
    None if it is not listening yet, or gave no dump within `ASK_WITHIN`."""
    try:
        before = os.path.getsize(path)
    except OSError:
        return None
    if before == 0:
        return None  # still starting: the signal would kill it
    try:
        os.kill(pid, STACK_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return None
    deadline = time.monotonic() + ASK_WITHIN
    size = before
    while time.monotonic() < deadline:
        time.sleep(_LOOK_EVERY)  # a bounded wait for another process's write, not a handshake
        try:
            now = os.path.getsize(path)
        except OSError:
            return None
        if now > before and now == size:
            break  # written, and no longer growing
        size = now
    else:
        if size == before:
            return None
    with open(path, encoding="utf-8", errors="replace") as dump:
        header = dump.readline()
        dump.seek(before)
        text = dump.read()
    return traceback_of(text, header)


def traceback_of(dump: str, header: str = "") -> str | None:
    """A faulthandler dump of every thread, as the traceback of the thread `header` names (the
    worker's main thread; the first thread dumped if none is named): innermost call last."""
    main = None
    if header.startswith(_HEADER):
        main = int(header[len(_HEADER) :].strip(), 16)
    threads: list[tuple[int, list[tuple[str, int, str]]]] = []
    for line in dump.splitlines():
        thread = _THREAD.match(line)
        if thread is not None:
            threads.append((int(thread.group(1), 16), []))
            continue
        frame = _FRAME.match(line)
        if frame is not None and threads:
            threads[-1][1].append((frame.group(1), int(frame.group(2)), frame.group(3)))
    if not threads:
        return None
    frames = next((frames for ident, frames in threads if ident == main), threads[0][1])
    body = [i for i, (filename, _, name) in enumerate(frames) if (filename, name) == _BODY]
    if body:
        frames = frames[: body[-1] + 1]  # innermost first: the body's caller and out go
    lines = ["Traceback (most recent call last):"]
    for filename, lineno, name in reversed(frames):  # faulthandler prints innermost first
        lines.append(f'  File "{filename}", line {lineno}, in {name}')
        source = linecache.getline(filename, lineno).strip()
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines)
