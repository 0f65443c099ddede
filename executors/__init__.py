"""The imperative shell: executors that carry out the scheduler's commands.

Installed as `statecore.executors`. The executor protocol lives here; the executors themselves
(inline, multiprocessing, threads, pinned memory) build on it.
"""

from statecore.executors._protocol import Executor

__all__ = ["Executor"]
