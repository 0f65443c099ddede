"""A trace in Chrome's trace event format (JSON object form), which Perfetto and
`chrome://tracing` open: one track per worker, one for the consumer (`Trace.chrome`).

A worker replaced in its slot (`DataLoader(worker_restarts=N)`) gets a track per incarnation,
"worker 1 (incarnation 0)", "worker 1 (incarnation 1)", side by side: the lost one's ends with
an instant naming how it was lost (the signal, or the hang with its stack in the args), and
the replacement's begins with a slice from `ReplaceWorker` to its start. A track per
incarnation rather than one per slot: Perfetto then shows the lost worker's last, unanswered
try and the replacement's re-send of the same task apart, each where it ran.

A worker retired by a tuner (`Driver.retire`) is drawn the same way: an instant on its track
where it was retired (naming the tasks it held, which it goes on to finish) and one where it
was stopped; its slot added back (`Driver.add`) runs a new incarnation, on a track of its own
that begins with a slice from the add to its start."""

from __future__ import annotations

import bisect
from typing import Any

import torch

from statecore import WorkerDeath, WorkerHang
from statecore.executors._observe.trace import LostWorker, RetiredWorker, Trace, shown_index

__all__ = [
    "chrome_trace",
]

_PROCESS = 1
_CONSUMER = 0


def _us(moment: float, origin: float) -> float:
    return round((moment - origin) * 1e6, 3)


def chrome_trace(trace: Trace) -> dict[str, Any]:
    origin = trace.start
    stats = trace.stats()
    stragglers = {(b.epoch, b.task, b.worker) for b in stats.stragglers}
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": _PROCESS,
            "tid": _CONSUMER,
            "args": {"name": f"statecore loader ({trace.executor})"},
        },
        {
            "name": "thread_name",
            "ph": "M",
            "pid": _PROCESS,
            "tid": _CONSUMER,
            "args": {"name": "consumer (training loop)"},
        },
        {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": _PROCESS,
            "tid": _CONSUMER,
            "args": {"sort_index": 0},
        },
    ]
    tracks = _Tracks(trace)
    for worker in range(trace.num_workers):
        for incarnation in range(tracks.incarnations[worker] + 1):
            tid = tracks.tid(worker, incarnation)
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": _PROCESS,
                    "tid": tid,
                    "args": {"name": tracks.name(worker, incarnation)},
                }
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": _PROCESS,
                    "tid": tid,
                    "args": {"sort_index": tracks.sort_index(worker, incarnation)},
                }
            )
    for b in trace.batches:
        if b.started is None or b.finished is None:
            continue
        straggler = (b.epoch, b.task, b.worker) in stragglers
        args: dict[str, Any] = {
            "task": b.task,
            "epoch": b.epoch,
            "index": _jsonable(b.index),
            "cpu_ms": None if b.cpu is None else round(b.cpu * 1e3, 3),
            "slowest_samples": [
                {"index": _jsonable(index), "ms": round(took * 1e3, 3)} for index, took in b.slowest
            ],
            "queued_ms": round((b.started - b.sent) * 1e3, 3),
        }
        if b.handed is not None and b.arrived is not None:
            args["held_ms"] = round((b.handed - b.arrived) * 1e3, 3)
        if b.first_sent is not None:
            args["resent"] = True
            args["first_sent_ms"] = _us(b.first_sent, origin) / 1e3
        name = f"{'straggler ' if straggler else ''}batch {b.task}"
        if b.first_sent is not None:
            name = f"{name} (re-sent)"
        if b.failed:
            name = f"failed {name}"
        event: dict[str, Any] = {
            "name": name,
            "cat": "straggler" if straggler else "batch",
            "ph": "X",
            "pid": _PROCESS,
            "tid": tracks.tid(b.worker, b.incarnation),
            "ts": _us(b.started, origin),
            "dur": max(0.0, _us(b.finished, b.started)),
            "args": args,
        }
        if straggler:
            event["cname"] = "terrible"
        events.append(event)
    for wait in trace.waits:
        events.append(
            {
                "name": "waiting for a batch" if wait.task is not None else "waiting",
                "cat": "wait",
                "ph": "X",
                "pid": _PROCESS,
                "tid": _CONSUMER,
                "ts": _us(wait.asked, origin),
                "dur": max(0.0, _us(wait.got, wait.asked)),
                "args": {"task": wait.task, "held_ms": round(wait.held * 1e3, 3)},
            }
        )
    # A loss's own instant (below) names the death with more than its mark says.
    losses = {(lost.worker, lost.at) for lost in trace.losses}
    for mark in trace.marks:
        if mark.kind == "worker died" and (mark.worker, mark.time) in losses:
            continue
        global_mark = mark.worker is None
        events.append(
            {
                "name": mark.kind if not mark.detail else f"{mark.kind}: {mark.detail}",
                "cat": "lifecycle",
                "ph": "i",
                "s": "g" if global_mark else "t",
                "pid": _PROCESS,
                "tid": _CONSUMER if global_mark else tracks.at(mark.worker or 0, mark.time),
                "ts": _us(mark.time, origin),
            }
        )
    for lost in trace.losses:
        events += _lost_events(lost, tracks, origin)
    for retired in trace.retirements:
        events += _retired_events(retired, tracks, origin)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "statecore",
            "verdict": stats.verdict(),
        },
    }


