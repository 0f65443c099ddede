"""The imperative shell: the DataLoader facade, the driver loop and the executors.

Installed as `statecore.executors`. Executors carry out the scheduler's commands and report
what their workers did; they decide nothing.
"""

from statecore.executors._driver import Driver, failure_exception
from statecore.executors._launch import ExecutorFactory, Launch
from statecore.executors._loader import DataLoader
from statecore.executors._pinned import Pinned, PinnedExecutor, pinned
from statecore.executors._protocol import Executor
from statecore.executors._registry import ENTRY_POINT_GROUP, available
from statecore.executors._remote import RemoteError
from statecore.executors._worker import WorkerRuntime, WorkerSetup, as_worker, get_worker_info

__all__ = [
    "ENTRY_POINT_GROUP",
    "DataLoader",
    "Driver",
    "Executor",
    "ExecutorFactory",
    "Launch",
    "Pinned",
    "PinnedExecutor",
    "RemoteError",
    "WorkerRuntime",
    "WorkerSetup",
    "as_worker",
    "available",
    "failure_exception",
    "get_worker_info",
    "pinned",
]
