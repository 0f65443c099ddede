"""The thread executor: workers are threads of the main process.

Everything here runs in the main process; split by what each part holds:

- `executor`: the executor (start, dispatch, poll, shutdown) and each worker thread's body;
  its docstring says what a worker thread gets of what torch gives a worker process;
- `copies`: each worker thread's own copy of the dataset, and its methods bound to it;
- `hooks`: what the executor changes in torch, once per process, so that threads can be
  workers (`get_worker_info()` per thread; collate's storages from the pool);
- `reseed`: the watch on the process-wide seeding functions, and the datasets warned about;
- `storages`: the pool of ordinary storages that worker threads collate batches into.

A worker thread starts as every worker does, through `executors._startup.start_worker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from statecore.executors._lazy import lazy_names

if TYPE_CHECKING:
    from statecore.executors._thread.executor import ThreadExecutor
    from statecore.executors._thread.reseed import ThreadReseedWarning
    from statecore.executors._thread.storages import StoragePool

_WHERE = {
    "StoragePool": "storages",
    "ThreadExecutor": "executor",
    "ThreadReseedWarning": "reseed",
}

__all__ = ["StoragePool", "ThreadExecutor", "ThreadReseedWarning"]


__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals())