def _jsonable(value: Any) -> Any:
    """`value` if JSON takes it as it is (numbers, strings, lists of them), else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(
        isinstance(item, (bool, int, float, str)) for item in value
    ):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() <= 64:
        return value.tolist()
    return shown_index(value)


class _Tracks:
    """The workers' tracks: one per incarnation of a slot. Incarnation 0 of worker w keeps
    the track id w + 1 (a trace with no loss looks as it always did); a replacement's track
    comes after every first one, and sorts right under its slot's earlier incarnations."""

    def __init__(self, trace: Trace) -> None:
        self.workers = trace.num_workers
        self.incarnations = [0] * trace.num_workers
        self.replaced: list[list[float]] = [[] for _ in range(trace.num_workers)]
        """Per slot, when each of its incarnations after the first took over (its loss's
        `ReplaceWorker`, or the add that started a retired slot again), in order."""
        took_over = [(lost.worker, lost.incarnation, lost.replaced) for lost in trace.losses]
        took_over += [(r.worker, r.incarnation, r.added) for r in trace.retirements]
        for worker, incarnation, at in took_over:
            if 0 <= worker < self.workers and at is not None:
                self.incarnations[worker] = max(self.incarnations[worker], incarnation + 1)
                self.replaced[worker].append(at)
        for batch in trace.batches:
            # One whose slot's take-over was forgotten with the stretch before those kept.
            if 0 <= batch.worker < self.workers and batch.incarnation:
                self.incarnations[batch.worker] = max(
                    self.incarnations[batch.worker], batch.incarnation
                )
        for times in self.replaced:
            times.sort()
        self.deepest = max(self.incarnations, default=0)

    def tid(self, worker: int, incarnation: int) -> int:
        return worker + 1 + incarnation * max(1, self.workers)

    def name(self, worker: int, incarnation: int) -> str:
        if 0 <= worker < self.workers and self.incarnations[worker]:
            return f"worker {worker} (incarnation {incarnation})"
        return f"worker {worker}"

    def sort_index(self, worker: int, incarnation: int) -> int:
        return 1 + worker * (self.deepest + 1) + incarnation

    def at(self, worker: int, moment: float) -> int:
        """The track of the incarnation of `worker` that ran at `moment`."""
        if not 0 <= worker < self.workers:
            return worker + 1
        return self.tid(worker, bisect.bisect_right(self.replaced[worker], moment))


