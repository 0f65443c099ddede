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

An executor may also offer an attribute `unconfirmed` (None at first), to be interruptible
without losing answers: `poll` sets it to the answer it returns before it removes that answer
from wherever it kept it, with no call in between, and the driver sets it back to None once it
has recorded the answer. Ctrl-C may land just after `poll` took an answer, where the return
value is dropped; the driver then finds the answer in `unconfirmed` and records it on its next
wait. Without the attribute an interrupt landing there loses that answer, and the loader waits
for it in vain. The mp and thread executors offer it.

Every method is called from one thread, the driver's, unless the executor's factory has a
true `poll_from_any_thread` attribute: then the pin-memory stage may call `poll` from a thread
of its own while the driver's thread calls the others.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from statecore import Event, ResumeWorker, SendTask

__all__ = ["Executor"]


@runtime_checkable
class Executor(Protocol):
    """The small surface a driver loop drives."""

    def start(self) -> None:
        """Bring up the workers it was built for; they wait for tasks."""

    def dispatch(self, command: SendTask) -> None:
        """Give `command.worker` the task: produce the batch for `command.index`."""

    def resume(self, command: ResumeWorker) -> None:
        """Ask `command.worker` to start a new epoch with a fresh dataset iterator."""

    def poll(self, timeout: float | None) -> Event | None:
        """The next answer or death from any worker; None if none came within `timeout` seconds.

        `timeout=None` waits as long as it takes. An executor with nothing left to answer
        returns None at once.
        """

    def stop_worker(self, worker: int) -> None:
        """Tell `worker` to exit once it has read everything sent before."""

    def shutdown(self) -> None:
        """Release everything: join or terminate workers, close queues, free shared memory."""
