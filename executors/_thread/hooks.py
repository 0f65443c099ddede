"""What the thread executor changes in torch, once per process, so that threads can be workers.

Run in the main process: installed by the executor's `start`, then called in whatever thread
calls them. Outside a worker thread each hooked function does exactly what it did before.

- torch's `get_worker_info()` answers per thread: a worker thread's own WorkerInfo
  (`per_thread.info`), set by the worker's start-up (`executors._startup`);
- torch's collate, in a worker thread, takes each batch's storage from the executor's pool
  (`storages`) instead of shared memory: see `executor`'s docstring.

The reseed watch, the third change, is in `reseed`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data._utils.worker as torch_worker

__all__ = ["INSTALLED", "install_pooled_storages", "install_worker_info", "per_thread"]

per_thread = threading.local()
"""In a worker thread: `info` (its WorkerInfo), `on_reseed` (told of each seeding call),
`where` (what the thread is doing, for the reseed warning), `pool` (the executor's
StoragePool) and `claiming` (torch's collate has just asked for the worker info, and will ask
for a storage). Absent in every other thread."""
INSTALLED = threading.Lock()
"""Held while a hook is installed: two loaders starting at once install each hook once."""
_COLLATE_MODULE = "torch.utils.data._utils.collate"


def install_worker_info() -> None:
    """Make torch's get_worker_info() answer per thread, once per process.

    torch keeps the worker's info in a module global, one per process. We give the function a
    body that first looks at this thread's info; everyone holding a reference to it, such as
    `torch.utils.data.get_worker_info`, sees the change. Outside our worker threads it returns
    exactly what it returned before. Called from torch's collate module in a worker thread, it
    answers None unless the thread has a pool: see `_collating`.
    """
    with INSTALLED:
        namespace = torch_worker.__dict__
        if namespace.get("_statecore_threads") is per_thread:
            return
        namespace["_statecore_threads"] = per_thread
        namespace["_statecore_caller"] = sys._getframe
        namespace["_statecore_collate"] = _COLLATE_MODULE
        namespace["_statecore_collating"] = _collating
        source = (
            "def get_worker_info():\n"
            "    info = getattr(_statecore_threads, 'info', None)\n"
            "    if info is None:\n"
            "        return _worker_info\n"
            "    if _statecore_caller(1).f_globals.get('__name__') == _statecore_collate:\n"
            "        return _statecore_collating(info)\n"
            "    return info\n"
        )
        compiled: dict[str, Any] = {}
        exec(compile(source, "<statecore thread worker info>", "exec"), namespace, compiled)
        torch_worker.get_worker_info.__code__ = compiled["get_worker_info"].__code__


def _collating(info: Any) -> Any:
    """What torch's collate module hears from get_worker_info() in a worker thread: the info,
    if the thread has a pool to give it the batch's storage from (it then asks for one with
    `_new_shared`); else None, so that it allocates an ordinary batch itself."""
    if getattr(per_thread, "pool", None) is None:
        return None
    per_thread.claiming = True
    return info


def install_pooled_storages() -> None:
    """Have `UntypedStorage._new_shared`, asked by torch's collate in a worker thread, return
    an ordinary storage from that thread's pool, once per process. Every other call, in any
    thread, gets what it got before."""
    with INSTALLED:
        current = torch.UntypedStorage._new_shared
        if getattr(current, "_statecore_pooled", False):
            return
        original: Callable[..., torch.UntypedStorage] = current

        def new_shared(cls: type, size: int, *, device: Any = "cpu") -> torch.UntypedStorage:
            pool = getattr(per_thread, "pool", None)
            if pool is not None and getattr(per_thread, "claiming", False):
                # This call answers collate's question, pooled or not: a later call of the
                # thread's own (a dataset asking for shared memory) must get shared memory.
                per_thread.claiming = False
                if cls is torch.UntypedStorage and torch.device(device).type == "cpu":
                    claimed: torch.UntypedStorage = pool.claim(size)
                    return claimed
            return original(size, device=device)

        new_shared._statecore_pooled = True  # type: ignore[attr-defined]
        torch.UntypedStorage._new_shared = classmethod(new_shared)  # type: ignore[assignment,method-assign]
