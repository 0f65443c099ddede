"""The inline executor: loads in the calling thread, like torch with `num_workers=0`."""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from statecore import Event, ResumeWorker, SendTask
from statecore.executors._confirm import Confirming
from statecore.executors._protocol import Capabilities, Launch
from statecore.executors._startup import Seat, start_worker
from statecore.executors._worker import WorkerRuntime

__all__ = ["InlineExecutor"]


class InlineExecutor(Confirming):
    """One worker: the caller. A task is loaded when the driver polls for its answer.

    Loading at poll time rather than at dispatch keeps torch's single-process timing: a batch
    is produced when the consumer asks for it, not ahead of time.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(confirms_answers=True)

    def __init__(self, launch: Launch) -> None:
        if launch.num_workers != 1:
            raise ValueError(f"the inline executor has one worker, not {launch.num_workers}")
        self.launch = launch
        self.queue: deque[SendTask | ResumeWorker] = deque()
        self.runtime: WorkerRuntime | None = None

    def start(self) -> None:
        # In the main process torch neither seeds nor sets worker info: neither does this seat.
        self.runtime = start_worker(self.launch.setup, 0, Seat.caller())

    def dispatch(self, command: SendTask) -> None:
        self.queue.append(command)

    def resume(self, command: ResumeWorker) -> None:
        self.queue.append(command)

    def poll(self, timeout: float | None) -> Event | None:
        if self._unconfirmed is not None:
            return self._unconfirmed  # not confirmed yet: an interrupt cut the last poll short
        queue, runtime = self.queue, self.runtime
        if not queue or runtime is None:
            return None
        # Taken off the queue only once answered: Ctrl-C inside the dataset leaves the task to
        # be loaded again by the next request, where torch would skip that batch.
        answer = runtime.answer(queue[0])
        # `_hand_out`, without its frame (a batch costs a few microseconds here): kept, then
        # taken off, with no call in between.
        self._unconfirmed = answer
        del queue[0]
        return answer

    def stop_worker(self, worker: int) -> None:
        self.queue.clear()

    def shutdown(self) -> None:
        self.queue.clear()
        self.runtime = None
        self.confirm()
