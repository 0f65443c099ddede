"""The storages worker threads collate batches into, used again once the consumer lets go.

Run by the thread executor's workers (`executor`), asked by torch's collate through `hooks`.
A worker process writes each batch into a buffer of its pool and the main process hands that
buffer back when the consumer lets go of the batch (`_mp.pool`). Worker threads need no
crossing, but a batch is still a large new allocation: from the C library's heap or, for a
batch of many megabytes, from a fresh mapping, whose pages the kernel must find and zero as
collate first writes them. On the large-batch benchmark that page-faulting costs about a third
of a worker thread's time.

So torch's collate functions, in a worker thread, take the storage of the batch from here:
a storage of exactly the size asked for that no tensor uses any more (its reference count is
the pool's own), or a new one. It is ordinary memory, as any tensor's; only where it came from
changes. The pool keeps a bounded number of storages: free ones beyond `spare` are let go at
the next claim, and a storage the consumer keeps while the pool is full is forgotten by the
pool, so that a consumer keeping many batches makes it hold no more than `most`, and one that
lets go of them gets their memory back to the system when the pool next trims.

Storages that outlive their executor: when the executor shuts down, the storages of its pool
are not let go but *kept* by this process (`SHELF`), and the next executor's pool (the next
epoch's, when workers do not persist, or a later loader's) takes from them before making a
new one: its first batches are collated into pages that were faulted in already. One that a
batch still uses (a training loop holds its last batch until the next epoch's first replaces
it) is kept too, and handed on only once nothing uses it any more. A new 20 MB storage costs
its first batches some 5,000 page faults, and a pool cycles about five of them (a batch being
made by each worker, those made ahead, the one in the consumer's hand). What is kept is
bounded (`KEPT_STORAGES` storages and `KEPT_BYTES` bytes, the free ones first; beyond that a
storage is let go as before) and let go once no pool has taken any for `KEPT_IDLE` seconds,
so memory a consumer lets go of after the workers stopped may stay that long; a process
forked meanwhile lets go of its copies at once. Worker processes keep their shared buffers
the same way, within the same bounds (`_mp.leases`), though only those no batch uses.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

__all__ = [
    "AVAILABLE",
    "KEPT_BYTES",
    "KEPT_IDLE",
    "KEPT_STORAGES",
    "MIN_BYTES",
    "SHELF",
    "Shelf",
    "StoragePool",
]

MIN_BYTES = 64 << 10
"""Storages smaller than this come from the allocator as usual: they cost little to make, and
the C library's heap serves them without faulting pages in."""

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
AVAILABLE = _use_count is not None
"""Whether this torch says how many references a storage has; without it, no pool."""


# What this process keeps of the storages of executors that are gone, for the next ones (see
# the docstring): at most this many storages and bytes, for at most this many seconds unused;
# the bounds worker processes' kept buffers have (`_mp.leases`).
KEPT_STORAGES = 32
KEPT_BYTES = 1 << 30
KEPT_IDLE = 30.0


def _new(nbytes: int) -> torch.UntypedStorage:
    return torch.UntypedStorage(nbytes)  # type: ignore[no-untyped-call]


def _unused(storage: torch.UntypedStorage) -> bool:
    """Whether nothing but the pool refers to `storage`: no tensor, view or other storage
    object. A tensor made from it afterwards can only be made from the pool's object."""
    assert _use_count is not None
    return _use_count(storage._cdata) == 1


