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
batches of the loaders' steady stretch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from statecore.tools.workloads import Measurement, Unit, Workload

__all__ = ["threads_floor"]


def threads_floor(workload: Workload) -> Measurement:
    """One run of `workload`'s floor: its batches made and collated by `workload.workers`
    threads with no loader; the work is the batches' bytes (`Unit.GB_PER_S`)."""
    if workload.unit is not Unit.GB_PER_S:
        raise ValueError(f"{workload.name}: a floor is measured in GB/s, not {workload.unit.value}")
    dataset: Any = workload.dataset_for_run()
    size, threads = workload.batch_size, workload.workers
    # The steady stretch: every batch but the first, as `workloads.measure` times it.
    batches = [range(number * size, number * size + size) for number in range(workload.batches)]
    timed = batches[1:]
    ready = threading.Barrier(threads + 1)
    finished = threading.Barrier(threads + 1)
    done = [0.0] * threads
    failures: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            first = [dataset[index] for index in batches[0]]
            batch = torch.stack(first)
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
