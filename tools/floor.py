"""The floor of a workload: what its workers' work reaches with no loader at all.

On a workload that moves large batches, the work is memory bandwidth: each sample is made
(`torch.full`, in the dataset) and copied into its batch (collate). What the machine makes of
that, with as many threads as the workload has workers and nothing else (no tasks, no queues,
no hand-over to a consumer), is the most any loader of threads can reach: `bench` runs it in
every round of a workload marked `floor=True`, beside the loaders, and gives the threads'
figure as a share of it (docs/performance.md).

Each thread makes every `workers`-th batch of the same epoch the loaders run, of the same
samples, and stacks them into one batch tensor of its own, used again for each batch (as the
thread executor's collate takes storages the consumer has let go of); it reads the batch's
last value, as the benchmark's consumer does. The clock runs from when every thread is ready
(one untimed batch each, to fault their pages in) to when the last has finished, over the
batches of the loaders' steady stretch. Its batch tensors are made as the thread executor makes
its batches' storages (`new_storage`: huge pages advised, where the system allows them), so
that the loader has no memory the floor lacks (docs/performance.md, "The bench against the
probe").

The floor with a hand-over (`handover_floor`) is the same work with the least a loader of
threads adds to it under torch's contract: each thread takes the batch numbers given to it,
in turns (batch k goes to thread k mod threads), collates into a free batch tensor of a pool
they share, and puts the batch on a queue; this thread takes the batches in their order,
reads the last value, and gives the tensor back; as many tasks are out at a time as the
loaders' prefetch allows (`PREFETCH` a thread). Its pool is made and written once before the
clock, as the floor's batches are, so that what it measures is the hand-over itself: the
queues, the wait for the next batch in order, the turns, the batch written into a tensor
last written several batches ago, and this thread's steps. No loader of threads can do less;
the thread loader's share of it is what statecore costs beyond that.

In turns, because torch's loaders give batch k to worker k mod num_workers, and a dataset's
random draws follow its worker's seed: which worker makes a batch decides what it holds. A
thread done ahead of its turn waits, where one queue shared by the threads would give it the
next batch: on `large-batches` (quiet machine, 2026-11-28, 8 rounds of 600 batches) a shared
queue's hand-over reached 0.997 of the floor and the turns 0.950.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from typing import Any

import torch

from statecore.executors._thread.storages import new_storage
from statecore.tools.workloads import Measurement, Unit, Workload

__all__ = ["PREFETCH", "handover_floor", "threads_floor"]

PREFETCH = 2
"""Tasks out a thread in the floor with a hand-over: the loaders' default `prefetch_factor`."""


def _batches(workload: Workload) -> list[range]:
    """The indices of each batch of one epoch of `workload`, in order; refuses a workload not
    measured in bytes."""
    if workload.unit is not Unit.GB_PER_S:
        raise ValueError(f"{workload.name}: a floor is measured in GB/s, not {workload.unit.value}")
    size = workload.batch_size
    return [range(number * size, number * size + size) for number in range(workload.batches)]


def _batch_of(samples: list[torch.Tensor]) -> torch.Tensor:
    """`samples` stacked into a new batch tensor whose storage is made as the thread
    executor's are (`new_storage`)."""
    first = samples[0]
    shape = (len(samples), *first.shape)
    storage = new_storage(math.prod(shape) * first.element_size())
    batch = torch.empty(0, dtype=first.dtype).set_(storage).view(shape)
    return torch.stack(samples, out=batch)


def threads_floor(workload: Workload) -> Measurement:
    """One run of `workload`'s floor: its batches made and collated by `workload.workers`
    threads with no loader; the work is the batches' bytes (`Unit.GB_PER_S`)."""
    batches = _batches(workload)
    dataset: Any = workload.dataset_for_run()
    threads = workload.workers
    # The steady stretch: every batch but the first, as `workloads.measure` times it.
    timed = batches[1:]
    ready = threading.Barrier(threads + 1)
    finished = threading.Barrier(threads + 1)
    done = [0.0] * threads
    failures: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            batch = _batch_of([dataset[index] for index in batches[0]])
            ready.wait()
            made = 0.0
            for indices in timed[thread::threads]:
                torch.stack([dataset[index] for index in indices], out=batch)
                batch.reshape(-1)[-1].item()
                made += float(batch.nbytes)
            done[thread] = made
        except BaseException as error:
            failures.append(error)
            ready.abort()
        finally:
            finished.wait()

    workers = [
        threading.Thread(target=work, args=(thread,), name=f"floor-{thread}", daemon=True)
        for thread in range(threads)
    ]
    for worker in workers:
        worker.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a thread failed: raised below
        ready.wait()
    started = time.perf_counter()
    finished.wait()
    seconds = time.perf_counter() - started
    for worker in workers:
        worker.join()
    if failures:
        raise failures[0]
    return Measurement(seconds, sum(done))


_STOP = -1


def handover_floor(workload: Workload) -> Measurement:
    """One run of `workload`'s floor with a hand-over (see the docstring): its batches made by
    `workload.workers` threads and taken in order by this one, through queues and a shared
    pool of batch tensors, with no loader; the work is the bytes of the batches of the steady
    stretch, timed from the first batch taken to the last (`Unit.GB_PER_S`)."""
    batches = _batches(workload)
    dataset: Any = workload.dataset_for_run()
    threads = workload.workers
    turns: list[queue.SimpleQueue[int]] = [queue.SimpleQueue() for _ in range(threads)]
    made: queue.SimpleQueue[tuple[int, torch.Tensor | BaseException]] = queue.SimpleQueue()
    # As many tensors as can be out at once (the tasks out and the one in this thread's hand),
    # written once before the clock.
    free = [
        _batch_of([dataset[index] for index in batches[0]]) for _ in range(threads * PREFETCH + 1)
    ]
    lock = threading.Lock()

    def claim() -> torch.Tensor:
        with lock:
            if free:
                return free.pop()
        return _batch_of([dataset[index] for index in batches[0]])

    def work(tasks: queue.SimpleQueue[int]) -> None:
        while (number := tasks.get()) != _STOP:
            try:
                batch = claim()
                torch.stack([dataset[index] for index in batches[number]], out=batch)
                made.put((number, batch))
            except BaseException as error:
                made.put((number, error))
                return

    workers = [
        threading.Thread(
            target=work, args=(turns[thread],), name=f"handover-floor-{thread}", daemon=True
        )
        for thread in range(threads)
    ]
    for worker in workers:
        worker.start()
    sent = 0
    for _ in range(min(len(batches), threads * PREFETCH)):
        turns[sent % threads].put(sent)
        sent += 1
    waiting: dict[int, torch.Tensor] = {}
    work_done = 0.0
    started = 0.0
    try:
        for number in range(len(batches)):
            while number not in waiting:
                arrived, batch_or_error = made.get()
                if isinstance(batch_or_error, BaseException):
                    raise batch_or_error
                waiting[arrived] = batch_or_error
            batch = waiting.pop(number)
            if number == 0:
                started = time.perf_counter()
            else:
                batch.reshape(-1)[-1].item()
                work_done += float(batch.nbytes)
            if sent < len(batches):
                turns[sent % threads].put(sent)
                sent += 1
            with lock:
                free.append(batch)
            del batch
        seconds = time.perf_counter() - started
    finally:
        for tasks in turns:
            tasks.put(_STOP)
        for worker in workers:
            worker.join()
    return Measurement(seconds, work_done)
