"""torch's scheduling bookkeeping, written the way torch writes it, for the step benchmark.

This mirrors `_MultiProcessingDataLoaderIter`'s counters (`_send_idx`, `_rcvd_idx`,
`_task_info`, `_tasks_outstanding`, `_workers_status`, the worker cycle) as plain mutable
attributes updated in place: the cheapest honest way to do the same job, and the yardstick
for what the pure core costs. Only the in-order, map-style path that the benchmark exercises
is here. It is not used by the loader.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

__all__ = ["TorchStyleBookkeeping"]


class TorchStyleBookkeeping:
    """Mutable counters and a dict, as in torch; `send` stands in for the index queue put."""

    def __init__(
        self, num_workers: int, prefetch_factor: int, send: Callable[[int, object], None]
    ) -> None:
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.send = send
        self.in_order = True
        self.send_idx = 0
        self.rcvd_idx = 0
        self.task_info: dict[int, tuple[object, ...]] = {}
        self.tasks_outstanding = 0
        self.workers_status = [True] * num_workers
        self.workers_num_tasks = [0] * num_workers
        self.worker_queue_idx_cycle = itertools.cycle(range(num_workers))
        self.waiting = False
        self.drawing_for: int | None = None

    def _want_index(self) -> bool:
        """torch's `_try_put_index` up to the point where it reads the sampler."""
        max_tasks = self.prefetch_factor * self.num_workers
        if self.tasks_outstanding >= max_tasks or self.send_idx - self.rcvd_idx >= max_tasks:
            return False
        for _ in range(self.num_workers):
            worker_queue_idx = next(self.worker_queue_idx_cycle)
            if self.workers_status[worker_queue_idx]:
                if self.in_order:
                    break
                if self.workers_num_tasks[worker_queue_idx] < max_tasks // sum(self.workers_status):
                    break
        else:
            return False
        self.drawing_for = worker_queue_idx
        return True

    def start(self) -> bool:
        return self._want_index()

    def index_drawn(self, index: object) -> bool:
        """The rest of `_try_put_index`: put the index, record the task. True: draw another."""
        worker_queue_idx = self.drawing_for
        assert worker_queue_idx is not None
        self.drawing_for = None
        self.send(worker_queue_idx, (self.send_idx, index))
        self.task_info[self.send_idx] = (worker_queue_idx,)
        self.workers_num_tasks[worker_queue_idx] += 1
        self.tasks_outstanding += 1
        self.send_idx += 1
        return self._want_index()

    def _skip_resolved(self) -> None:
        """The loop at the top of `_next_data`: skip tasks of workers that ran dry."""
        while self.rcvd_idx < self.send_idx:
            info = self.task_info.get(self.rcvd_idx, None)
            if info:
                worker_id = info[0]
                assert isinstance(worker_id, int)
                if len(info) == 2 or self.workers_status[worker_id]:
                    break
                del self.task_info[self.rcvd_idx]
            self.rcvd_idx += 1

    def _process_data(self, data: object) -> tuple[object, bool]:
        self.rcvd_idx += 1
        return data, self._want_index()

    def next_requested(self) -> tuple[object, bool] | None:
        """`_next_data`'s check for an answer already in hand; None means wait."""
        self._skip_resolved()
        info = self.task_info.get(self.rcvd_idx)
        if info is not None and len(info) == 2:
            _worker, data = self.task_info.pop(self.rcvd_idx)
            return self._process_data(data)
        self.waiting = True
        return None

    def data_arrived(self, idx: int, data: object) -> tuple[object, bool] | None:
        """`_next_data`'s handling of one answer from the result queue."""
        self.tasks_outstanding -= 1
        worker_id = self.task_info[idx][0]
        assert isinstance(worker_id, int)
        self.workers_num_tasks[worker_id] -= 1
        if self.waiting and idx == self.rcvd_idx:
            del self.task_info[idx]
            self.waiting = False
            return self._process_data(data)
        self.task_info[idx] += (data,)
        return None