def _lost_events(lost: LostWorker, tracks: _Tracks, origin: float) -> list[dict[str, Any]]:
    """The lost incarnation's last event, and its replacement's first."""
    loss = lost.loss
    args: dict[str, Any] = {"worker": lost.worker, "incarnation": lost.incarnation}
    if type(loss) is WorkerDeath:
        how = (
            f"killed by signal {-loss.exitcode}"
            if loss.exitcode is not None and loss.exitcode < 0
            else "died"
            if loss.exitcode is None
            else f"exited with code {loss.exitcode}"
        )
        args.update(pid=loss.pid, exitcode=loss.exitcode, reason=loss.reason)
        if loss.exitcode is not None and loss.exitcode < 0:
            args["signal"] = -loss.exitcode
    else:
        assert type(loss) is WorkerHang
        how = f"stuck on task {loss.task} for {loss.seconds} s"
        args.update(pid=loss.pid, task=loss.task, seconds=loss.seconds, stack=loss.stack)
    args["tasks_sent_again"] = list(lost.held)
    args["replaced"] = lost.restarted
    events: list[dict[str, Any]] = [
        {
            "name": f"worker lost: {how}",
            "cat": "restart",
            "ph": "i",
            "s": "t",
            "pid": _PROCESS,
            "tid": tracks.tid(lost.worker, lost.incarnation),
            "ts": _us(lost.at, origin),
            "args": args,
        }
    ]
    if lost.replaced is not None:
        replacement = tracks.tid(lost.worker, lost.incarnation + 1)
        end = lost.started if lost.started is not None else lost.replaced
        events.append(
            {
                "name": f"starting (replaces incarnation {lost.incarnation})",
                "cat": "restart",
                "ph": "X",
                "pid": _PROCESS,
                "tid": replacement,
                "ts": _us(lost.replaced, origin),
                "dur": max(0.0, _us(end, lost.replaced)),
                "args": {"worker": lost.worker, "incarnation": lost.incarnation + 1},
            }
        )
        if lost.started is not None:
            events.append(
                {
                    "name": "worker started",
                    "cat": "restart",
                    "ph": "i",
                    "s": "t",
                    "pid": _PROCESS,
                    "tid": replacement,
                    "ts": _us(lost.started, origin),
                    "args": {"worker": lost.worker, "incarnation": lost.incarnation + 1},
                }
            )
    return events


def _retired_events(retired: RetiredWorker, tracks: _Tracks, origin: float) -> list[dict[str, Any]]:
    """The retired incarnation's retirement and stop, and its slot's return if it was added."""
    track = tracks.tid(retired.worker, retired.incarnation)
    args: dict[str, Any] = {
        "worker": retired.worker,
        "incarnation": retired.incarnation,
        "tasks_held": list(retired.held),
    }
    events: list[dict[str, Any]] = [
        {
            "name": "worker retiring",
            "cat": "retire",
            "ph": "i",
            "s": "t",
            "pid": _PROCESS,
            "tid": track,
            "ts": _us(retired.at, origin),
            "args": args,
        }
    ]
    if retired.stopped is not None:
        events.append(
            {
                "name": "worker retired (stopped)",
                "cat": "retire",
                "ph": "i",
                "s": "t",
                "pid": _PROCESS,
                "tid": track,
                "ts": _us(retired.stopped, origin),
                "args": {"worker": retired.worker, "incarnation": retired.incarnation},
            }
        )
    if retired.added is not None:
        back = {"worker": retired.worker, "incarnation": retired.incarnation + 1}
        added = tracks.tid(retired.worker, retired.incarnation + 1)
        end = retired.started if retired.started is not None else retired.added
        events.append(
            {
                "name": f"starting (added back after incarnation {retired.incarnation})",
                "cat": "retire",
                "ph": "X",
                "pid": _PROCESS,
                "tid": added,
                "ts": _us(retired.added, origin),
                "dur": max(0.0, _us(end, retired.added)),
                "args": back,
            }
        )
        if retired.started is not None:
            events.append(
                {
                    "name": "worker started",
                    "cat": "retire",
                    "ph": "i",
                    "s": "t",
                    "pid": _PROCESS,
                    "tid": added,
                    "ts": _us(retired.started, origin),
                    "args": back,
                }
            )
    return events
