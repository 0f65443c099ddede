"""The executor protocol: what a driver loop needs from whatever does the loading.

An executor only moves data. It never decides which worker gets a task, how far to prefetch,
or in which order batches are handed over: the scheduler core decides that, and the driver
loop passes its commands on to the executor.

What an executor promises, and the models assume:

- every task sent to a worker is answered exactly once (`TaskCompleted`, `TaskFailed`, or, for
  an iterable dataset whose worker has run dry, `WorkerExhausted`), until the worker is stopped;
- a worker answers in the order it was given work, and answers a resume after every task sent
  before it (`WorkerResumed`);
- a worker that ends without being stopped is reported once with `WorkerDied`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from statecore import Event

__all__ = ["Executor"]


@runtime_checkable
class Executor(Protocol):
    """The small surface a driver loop drives."""

    def start(self, num_workers: int) -> None:
        """Bring up `num_workers` workers; they wait for tasks."""

    def dispatch(self, worker: int, task: int, index: object) -> None:
        """Give `worker` the task numbered `task`: produce the batch for `index`."""

    def resume(self, worker: int, epoch: int, seed: int | None) -> None:
        """Ask `worker` to start epoch `epoch` with a fresh dataset iterator."""

    def poll(self, timeout: float | None) -> Event | None:
        """The next answer from any worker, or None if none came within `timeout` seconds."""

    def stop_worker(self, worker: int) -> None:
        """Tell `worker` to exit once it has read everything sent before."""

    def shutdown(self) -> None:
        """Release everything: join or terminate workers, close queues, free shared memory."""
