"""`statecore.DataLoader`: torch's DataLoader, with the scheduling done by the statecore core.

The class is a subclass of `torch.utils.data.DataLoader`, so it takes the same arguments with
the same defaults and the same validation, computes `len()` the same way, builds the same
samplers from `shuffle` and `generator` (shuffle=True's draws torch's order from a permutation
kept as a tensor: `_permutation`), and is accepted wherever a torch DataLoader is. Only
the iterator differs: it runs the scheduler core through a driver loop and an executor.

The iterator also subclasses torch's base iterator, which draws the base seed from the
loader's generator exactly as torch does, so shuffling and worker seeds match torch epoch
after epoch.
"""

from __future__ import annotations

import atexit
import copy
import operator
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import multiprocess.context
import torch.utils.data
from torch._C._autograd import _profiler_enabled
from torch.utils.data import IterDataPipe
from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

from statecore import Config, Phase, Progress, State, can_restart
from statecore.executors._autotune import (
    AutoPrefetch,
    AutoTuner,
    AutoWorkers,
    auto_num_workers,
    auto_prefetch_factor,
)
from statecore.executors._checkpoint import (
    EpochRecord,
    Resume,
    SamplerLog,
    draws_nothing,
    fingerprint,
    parse,
    positioned,
    snapshot,
    stateful_sampler,
)
from statecore.executors._driver import Driver
from statecore.executors._elastic import (
    Elastic,
    Stage,
    align_epoch,
    batches_of,
    check_process_group,
    continuation,
    distributed_sampler,
    entry,
    facts_for,
    process_group_entry,
)
from statecore.executors._observe.flight import FlightRecorder
from statecore.executors._observe.seam import Observer
from statecore.executors._observe.trace import LoaderCounters, LoaderStats, Trace
from statecore.executors._observe.tracer import Tracer, collecting, tracing_from_environment
from statecore.executors._permutation import PermutationSampler, default_sampler
from statecore.executors._pinned import Pinned
from statecore.executors._protocol import (
    Capabilities,
    Executor,
    ExecutorFactory,
    Launch,
    capabilities_of,
    confirmer_of,
)
from statecore.executors._registry import resolve_executor
from statecore.executors._restarts import RestartBudget
from statecore.executors._seeding import PER_BATCH, BatchSeeds, resolve_seeding
from statecore.executors._worker import Mark, WorkerSetup, has_state

