"""What an executor is given to start its workers."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from statecore.executors._protocol import Executor
from statecore.executors._worker import WorkerSetup

__all__ = ["ExecutorFactory", "Launch"]


@attrs.frozen
class Launch:
    """Everything an executor needs: what each worker runs, and how many workers."""

    setup: WorkerSetup
    num_workers: int
    """Workers the scheduler addresses: the loader's num_workers, or 1 to load in-process."""
    multiprocessing_context: object = None
    """A start method name or a context object (stdlib or multiprocess), for process executors."""
    start_all_at_once: bool = False
    """Whether every worker must be started by the time `start()` returns.

    Executors may otherwise start workers as they are needed, from the thread that polls. A
    pin stage asks for this: its own thread polls, and starting (forking) workers there would
    fork while the training loop runs, holding locks the children would inherit as held.
    """


ExecutorFactory = Callable[[Launch], Executor]
