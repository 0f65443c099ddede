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
bounded (32 storages and 1 GiB, `_keeping`'s bounds, the free ones first; beyond that a
storage is let go as before) and let go once no pool has taken any for 30 seconds,
so memory a consumer lets go of after the workers stopped may stay that long; a process
forked meanwhile lets go of its copies at once. Worker processes keep their shared buffers
the same way, within the same bounds (`_mp.leases`), though only those no batch uses.

Huge pages: a kept storage is not free of faults after all once the process forks (a loader
of worker processes starting, say): fork makes every page of the parent copy-on-write, and the
first write to each afterwards faults, one fault a 4 kB page, 5,000 a 20 MB storage, even once
the child has gone. So a new storage of at least `HUGE_BYTES` is advised to the kernel as one
of transparent huge pages (`madvise(MADV_HUGEPAGE)`, Linux, over the 2 MB-aligned part of it):
where the system allows them (`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or
`madvise`), making it and writing it again after a fork cost one fault a 2 MB page. Only the
kernel's way of mapping the memory changes; without huge pages, or elsewhere, nothing does.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Callable

import torch

from statecore.executors._keeping import Keeping

__all__ = [
    "AVAILABLE",
    "HUGE_BYTES",
    "MIN_BYTES",
    "SHELF",
    "Shelf",
    "StoragePool",
    "new_storage",
]

MIN_BYTES = 64 << 10
"""Storages smaller than this come from the allocator as usual: they cost little to make, and
the C library's heap serves them without faulting pages in."""

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
AVAILABLE = _use_count is not None
"""Whether this torch says how many references a storage has; without it, no pool."""


HUGE_BYTES = 4 << 20
"""New storages at least this large are advised as huge pages (see the docstring): two 2 MB
pages at least, where a smaller one may hold no whole aligned one."""

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def _madvise() -> Callable[[int, int, int], int] | None:
    """The C library's `madvise(address, length, advice)`, where the kernel takes huge-page
    advice; else None."""
    if not sys.platform.startswith("linux") or _MADV_HUGEPAGE is None:
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_advise = _madvise()


def _advise_huge_pages(storage: torch.UntypedStorage) -> None:
    """Advise the whole 2 MB pages inside `storage` as huge pages; a refusal changes nothing."""
    if _advise is None or _MADV_HUGEPAGE is None:
        return
    start = storage.data_ptr()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    end = (start + storage.nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if end > first:
        _advise(first, end - first, _MADV_HUGEPAGE)


def new_storage(nbytes: int) -> torch.UntypedStorage:
    """A new CPU storage of `nbytes` bytes, as the pool makes one: a large one advised as huge
    pages (see the docstring). The benchmark's floors make their batches with it too, so that
    the loader has no memory the floors lack (`tools/floor.py`)."""
    storage: torch.UntypedStorage = torch.UntypedStorage(nbytes)  # type: ignore[no-untyped-call]
    if nbytes >= HUGE_BYTES:
        # Before anything writes it: pages already faulted in stay small.
        _advise_huge_pages(storage)
    return storage


def _unused(storage: torch.UntypedStorage) -> bool:
    """Whether nothing but the pool refers to `storage`: no tensor, view or other storage
    object. A tensor made from it afterwards can only be made from the pool's object."""
    assert _use_count is not None
    return _use_count(storage._cdata) == 1


class Shelf(Keeping[torch.UntypedStorage]):
    """The free storages of executors that have shut down, kept by this process for the next
    ones (see the docstring). One per process (`SHELF`)."""

    def __init__(self) -> None:
        super().__init__(lambda storage: storage.nbytes(), "statecore-kept-storages")

    def keep(self, storages: list[torch.UntypedStorage]) -> None:
        """Keep `storages` as far as the bounds allow, the free ones first; the rest are let
        go of as they would have been. One a batch still uses (the consumer's last, say, which
        a training loop holds until the next epoch's first batch replaces it) is kept too, and
        handed on only once nothing else uses it (`take`)."""
        with self.lock:
            held = self._held()
            in_use = []
            for storage in storages:
                if not _unused(storage):
                    in_use.append(storage)
                elif self._fits(storage, held):
                    self.items.append(storage)
                    held += storage.nbytes()
            for storage in in_use:
                if self._fits(storage, held):
                    self.items.insert(0, storage)  # the last one `take` looks at
                    held += storage.nbytes()
            self._rearm()

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A kept storage of exactly `nbytes` bytes that nothing else uses, the most recently
        kept; None if none is."""
        with self.lock:
            for position in range(len(self.items) - 1, -1, -1):
                storage = self.items[position]
                if storage.nbytes() == nbytes and _unused(storage):
                    del self.items[position]
                    self._rearm()
                    return storage
            return None


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
            return new_storage(nbytes)
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
            storage = new_storage(nbytes) if found is None else found
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
