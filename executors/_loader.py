"""`statecore.DataLoader`: torch's DataLoader, with the scheduling done by the statecore core.

The class is a subclass of `torch.utils.data.DataLoader`, so it takes the same arguments with
the same defaults and the same validation, computes `len()` the same way, builds the same
samplers from `shuffle` and `generator`, and is accepted wherever a torch DataLoader is. Only
the iterator differs: it runs the scheduler core through a driver loop and an executor.

The iterator also subclasses torch's base iterator, which draws the base seed from the
loader's generator exactly as torch does, so shuffling and worker seeds match torch epoch
after epoch.
"""

from __future__ import annotations

import atexit
import operator
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import multiprocess.context
import torch.utils.data
from torch._C._autograd import _profiler_enabled
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from statecore import Config, Phase, can_restart
from statecore.executors._driver import Driver
from statecore.executors._pinned import Pinned
from statecore.executors._protocol import (
    Capabilities,
    Executor,
    ExecutorFactory,
    Launch,
    capabilities_of,
)
from statecore.executors._registry import resolve_executor
from statecore.executors._worker import WorkerSetup

__all__ = ["DataLoader"]

_LIVE: weakref.WeakSet[_Iterator] = weakref.WeakSet()
_ITER = _DatasetKind.Iterable
# The arguments that choose the executor: changing either after construction resolves it again.
_CHOOSE_EXECUTOR = frozenset({"executor", "num_workers"})

T_co = TypeVar("T_co", covariant=True)


@atexit.register
def _close_live_iterators() -> None:
    # Persistent workers outlive the loop that used them; stop them before the interpreter goes.
    for iterator in list(_LIVE):
        iterator._shutdown()


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """`torch.utils.data.DataLoader`, plus `executor=`: a registered name or a factory.

    Left out, `executor` follows torch: `num_workers=0` loads in the calling thread,
    `num_workers>0` in worker processes. Built-in names: "inline", "mp", "thread" and
    "pinned"; `pin_memory=True` puts the pin-memory stage over whichever executor loads.
    `multiprocessing_context` also takes a context of the `multiprocess` package.

    Like torch's, the class is generic in what it yields: `statecore.DataLoader[Batch]`.
    Every argument is kept as the public attribute of the same name (`executor` as given),
    so frameworks that rebuild a loader from its attributes (Lightning adding a distributed
    sampler) rebuild it with the same executor.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        executor: str | Callable[[Launch], Executor] | None = None,
    ) -> None:
        if isinstance(multiprocessing_context, multiprocess.context.BaseContext):
            # torch validates against the standard library's contexts; ours maps it back.
            multiprocessing_context = multiprocessing_context.get_start_method()
        # Keywords only: a framework that records the arguments of torch's __init__ (Lightning,
        # when this class did not exist yet as it patched torch's) then rebuilds this class
        # from names, and a sampler it injects cannot collide with a positional one.
        super().__init__(
            dataset=dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self.executor = executor
        self.executor_factory, self.loads_in_process = resolve_executor(executor, num_workers)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CHOOSE_EXECUTOR and "loads_in_process" in vars(self):
            # Resolved before anything changes: a refused value leaves the loader as it was.
            executor = value if name == "executor" else self.executor
            workers = value if name == "num_workers" else self.num_workers
            chosen = resolve_executor(executor, workers)
            super().__setattr__(name, value)
            super().__setattr__("executor_factory", chosen[0])
            super().__setattr__("loads_in_process", chosen[1])
            return
        super().__setattr__(name, value)

    def __iter__(self) -> _BaseDataLoaderIter:
        kept = self.__dict__.get("_iterator")
        if isinstance(kept, _Iterator) and not kept._usable():
            # A persistent iterator whose scheduler failed or was closed cannot run another
            # epoch: the next epoch gets fresh workers, as a loader without persistent workers
            # would, instead of the old failure for ever.
            kept._shutdown()
            self._iterator = None
        return super().__iter__()

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if not self.loads_in_process:
            self.check_worker_number_rationality()
        return _Iterator(self)


def _too_long(iterator: _Iterator, promised: int) -> str:
    """torch's warning for an IterableDataset that yields more than its len() said."""
    message = (
        f"Length of IterableDataset {iterator._dataset} was reported to be {promised}"
        f"(when accessing len(dataloader)), but {iterator._num_yielded} samples have been "
        "fetched. "
    )
    if iterator._num_workers > 0:
        message += (
            "For multiprocessing data-loading, this could be caused by not properly configuring "
            "the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for "
            "examples."
        )
    return message


def _drawer(iterator: _Iterator) -> Callable[[], Any]:
    """`iterator._next_index` without a reference to the iterator.

    A bound method would close a cycle (iterator -> driver -> method -> iterator), and a cycle
    waits for the garbage collector: the workers of a dropped iterator would outlive it.
    """
    ref = weakref.ref(iterator)

    def draw() -> Any:
        alive = ref()
        if alive is None:
            raise StopIteration
        return next(alive._sampler_iter)  # what torch's _next_index does, one call fewer

    return draw


_EXECUTOR_METHODS = ("start", "dispatch", "resume", "poll", "stop_worker", "shutdown")


