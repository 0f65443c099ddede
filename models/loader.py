"""The loader-level machine: the real `statecore.DataLoader` against an uninterrupted run.

The scheduler's machines (`statecore.models.machines`) prove the core and the driver; the
code between them and the user (which random state a checkpoint replays, where a sampler or a
dataset stands, what a state taken at an epoch's edge means) is checked here, where the user
sees it. `loader_machine(setups)` builds a `RuleBasedStateMachine` that plays a training
program: it asks for batches, breaks out of its loop, is interrupted in `next()`, saves the
loader's state (through JSON or `torch.save`/`torch.load(weights_only=True)`, with torch's
global random state beside it, as a training framework saves it), restarts in a fresh loader
from a saved state, starts epochs, and (with worker processes) loses a worker to SIGKILL: with
no restart left, it goes on from the state the failed loader gives; with restarts left
(`Setup.restarts`, in `loader_machine(replacing=True)`), the loader replaces the worker and
the program goes on in the same epoch, saving a state right after the kill or right after the
call that noticed it (the replacement may not have answered yet), and resuming from it at
once or later.

Every dataset here is exact under a restart: none draws from a worker's random stream (the
stateful map-style one is seeded by the worker's seed, which a replacement shares, and its
draws are its state), so a replacement's batches are the uninterrupted run's.

Its oracle is the same configuration run once, uninterrupted, for up to `EPOCHS` epochs,
breaking out of the epochs the program broke out of (after as many batches): per epoch, the
batches the program was handed, across every resume, must be that run's (in order), or the
same multiset (`in_order=False`). A resume rolls the program's record back to the saved one,
as a restarted job forgets what it trained on after its checkpoint.

Hypothesis's draws depend on the program's choices alone, never on the workers' timing: the
record moves as the uninterrupted run says, and a loader handing anything else is a violation
kept and raised as the run ends (see `loader_machine`).

Failures print as runnable programs: a `Setup` is a valid Python expression.
"""

from __future__ import annotations

