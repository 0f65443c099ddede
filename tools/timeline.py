"""A traced loader's timeline as a PNG: when each worker loaded, when the training loop waited.

One row per worker, with a bar for every batch it loaded (stragglers in red, labelled with
their slowest sample's dataset index), and a row for the consumer, the training loop, with a
bar for every wait in `next()` or `iter()` (darker where a later batch was ready and held back
for the order of delivery). Epoch starts are dashed lines; a green triangle marks when a
worker became ready, a cross when one died. Needs matplotlib (the `bench`
extra).
"""

from __future__ import annotations

import os
from pathlib import Path

from statecore.executors import Trace

__all__ = ["INSTALL_HINT", "MissingMatplotlib", "draw_timeline"]

INSTALL_HINT = "pip install -e '.[bench]' (or pip install matplotlib)"

_BATCH = "tab:blue"
_STRAGGLER = "tab:red"
_WAIT = "tab:orange"
_HELD = "tab:brown"


class MissingMatplotlib(RuntimeError):
    """Drawing needs matplotlib, which is not installed."""


def draw_timeline(trace: Trace, path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw `trace` as a PNG at `path`; return the path. Raises MissingMatplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingMatplotlib(
            f"drawing the timeline needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from error
    stats = trace.stats()
    stragglers = {(b.epoch, b.task, b.worker) for b in stats.stragglers}
    origin = trace.start
    rows = trace.num_workers + 1
    figure = Figure(figsize=(12, 1.8 + 0.45 * rows), layout="constrained")
    axes = figure.add_subplot()
    labelled = set()
    for b in trace.batches:
        if b.started is None or b.finished is None:
            continue
        straggler = (b.epoch, b.task, b.worker) in stragglers
        color = _STRAGGLER if straggler else _BATCH
        label = "straggler batch" if straggler else "batch loading"
        axes.broken_barh(
            [(b.started - origin, b.finished - b.started)],
            (b.worker + 1 - 0.4, 0.8),
            facecolors=color,
            edgecolors="white",
            linewidth=0.3,
            label=None if label in labelled else label,
        )
        labelled.add(label)
        if straggler and b.slowest:
            index, took = b.slowest[0]
            axes.annotate(
                f"index {index}: {took * 1e3:.0f} ms",
                (b.started - origin + (b.finished - b.started) / 2, b.worker + 1),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
    for wait in trace.waits:
        free = max(wait.got - wait.asked - wait.held, 0.0)
        if free > 0:
            label = "training loop waiting"
            axes.broken_barh(
                [(wait.asked - origin, free)],
                (-0.4, 0.8),
                facecolors=_WAIT,
                label=None if label in labelled else label,
            )
            labelled.add(label)
        if wait.held > 0:
            label = "waiting, a later batch ready"
            axes.broken_barh(
                [(wait.got - origin - wait.held, wait.held)],
                (-0.4, 0.8),
                facecolors=_HELD,
                label=None if label in labelled else label,
            )
            labelled.add(label)
    for mark in trace.marks:
        if mark.kind == "epoch start":
            axes.axvline(mark.time - origin, color="grey", linestyle="--", linewidth=0.8)
        elif mark.kind == "worker died" and mark.worker is not None:
            axes.plot([mark.time - origin], [mark.worker + 1], "kx", markersize=9)
        elif mark.kind == "worker ready" and mark.worker is not None:
            label = "worker ready"
            axes.plot(
                [mark.time - origin],
                [mark.worker + 1],
                marker=">",
                color="tab:green",
                linestyle="none",
                label=None if label in labelled else label,
            )
            labelled.add(label)
    axes.set_yticks(
        range(rows), ["training loop"] + [f"worker {w}" for w in range(trace.num_workers)]
    )
    axes.set_ylim(-0.7, rows - 0.3)
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the first iter(loader)")
    heading = (
        f"waited on loading {100 * stats.waiting_share:.0f}% of {stats.seconds:.2f} s; "
        f"{len(stats.stragglers)} straggler batch(es)"
    )
    axes.set_title(f"{title}: {heading}" if title else heading, fontsize=10)
    # Below the axes, where it hides no bar.
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncols=5)
    path = Path(path)
    figure.savefig(path, format="png", dpi=100)
    return path
