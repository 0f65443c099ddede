"""A trace in Chrome's trace event format (`executors/_observe/chrome.py`), as Perfetto and
chrome://tracing read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _tracing import (
    STRAGGLER,
    format_problems,
    traced_epoch,
)


def test_the_format_check_catches_what_breaks_the_format() -> None:
    assert format_problems({"events": []})
    bad = {"traceEvents": [{"name": "x", "ph": "X", "pid": 1, "tid": 1, "ts": -1.0}]}
    assert len(format_problems(bad)) == 2  # negative ts, no duration


@pytest.mark.timeout(120)
def test_the_chrome_trace_follows_the_format_and_puts_the_straggler_on_its_workers_track(
    tmp_path: Path,
) -> None:
    loader, loaded_by = traced_epoch("mp", workers=2)
    path = loader.trace_record().write_chrome(tmp_path / "loader.trace.json")
    document = json.loads(path.read_text())
    assert format_problems(document) == []
    names = {
        (event["tid"], event["args"]["name"])
        for event in document["traceEvents"]
        if event["name"] == "thread_name"
    }
    assert names == {(0, "consumer (training loop)"), (1, "worker 0"), (2, "worker 1")}
    # On a busy machine a batch of fast samples may be slow enough to count as a straggler
    # too: the one that holds the slow sample is the one looked for.
    (straggler,) = [
        e
        for e in document["traceEvents"]
        if e.get("cat") == "straggler" and e["args"]["slowest_samples"][0]["index"] == STRAGGLER
    ]
    assert straggler["tid"] == loaded_by[STRAGGLER] + 1
    waits = [e for e in document["traceEvents"] if e.get("cat") == "wait"]
    assert waits and all(e["tid"] == 0 for e in waits)
