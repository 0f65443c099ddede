"""Helpers of the tracing tests (tests/test_trace_*.py): a dataset with one known straggler
(dataset index 37, a sample that takes far longer than the others), a traced epoch over it
that says which worker really loaded each sample (from the dataset's `get_worker_info`, not
from the trace), and a check of Chrome's trace event format."""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import Dataset, get_worker_info

import statecore
from statecore.executors import Trace
from statecore.executors._observe.trace import BatchRecord

STRAGGLER = 37


BATCH_SIZE = 4


class OneStraggler(Dataset[tuple[int, int]]):
    """48 samples; sample 37 waits until `released` is set or 0.2 s pass, the others 1 ms.
    Each sample is (its index, the id of the worker that loaded it, -1 in the main process)."""

    def __init__(self, size: int = 48) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int]:
        time.sleep(0.2 if index == STRAGGLER else 0.001)
        info = get_worker_info()
        return index, -1 if info is None else info.id


def traced_epoch(executor: str, workers: int, **options: Any) -> tuple[Any, dict[int, int]]:
    """One traced epoch; the loader and which worker loaded each sample, as the dataset saw."""
    loader = statecore.DataLoader(
        OneStraggler(),
        batch_size=BATCH_SIZE,
        num_workers=workers,
        executor=executor,
        trace=True,
        **options,
    )
    loaded_by = {}
    for indices, worker_ids in loader:
        for index, worker in zip(indices.tolist(), worker_ids.tolist(), strict=True):
            loaded_by[index] = worker
    return loader, loaded_by


def straggler_record(trace: Trace) -> BatchRecord:
    (record,) = [b for b in trace.batches if STRAGGLER in list(b.index)]
    return record


PHASES_WITH_DURATION = {"X"}


INSTANT_SCOPES = {"g", "p", "t"}


def format_problems(document: Any) -> list[str]:
    """What breaks the rules of Chrome's trace event format (JSON object form), as Perfetto
    and chrome://tracing read it; empty if nothing does."""
    problems = []
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return ["the top level must be an object with a traceEvents list"]
    if document.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append("displayTimeUnit must be ms or ns")
    for number, event in enumerate(document["traceEvents"]):
        where = f"event {number} ({event.get('name')!r})"
        if not isinstance(event.get("name"), str):
            problems.append(f"{where}: name must be a string")
        phase = event.get("ph")
        if phase not in {"X", "B", "E", "i", "I", "M", "C"}:
            problems.append(f"{where}: unknown phase {phase!r}")
        for key in ("pid", "tid"):
            if not isinstance(event.get(key), int):
                problems.append(f"{where}: {key} must be an integer")
        if phase != "M":
            ts = event.get("ts")
            if not isinstance(ts, (int, float)) or ts < 0:
                problems.append(f"{where}: ts must be a number of microseconds, not negative")
        if phase in PHASES_WITH_DURATION:
            dur = event.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"{where}: a complete event needs a duration of 0 or more")
        if phase == "i" and event.get("s", "t") not in INSTANT_SCOPES:
            problems.append(f"{where}: an instant event's scope must be g, p or t")
        if phase == "M" and not isinstance(event.get("args"), dict):
            problems.append(f"{where}: a metadata event needs args")
        if "args" in event and not isinstance(event["args"], dict):
            problems.append(f"{where}: args must be an object")
    return problems