__all__ = ["DataLoader", "EpochOverWarning"]

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

    `seeding="per-batch"` seeds `random`, torch and numpy before each batch from the epoch's
    seed and the batch's position in the epoch, so that a map-style dataset's random draws do
    not depend on how many workers there are (docs/checkpointing.md, "Seeding per batch");
    None is "per-worker", torch's.

    `num_workers="auto"` (map-style datasets, executors that can start workers mid-epoch)
    starts two workers and tunes the count as the loop runs; `stats().tuning` says what it did
    and the count to pin (docs/choosing-num-workers.md). It seeds per batch unless `seeding`
    says otherwise.

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
        num_workers: int | str = 0,
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
        snapshot_every_n_steps: int | None = 1,
        trace: bool | None = None,
        worker_restarts: int = 0,
        worker_timeout: float = 0,
        seeding: str | None = None,
    ) -> None:
        if isinstance(multiprocessing_context, multiprocess.context.BaseContext):
            # torch validates against the standard library's contexts; ours maps it back.
            multiprocessing_context = multiprocessing_context.get_start_method()
        # "auto": as many worker slots as the budget allows, of which the tuner runs a few.
        count: int = auto_num_workers(num_workers, dataset)
        # "auto": torch's default to start with, which the tuner changes as the loop runs.
        prefetch_factor = auto_prefetch_factor(prefetch_factor, count)
        # shuffle=True: torch's RandomSampler order, its permutation kept as a tensor rather
        # than a list of ints (see _permutation), passed to torch as the sampler it would make.
        permutation = default_sampler(dataset, shuffle, sampler, batch_sampler, generator)
        # Keywords only: a framework that records the arguments of torch's __init__ (Lightning,
        # when this class did not exist yet as it patched torch's) then rebuilds this class
        # from names, and a sampler it injects cannot collide with a positional one.
        super().__init__(
            dataset=dataset,
            batch_size=batch_size,
            shuffle=shuffle if permutation is None else None,
            sampler=sampler if permutation is None else permutation,
            batch_sampler=batch_sampler,
            num_workers=count,
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
        try:
            self.executor_factory, self.loads_in_process = resolve_executor(executor, count)
        except ValueError as error:
            if not isinstance(count, AutoWorkers):
                raise
            raise ValueError(
                f'num_workers="auto" runs up to {int(count)} workers (its slots), which this '
                f"executor cannot: {error}"
            ) from None
        if isinstance(count, AutoWorkers):
            _check_auto(self.executor_factory, self)
        self._autotuner: AutoTuner | None = None
        """The tuner of `num_workers="auto"`, made with the first iterator: what it learned
        carries from one iterator to the next."""
        if snapshot_every_n_steps is not None and (
            isinstance(snapshot_every_n_steps, bool)
            or not isinstance(snapshot_every_n_steps, int)
            or snapshot_every_n_steps < 0
        ):
            raise ValueError(
                f"snapshot_every_n_steps must be an integer of at least 0, or None, got "
                f"{snapshot_every_n_steps!r}"
            )
        # torchdata's meaning: how often an iterable dataset's workers send their dataset's
        # state (see WorkerSetup.snapshot_every); between snapshots a resume fast-forwards.
        # 0, accepted by torchdata, sends none between epochs' starts, as None does.
        self.snapshot_every_n_steps = snapshot_every_n_steps
        # Kept under its argument's name, as every argument is: frameworks rebuild a loader
        # from the attributes named like its arguments.
        self.trace = tracing_from_environment() if trace is None else bool(trace)
        if (
            isinstance(worker_restarts, bool)
            or not isinstance(worker_restarts, int)
            or worker_restarts < 0
        ):
            raise ValueError(
                f"worker_restarts must be an integer of at least 0 (how many lost workers the "
                f"loader replaces), got {worker_restarts!r}"
            )
        if isinstance(worker_timeout, bool) or not isinstance(worker_timeout, (int, float)):
            raise ValueError(f"worker_timeout must be a number of seconds, got {worker_timeout!r}")
        if worker_timeout < 0:
            raise ValueError(
                f"worker_timeout should be a non-negative value (0: never), got {worker_timeout}"
            )
        self.worker_restarts = worker_restarts
        self.worker_timeout = worker_timeout
        self.seeding = seeding
        self._seeding_in_force()  # a bad value is refused now, not at iter()
        self._restarts = RestartBudget(worker_restarts)
        """The restarts this loader's iterators spent: `worker_restarts` is per loader."""
        self._tracer: Tracer | None = None
        self._resume: Resume | None = None
        self._latest: weakref.ref[_Iterator] | None = None
        """The latest iterator while it lives: its epoch's position is read from it."""
        self._trail = _Trail()
        """Where the latest iterator left its epoch once it was shut down or dropped."""

    def _seeding_in_force(self) -> str:
        """The seeding this loader's iterators use: `seeding`, None resolved."""
        return resolve_seeding(
            self.seeding,
            self.num_workers,
            self._dataset_kind == _ITER,
            auto=isinstance(self.num_workers, AutoWorkers),
        )

    def __getstate__(self) -> dict[str, Any]:
        # What torch's DataLoader pickles: its attributes, so a used loader pickles too. The
        # latest iterator is left out (torch keeps none but a persistent one, whose own pickle
        # refuses, as torch's does), its epoch's position kept as plain data.
        state = self.__dict__.copy()
        state["_latest"] = None
        state["_trail"] = _Trail(self._position())
        return state

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "num_workers" and "loads_in_process" in vars(self):
            value = auto_num_workers(value, self.dataset)
        if name == "prefetch_factor" and "loads_in_process" in vars(self):
            value = auto_prefetch_factor(value, self.num_workers)
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

    def check_worker_number_rationality(self) -> None:
        # An auto loader's slots may outnumber the cores (samples that wait on I/O): its tuner
        # keeps to the CPU budget itself, so torch's warning about too many workers is not due.
        if not isinstance(self.__dict__.get("num_workers"), AutoWorkers):
            super().check_worker_number_rationality()

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if not self.loads_in_process:
            self.check_worker_number_rationality()
        iterator = _Iterator(self)
        self._latest, self._trail = weakref.ref(iterator), iterator._trail
        return iterator

    # --- tracing ------------------------------------------------------------------------------

    def _tracer_for(self, workers: int, persistent: bool) -> Tracer | None:
        """The loader's tracer, made with its first iterator; None when it is not traced."""
        if not self.trace:
            return None
        if self._tracer is None:
            self._tracer = Tracer(workers, self.in_order, persistent, _executor_name(self))
            collecting(self._tracer)
        return self._tracer

    def trace_record(self) -> Trace:
        """Everything traced so far: per batch, when it was sent, loaded and handed over; the
        consumer's waits; epochs, resumes and deaths (see docs/profiling.md)."""
        return self._traced().trace()

    def _traced(self) -> Tracer:
        if self._tracer is None:
            why = (
                "it has not been iterated yet"
                if self.trace
                else "pass trace=True, or set STATECORE_TRACE=1 in the environment"
            )
            raise RuntimeError(f"this DataLoader has no trace: {why}")
        return self._tracer

    def stats(self) -> LoaderStats:
        """What the loader did, traced or not (as trio's `statistics()`): `counters` holds
        what the scheduler of its latest iterator knows now (batches handed over this epoch,
        tasks in flight per worker, whether the training loop waits), read from its state at
        no cost. A traced loader (`trace=True` or STATECORE_TRACE=1) adds the figures: how
        long the training loop waited on loading, how busy each worker was, the slowest
        samples by index; `.verdict()` says it in words, with what to try."""
        iterator = self._latest() if self._latest is not None else None
        driver = iterator._driver if iterator is not None else None
        # Restarts count over the loader's life, as its `worker_restarts` budget does.
        budget = self.__dict__.get("_restarts")
        restarts = budget.spent if budget is not None else None
        if driver is not None:
            counters = LoaderCounters.of(driver.state, driver.state.config.num_workers, restarts)
        else:
            counters = self._trail.counters or LoaderCounters.of(None, self.num_workers)
            if restarts is not None:
                counters = attrs.evolve(counters, restarts=restarts)
        tuner = self.__dict__.get("_autotuner")
        tuning = None if tuner is None else tuner.report()
        if self._tracer is None:
            return LoaderStats.counted(
                counters,
                self.num_workers,
                self.in_order,
                self.persistent_workers,
                _executor_name(self),
                traced=self.trace,
                tuning=tuning,
            )
        # From the tracer's tables: the records of a trace at the limit took most of the time.
        return attrs.evolve(self._tracer.stats(), counters=counters, tuning=tuning)

    def _restarts_left(self) -> int:
        budget = self.__dict__.get("_restarts")
        if budget is None or budget.restarts != self.worker_restarts:
            # Set after the loader was built (frameworks rebuild loaders from attributes).
            budget = self._restarts = RestartBudget(self.worker_restarts)
        return int(budget.left)

    # --- checkpoints (torchdata's StatefulDataLoader API) ------------------------------------

    def __len__(self) -> int:
        """torch's len(), but for an epoch resumed on another number of ranks: this rank's
        batches of it, those yielded before the checkpoint and those of its share, as a
        training loop that counts the first among the epoch's (Lightning's) expects."""
        resume = self.__dict__.get("_resume")
        if resume is not None and resume.elastic is not None:
            return int(resume.num_yielded) + _count(resume.elastic.share, self)
        latest = self.__dict__.get("_latest")
        iterator = latest() if latest is not None else None
        record = None if iterator is None else iterator._epoch
        if record is not None and record.length is not None:
            return int(record.length)
        return super().__len__()

    def state_dict(self, *, gather: bool = True) -> dict[str, Any]:
        """Where this loader is: loading it into a fresh loader goes on from here, exactly.

        May be called at any time: before `iter()`, at any point of an epoch, between epochs,
        after the last batch. The batches not yet handed to the consumer (in flight or
        buffered) are produced again after a resume, and none handed over is. The result is
        plain data (see docs/checkpointing.md).

        With a DistributedSampler and a torch.distributed process group, it gathers every
        rank's progress (one collective: call it on every rank), so that the state resumes
        on any number of ranks. `gather=False` does without, for code that calls it on one
        rank only: the state then resumes on its own rank, or merged with the others'
        (`merge_state_dicts`).
        """
        facts = self._checkpoint_facts()
        if self._resume is not None:
            return dict(self._resume.raw)  # loaded and not yet iterated: the same checkpoint
        position = self._position()
        # The generator the loader draws from, as it stands now: a resume puts it back here.
        # torch's global one too where the epoch's batches depend on it (its shuffle, its
        # workers' seeds): a program that does not restore its own state of it (Lightning's
        # does not) then goes on with the uninterrupted run's global stream. Where they do not
        # depend on it, the state holds nothing of it: two loaders at the same point of the
        # same batches give equal states, whatever their programs drew.
        random = position is not None and (
            position.base_seed is not None or position.rng_epoch_start is not None
        )
        rng_now = _generator_of(self).get_state() if self.generator is not None or random else None
        if position is not None:
            fields = attrs.asdict(position, recurse=False)
            stage = fields.pop("stage")
            return self._ranked(snapshot(facts, rng_now=rng_now, **fields), stage, gather)
        # Nothing started: the next iter() starts an epoch.
        sampler = stateful_sampler(self._index_sampler)
        state = snapshot(
            facts,
            progress=Progress(),
            complete=True,
            base_seed=None,
            rng_epoch_start=None,
            rng_now=_generator_of(self).get_state(),
            sampler=None if sampler is None else sampler.state_dict(),
            num_yielded=0,
            workers=[None] * max(self.num_workers, 1) if self._dataset_kind == _ITER else None,
        )
        return self._ranked(state, None, gather)

    def _ranked(self, state: dict[str, Any], stage: Stage | None, gather: bool) -> dict[str, Any]:
        """`state` with what a resume on other ranks needs: with a DistributedSampler, every
        rank's progress, gathered where torch.distributed is initialised (a collective: every
        rank calls state_dict(), as checkpoint code does); for an iterable dataset, the rank
        and world size it was taken on, which it resumes on only."""
        if self._dataset_kind == _ITER:
            group = process_group_entry()
            if group is not None:
                state["process_group"] = group
            return state
        sampler = distributed_sampler(self.sampler, self.batch_sampler)
        if sampler is None:
            return state
        progress = state["progress"]
        state["distributed"] = entry(
            sampler,
            Stage(int(sampler.epoch)) if stage is None else stage,
            Progress(progress["done"], frozenset(progress["also"])),
            len(self.dataset),  # type: ignore[arg-type]  # a DistributedSampler's has one
            gather=gather,
        )
        return state

    def _position(self) -> _Position | None:
        """Where the latest iterator's epoch stands, whether or not anyone still holds it.

        A for loop left with `break` drops its iterator before the checkpoint is taken; the
        state still describes that epoch until the next `iter()` starts another.
        """
        iterator = self._latest() if self._latest is not None else None
        if iterator is not None and iterator._epoch is not None:
            return iterator._position()
        return self._trail.left

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Go on from `state_dict` (taken by `state_dict()`) with the next `iter()`.

        Call it before `iter()`. The dataset and its batching must be those of the loader the
        state was taken from; the executor may differ, and so may the number of workers for a
        map-style dataset (an iterable dataset's workers each resume their own part of it).
        """
        source = torch.default_generator if self.generator is None else self.generator
        facts: dict[str, Any] = self._checkpoint_facts()
        taken = None
        if self._dataset_kind == _ITER:
            check_process_group(state_dict)
        else:
            facts, taken = facts_for(state_dict, self, facts)
        resume = parse(
            state_dict,
            facts,
            batches=(
                None
                if self._dataset_kind == _ITER or taken is not None
                else _trusted_length(self._index_sampler)
            ),
            rng_size=source.get_state().numel(),
            drawless=self._dataset_kind != _ITER and draws_nothing(self._index_sampler),
        )
        if taken is not None:
            # Taken on other ranks: this rank goes on with its own progress, or its share.
            goes_on = continuation(taken, resume.complete, self)
            if isinstance(goes_on, Elastic):
                resume = attrs.evolve(resume, progress=Progress(), elastic=goes_on)
            elif goes_on is not None:
                resume = attrs.evolve(resume, progress=goes_on)
        saved = resume.workers
        workers = max(self.num_workers, 1)
        if self._dataset_kind != _ITER and saved is not None and len(saved) != workers:
            warnings.warn(
                f"this DataLoader state holds the dataset's state_dict() of each of "
                f"{len(saved)} workers, and this loader has {workers}: worker k gets worker k's "
                f"state where there was one, so the batches are the original run's, and what "
                f"the dataset draws from its state (augmentations, say) is not",
                stacklevel=2,
            )
        kept = self.__dict__.get("_iterator")
        if isinstance(kept, _Iterator):
            # Persistent workers are in the middle of something else: the resumed epoch gets
            # fresh ones, seeded as the checkpoint's were.
            kept._shutdown()
            self._iterator = None
        self._resume = resume

    def _checkpoint_facts(self) -> dict[str, Any]:
        return fingerprint(
            "iterable" if self._dataset_kind == _ITER else "map",
            dataset=self.dataset,
            sampler=self.sampler,
            batch_sampler=self.batch_sampler,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            generator=self.generator,
        )


def observers(config: Config, tracer: Tracer | None) -> tuple[Observer, ...]:
    """What watches an iterator's driver: a flight recorder unless the scheduler loads in the
    calling thread (there a batch costs so little that the recorder would add 3 to 4% to it,
    and no timeout can happen), and the loader's tracer when it is traced."""
    watching = [] if config.lazy else [FlightRecorder(config).observer()]
    if tracer is not None:
        watching.append(tracer.observer())
    return tuple(watching)


def _check_replacing(factory: Any, loader: DataLoader[Any]) -> None:
    """Refuse restarts, or a stuck worker's replacement, on an executor that cannot."""
    declared = capabilities_of(factory)
    name = _executor_name(loader)
    if loader.worker_restarts and not declared.replaces_workers:
        raise ValueError(
            f"worker_restarts={loader.worker_restarts} needs an executor that can replace a lost "
            f"worker, and {name!r} cannot; use executor='mp' (processes) or 'thread', or leave "
            "worker_restarts at 0"
        )


def _check_auto(factory: Any, loader: DataLoader[Any]) -> None:
    """Refuse `num_workers="auto"` on an executor that cannot start a worker mid-epoch."""
    if not capabilities_of(factory).replaces_workers:
        raise ValueError(
            f'num_workers="auto" adds and retires workers as the loader runs, which needs an '
            f"executor that can start a worker in a slot mid-epoch, and {_executor_name(loader)!r} "
            "cannot (it does not declare replaces_workers); use executor='mp' (processes), "
            "'thread' or 'ray', or pick a count: num_workers=N"
        )


def _autotuner_for(loader: DataLoader[Any], slots: int) -> AutoTuner | None:
    """The loader's tuner, made with its first iterator, if its num_workers or its
    prefetch_factor is "auto"."""
    workers = isinstance(loader.num_workers, AutoWorkers)
    auto_prefetch = loader.prefetch_factor
    prefetch = isinstance(auto_prefetch, AutoPrefetch)
    if not (workers or prefetch) or loader.loads_in_process:
        return None
    tuner = loader.__dict__.get("_autotuner")
    if (
        tuner is None
        or tuner.slots != slots
        or tuner.tunes_workers != workers
        or (tuner.prefetch is not None) != prefetch
    ):
        start = int(auto_prefetch) if isinstance(auto_prefetch, AutoPrefetch) else None
        tuner = loader._autotuner = AutoTuner(slots, tunes_workers=workers, prefetch=start)
    tuner.seeding = loader._seeding_in_force()
    return tuner


def _prefetch_in_force(prefetch: int | None, tuner: AutoTuner | None) -> int:
    """The prefetch bound an iterator starts with: what the tuner learned, where
    `prefetch_factor="auto"`; else the loader's, torch's default 2 if unset."""
    if tuner is not None and tuner.prefetch is not None:
        return tuner.prefetch
    return 2 if prefetch is None else prefetch


def _executor_name(loader: DataLoader[Any]) -> str:
    """The executor's name as a user would give it, for the trace."""
    executor = loader.executor
    if executor is None:
        return "inline" if loader.loads_in_process else "mp"
    if isinstance(executor, str):
        return executor
    return getattr(executor, "__qualname__", None) or type(executor).__name__


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


def _drawer(iterator: _Iterator) -> Callable[[State], Any]:
    """`iterator._next_index` without a reference to the iterator, for the driver to call
    with the scheduler's state (where the consumer stands, for the sampler's log).

    A bound method would close a cycle (iterator -> driver -> method -> iterator), and a cycle
    waits for the garbage collector: the workers of a dropped iterator would outlive it.
    """
    ref = weakref.ref(iterator)

    def draw(state: State) -> Any:
        alive = ref()
        if alive is None:
            raise StopIteration
        index = next(alive._sampler_iter)  # what torch's _next_index does, one call fewer
        log = alive._log
        if log is not None:
            # This run's draws before the window were all handed over.
            log.record(log.origin + state.rcvd_idx - state.life.base)
        return index

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
        confirmer_of(executor)  # refuses one that declares confirms_answers with no confirm()
        return executor


def _checked(factory: ExecutorFactory) -> ExecutorFactory:
    """`factory`, and for a pin stage the factory it wraps, checked to return executors."""
    if isinstance(factory, Pinned):
        assert callable(factory.inner)  # resolved by the DataLoader
        return attrs.evolve(factory, inner=_Checked(factory.inner))
    return _Checked(factory)


_EXACT_LENGTH = (
    torch.utils.data.SequentialSampler,
    torch.utils.data.RandomSampler,
    PermutationSampler,
    torch.utils.data.SubsetRandomSampler,
    torch.utils.data.WeightedRandomSampler,
    torch.utils.data.distributed.DistributedSampler,
)


def _trusted_length(index_sampler: Any) -> int | None:
    """The epoch's number of batches, where the sampler's len() is sure to be it, else None.

    torch's own samplers yield exactly len() items. Another sampler may yield more than its
    len() says (torch iterates it to its end, and so does a resumed epoch), so a checkpoint's
    positions beyond its len() are legitimate and only torch's samplers bound them.
    """
    sampler = index_sampler
    if type(sampler) is torch.utils.data.BatchSampler:
        sampler = sampler.sampler
    if type(sampler) not in _EXACT_LENGTH:
        return None
    return len(index_sampler)


def _count(share: tuple[int, ...], loader: DataLoader[Any]) -> int:
    """The batches `loader` makes of `share`."""
    batches: Any = loader.batch_sampler
    if batches is None:
        return len(share)
    size = int(batches.batch_size)
    return len(share) // size if batches.drop_last else -(-len(share) // size)


def _generator_of(loader: DataLoader[Any]) -> torch.Generator:
    """The generator the loader's epochs draw their seeds from."""
    return torch.default_generator if loader.generator is None else loader.generator


def _between_epochs(loader: DataLoader[Any], resume: Resume) -> None:
    """Put the loader where the checkpoint's was once its epoch had ended."""
    if resume.rng_now is not None:
        _generator_of(loader).set_state(resume.rng_now)
    sampler = stateful_sampler(loader._index_sampler)
    if sampler is not None and resume.sampler is not None:
        sampler.load_state_dict(resume.sampler)


class EpochOverWarning(UserWarning):
    """A resumed epoch had nothing left: the checkpoint was taken after its last batch."""


_EPOCH_OVER = (
    "this DataLoader was resumed from a state taken after the last batch of an epoch but before "
    "that epoch ended (its StopIteration), so this iter() only ends that epoch and yields no "
    "batch, as torchdata's StatefulDataLoader does; the next iter() starts the next epoch. To "
    "resume with the next epoch instead, take the state after the for loop is over (see "
    "'At the end of an epoch' in docs/checkpointing.md)"
)


@attrs.frozen
class _Position:
    """Where an iterator's epoch stands: a checkpoint, less the loader's own facts."""

    progress: Progress
    complete: bool
    base_seed: int | None
    """None where no worker or batch is seeded from it: loading in the calling thread, seeded
    per worker (torch's single-process loading seeds nothing)."""
    rng_epoch_start: torch.Tensor | None
    """None where the sampler draws no random number."""
    seeded: bool
    sampler: Any
    num_yielded: int
    workers: list[Any] | None
    seed_epoch: int = 1
    """The epochs seeded from `base_seed` so far, this one included (see `_seeding.epoch_seed`)."""
    carried: list[Any] | None = None
    """Per worker, where its dataset stood as the epoch before ended, where it lived on."""
    carried_open: frozenset[int] = frozenset()
    """See `EpochRecord.carried_open`."""
    stage: Stage | None = None
    """See `EpochRecord.stage`."""


def _standing(resume: Resume) -> tuple[Mark | None, ...] | None:
    """Where each worker's dataset stood at a checkpoint: at its last batch handed over, or, for
    a worker with none this epoch, where the epoch before left it (where it lived on)."""
    return _merged(resume.workers, resume.carried)


def _standing_open(resume: Resume) -> frozenset[int]:
    """The workers whose mark `_standing` takes from an iterator left open (see
    `EpochRecord.carried_open`)."""
    return _open(resume.workers, resume.carried, resume.carried_open)


def _open(
    marks: tuple[Mark | None, ...] | list[Any] | None,
    carried: tuple[Mark | None, ...] | list[Any] | None,
    carried_open: frozenset[int],
) -> frozenset[int]:
    """The workers of `carried_open` whose mark `_merged(marks, carried)` takes from `carried`."""
    if marks is None or carried is None:
        return frozenset()
    return frozenset(w for w in carried_open if w < len(marks) and marks[w] in (None, (0, None)))


def _merged(
    marks: tuple[Mark | None, ...] | list[Any] | None,
    carried: tuple[Mark | None, ...] | list[Any] | None,
) -> tuple[Mark | None, ...] | None:
    if marks is None or carried is None:
        return None if marks is None else tuple(marks)
    # (0, None), as a state writes "no batch handed over", is no mark.
    return tuple(
        mark if mark not in (None, (0, None)) or w >= len(carried) else carried[w]
        for w, mark in enumerate(marks)
    )


def _carried_over(
    previous: _Position | None, exact_after_a_break: bool, iterable: bool = False
) -> tuple[tuple[Mark | None, ...] | None, frozenset[int]]:
    """What the datasets carry into a new epoch from the `previous` one, which lived on, and
    which workers' parts of an iterable dataset it leaves open (see `EpochRecord.carried_open`).

    Known where the previous epoch ended (every batch handed over, each worker at its last
    mark), and, with `exact_after_a_break`, where it was broken out of: a dataset loaded in the
    main process, which loads nothing ahead of the consumer (an `iterable` one's part is then
    left open). Workers that loaded ahead (prefetched batches no one received) stand where
    their last answers left them, which only their driver knows: see
    `EpochRecord.after_a_break`.
    """
    if previous is None or not (previous.complete or exact_after_a_break):
        return None, frozenset()
    marks, carried_open = previous.workers, previous.carried_open
    carried_open = _open(marks, previous.carried, carried_open)
    if iterable and not previous.complete and marks is not None:
        answered = {w for w, mark in enumerate(marks) if mark not in (None, (0, None))}
        if previous.carried is None:
            # Nothing lived on into the epoch broken out of: a part that handed over no batch
            # stood where its dataset began, and was not run dry unless found so (a dataset
            # counting its epochs as its part runs dry must not count that one). Where
            # something lived on, such a part stands as `carried` says, open or not.
            answered = set(range(len(marks)))
        carried_open |= frozenset(answered) - previous.progress.dry
    return _merged(marks, previous.carried), carried_open


def _carried_in(
    record: EpochRecord, driver: Driver, workers: int, iterable: bool
) -> tuple[list[Mark | None] | None, frozenset[int]]:
    """Where each worker's dataset stood as `record`'s epoch began, as a checkpoint records it,
    and which workers' iterable parts were left open there (see `EpochRecord.after_a_break`)."""
    carried, carried_open, left = record.carried, record.carried_open, driver.left
    if record.after_a_break and left is not None:
        marks = [left.get(w) for w in range(workers)]
        if iterable:
            # A part whose last answer was recorded stands open, one with none where the epoch
            # before had it; unless it was found dry.
            answered = frozenset(w for w, mark in enumerate(marks) if mark is not None)
            carried_open = (_open(marks, carried, carried_open) | answered) - driver.left_dry
        carried = _merged(marks, carried)
    return (None if carried is None else list(carried)), carried_open


def _opening_mark(dataset: Any) -> Mark | None:
    """The mark of an iterable dataset that is its own iterator, as an epoch in the main
    process opens (`iter()` called, no item read), or None.

    Such a dataset is the loader's own object, and may stand anywhere as the epoch opens: the
    program may reuse one that an earlier loader ran through. A resume from a state taken
    before the epoch's first batch then starts where the original's epoch did, not wherever
    the resumed loader's dataset object stands, as torchdata's does. Only for a dataset that
    is its own iterator: its state is its position. Another dataset's state may describe its
    previous iterator until the new one reads its first item (a generator function's body
    does not run before), and a fresh iterator of it starts its epoch anyway.
    """
    if not isinstance(dataset, torch.utils.data.IterableDataset) or not has_state(dataset):
        return None
    if not callable(getattr(dataset, "__next__", None)):
        return None
    stateful: Any = dataset
    try:
        # A copy: the dataset may hand out the very dict it goes on updating. Its iterator's
        # state, as a worker sends it (loaded after iter(), which may start it over).
        return (0, {"iterator": copy.deepcopy(stateful.state_dict())})
    except Exception:
        # A state that cannot be taken yet: its batches' marks still carry it.
        return None


def _worker_handles(executor: Any) -> list[Any]:
    """The handles of `executor`'s workers (its `worker_handles()`), looked for through the
    executors it wraps (`inner`: the pin stage, a plug-in's wrapper); none if it has none."""
    for _ in range(16):  # a chain of wrappers, never a cycle
        handles = getattr(executor, "worker_handles", None)
        if callable(handles):
            try:
                return list(handles())
            except Exception:
                # Compatibility only: never the reason an iterator fails or does not shut down.
                return []
        executor = getattr(executor, "inner", None)
        if executor is None:
            break
    return []


def _load_main_dataset(loader: DataLoader[Any], marks: tuple[Mark | None, ...] | None) -> None:
    """Put a map-style dataset loaded in the main process where worker 0's mark says."""
    mark = None if not marks else marks[0]
    if mark is not None and mark[1] not in (None, ...) and mark[1].get("dataset") is not None:
        dataset: Any = loader.dataset  # map-style with a state: the mark says so
        dataset.load_state_dict(mark[1]["dataset"])


@attrs.define
class _Trail:
    """Shared by an iterator and its loader: where the iterator left its epoch.

    The loader holds this, not the iterator, so that dropping an iterator still shuts its
    workers down, and a pickled loader carries plain data.
    """

    left: _Position | None = None
    counters: LoaderCounters | None = None
    """The scheduler's counters as the iterator was shut down, for `DataLoader.stats()` (not
    its state, which may hold batches)."""
    handles: list[Any] = attrs.field(factory=list)
    """The iterator's workers as it was shut down (see `_Iterator._workers`)."""


class _Iterator(_BaseDataLoaderIter):
    """One pass (or, with persistent workers, every pass) over a statecore DataLoader."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self._driver: Driver | None = None
        self._autotuner: AutoTuner | None = None
        self._epoch: EpochRecord | None = None
        self._log: SamplerLog | None = None
        self._trail = _Trail()
        self._resumed_from: int | None = None
        """Batches yielded before the checkpoint, while a resumed epoch has yielded none."""
        if loader._resume is not None:
            align_epoch(loader._resume.raw, loader)
        resume, loader._resume = loader._resume, None
        # The workers are seeded as the checkpoint's were. The base seed is drawn from the
        # generator as torch draws it, so that the generator moves on as the original's did,
        # except where the original drew none: a persistent iterator's later epochs.
        seed = None if resume is None else resume.base_seed
        persistent = bool(loader.persistent_workers) and not loader.loads_in_process
        undraw = (
            resume is not None
            and seed is not None
            and (persistent if resume.complete else not resume.seeded)
        )
        in_process = loader.loads_in_process
        # Where the original's datasets lived on from one epoch into the next (persistent
        # workers, the main process), they carry what their last epoch left in their state into
        # it: so do the resumed ones (torchdata's too). `_carried` goes to the resumed workers,
        # which bring their datasets there; `_carries` is this epoch's record of it, so that a
        # state taken before a worker's first batch of the epoch still holds it.
        self._carried: tuple[Mark | None, ...] | None = None
        self._opening: Mark | None = None
        self._carries: tuple[Mark | None, ...] | None = None
        self._carries_open: frozenset[int] = frozenset()
        in_main = in_process and loader._dataset_kind != _ITER
        if resume is None and in_process:
            # The dataset is the loader's own object, which the previous iterator's epoch left
            # where it stands: nothing to bring there, only to record.
            position = loader._position()
            iterable = not in_main
            self._carries, self._carries_open = _carried_over(position, True, iterable)
        elif (
            resume is not None
            and (persistent or in_process)
            # A state taken before any epoch started (complete, nothing ended) carries nothing.
            and (resume.progress.ended or not resume.complete)
        ):
            # Between epochs, the resumed epoch is the next: what the checkpoint's left in each
            # dataset is carried into it. Mid-epoch, the checkpoint's own marks are of this
            # epoch, and only what the epoch before left (`carried`) is carried.
            if resume.complete:
                self._carries, self._carries_open = _standing(resume), _standing_open(resume)
            else:
                self._carries, self._carries_open = resume.carried, resume.carried_open
            self._carried = self._carries
            if in_main and resume.complete:
                # A map-style dataset in the main process is the loader's own: it is put where
                # it stood before iter() draws its seeds, as the original's stood then (a state
                # that is torch's global generator's is then put where the checkpoint found it).
                _load_main_dataset(loader, self._carried)
        # Epochs seeded from this iterator's base seed before its first (see `_seeding.epoch_seed`):
        # a resumed epoch is the checkpoint's; after a checkpoint taken between epochs, the next.
        self._seed_epoch = 0 if resume is None else resume.seed_epoch - 1
        if resume is not None and resume.complete:
            # The generator is put where the checkpoint found it (torch's global one too, so
            # the program goes on with the original's stream), and the epoch draws from it.
            _between_epochs(loader, resume)
            resume = None
            seed = seed if persistent else None
            self._seed_epoch += 1
        if seed is None:
            self._seed_epoch = 0  # a base seed of its own, drawn by iter()
        self._resume = resume
        self._start(loader, resume, seed, undraw)

    def _start(
        self, loader: DataLoader[Any], resume: Resume | None, seed: int | None, undraw: bool
    ) -> None:
        source = torch.default_generator if loader.generator is None else loader.generator
        before = source.get_state() if undraw else None
        super().__init__(loader)
        if before is not None:
            source.set_state(before)
        if seed is not None:
            self._base_seed = seed
        in_process = self._in_process = loader.loads_in_process
        self._per_batch = loader._seeding_in_force() == PER_BATCH
        # A map-style dataset in the main process is the loader's own: `_reset` loads its state.
        in_main = in_process and self._dataset_kind != _ITER
        self._drawless = self._dataset_kind != _ITER and draws_nothing(self._index_sampler)
        if in_process and self._timeout != 0:
            raise AssertionError("loading in the calling thread requires timeout == 0, as torch")
        if in_process and loader.worker_timeout:
            raise ValueError(
                "worker_timeout needs workers: with num_workers=0 the batches are loaded in the "
                "calling thread, which cannot be watched or replaced; set num_workers >= 1"
            )
        # torch takes num_workers=True as one worker (True > 0, range(True)), and refuses 2.5
        # with range()'s TypeError: operator.index does both.
        workers = self._worker_slots = 1 if in_process else operator.index(loader.num_workers)
        self._autotuner = _autotuner_for(loader, workers)
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
            resume=None if resume is None or in_main else resume.workers,
            ended=None if in_main else self._carried,
            ended_open=frozenset() if self._carried is None else self._carries_open,
            resume_dry=frozenset() if resume is None or in_main else resume.progress.dry,
            batch_size=loader.batch_size,
            snapshot_every=loader.snapshot_every_n_steps or None,
            trace=loader.trace,
        )
        config = Config(
            num_workers=workers,
            prefetch_factor=1 if in_process else _prefetch_in_force(prefetch, self._autotuner),
            in_order=loader.in_order,
            iterable=self._dataset_kind == _DatasetKind.Iterable,
            persistent_workers=self._persistent_workers and not in_process,
            lazy=in_process,
            restarts=0 if in_process else loader._restarts_left(),
            # An auto loader starts with the count it learned (two at first); the others begin
            # retired, and its tuner adds them as they pay.
            started=(
                self._autotuner.workers
                if self._autotuner is not None and self._autotuner.tunes_workers
                else None
            ),
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
        if config.restarts or loader.worker_timeout:
            _check_replacing(factory, loader)
        if self._autotuner is not None and self._autotuner.tunes_workers:
            _check_auto(factory, loader)  # set after the loader was built, say
        launch = Launch(
            setup,
            workers,
            loader.multiprocessing_context,
            worker_restarts=0 if in_process else loader.worker_restarts,
            started=config.started,
        )
        executor = _checked(factory)(launch)
        executor.start()
        # After start(): the dataset's iterator for the epoch is made, as torchdata's is made
        # before it takes its first state.
        self._opening = _opening_mark(self._dataset) if in_process and resume is None else None
        tracer = loader._tracer_for(workers, config.persistent_workers)
        if tracer is not None and self._autotuner is not None:
            tracer.tuner = self._autotuner
        marked = self._dataset_kind != _ITER and has_state(self._dataset)
        # A persistent worker's replacement in a later epoch cannot be given what its copy of
        # such a dataset carried into the epoch; a datapipe's is its epoch's seed, which it is.
        afresh = (
            config.persistent_workers
            and self._dataset_kind == _ITER
            and not has_state(self._dataset)
            and not isinstance(self._dataset, IterDataPipe)
        )
        self._driver = Driver(
            config,
            executor,
            _drawer(self),
            self._timeout,
            # Without restarts no worker is replaced, and the budget needs to see nothing: not
            # watching every transition for it saves a call per step.
            observers=(
                *observers(config, tracer),
                *((loader._restarts.observer(afresh),) if config.restarts else ()),
            ),
            marked=marked,
            worker_timeout=0 if in_process else loader.worker_timeout,
        )
        _LIVE.add(self)
        self._reset(loader, first_iter=True)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        resume, self._resume = self._resume, None
        source = torch.default_generator if loader.generator is None else loader.generator
        # Taken before the epoch's sampler draws anything: a checkpoint of this epoch replays
        # its draws from here.
        rng = source.get_state()
        # torch's single-process iterator does not reset when built: its base class has just
        # done what a reset does, and a second reset would draw a datapipe's shared seed again
        # from the loader's generator, moving it on.
        if not (first_iter and self._in_process):
            super()._reset(loader, first_iter)
        # Whether this epoch drew its workers' base seed: an iterator's first epoch does, a
        # persistent iterator's later ones do not. A resume draws as the original did.
        seeded = first_iter if resume is None else resume.seeded
        carries, carries_open = self._carries, self._carries_open
        after_a_break = False
        if not first_iter:
            # A persistent iterator's workers go on into this epoch with their datasets.
            previous = self._position() if self._epoch is not None else None
            carries, carries_open = _carried_over(previous, False)
            if carries is None and previous is not None:
                # Left before its end: see `EpochRecord.after_a_break`.
                after_a_break = True
                carries, carries_open = _merged(previous.carried, None), previous.carried_open
        record = EpochRecord(
            rng, seeded, carried=carries, after_a_break=after_a_break, carried_open=carries_open
        )
        shared = distributed_sampler(loader.sampler, loader.batch_sampler)
        if resume is not None and resume.elastic is not None:
            record.stage = resume.elastic.stage
            record.length = resume.num_yielded + _count(resume.elastic.share, loader)
        elif shared is not None:
            record.stage = Stage(int(shared.epoch))
        sampler = stateful_sampler(self._index_sampler)
        start: Progress | None = None
        marks = None
        if resume is not None and resume.workers is not None:
            # A map-style dataset's states may come from more workers than this loader has.
            marks = {
                w: mark
                for w, mark in enumerate(resume.workers)
                if mark is not None and w < self._worker_slots
            }
        elif first_iter and self._opening is not None:
            marks = {0: self._opening}
        if resume is not None:
            start = resume.progress
            if resume.rng_epoch_start is not None:
                record.rng = resume.rng_epoch_start
            if self._in_process and self._dataset_kind != _ITER:
                # The loader's own dataset, where it stood at the last batch handed over (or as
                # the epoch before left it), before torch's global generator is put where the
                # checkpoint found it: a state that is that generator's is then where the
                # original's stood at the checkpoint, after its iter()'s draws. And now rather
                # than with the first batch, so that an epoch broken out of at once still
                # leaves it for the next.
                _load_main_dataset(loader, _standing(resume))
            self._sampler_iter = self._positioned(loader, resume, sampler, source)
            self._num_yielded = self._resumed_from = resume.num_yielded
        if sampler is not None:
            first = resume.sampler if resume is not None else None
            record.log = SamplerLog(sampler, start.done if start is not None else 0, first)
        # `_log` again on its own: the drawer reads it on every draw.
        self._epoch, self._log = record, record.log
        assert self._driver is not None
        self._seed_epoch += 1
        seeds = BatchSeeds.of(int(self._base_seed), self._seed_epoch) if self._per_batch else None
        if self._autotuner is not None:
            self._autotuner.begin_epoch()
        self._driver.start_epoch(
            None if first_iter else self._shared_seed, resume=start, marks=marks, seeds=seeds
        )

    def _positioned(
        self, loader: Any, resume: Resume, sampler: Any, source: torch.Generator
    ) -> Any:
        """The sampler's iterator, at the first draw not handed over before the checkpoint.

        torch's global generator is put where the original's stood at the checkpoint: the
        epoch's own draws (the base seed, the sampler's seed) had been made from it, and the
        program's draws (its dropout, its own sampling) come next, as they did.
        """
        if loader.generator is None and resume.rng_now is not None:
            source.set_state(resume.rng_now)  # the replay draws on a copy (see `_replayed`)
        return self._replayed(loader, resume, sampler, source)

    def _replayed(self, loader: Any, resume: Resume, sampler: Any, source: torch.Generator) -> Any:
        if resume.elastic is not None:
            # Taken on another number of ranks: this rank's share of what none received.
            return batches_of(resume.elastic.share, loader)
        if sampler is not None and resume.sampler is not None:
            sampler.load_state_dict(resume.sampler)  # restored directly: no draw repeated
            return iter(self._index_sampler)
        start = resume.rng_epoch_start
        if self._dataset_kind == _ITER:
            # Its sampler yields placeholders, and its workers restore their own positions; the
            # loader's generator is put where the epoch began, so the epochs after draw as they
            # did. torch's global generator is the program's: it has moved on as torch's would.
            if start is not None and loader.generator is not None:
                source.set_state(start)
            return iter(self._index_sampler)
        if start is None and self._drawless:
            return positioned(iter(self._index_sampler), resume.progress.done, peek=False)
        if start is None:
            raise ValueError(
                "cannot resume this epoch: the checkpoint has neither the sampler's state nor "
                "the random state the epoch began with"
            )
        # Any other sampler is drawn again from the epoch's start, as the original drew it.
        if loader.generator is not None:
            # Only the sampler draws from the loader's own generator, some of it lazily (torch's
            # RandomSampler, a chunk at a time): drawn again on it, it ends where the
            # original's did.
            source.set_state(start)
            return positioned(iter(self._index_sampler), resume.progress.done, peek=False)
        # torch's global generator: the epoch is drawn on a copy set to its start (torch's
        # samplers take all they draw from it on their first draw, hence the peek), and the
        # generator is then put where the checkpoint found it (see `_positioned`).
        with torch.random.fork_rng(devices=[]):
            source.set_state(start)
            draws = positioned(iter(self._index_sampler), resume.progress.done, peek=True)
            drew = not torch.equal(source.get_state(), start)
        now = resume.rng_now
        if drew and (now is None or torch.equal(now, start)):
            # The original's sampler had drawn nothing yet at the checkpoint (the generator
            # stood where the epoch began), or the state did not record the generator: the
            # stream moves on by the sampler's first draw, as the original's did (torch's).
            next(iter(self._index_sampler), None)
        return draws

    def _position(self) -> _Position | None:
        """Where this iterator's epoch stands now (see `DataLoader.state_dict`); None if its
        position could not be kept as it shut down."""
        record = self._epoch
        assert record is not None
        driver = self._driver
        if driver is None:
            return self._trail.left  # written as the driver was shut down
        done = driver.progress()
        marks = driver.marks
        # Complete once the consumer was told the epoch ended (its StopIteration), as
        # torchdata's is: never from the sampler's len(), which may promise fewer than it
        # yields. A state taken after the last batch and before the StopIteration resumes
        # that epoch, which then ends with no batch (see `_next_data`).
        complete = driver.state.phase is Phase.FINISHED
        iterable = self._dataset_kind == _ITER
        carried, carried_open = _carried_in(record, driver, self._worker_slots, iterable)
        sampler_state = None
        if record.log is not None:
            log = record.log
            sampler_state = log.sampler.state_dict() if complete else log.at(done.done)
        return _Position(
            progress=done,
            complete=complete,
            # In the calling thread only batches seeded per batch are seeded from it.
            base_seed=None if self._in_process and not self._per_batch else int(self._base_seed),
            rng_epoch_start=None if self._drawless else record.rng,
            seeded=record.seeded,
            seed_epoch=self._seed_epoch,
            sampler=sampler_state,
            num_yielded=self._num_yielded,
            workers=None if marks is None else [marks.get(w) for w in range(self._worker_slots)],
            carried=carried,
            carried_open=carried_open,
            stage=record.stage,
        )

    def __next__(self) -> Any:
        if _profiler_enabled():
            # torch's own __next__ labels the batch for the profiler.
            return super().__next__()
        # Without a profiler the label is wasted, and it costs more than the rest of a small
        # batch's journey through torch (record_function enters a dispatcher op each time).
        if self._sampler_iter is None:
            self._reset()  # type: ignore[call-arg]
        driver = self._driver
        if driver is not None and self._resumed_from is None and self._autotuner is None:
            data = driver.next()  # `_next_data`'s common case, without its frame
        else:
            data = self._next_data()
        self._num_yielded += 1
        promised: int | None = self._IterableDataset_len_called
        if promised is not None and self._num_yielded > promised and self._dataset_kind == _ITER:
            warnings.warn(_too_long(self, promised), stacklevel=2)
        return data

    def _next_data(self) -> Any:
        driver = self._driver
        assert driver is not None
        tuner = self._autotuner
        if self._resumed_from is None and tuner is None:
            return driver.next()
        try:
            if tuner is None:
                return driver.next()
            # num_workers="auto": the tuner measures between the consumer's calls, and decides
            # (every few batches) after this one was handed over.
            asked = tuner.asking()
            data = driver.next()
            tuner.handed(driver, asked, driver.executor)
            return data
        except StopIteration:
            if self._resumed_from is None:
                raise
            if self._num_yielded == self._resumed_from:
                warnings.warn(EpochOverWarning(_EPOCH_OVER), stacklevel=3)
            self._resumed_from = None
            raise

    @property
    def _workers(self) -> list[Any]:
        """The workers, as torch's multi-process iterator lists its processes (code written
        against torch's joins them, or reads their pids): the mp executor's processes (pid,
        `is_alive()`, `join()`, `exitcode`, also after the iterator shut down), the thread
        executor's threads, Ray's actor handles, none loading in the calling thread. Those
        started so far, by slot (a worker process starts with its first task); once the
        iterator is shut down, those it had."""
        driver = self._driver
        if driver is None:
            return list(self._trail.handles)
        return _worker_handles(driver.executor)

    def _usable(self) -> bool:
        """Whether another epoch can start on this iterator's scheduler and executor."""
        driver = self._driver
        return driver is not None and can_restart(driver.state)

    def _shutdown(self) -> None:
        driver = self._driver
        if driver is None:
            return
        try:
            if self._epoch is not None:
                # Kept for the loader: its state_dict() describes this epoch until the next
                # iter(), whether or not anyone still holds this iterator.
                self._trail.left = self._position()
        finally:
            # The workers stop even when a stateful sampler's state_dict() raised. The driver
            # is let go only once closed: a close an interrupt cut short is finished by the
            # next call (the driver carries out what is left of it).
            self._trail.counters = LoaderCounters.of(driver.state, driver.state.config.num_workers)
            self._trail.handles = _worker_handles(driver.executor)
            if driver.state.phase is not Phase.CLOSED or driver.todo:
                driver.close()
            self._driver = None

    def __del__(self) -> None:
        # Never raise from a finalizer. No module globals here either: at interpreter exit they
        # may already be gone when this runs.
        try:  # noqa: SIM105
            self._shutdown()
        except Exception:
            pass