@attrs.frozen
class _Checked:
    """An executor factory whose result is checked to be an executor before anything uses it.

    Without the check, a factory returning None (a forgotten `return`) fails later as
    "'NoneType' object has no attribute 'start'", naming neither the factory nor the fix.
    """

    factory: ExecutorFactory

    @property
    def capabilities(self) -> Capabilities:
        # The pin stage asks the factory it wraps; the answer is the checked factory's.
        return capabilities_of(self.factory)

    def __call__(self, launch: Launch) -> Executor:
        executor = self.factory(launch)
        missing = [name for name in _EXECUTOR_METHODS if not callable(getattr(executor, name, 0))]
        if missing:
            name = getattr(self.factory, "__qualname__", None) or repr(self.factory)
            raise TypeError(
                f"the executor factory {name} returned {executor!r}, which is not an executor: it "
                f"has no {', '.join(missing)}. A factory takes a Launch and returns an object "
                f"with the methods {', '.join(_EXECUTOR_METHODS)} (see docs/executors.md)"
            )
        return executor


def _checked(factory: ExecutorFactory) -> ExecutorFactory:
    """`factory`, and for a pin stage the factory it wraps, checked to return executors."""
    if isinstance(factory, Pinned):
        assert callable(factory.inner)  # resolved by the DataLoader
        return attrs.evolve(factory, inner=_Checked(factory.inner))
    return _Checked(factory)


class _Iterator(_BaseDataLoaderIter):
    """One pass (or, with persistent workers, every pass) over a statecore DataLoader."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        super().__init__(loader)
        self._driver: Driver | None = None
        in_process = self._in_process = loader.loads_in_process
        if in_process and self._timeout != 0:
            raise AssertionError("loading in the calling thread requires timeout == 0, as torch")
        # torch takes num_workers=True as one worker (True > 0, range(True)), and refuses 2.5
        # with range()'s TypeError: operator.index does both.
        workers = 1 if in_process else operator.index(loader.num_workers)
        prefetch = loader.prefetch_factor
        if not in_process and prefetch is not None and prefetch <= 0:
            # torch accepts 0 when built and refuses it here, when workers would start.
            raise AssertionError(
                f"prefetch_factor must be greater than 0 for loading in workers, as torch's "
                f"MultiProcessingDataLoaderIter requires, but got prefetch_factor={prefetch}"
            )
        setup = WorkerSetup(
            dataset=self._dataset,
            dataset_kind=self._dataset_kind,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=int(self._base_seed),
            num_workers=workers,
            worker_init_fn=loader.worker_init_fn,
            shared_seed=self._shared_seed,
        )
        config = Config(
            num_workers=workers,
            prefetch_factor=1 if in_process else (2 if prefetch is None else prefetch),
            in_order=loader.in_order,
            iterable=self._dataset_kind == _DatasetKind.Iterable,
            persistent_workers=self._persistent_workers and not in_process,
            lazy=in_process,
        )
        factory = loader.executor_factory
        if isinstance(factory, Pinned):
            # torch has just warned that there is no accelerator: the stage would warn again,
            # then pass every batch through.
            torch_warned = loader.pin_memory and not self._pin_memory
            if torch_warned and factory.pin is None and factory.device is None:
                assert callable(factory.inner)  # resolved by the DataLoader
                factory = factory.inner
        elif self._pin_memory:
            # torch's base iterator says whether to pin: an accelerator is there, and not MPS.
            factory = Pinned(factory, in_process=in_process)
        executor = _checked(factory)(Launch(setup, workers, loader.multiprocessing_context))
        executor.start()
        self._driver = Driver(config, executor, _drawer(self), self._timeout)
        _LIVE.add(self)
        self._reset(loader, first_iter=True)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        # torch's single-process iterator does not reset when built: its base class has just
        # done what a reset does, and a second reset would draw a datapipe's shared seed again
        # from the loader's generator, moving it on.
        if not (first_iter and self._in_process):
            super()._reset(loader, first_iter)
        assert self._driver is not None
        self._driver.start_epoch(None if first_iter else self._shared_seed)

    def __next__(self) -> Any:
        if _profiler_enabled():
            # torch's own __next__ labels the batch for the profiler.
            return super().__next__()
        # Without a profiler the label is wasted, and it costs more than the rest of a small
        # batch's journey through torch (record_function enters a dispatcher op each time).
        if self._sampler_iter is None:
            self._reset()  # type: ignore[call-arg]
        data = self._next_data()
        self._num_yielded += 1
        promised: int | None = self._IterableDataset_len_called
        if promised is not None and self._num_yielded > promised and self._dataset_kind == _ITER:
            warnings.warn(_too_long(self, promised), stacklevel=2)
        return data

    def _next_data(self) -> Any:
        assert self._driver is not None
        return self._driver.next()

    def _usable(self) -> bool:
        """Whether another epoch can start on this iterator's scheduler and executor."""
        driver = self._driver
        return driver is not None and can_restart(driver.state)

    def _shutdown(self) -> None:
        driver, self._driver = self._driver, None
        if driver is not None and driver.state.phase is not Phase.CLOSED:
            driver.close()

    def __del__(self) -> None:
        # Never raise from a finalizer. No module globals here either: at interpreter exit they
        # may already be gone when this runs.
        try:  # noqa: SIM105
            self._shutdown()
        except Exception:
            pass