import io
import json
import os
import signal
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from torch.utils.data import (
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from statecore import (
    DataLoader,
    Event,
    ReplaceWorker,
    ResumeWorker,
    SendTask,
    WorkerDiedError,
    WorkerRestartedWarning,
)
from statecore.executors import Capabilities, Executor, Launch, capabilities_of
from statecore.executors._incarnation import Standing
from statecore.executors._protocol import WorkerReport, confirmer_of, replacer_of
from statecore.executors._registry import lookup

__all__ = [
    "DATASETS",
    "EPOCHS",
    "Forwarding",
    "Setup",
    "Switchboard",
    "dry_setups",
    "loader_machine",
    "setups",
]

EPOCHS = 3
"""Epochs of the uninterrupted run; the program never goes past them."""

RESTARTS = 1000
"""A loader's `worker_restarts` where workers are replaced: more than an example kills."""

DATASETS = (
    "map",  # a map-style dataset: index -> index
    "stateful-map",  # map-style, with a per-worker draw counter in state_dict (augmentation)
    "iterable",  # each worker its shard
    "stateful-iterator",  # the iterator has state_dict/load_state_dict
    "stateful-dataset",  # the dataset has the state, and its next iterator starts from it
    "rewinding",  # as stateful-dataset, but its state returns to the start once exhausted
    "counting-epochs",  # as rewinding, and it counts its epochs as its part runs dry
)
"""The kinds of dataset a `Setup` names. Iterable ones take per-worker counts, short and
uneven (0 included): shards that run dry at different times."""


# --- datasets and samplers ----------------------------------------------------------------------


class Numbers(Dataset[int]):
    """range(n), map-style."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Augmented(Dataset[int]):
    """Map-style with a state of its own: each sample carries a draw from the loading worker's
    stream (as a random augmentation would), seeded from the worker's torch seed. A resumed run
    draws the same augmentations only if each worker's state is saved and restored."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seed: int | None = None
        self.draws = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.seed is None:
            self.seed = torch.initial_seed() % 1_000_003
        self.draws += 1
        return index * 1000 + (self.seed * 7919 + self.draws * 104_729) % 997

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.draws = state["seed"], state["draws"]


def _shard(counts: tuple[int, ...]) -> list[int]:
    """This worker's items: worker k's are 100 * k + j; in-process, every worker's in turn."""
    info = get_worker_info()
    workers = range(len(counts)) if info is None else [info.id]
    return [100 * k + j for k in workers for j in range(counts[k])]


class Shards(IterableDataset[int]):
    """Worker k yields counts[k] items: short and uneven shards run dry at different times."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.counts = counts

    def __iter__(self) -> Iterator[int]:
        return iter(_shard(self.counts))


class _Cursor:
    """An iterator over items that says where it is (torchdata's Stateful protocol)."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.at = 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.at >= len(self.items):
            raise StopIteration
        self.at += 1
        return self.items[self.at - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


class StatefulShards(IterableDataset[int]):
    """`Shards` whose iterator has the state."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.counts = counts

    def __iter__(self) -> _Cursor:
        return _Cursor(_shard(self.counts))


class ShardsWithState(IterableDataset[int]):
    """`Shards` whose dataset has the state, and whose next iterator starts from it (as
    Hugging Face's). With `rewinds`, the state returns to the start once the shard is
    exhausted, a common pattern: a worker found dry must then stay dry on resume."""

    def __init__(self, counts: tuple[int, ...], rewinds: bool) -> None:
        self.counts = counts
        self.rewinds = rewinds
        self.start = 0
        self.yielded = 0

    def __iter__(self) -> Iterator[int]:
        # The state is taken up as iter() is called, not at the first item (as a generator
        # function would): an iterator dropped unread leaves none behind for the next epoch.
        shard = _shard(self.counts)
        start, self.start = self.start, 0
        self.yielded = start
        return self._items(shard[start:])

    def _items(self, items: list[int]) -> Iterator[int]:
        for item in items:
            self.yielded += 1
            yield item
        if self.rewinds:
            self.yielded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start = state["start"]


class CountsEpochs(ShardsWithState):
    """`ShardsWithState` (rewinding) whose dataset also counts its epochs, moving on as its
    part runs dry, as a dataset keeping its own epoch does: worker k's item j of epoch e is
    1000 * e + 100 * k + j. A resume must run a part dry again exactly where the uninterrupted
    run's ran dry, and nowhere else: a replacement, an epoch broken off, a state taken at an
    epoch's edge all show in the items' epochs."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        super().__init__(counts, rewinds=True)
        self.epoch = 0

    def _items(self, items: list[int]) -> Iterator[int]:
        for item in super()._items(items):
            yield 1000 * self.epoch + item
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.epoch = state["epoch"]


class Understated(Sampler[int]):
    """A sampler whose `__len__` says `missing` fewer than it yields; torch tolerates it."""

    def __init__(self, inner: Sampler[int], missing: int) -> None:
        self.inner = inner
        self.missing = missing

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner)

    def __len__(self) -> int:
        return max(len(self.inner) - self.missing, 0)  # type: ignore[arg-type]


# --- the executor the program can interrupt -----------------------------------------------------


@attrs.define
class Switchboard:
    """What the program reaches into the loader with: an interrupt armed for the next wait,
    and the executors made, to find a worker process to kill."""

    armed: bool = False
    executors: list[Any] = attrs.field(factory=list)

    def factory(self, name: str) -> Callable[[Launch], Executor]:
        inner, _ = lookup(name)
        return _Factory(inner, self)

    def worker_pids(self) -> list[int]:
        """The live worker processes of the latest executor (an "mp" one), oldest first."""
        if not self.executors:
            return []
        processes = getattr(self.executors[-1].inner, "processes", {})
        return [p.pid for _, p in sorted(processes.items()) if p.is_alive()]


@attrs.frozen
class _Factory:
    inner: Callable[[Launch], Executor]
    board: Switchboard

    @property
    def capabilities(self) -> Capabilities:
        return capabilities_of(self.inner)

    def __call__(self, launch: Launch) -> Executor:
        executor = _Interruptible(self.inner(launch), self.board)
        self.board.executors.append(executor)
        return executor


class Forwarding:
    """An executor that does what the executor it wraps does, and declares what it declares:
    above all that an answer a poll returned is given again until confirmed, which an
    interrupt must not lose. Subclasses change one move (the interrupting executors)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:
        return capabilities_of(self.inner)

    def confirm(self) -> None:
        # Called only where the inner executor declares that it confirms answers.
        confirm = confirmer_of(self.inner)
        if confirm is not None:
            confirm()

    def start(self) -> None:
        self.inner.start()

    def dispatch(self, command: SendTask) -> None:
        self.inner.dispatch(command)

    def resume(self, command: ResumeWorker) -> None:
        self.inner.resume(command)

    def stop_worker(self, worker: int) -> None:
        self.inner.stop_worker(worker)

    def replace(self, command: ReplaceWorker, mark: Standing) -> None:
        # Called only where the inner executor declares that it replaces workers.
        replacer = replacer_of(self.inner)
        assert replacer is not None
        replacer.replace(command, mark)

    def report(self, worker: int) -> WorkerReport:
        replacer = replacer_of(self.inner)
        assert replacer is not None
        return replacer.report(worker)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def poll(self, timeout: float | None) -> Event | None:
        return self.inner.poll(timeout)


class _Interruptible(Forwarding):
    """An executor whose next wait raises KeyboardInterrupt when the program armed it: a
    Ctrl-C landing as the consumer starts waiting in `next()`, without a signal or a clock."""

    def __init__(self, inner: Executor, board: Switchboard) -> None:
        super().__init__(inner)
        self.board = board

    def poll(self, timeout: float | None) -> Event | None:
        if self.board.armed:
            self.board.armed = False
            raise KeyboardInterrupt("the loader machine's interrupt")
        return self.inner.poll(timeout)


# --- configurations -----------------------------------------------------------------------------


@attrs.frozen
class Setup:
    """One loader configuration; the program builds it again, alike, for every restart."""

    executor: str
    workers: int
    dataset: str
    counts: tuple[int, ...]
    """Map-style: (n,). Iterable: items per worker (one entry in-process)."""
    batch_size: int
    drop_last: bool = False
    shuffle: bool = False
    generator: bool = False
    """A seeded generator of the loader's own; else torch's global generator."""
    persistent: bool = False
    in_order: bool = True
    understated: int = 0
    """Map-style: the sampler's __len__ says this many fewer than it yields."""
    seed: int = 0
    restarts: int = 0
    """`worker_restarts` (worker processes only): 0, a killed worker fails the loader; more,
    enough for every kill an example makes, it is replaced."""

    @property
    def iterable(self) -> bool:
        return self.dataset not in ("map", "stateful-map")

    def _dataset(self) -> Any:
        if self.dataset == "map":
            return Numbers(self.counts[0])
        if self.dataset == "stateful-map":
            return Augmented(self.counts[0])
        if self.dataset == "iterable":
            return Shards(self.counts)
        if self.dataset == "stateful-iterator":
            return StatefulShards(self.counts)
        if self.dataset == "counting-epochs":
            return CountsEpochs(self.counts)
        return ShardsWithState(self.counts, rewinds=self.dataset == "rewinding")

    def build(self, board: Switchboard) -> DataLoader[Any]:
        """The loader, built as the program builds it after every (re)start."""
        dataset = self._dataset()
        generator = torch.Generator().manual_seed(self.seed) if self.generator else None
        options: dict[str, Any] = {}
        if self.understated:
            # It draws from torch's global generator: one drawing from a generator of its own
            # cannot be drawn again (docs/checkpointing.md), and the loader's is not its.
            inner: Sampler[int] = (
                RandomSampler(dataset) if self.shuffle else SequentialSampler(dataset)
            )
            options["sampler"] = Understated(inner, self.understated)
        elif not self.iterable:
            options["shuffle"] = self.shuffle
            options["generator"] = generator
        elif self.generator:
            options["generator"] = generator
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            num_workers=self.workers,
            persistent_workers=self.persistent,
            in_order=self.in_order,
            executor=board.factory(self.executor),
            worker_restarts=self.restarts,
            **options,
        )

    def uninterrupted(self, taken: tuple[int | None, ...]) -> list[Any]:
        """The oracle: the epoch after `taken`, of one loader run from the program's seed with
        nothing saved, restored, interrupted or killed.

        `taken` says, per earlier epoch, how many batches the program took before it broke out
        of the loop and started the next (None: to the end). Breaking changes what the epochs
        after draw from the generator (a sampler never touched draws no seed), so the
        uninterrupted run breaks where the program did.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            loader = self.build(Switchboard())
            try:
                for count in taken:
                    iterator = iter(loader)
                    if count is None:
                        for _ in iterator:
                            pass
                    else:
                        for _ in range(count):
                            next(iterator)
                    del iterator
                return [_plain(batch) for batch in loader]
            finally:
                _retire(loader)


def _plain(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _retire(loader: DataLoader[Any]) -> None:
    """Stop the loader's persistent workers now rather than whenever it is collected."""
    kept = loader.__dict__.get("_iterator")
    if kept is not None:
        kept._shutdown()


@st.composite
def setups(draw: st.DrawFn, executors: tuple[str, ...] = ("inline", "thread")) -> Setup:
    """Configurations small enough for tens of examples a second, over `executors`."""
    executor = draw(st.sampled_from(executors), label="executor")
    workers = 0 if executor == "inline" else draw(st.integers(1, 3), label="workers")
    # Map-style thrice: it alone shuffles, and shuffling is where resumes go wrong most.
    dataset = draw(st.sampled_from(["map", "map", *DATASETS]), label="dataset")
    iterable = dataset not in ("map", "stateful-map")
    if iterable:
        counts = tuple(
            draw(st.lists(st.integers(0, 5), min_size=max(workers, 1), max_size=max(workers, 1)))
        )
    else:
        counts = (draw(st.integers(1, 9), label="n"),)  # torch refuses to shuffle nothing
    shuffle = not iterable and draw(st.sampled_from((True, False)), label="shuffle")
    understated = 0 if iterable else draw(st.sampled_from((0, 0, 1, 3)), label="understated")
    return Setup(
        executor=executor,
        workers=workers,
        dataset=dataset,
        counts=counts,
        batch_size=draw(st.integers(1, 3), label="batch_size"),
        drop_last=draw(st.booleans(), label="drop_last"),
        shuffle=shuffle,
        generator=not understated and draw(st.booleans(), label="generator"),
        persistent=workers > 0 and draw(st.booleans(), label="persistent"),
        # A stateful map-style dataset's samples depend on which worker loads them, which
        # out of order depends on timing: the uninterrupted run itself would differ run to run.
        in_order=workers < 2 or dataset == "stateful-map" or draw(st.booleans(), label="in_order"),
        understated=understated,
        seed=draw(st.integers(0, 2**16), label="seed"),
        restarts=RESTARTS if executor == "mp" and draw(st.booleans(), label="restarts") else 0,
    )


@st.composite
def dry_setups(draw: st.DrawFn, executors: tuple[str, ...] = ("mp",)) -> Setup:
    """Configurations made for the edges of iterable workers that run dry at different times
    under persistent workers, whose datasets carry their state (counting their epochs as their
    parts run dry, or going back to their start): one short part (found dry early) beside
    longer ones, so that a state taken with it dry, a resumed epoch, the epoch after it (a
    state taken there, a break) and a worker killed after its part ran dry (worker processes,
    replaced) come within a few steps."""
    executor = draw(st.sampled_from(executors), label="executor")
    workers = draw(st.integers(2, 3), label="workers")
    short = draw(st.integers(0, 2), label="short")
    longer = draw(
        st.lists(st.integers(3, 7), min_size=workers - 1, max_size=workers - 1), label="longer"
    )
    counts = tuple(draw(st.permutations([short, *longer]), label="counts"))
    return Setup(
        executor=executor,
        workers=workers,
        dataset=draw(st.sampled_from(("counting-epochs", "rewinding")), label="dataset"),
        counts=counts,
        batch_size=draw(st.integers(1, 2), label="batch_size"),
        drop_last=False,
        generator=draw(st.booleans(), label="generator"),
        persistent=True,
        seed=draw(st.integers(0, 2**16), label="seed"),
        restarts=RESTARTS if executor == "mp" else 0,
    )


def _roundtrip(state: dict[str, Any], through_json: bool) -> dict[str, Any]:
    """The state as a checkpoint file gives it back."""
    if through_json:
        return json.loads(json.dumps(state))  # type: ignore[no-any-return]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # type: ignore[no-any-return]


# --- the machine --------------------------------------------------------------------------------


class Violation(AssertionError):
    """The program was handed other batches than the uninterrupted run's."""


@attrs.frozen
class _Record:
    """What the program knows of its run: the epoch it is in, what it was handed per epoch,
    which epochs it saw end, and whether it broke out of the current epoch's loop."""

    epoch: int = 0
    seen: tuple[tuple[Any, ...], ...] = ((),) * EPOCHS
    ended: frozenset[int] = frozenset()
    dropped: bool = False

    def handed(self, batch: Any) -> _Record:
        seen = list(self.seen)
        seen[self.epoch] = (*seen[self.epoch], batch)
        return attrs.evolve(self, seen=tuple(seen))

    def taken(self, epoch: int) -> tuple[int | None, ...]:
        """Per epoch before `epoch`: the batches taken before breaking out, None if it ended."""
        return tuple(None if e in self.ended else len(self.seen[e]) for e in range(epoch))

    def end(self) -> _Record:
        return _Record(self.epoch + 1, self.seen, self.ended | {self.epoch}, False)


@attrs.frozen
class _Saved:
    state: dict[str, Any]
    record: _Record
    rng: torch.Tensor


def _loads_what_a_break_left(setup: Setup, record: _Record) -> bool:
    """Whether persistent workers of a map-style dataset with a state may still load the tasks
    of the epoch before, broken out of: a replacement is not sent those (their batches are
    dropped), so its draws would not be the uninterrupted run's (docs/fault-tolerance.md,
    "What is exact", the known gap). The loader machine kills no worker then."""
    return (
        setup.dataset == "stateful-map"
        and setup.persistent
        and record.epoch > 0
        and record.epoch - 1 not in record.ended
    )


_END = object()
"""What a `next()` gives at an epoch's end, in place of a batch."""


def _ran_ahead_counts(setup: Setup) -> bool:
    """Whether a break leaves a dataset whose state depends on timing: persistent workers
    broken out of have loaded ahead as far as their speed took them, and a dataset counting
    its epochs counts the one broken off only if a worker's loading ahead ran its part dry,
    so the uninterrupted run itself differs run to run. The loader machine breaks no such
    loop (in the main process, which loads nothing ahead, it does)."""
    return setup.dataset == "counting-epochs" and setup.persistent


def loader_machine(
    setup_strategy: st.SearchStrategy[Setup] | None = None, *, replacing: bool = False
) -> type[RuleBasedStateMachine]:
    """A state machine class driving real loaders built from setups drawn from
    `setup_strategy` (default: inline and thread executors). Run it with
    `run_state_machine_as_test(loader_machine())` or expose its `TestCase` to pytest.

    `replacing`: with the rule that kills a worker the loader replaces (`Setup.restarts`,
    worker processes). Only there: a rule that is never enabled still changes what
    Hypothesis draws, and so which examples a fixed budget (a derandomized one) meets.

    What Hypothesis draws depends on the choices alone, never on timing: the program's record
    (its epoch, how many batches it was handed, whether it is in its loop) moves as the
    uninterrupted run says it must, whatever the loader hands. A loader that hands anything
    else (a wrong batch, an early or late end, an error) is a violation, kept and raised as
    the run ends (`teardown`), and the loader is driven no further: a loader going wrong at a
    moment set by its workers' speed (a mutant) must not end the run at that moment, or the
    same choices would draw a different number of steps (Hypothesis's FlakyStrategyDefinition)."""
    drawn = setups() if setup_strategy is None else setup_strategy

    class LoaderMachine(RuleBasedStateMachine):
        setup: Setup
        oracles: dict[tuple[int | None, ...], list[Any]]
        board: Switchboard
        loader: DataLoader[Any]
        iterator: Iterator[Any] | None
        """The loader's iterator the program holds (None once a violation stopped it)."""
        looping: bool
        """Whether the program is in an epoch's loop."""
        record: _Record
        saved: _Saved | None
        killed: set[int]
        """The worker processes the program killed (`a_worker_is_killed_and_replaced`)."""
        told: set[int]
        """Those of them a restart warning named, as far as the program caught them."""
        violation: Violation | None
        """The first thing the loader did that the uninterrupted run does not."""

        @initialize(setup=drawn)
        def start(self, setup: Setup) -> None:
            self.setup = setup
            self.oracles = {}
            self.board = Switchboard()
            self.iterator = None
            self.looping = False
            self.record = _Record()
            self.saved = None
            self.killed, self.told = set(), set()
            self.violation = None
            self._rng = torch.get_rng_state()
            torch.manual_seed(setup.seed)
            self._rng_at_begin = torch.get_rng_state()
            self.loader = setup.build(self.board)

        def teardown(self) -> None:
            self.iterator = None
            if hasattr(self, "loader"):
                _retire(self.loader)
            if hasattr(self, "_rng"):
                torch.set_rng_state(self._rng)
            self.handed_what_the_uninterrupted_run_hands()

        # -- the program's moves --

        def _can_iterate(self) -> bool:
            record = self.record
            return record.epoch + (1 if record.dropped else 0) < EPOCHS

        def _begin(self) -> None:
            if self.looping:
                return
            if self.record.dropped:
                # The program moves on: the epoch it broke out of is left unfinished.
                self.record = _Record(self.record.epoch + 1, self.record.seen, self.record.ended)
            self._rng_at_begin = torch.get_rng_state()
            self.looping = True
            if self.violation is None:
                try:
                    self.iterator = iter(self.loader)
                except Exception as error:
                    self._violated(f"iter(loader) raised {error!r}", error)

        def _next(self, interrupt: bool) -> None:
            self._begin()
            if self.iterator is None:
                self._takes(_END)  # stopped by a violation: the record moves on alone
                return
            self.board.armed = interrupt
            try:
                batch = next(self.iterator)
            except KeyboardInterrupt:
                # Asks again at once, as a notebook user re-runs the cell: whether the interrupt
                # landed (a batch may already have been waiting) leaves no trace in the record,
                # so that an example replays alike.
                self.board.armed = False
                self._next(interrupt=False)
                return
            except StopIteration:
                self._takes(_END)
                return
            except Exception as error:
                self._violated(f"next() raised {error!r}", error)
                self._takes(_END)
                return
            finally:
                self.board.armed = False
            self._takes(_plain(batch))

        @precondition(lambda self: not self.looping and self._can_iterate())
        @rule()
        def starts_an_epoch(self) -> None:
            self._begin()

        @precondition(lambda self: self.looping or self._can_iterate())
        @rule()
        def asks_for_a_batch(self) -> None:
            self._next(interrupt=False)

        @precondition(lambda self: self.looping)
        @rule()
        def is_interrupted_in_next(self) -> None:
            # Then asks again, as a notebook user does: nothing lost, nothing repeated.
            self._next(interrupt=True)

        @precondition(lambda self: self.looping and not _ran_ahead_counts(self.setup))
        @rule()
        def breaks_out_of_its_loop(self) -> None:
            self.iterator = None
            self.looping = False
            self.record = attrs.evolve(self.record, dropped=True)

        @rule(through_json=st.booleans())
        def saves(self, through_json: bool) -> None:
            state: dict[str, Any] = {}
            if self.violation is None:
                try:
                    state = _roundtrip(self.loader.state_dict(), through_json)
                except Exception as error:
                    self._violated(f"state_dict() raised {error!r}", error)
            # A state taken after a break describes the dropped epoch until the next iter():
            # resumed, that epoch goes on.
            record = attrs.evolve(self.record, dropped=False)
            self.saved = _Saved(state, record, self._rng_of_the_epoch())

        @rule()
        def asks_for_a_state_it_drops(self) -> None:
            # A state may be asked for at any moment, and asking changes nothing; also keeps a
            # rule enabled once every epoch is over.
            if self.violation is None:
                try:
                    self.loader.state_dict()
                except Exception as error:
                    self._violated(f"state_dict() raised {error!r}", error)

        @precondition(lambda self: self.saved is not None)
        @rule()
        def restarts_from_its_save(self) -> None:
            saved = self.saved
            assert saved is not None
            self._restart(saved.state)
            torch.set_rng_state(saved.rng)
            self._rng_at_begin = saved.rng
            self.record = saved.record

        @precondition(
            lambda self: self.setup.executor == "mp" and not self.setup.restarts and self.looping
        )
        @rule(which=st.integers(0, 3))
        def loses_a_worker(self, which: int) -> None:
            # A worker process is killed; the job goes on from the state the loader gives once
            # it has noticed (or once the epoch ended unnoticed), in a fresh loader, to the
            # epoch's end: how many batches came before the death depends on timing, the
            # epoch's batches do not, so the record after this rule does not.
            pids = self.board.worker_pids()
            if pids and self.violation is None:
                os.kill(pids[which % len(pids)], signal.SIGKILL)
            died = False
            if self.iterator is not None:
                try:
                    self._drains(self.iterator)
                except WorkerDiedError:
                    died = True
                except Exception as error:
                    self._violated(f"next() raised {error!r}", error)
            rng = self._rng_of_the_epoch() if died else torch.get_rng_state()
            state: dict[str, Any] = {}
            if self.violation is None:
                try:
                    state = _roundtrip(self.loader.state_dict(), through_json=False)
                except Exception as error:
                    self._violated(f"state_dict() raised {error!r}", error)
            self._restart(state)
            torch.set_rng_state(rng)
            self._rng_at_begin = rng
            self.record = attrs.evolve(self.record, dropped=False)
            # A state taken once every batch was handed over (the death noticed before the
            # StopIteration) resumes that epoch, which then ends with no batch.
            if died and self.violation is None:
                try:
                    self._drains(iter(self.loader))
                except Exception as error:
                    self._violated(f"the resumed epoch raised {error!r}", error)
            self._ends_the_epoch()

        if replacing:

            @precondition(lambda self: self.setup.restarts > 0 and self.looping)
            @rule(
                which=st.integers(0, 3),
                saves=st.sampled_from(("never", "killed", "noticed")),
                resumes=st.booleans(),
            )
            def a_worker_is_killed_and_replaced(
                self, which: int, saves: str, resumes: bool
            ) -> None:
                # A worker process is killed mid-epoch with restarts left, and the program asks
                # for its next batch: that call, or a later one (the next epoch's, for a persistent
                # worker found dead only then), notices the death and replaces the worker, telling
                # the user once. The batches must be the uninterrupted run's: nothing lost,
                # nothing repeated. A state taken right after the kill (`killed`), or right after
                # the call (`noticed`, its replacement perhaps not answered yet), is this rule's
                # to save; `resumes` loads it in a fresh loader at once, and the rules after may
                # too. Whether a worker is left to kill depends on timing (every worker of the
                # epoch may have stopped): the program's moves do not.
                if _loads_what_a_break_left(self.setup, self.record):
                    return
                pids = self.board.worker_pids()
                if pids and self.violation is None:
                    pid = pids[which % len(pids)]
                    os.kill(pid, signal.SIGKILL)
                    self.killed.add(pid)
                if saves == "killed":
                    self.saves(through_json=False)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", WorkerRestartedWarning)
                    self._next(interrupt=False)
                told = [str(w.message) for w in caught if w.category is WorkerRestartedWarning]
                # The call may notice an earlier kill too (a persistent worker found dead only
                # as a later epoch begins): every restart told names a process this program
                # killed, and none is told twice.
                named = [
                    next((p for p in self.killed if f"(pid {p})" in text), None) for text in told
                ]
                if None in named or len(set(named)) < len(named) or self.told & set(named):
                    self._violated(f"the program killed {sorted(self.killed)}, was told {told}")
                self.told |= {p for p in named if p is not None}
                if saves == "noticed":
                    self.saves(through_json=False)
                if resumes and saves != "never":
                    self.restarts_from_its_save()

        def _rng_of_the_epoch(self) -> torch.Tensor:
            """torch's global random state where the epoch a state resumes began, which the
            program keeps beside its checkpoint: between epochs, where it stands now.

            docs/checkpointing.md: a program whose global generator stands where the epoch
            began gets the uninterrupted run's stream after a resume; one standing elsewhere
            moves on by a fresh epoch's draws."""
            if not self.looping and not self.record.dropped:
                return torch.get_rng_state()
            return self._rng_at_begin

        def _restart(self, state: dict[str, Any]) -> None:
            self.iterator = None
            self.looping = False
            if self.violation is not None:
                return
            try:
                _retire(self.loader)
                self.board = Switchboard()
                self.loader = self.setup.build(self.board)
                with warnings.catch_warnings():
                    # A state taken at an epoch's last batch warns that the resumed epoch is
                    # empty.
                    warnings.simplefilter("ignore", UserWarning)
                    self.loader.load_state_dict(state)
            except Exception as error:
                self._violated(f"resuming from a saved state raised {error!r}", error)

        # -- the oracle --

        def _oracle(self, taken: tuple[int | None, ...]) -> list[Any]:
            if taken not in self.oracles:
                self.oracles[taken] = self.setup.uninterrupted(taken)
            return self.oracles[taken]

        def _violated(self, what: str, cause: BaseException | None = None) -> None:
            """Keeps the first violation and stops driving the loader."""
            if self.violation is None:
                self.violation = Violation(f"epoch {self.record.epoch}: {what}")
                self.violation.__cause__ = cause
                self.iterator = None

        def _takes(self, outcome: Any) -> None:
            """The program is handed `outcome` (a batch, or `_END`); the record moves on by
            what the uninterrupted run hands there, which a violation (kept) says it is not."""
            record = self.record
            expected = self._oracle(record.taken(record.epoch))
            seen = record.seen[record.epoch]
            if self.setup.in_order or self.setup.workers < 2:
                due = expected[len(seen)] if len(seen) < len(expected) else _END
            else:
                left = Counter(map(repr, expected)) - Counter(map(repr, seen))
                if not left:
                    due = _END
                elif outcome is not _END and repr(outcome) in left:
                    due = outcome
                else:
                    due = next(batch for batch in expected if repr(batch) in left)
            if self.violation is None and outcome != due:
                self._violated(
                    f"after {list(seen)}, handed "
                    f"{'the end' if outcome is _END else outcome}, where the uninterrupted run "
                    f"hands {expected}"
                )
            if due is _END:
                self.iterator = None
                self.looping = False
                self.record = record.end()
            else:
                self.record = record.handed(due)

        def _drains(self, iterator: Iterator[Any]) -> None:
            """Takes the batches of `iterator` to its end, or to a violation."""
            for batch in iterator:
                self._takes(_plain(batch))
                if self.violation is not None:
                    return

        def _ends_the_epoch(self) -> None:
            """The loader ended the epoch here; after a violation, the record runs to its end."""
            epoch = self.record.epoch
            while self.record.epoch == epoch:
                self._takes(_END)

        def handed_what_the_uninterrupted_run_hands(self) -> None:
            """Raises the violation kept, if any (the run's verdict, given at its end)."""
            if self.violation is not None:
                raise self.violation

    return LoaderMachine
