"""The multiprocessing executor: worker processes from the `multiprocess` package.

Split by which process runs what:

- `executor`: the parent (the loader's process): starts workers, sends tasks, polls, shuts down;
- `taskpipe`: the parent's end of a worker's task pipe, written without ever blocking;
- `leases`: the parent's side of the shared-memory buffers: its mappings, and leases;
- `descriptors`: the parent's diagnosis of running out of file descriptors;
- `worker`: the body of a worker process and the thread that sends its answers;
- `pool`: a worker's side of the buffers: its pool, and the pickler that places batches;
- `wire`: what crosses and how it is encoded, for both sides;
- `stacks`: a worker's Python stack, dumped on a signal and read back, for both sides.

What crosses process boundaries, and how:

- *User code* (dataset, collate_fn, worker_init_fn) goes to spawn and forkserver workers pickled
  once for all workers, by the C pickler, or by dill where it holds code that a worker could not
  find by name, so lambdas, closures and classes defined in functions work; except for tensors
  (and pipes), whose pickle is a handle only one process can fetch, pickled for each worker as
  it starts (`wire.Shipment`). The pickle is made while the first worker imports its modules
  and written once to a file of the executor's directory that every worker reads (its path the
  worker's first message), not into each process's arguments, so that starting a worker never
  waits for it to import torch; and no more workers import at once than there are cores less
  one (`executor`). Under fork nothing is pickled, as in torch. Under forkserver the server
  preloads the worker's module, and so torch, before it forks any worker.
- *Tasks* go through a pipe per worker, pickled by the C pickler (dill only as a fallback).
  The main thread writes them itself, and what the pipe has no room for is left to a flusher
  thread (`taskpipe`), so sending a task never blocks the main process.
- *Results* come back pickled with the standard library's C pickler. Large tensors travel in
  shared-memory buffers that each worker reuses (`pool`, `leases`): default_collate writes the
  batch straight into one, and the message says which. Other tensors travel as torch sends
  them, each in a shared-memory segment of its own whose file descriptor crosses through the
  resource sharer. Only a batch the C pickler refuses falls back to dill (with torch's
  reductions).
- *Buffers* cross once each: a notice carrying the file descriptor precedes the first message
  that uses one. The main process gives a buffer back, once the consumer has freed the storage
  built on it, with the next task it sends that worker, or on its own when no task has carried
  it back soon after (`executor.LINGER`). A worker closes the free buffers its next batches
  will not need as they come back, and their memory goes back to the system at once.

A worker exits on its own the moment its loader's process ends, however that process was
killed and whatever the worker is doing (`worker.watch_loader`).

A lost worker (dead, or stuck past `worker_timeout`) is replaced in its slot when the loader
has restarts left (`executor.replace`): its process is killed and joined, its pipes closed with
whatever it sent that was not read, its buffers forgotten, and a new process started with a
`worker.Restart` that sets it up as the lost one was. Every answer is stamped with the
incarnation of the process whose pipe it came by. A stuck worker's stack is asked of it with a
signal before anything is decided (`stacks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statecore.executors._lazy import lazy_names

if TYPE_CHECKING:
    from statecore.executors._mp.descriptors import explain_exhaustion
    from statecore.executors._mp.executor import MultiprocessExecutor, resolve_context
    from statecore.executors._mp.leases import BufferReceiver
    from statecore.executors._mp.pool import (
        AVAILABLE,
        BUFFERS_PER_WORKER,
        MIN_BUFFER_BYTES,
        Batch,
        BufferSender,
        buffers_per_worker,
    )
    from statecore.executors._mp.taskpipe import TaskWriter
    from statecore.executors._mp.wire import BufferClosed, BufferOpened
    from statecore.executors._mp.worker import AnswerSender

# The names below load on first use, each from its module: a worker process imports this
# package on its way to `worker`, and must not import the main process's side with it
# (`executor`, `leases`, `taskpipe`, `descriptors`): for a spawned worker every module imported
# is start-up time.
_WHERE = {
    "AVAILABLE": "pool",
    "BUFFERS_PER_WORKER": "pool",
    "MIN_BUFFER_BYTES": "pool",
    "AnswerSender": "worker",
    "Batch": "pool",
    "BufferClosed": "wire",
    "BufferOpened": "wire",
    "BufferReceiver": "leases",
    "BufferSender": "pool",
    "MultiprocessExecutor": "executor",
    "TaskWriter": "taskpipe",
    "buffers_per_worker": "pool",
    "explain_exhaustion": "descriptors",
    "resolve_context": "executor",
}

__all__ = [
    "AVAILABLE",
    "BUFFERS_PER_WORKER",
    "MIN_BUFFER_BYTES",
    "AnswerSender",
    "Batch",
    "BufferClosed",
    "BufferOpened",
    "BufferReceiver",
    "BufferSender",
    "MultiprocessExecutor",
    "TaskWriter",
    "buffers_per_worker",
    "explain_exhaustion",
    "resolve_context",
]


__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
