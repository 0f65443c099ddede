"""`python -m statecore replay FILE`: re-drive the scheduler through a flight recorder's file.

A driver that meets an internal error, an executor reporting the impossible or a timeout writes
its last scheduler events to a file (see `statecore.executors._observe.flight`,
docs/flight-recorder.md).
This rebuilds the recorded state, gives `step` each recorded event, checks every invariant after
every step, and prints one line per step: the event, the commands `step` gave, and below it any
broken invariant or any way the replay left the live run.

Exit status: 0 when the replay breaks no invariant and follows the recording to its end, 1 when
it breaks one or leaves the recording (the lines marked VIOLATION or DIVERGES say where), 2 when
the file cannot be read as a flight recording.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from statecore import State
from statecore.executors._observe.flightfile import FlightFileError, Replayed, from_json, replay

__all__ = ["replay_file"]


def replay_file(path: str, out: TextIO | None = None) -> int:
    """Replay the flight recording at `path`, printing the trace to `out`; the exit status."""
    out = sys.stdout if out is None else out
    try:
        with open(path, encoding="utf-8") as file:
            recording = from_json(file.read())
    except (OSError, UnicodeDecodeError, FlightFileError) as error:
        print(f"replay: cannot read {path} as a flight recording: {error}", file=sys.stderr)
        return 2
    print(f"flight recording {path}", file=out)
    print(
        f"  written {recording.written} by pid {recording.pid}, statecore {recording.version}",
        file=out,
    )
    print(f"  because of {recording.reason}", file=out)
    older = f" ({recording.dropped} older ones left out)" if recording.dropped else ""
    print(f"  {len(recording.steps)} events{older}; {recording.start.config!r}", file=out)
    print(f"start  {_summary(recording.start)}", file=out)
    broken = diverged = 0
    ending: Replayed | None = None
    for done in replay(recording):
        if done.recorded is not None:
            print(_line(done), file=out)
        elif done.number > 0:
            ending = done  # the end differs from the live run's: said after the end's line
            continue
        broken += len(done.violations)
        diverged += len(done.divergence)
        _problems(done, out)
    print(f"end    {_summary(recording.end)}", file=out)
    if ending is not None:
        diverged += len(ending.divergence)
        _problems(ending, out)
    steps = len(recording.steps)
    if broken or diverged:
        print(
            f"replay: {broken} broken invariant(s) and {diverged} divergence(s) from the live "
            f"run in {steps} steps",
            file=out,
        )
        return 1
    print(
        f"replay: {steps} steps; every invariant holds and the replay follows the live run",
        file=out,
    )
    return 0


def _problems(done: Replayed, out: TextIO) -> None:
    for sentence in done.violations:
        print(f"       VIOLATION: {sentence}", file=out)
    for sentence in done.divergence:
        print(f"       DIVERGES: {sentence}", file=out)


def _line(done: Replayed) -> str:
    assert done.recorded is not None
    raised = done.recorded.raised
    if done.raised is not None:
        answer = f"raises {done.raised}"
    else:
        answer = ", ".join(map(repr, done.commands)) or "(no command)"
    if raised is not None and not raised.core:
        # An interrupt arriving, or a wrapper's check: the event was not taken in the live run.
        answer += f"  [live run: {raised.kind} raised around the step: {raised.message}]"
    return f"{done.number:5}  {done.recorded.event!r} -> {answer}"


def _summary(state: State) -> str:
    life = state.life
    failure = "" if life.failure is None else f" failure={life.failure!r}"
    return (
        f"{life.phase!r} epoch={life.epoch} rcvd_idx={state.rcvd_idx} window={state.window!r} "
        f"loads={state.loads} waiting={state.waiting}{failure}"
    )


# --- the recorder's cost ---------------------------------------------------------------------

BATCH_US = {"inline-b1": 17.2, "processes-b64": 177.0}
"""statecore's cost of a batch in two of `bench`'s workloads (docs/performance.md): the
cheapest loader, in the calling thread, and a loader with worker processes."""


def measure_cost(batches: int = 2000, rounds: int = 100, workers: int = 1) -> str:
    """The recorder's cost per event and per batch.

    One epoch's events (`step_bench.record_trace`: answers in a shuffled order) are replayed
    through `step` and through the recording wrapper, in turns; the fastest of `rounds` runs
    of each, since on a shared machine the other runs measure the neighbours as well.
    """
    import time

    from statecore import Config, initial_state, step
    from statecore.executors._observe.flight import FlightRecorder
    from statecore.tools.step_bench import PREFETCH, record_trace

    events = record_trace(batches, workers=workers)
    first = initial_state(Config(num_workers=workers, prefetch_factor=PREFETCH))

    def run(function: Any) -> float:
        state = first
        started = time.perf_counter()
        for event in events:
            state = function(state, event)[0]
        return time.perf_counter() - started

    plain = recorded = float("inf")
    for _ in range(rounds):
        plain = min(plain, run(step))
        recorded = min(recorded, run(FlightRecorder(first.config).wrap(step)))
    per_event = 1e6 / len(events)
    overhead = (recorded - plain) * per_event
    per_batch = overhead * len(events) / batches
    shares = ", ".join(
        f"{100 * per_batch / us:.1f}% of {name}'s {us:g}" for name, us in BATCH_US.items()
    )
    return (
        f"flight recorder: {workers} worker(s), prefetch {PREFETCH}, {len(events)} events for "
        f"{batches} batches, fastest of {rounds} runs\n"
        f"  step            {plain * per_event:6.3f} us/event\n"
        f"  step, recorded  {recorded * per_event:6.3f} us/event\n"
        f"  recorder        {overhead:6.3f} us/event, {per_batch:5.3f} us/batch: {shares} us"
    )


if __name__ == "__main__":  # python -m statecore.tools.replay --cost [WORKERS]
    if sys.argv[1:2] == ["--cost"]:
        print(measure_cost(workers=int(sys.argv[2]) if len(sys.argv) > 2 else 1))
    else:
        raise SystemExit(replay_file(sys.argv[1]))
