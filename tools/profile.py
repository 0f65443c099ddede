"""`python -m statecore profile script.py [args]`: a training script, traced, and what it shows.

The script runs in this process, as `python script.py args` would run it (`__name__` is
`"__main__"`, `sys.argv` is the script and its arguments), with tracing on for every statecore
DataLoader it makes without `trace=False` (`STATECORE_TRACE=1`, which its worker processes
inherit too). Once it ends, however it ends, each traced loader gets three files in the output
folder: `loader-N.trace.json` (Chrome's trace event format: open it in https://ui.perfetto.dev
or `chrome://tracing`), `loader-N.timeline.png` (with matplotlib) and `loader-N.verdict.txt`;
the verdicts are printed too (for a loader with `num_workers="auto"`, with what its tuner did
and the count it settled on, to pin). The exit status is the script's. A child the script forks
(`os.fork()`) and that runs on to the script's end writes nothing: only the profiled process
writes.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import attrs

from statecore.executors._observe.tracer import (
    TRACE_VARIABLE,
    Tracer,
    collect,
    stop_collecting,
)
from statecore.tools.progress import Bar

__all__ = ["DEFAULT_OUT", "profile", "verdict_of", "write_outputs"]

DEFAULT_OUT = "statecore-profile"
PROGRESS_INTERVAL = 0.25
"""Seconds between two updates of the progress bar (batches traced so far)."""


def _follow(tracers: list[Tracer], bar: Bar, done: threading.Event) -> None:
    """Until `done`, show on `bar` how many batches the script's loaders have sent so far.

    Read from a thread of its own every `PROGRESS_INTERVAL`, so tracing a batch costs nothing
    more for the bar; the counts are plain integers, read without a lock.
    """
    while not done.wait(PROGRESS_INTERVAL):
        batches = sum(tracer.kept + tracer.dropped for tracer in list(tracers))
        loaders = len(tracers)
        bar.goto(batches, description=f"profile: {loaders} loader{'s' if loaders != 1 else ''}")


def write_outputs(tracer: Tracer, out: Path, name: str, log: TextIO) -> list[Path]:
    """Write one loader's trace, timeline and verdict into `out`; return the files written."""
    from statecore.tools.timeline import MissingMatplotlib, draw_timeline

    trace = tracer.trace()
    written = [trace.write_chrome(out / f"{name}.trace.json")]
    verdict = out / f"{name}.verdict.txt"
    verdict.write_text(verdict_of(tracer) + "\n")
    written.append(verdict)
    try:
        written.append(draw_timeline(trace, out / f"{name}.timeline.png", title=name))
    except MissingMatplotlib as error:
        print(f"profile: no timeline for {name}: {error}", file=log)
    return written


def profile(
    script: str,
    arguments: Sequence[str] = (),
    out: str | os.PathLike[str] = DEFAULT_OUT,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    progress_bar: bool = True,
) -> int:
    """Run `script` with its `arguments`, traced; write the outputs into `out`; return the
    script's exit status (1 if it made no statecore loader to trace, 2 if it cannot run).

    While it runs, a bar on stderr counts the batches traced, where one may be drawn
    (`statecore.tools.progress`) and `progress_bar` is true."""
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    path = Path(script)
    if not path.is_file():
        print(f"profile: no such script: {script}", file=stderr)
        return 2
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"profile: cannot write into {folder}: {error}", file=stderr)
        return 2
    tracers = collect()
    saved_argv, saved_path = sys.argv, list(sys.path)
    previous = os.environ.get(TRACE_VARIABLE)
    os.environ[TRACE_VARIABLE] = "1"
    sys.argv = [str(path), *arguments]
    sys.path.insert(0, str(path.resolve().parent))  # as `python script.py` puts its folder first
    status = 0
    # A script that calls os.fork() has a child that goes on running it, and leaves runpy
    # through this function as the parent does: the child's stderr, files and verdicts would
    # be written over the parent's. Only the process that was profiled writes.
    profiled = os.getpid()
    bar = Bar(None, unit="batch", description="profile", show=progress_bar, stream=stderr)
    done = threading.Event()
    if bar.live:
        threading.Thread(target=_follow, args=(tracers, bar, done), daemon=True).start()
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=stderr)
    except BaseException:
        status = 1
        import traceback

        traceback.print_exc(file=stderr)
    finally:
        done.set()
        if os.getpid() == profiled:
            bar.close()
        sys.argv, sys.path[:] = saved_argv, saved_path
        if previous is None:
            os.environ.pop(TRACE_VARIABLE, None)
        else:
            os.environ[TRACE_VARIABLE] = previous
        stop_collecting()
    if os.getpid() != profiled:
        return status  # a forked child of the script: its exit status, and nothing written
    if not tracers:
        print(
            f"profile: {script} made no statecore DataLoader to trace (use `from statecore "
            "import DataLoader`, or statecore's loader in place of torch's)",
            file=stderr,
        )
        return status or 1
    for number, tracer in enumerate(tracers):
        name = f"loader-{number}"
        files = write_outputs(tracer, folder, name, stderr)
        print(f"== {name} ({', '.join(str(file) for file in files)})", file=stdout)
        print(verdict_of(tracer), file=stdout)
    return status


def verdict_of(tracer: Tracer) -> str:
    """The loader's verdict, as `DataLoader.stats().verdict()` gives it: the trace's figures,
    and for `num_workers="auto"` what its tuner did and the count it settled on, to pin."""
    tuner = tracer.tuner
    if tuner is None:
        return tracer.trace().verdict()
    stats = attrs.evolve(tracer.trace().stats(), tuning=tuner.report())
    return stats.verdict()
