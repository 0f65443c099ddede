"""A trace in Chrome's trace event format (JSON object form), which Perfetto and
`chrome://tracing` open: one track per worker, one for the consumer (`Trace.chrome`)."""

from __future__ import annotations

from typing import Any

import torch

from statecore.executors._observe.trace import Trace, shown_index

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
    for worker in range(trace.num_workers):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": _PROCESS,
                "tid": worker + 1,
                "args": {"name": f"worker {worker}"},
            }
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": _PROCESS,
                "tid": worker + 1,
                "args": {"sort_index": worker + 1},
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
        name = f"{'straggler ' if straggler else ''}batch {b.task}"
        if b.failed:
            name = f"failed {name}"
        event: dict[str, Any] = {
            "name": name,
            "cat": "straggler" if straggler else "batch",
            "ph": "X",
            "pid": _PROCESS,
            "tid": b.worker + 1,
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
    for mark in trace.marks:
        global_mark = mark.worker is None
        events.append(
            {
                "name": mark.kind if not mark.detail else f"{mark.kind}: {mark.detail}",
                "cat": "lifecycle",
                "ph": "i",
                "s": "g" if global_mark else "t",
                "pid": _PROCESS,
                "tid": _CONSUMER if global_mark else (mark.worker or 0) + 1,
                "ts": _us(mark.time, origin),
            }
        )
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
