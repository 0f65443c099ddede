"""`SharedSequence`: many small Python objects kept as one flat buffer that workers share.

A map-style dataset that holds a list of millions of small objects (dicts, strings, tuples)
grows by up to its whole size in every forked worker, though no worker changes it
(pytorch#13246): reading an object writes its reference count, and a collection in the worker
writes the garbage collector's header of every object it walks, so the page each object lives
on is copied into the worker that touched it ("copy on read"). A `SharedSequence` keeps the
items pickled, one after the other, in one uint8 tensor, with their boundaries in an int64
tensor: two objects with no per-item headers, whose pages nothing ever writes. Each access
unpickles a fresh copy of the item.

Forked workers share both tensors with the main process page for page. Sent to a spawn or
forkserver worker, the tensors go as torch sends any tensor to another process: moved into
shared memory once, in the sending process, and mapped, not copied, by every worker.
"""

from __future__ import annotations

import array
import ctypes
import io
import pickle
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar, overload

import torch

__all__ = ["SharedSequence"]

T = TypeVar("T")

_READ_ONLY = (
    "a SharedSequence is read-only: its items are kept pickled in one shared buffer; "
    "make a new one from the changed items instead (SharedSequence(items))"
)


def _bytes_at(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while its storage stays)."""
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")


class SharedSequence(Sequence[T]):
    """A read-only sequence of picklable items, stored pickled in one flat shared buffer.

    `SharedSequence(items)` pickles each item of `items` (any iterable: a generator avoids
    holding the objects and their pickles at once) into one byte buffer. `seq[i]` unpickles
    item `i` anew on every access, so changes made to what it returns are not kept; negative
    indices, slices (which share the buffer), `len`, iteration and `in` work as for a tuple.

    Use it where a dataset holds a large list of small Python objects and loads with worker
    processes: a plain list is copied, page by page, into every worker that reads it; this is
    shared. Each access pays an unpickling (a few microseconds for a small dict) instead.
    """

    __slots__ = ("_data", "_offsets", "_positions", "_views")

    _data: torch.Tensor
    """uint8: every item's pickle, one after the other."""
    _offsets: torch.Tensor
    """int64, one more than the items stored: item k's pickle is data[offsets[k]:offsets[k+1]]."""
    _positions: range
    """Which stored items this sequence shows, in order (a slice shows fewer)."""
    _views: tuple[int, int, memoryview, memoryview]
    """The tensors' addresses when `_data`'s and `_offsets`' views were taken, and the views."""

    def __init__(self, items: Iterable[T]) -> None:
        # One pickler writing into one growing stream: a sixth faster than pickle.dumps per item
        # and concatenating, and the same bytes.
        stream = io.BytesIO()
        pickler = pickle.Pickler(stream, protocol=pickle.HIGHEST_PROTOCOL)
        offsets = array.array("q", [0])
        for number, item in enumerate(items):
            try:
                pickler.dump(item)
            except Exception as error:
                raise TypeError(
                    f"SharedSequence: item {number} ({type(item).__name__}) cannot be pickled: "
                    f"{error}; every item is stored pickled, so each must be picklable"
                ) from error
            # Each item unpickles on its own: none may refer back to an object of another.
            pickler.clear_memo()
            offsets.append(stream.tell())
        # Both tensors use the memory they were built in: no second copy, not even briefly.
        written = stream.getbuffer()
        data = (
            torch.frombuffer(written, dtype=torch.uint8)
            if len(written)
            else torch.empty(0, dtype=torch.uint8)
        )
        self._set(data, torch.frombuffer(offsets, dtype=torch.int64), range(len(offsets) - 1))

    def _set(self, data: torch.Tensor, offsets: torch.Tensor, positions: range) -> None:
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_positions", positions)
        object.__setattr__(self, "_views", (0, 0, memoryview(b""), memoryview(b"")))

    def _current_views(self) -> tuple[memoryview, memoryview]:
        # Sending the tensors to a spawned worker moves them into shared memory, in this
        # process too (torch's share_memory_()), so the views are checked against the tensors'
        # addresses before each use and taken again after a move.
        data_at, offsets_at = self._data.data_ptr(), self._offsets.data_ptr()
        views = self._views
        if views[0] != data_at or views[1] != offsets_at:
            views = (data_at, offsets_at, _bytes_at(self._data), _bytes_at(self._offsets).cast("q"))
            object.__setattr__(self, "_views", views)
        return views[2], views[3]

    def _load(self, stored: int, data: memoryview, offsets: memoryview) -> T:
        item: T = pickle.loads(data[offsets[stored] : offsets[stored + 1]])
        return item

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> SharedSequence[T]: ...

    def __getitem__(self, index: int | slice) -> T | SharedSequence[T]:
        if isinstance(index, slice):
            part: SharedSequence[T] = SharedSequence.__new__(SharedSequence)
            part._set(self._data, self._offsets, self._positions[index])
            return part
        try:
            stored = self._positions[index]
        except IndexError:
            raise IndexError(
                f"SharedSequence index {index} out of range for {len(self)} items"
            ) from None
        except TypeError:
            raise TypeError(
                f"SharedSequence indices must be integers or slices, not {type(index).__name__}"
            ) from None
        data, offsets = self._current_views()
        return self._load(stored, data, offsets)

    def __iter__(self) -> Iterator[T]:
        for stored in self._positions:
            data, offsets = self._current_views()
            yield self._load(stored, data, offsets)

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers: the pickled items and their offsets."""
        return self._data.nbytes + self._offsets.nbytes

    def __repr__(self) -> str:
        return f"<SharedSequence of {len(self)} items, {self.nbytes / 1e6:.1f} MB pickled>"

    # Pickled as its two tensors: for another process, torch moves them into shared memory
    # (once, in the sender) and the receiver maps them; plain pickle copies their bytes.
    def __getstate__(self) -> tuple[torch.Tensor, torch.Tensor, range]:
        return self._data, self._offsets, self._positions

    def __setstate__(self, state: tuple[torch.Tensor, torch.Tensor, range]) -> None:
        self._set(*state)

    def __copy__(self) -> SharedSequence[T]:
        twin: SharedSequence[T] = SharedSequence.__new__(SharedSequence)
        twin._set(self._data, self._offsets, self._positions)
        return twin

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedSequence[T]:
        return self.__copy__()  # read-only: a copy may share the buffers

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(_READ_ONLY)

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(_READ_ONLY)

    def __setitem__(self, index: object, value: object) -> NoReturn:
        raise TypeError(_READ_ONLY)

    def __delitem__(self, index: object) -> NoReturn:
        raise TypeError(_READ_ONLY)
