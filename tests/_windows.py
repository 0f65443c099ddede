"""Windows of figures as the auto loader measures them, for the tuning policy's tests."""

from __future__ import annotations

import attrs

from statecore._tuning import LoadWindow


def recorded(
    batch: int,
    running: int,
    rate: float,
    wait: float,
    cpu: float,
    queued: float | None,
    batches: int = 16,
    busy: float = 1.0,
) -> LoadWindow:
    """A window as the loader measured it: `batches` at `rate` a second, the loop waiting
    `wait` of the time, the workers holding a task `busy` of it, the loader's processes busy
    on `cpu` cores and waiting for `queued` more in the run queue."""
    seconds = batches / rate
    return LoadWindow(
        batch=batch,
        batches=batches,
        seconds=seconds,
        waited=wait * seconds,
        longest_gap=0.0004,
        busy=busy,
        running=running,
        cpu=cpu,
        queued=queued,
    )


def one_window_later(window: LoadWindow) -> LoadWindow:
    """The same figures over the next window: what a second look at an add sees when the
    count's rate held."""
    return attrs.evolve(window, batch=window.batch + window.batches)