class Shelf:
    """The free storages of executors that have shut down, kept by this process for the next
    ones (see the docstring). One per process (`SHELF`); every method may be called from any
    thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.storages: list[torch.UntypedStorage] = []
        """Least recently kept first."""
        self.timer: threading.Timer | None = None

    def keep(self, storages: list[torch.UntypedStorage]) -> None:
        """Keep `storages` as far as the bounds allow, the free ones first; the rest are let
        go of as they would have been. One a batch still uses (the consumer's last, say, which
        a training loop holds until the next epoch's first batch replaces it) is kept too, and
        handed on only once nothing else uses it (`take`)."""
        with self.lock:
            held = sum(kept.nbytes() for kept in self.storages)
            in_use = []
            for storage in storages:
                if not _unused(storage):
                    in_use.append(storage)
                elif len(self.storages) < KEPT_STORAGES and held + storage.nbytes() <= KEPT_BYTES:
                    self.storages.append(storage)
                    held += storage.nbytes()
            for storage in in_use:
                if len(self.storages) < KEPT_STORAGES and held + storage.nbytes() <= KEPT_BYTES:
                    self.storages.insert(0, storage)  # the last one `take` looks at
                    held += storage.nbytes()
            self._rearm()

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A kept storage of exactly `nbytes` bytes that nothing else uses, the most recently
        kept; None if none is."""
        with self.lock:
            for position in range(len(self.storages) - 1, -1, -1):
                storage = self.storages[position]
                if storage.nbytes() == nbytes and _unused(storage):
                    del self.storages[position]
                    self._rearm()
                    return storage
            return None

    def __len__(self) -> int:
        with self.lock:
            return len(self.storages)

    def held(self) -> int:
        """Bytes of the storages kept."""
        with self.lock:
            return sum(storage.nbytes() for storage in self.storages)

    def release(self) -> None:
        """Let go of every kept storage now."""
        with self.lock:
            released, self.storages = self.storages, []
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
        del released  # outside the lock: the memory goes back here

    def forget_in_child(self) -> None:
        """In a process just forked from this one: let go of its copies of the kept storages,
        which it would otherwise hold (copy-on-write) for as long as it lives. The parent's lock
        may have been held by another of its threads as it forked: the child takes a fresh
        one."""
        self.lock = threading.Lock()
        self.timer = None  # the parent's timer thread is not the child's
        released, self.storages = self.storages, []
        del released

    def _rearm(self) -> None:
        """Let go of everything `KEPT_IDLE` seconds from now, unless a pool takes some first.
        With the lock held."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.storages:
            self.timer = threading.Timer(KEPT_IDLE, self._expire)
            self.timer.name = "statecore-kept-storages"
            self.timer.daemon = True
            self.timer.start()

    def _expire(self) -> None:
        with self.lock:
            if threading.current_thread() is not self.timer:
                return  # re-armed meanwhile: the newer timer decides
            released, self.storages, self.timer = self.storages, [], None
        del released


SHELF = Shelf()
"""This process's kept storages."""

os.register_at_fork(after_in_child=SHELF.forget_in_child)


class StoragePool:
    """Storages for batches, shared by the worker threads of one executor."""

    def __init__(self, spare: int, most: int, shelf: Shelf | None = None) -> None:
        if not 0 <= spare <= most or most < 1:
            raise ValueError(
                f"a pool keeps 0 <= spare <= most and most >= 1 storages, not {spare} and {most}"
            )
        self.spare = spare
        """Free storages kept for the next batches."""
        self.most = most
        """Storages the pool refers to at most, free or in use."""
        self.storages: list[torch.UntypedStorage] = []
        """Least recently handed out first."""
        self.made = 0
        """Storages of a size worth pooling made so far; the rest were used again."""
        self.adopted = 0
        """Storages taken from `shelf` so far, kept there by executors gone before."""
        self.shelf = shelf
        """Where the free storages go when the executor shuts down (`clear`), and where a claim
        that finds none free here looks before it makes one; None: nowhere."""
        self.lock = threading.Lock()

    def claim(self, nbytes: int) -> torch.UntypedStorage:
        """A CPU storage of `nbytes` bytes that nothing else uses: the pool's, or a new one."""
        if not AVAILABLE or nbytes < MIN_BYTES:
            return _new(nbytes)
        with self.lock:
            found = None
            for position, storage in enumerate(self.storages):
                if storage.nbytes() == nbytes and _unused(storage):
                    found = self.storages.pop(position)
                    break
            self._trim(room=found is None)
            if found is None and self.shelf is not None:
                found = self.shelf.take(nbytes)
                self.adopted += found is not None
            if found is None:
                self.made += 1
            storage = _new(nbytes) if found is None else found
            self.storages.append(storage)
            return storage

    def _trim(self, room: bool) -> None:
        """Let go of free storages beyond `spare`, least recent first; and if a new storage is
        to come in, of the least recent ones beyond `most - 1`, in use or not."""
        free = [storage for storage in self.storages if _unused(storage)]
        for storage in free[: max(0, len(free) - self.spare)]:
            self.storages.remove(storage)
        limit = self.most - 1 if room else self.most
        if len(self.storages) > limit:
            del self.storages[: len(self.storages) - limit]

    def held(self) -> int:
        """Bytes of the storages the pool refers to."""
        with self.lock:
            return sum(storage.nbytes() for storage in self.storages)

    def clear(self) -> None:
        """Let go of every storage, handing the free ones to `shelf` if there is one: those the
        consumer still uses live on with their tensors."""
        with self.lock:
            storages, self.storages = self.storages, []
        if self.shelf is not None:
            self.shelf.keep(storages)
