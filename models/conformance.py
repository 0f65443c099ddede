"""The models driving real executors: statecore's DataLoader checked against torch's, live.

`executor_machine(executor)` builds a Hypothesis `RuleBasedStateMachine` that loads a small
dataset through `statecore.DataLoader(executor=executor)` and, step for step, through torch's
own `torch.utils.data.DataLoader` built with the same arguments (the mirror). Torch is the
reference here: whatever it hands over, statecore must hand over too.

- `@initialize` draws a `Setup`: a map-style dataset or an iterable one sharded with
  `torch.utils.data.get_worker_info()` (with its own length per worker), batch size, drop_last,
  shuffling with a seeded generator (map-style only), num_workers, prefetch_factor, in_order,
  persistent_workers, and which item, if any, raises `InjectedFailure` when loaded.
- Rules: take the next batch; break out of the epoch and start a new one; run the epoch out.
- Checks: every finished epoch hands over what torch's did in the same epoch (in order: the
  same sequence, checked as it goes; out of order: the same multiset); the injected failure
  reaches the consumer as an `InjectedFailure` in its turn, and the epoch goes on after it;
  the scheduler's own invariants (`statecore.violations`) hold between steps. At teardown both
  loaders are deleted and no child process of this process started during the run may
  survive it (a bounded wait on /proc; skipped where there is no /proc).

Whether the executor loads in the calling thread decides num_workers: 0 for an in-process
executor, 1..max_workers otherwise. For a name it comes from the executor registry, for a
factory from what it declares (`Capabilities.in_process`; one declaring nothing starts
workers); `in_process=` overrides either.

Run it with `run_state_machine_as_test(executor_machine("mp"), settings=settings(...))`: every
example starts real loaders (and, for process executors, real processes), so keep
`max_examples` and `stateful_step_count` small.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Hashable, Iterable, Iterator
from typing import Any, Literal

import attrs
import torch
import torch.utils.data
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from statecore import violations
from statecore.executors._protocol import ExecutorFactory
from statecore.executors._registry import loads_in_process
from statecore.models.datasets import STRIDE, InjectedFailure, MapDataset, ShardedIterable

__all__ = [
    "ConformanceError",
    "InjectedFailure",
    "MapDataset",
    "Outcome",
    "Setup",
    "ShardedIterable",
    "canonical",
    "child_processes",
    "executor_machine",
    "loads_in_process",
    "rest_of_epoch",
    "stop_torch_workers",
    "take_outcome",
    "setups",
    "surviving_children",
]

Outcome = tuple[Literal["data", "error"], Hashable]
"""What the consumer got from one `next()`: a batch (in canonical form) or an error's type."""


@attrs.frozen
class Setup:
    """One drawn configuration: the dataset and every loader argument, shared by both loaders."""

    iterable: bool
    lengths: tuple[int, ...]
    """Map-style: `(size,)`. Iterable: items per worker (one entry when loading in-process)."""
    failing: int | None
    """The item whose loading raises `InjectedFailure`, or None."""
    batch_size: int | None
    drop_last: bool
    shuffle: bool
    seed: int
    num_workers: int
    prefetch_factor: int | None
    in_order: bool
    persistent_workers: bool

    def dataset(self) -> MapDataset | ShardedIterable:
        if self.iterable:
            return ShardedIterable(self.lengths, self.failing)
        return MapDataset(self.lengths[0], self.failing)

    def loader_arguments(self) -> dict[str, Any]:
        """Keyword arguments for either DataLoader, with a freshly seeded generator."""
        return dict(
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            drop_last=self.drop_last,
            generator=torch.Generator().manual_seed(self.seed),
            prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers,
            in_order=self.in_order,
        )


@st.composite
def setups(
    draw: st.DrawFn,
    in_process: bool,
    max_workers: int = 3,
    max_items: int = 10,
    max_batch_size: int = 3,
    max_prefetch: int = 2,
    shuffle: bool = True,
) -> Setup:
    """Configurations to load; num_workers is 0 when `in_process`, else 1..max_workers.

    `shuffle=False` never shuffles; otherwise map-style datasets are shuffled or not.
    """
    workers = 0 if in_process else draw(st.integers(1, max_workers), label="num_workers")
    iterable = draw(st.booleans(), label="iterable")
    if iterable:
        shards = max(1, workers)
        per_worker = max(1, max_items // shards)
        lengths = tuple(
            draw(st.lists(st.integers(0, per_worker), min_size=shards, max_size=shards), "lengths")
        )
        items = [STRIDE * w + k for w, length in enumerate(lengths) for k in range(length)]
    else:
        lengths = (draw(st.integers(0, max_items), label="size"),)
        items = list(range(lengths[0]))
    failing = draw(st.none() | st.sampled_from(items), label="failing") if items else None
    # torch shuffles map-style datasets only, and refuses to shuffle an empty one
    shuffled = shuffle and not iterable and bool(items) and draw(st.booleans(), label="shuffle")
    batch_size = draw(st.none() | st.integers(1, max_batch_size), label="batch_size")
    return Setup(
        iterable=iterable,
        lengths=lengths,
        failing=failing,
        batch_size=batch_size,
        # torch refuses drop_last without batching
        drop_last=False if batch_size is None else draw(st.booleans(), label="drop_last"),
        shuffle=shuffled,
        seed=draw(st.integers(0, 2**16), label="seed") if shuffled else 0,
        num_workers=workers,
        prefetch_factor=None if in_process else draw(st.integers(1, max_prefetch)),
        in_order=draw(st.booleans(), label="in_order"),
        persistent_workers=False if in_process else draw(st.booleans(), label="persistent"),
    )


def canonical(value: object) -> Hashable:
    """A hashable, comparable form of a batch: tensors become their dtype, shape and values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), tuple(value.flatten().tolist()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(canonical(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((key, canonical(item)) for key, item in value.items()))
    assert isinstance(value, Hashable), f"cannot compare a batch of type {type(value)}"
    return value


def rest_of_epoch(iterator: Iterator[Any]) -> list[Outcome]:
    """Every outcome left in the epoch."""
    rest: list[Outcome] = []
    while (outcome := take_outcome(iterator)) is not None:
        rest.append(outcome)
    return rest


def take_outcome(iterator: Iterator[Any]) -> Outcome | None:
    """The consumer's next `next()`: the outcome, or None at the end of the epoch.

    Only `InjectedFailure` counts as an outcome; any other exception fails the run.
    """
    try:
        batch = next(iterator)
    except StopIteration:
        return None
    except InjectedFailure as error:
        return ("error", type(error).__name__)
    return ("data", canonical(batch))


def stop_torch_workers(iterator: object) -> None:
    """Stop the workers of a torch iterator now, rather than whenever it is collected.

    Only statecore's loader is under test. Torch's iterator outlives its last reference once a
    worker's error reached the consumer (torch's ExceptionWrapper.reraise keeps the exception
    in a local, and its traceback holds that frame: a cycle through the iterator), so its
    workers would linger until the garbage collector runs.
    """
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


# --- child processes ----------------------------------------------------------------------------


def child_processes() -> dict[int, str]:
    """This process's children, by pid, each with its name and state from /proc ({} if none)."""
    me = os.getpid()
    found: dict[int, str] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
        except OSError:
            continue  # it ended while we looked
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
        if int(ppid) == me:
            found[int(entry)] = f"{name} (state {state})"
    return found


def surviving_children(before: Iterable[int], timeout: float) -> dict[int, str]:
    """Children not in `before` still there after waiting up to `timeout` seconds for them."""
    known = set(before)
    deadline = time.monotonic() + timeout
    while True:
        left = {pid: what for pid, what in child_processes().items() if pid not in known}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


# --- the machine --------------------------------------------------------------------------------


class ConformanceError(AssertionError):
    """statecore's loader and torch's handed over different things, or left something behind."""


def executor_machine(
    executor: str | ExecutorFactory,
    *,
    max_workers: int = 3,
    in_process: bool | None = None,
    max_items: int = 10,
    max_batch_size: int = 3,
    max_prefetch: int = 2,
    exit_timeout: float = 15.0,
    setup_strategy: st.SearchStrategy[Setup] | None = None,
) -> type[RuleBasedStateMachine]:
    """A state machine class running `statecore.DataLoader(executor=executor)` against torch.

    `executor` is anything `statecore.DataLoader(executor=...)` accepts. `in_process` says
    whether it loads in the calling thread (num_workers=0); left out, a name is looked up in
    the executor registry and a factory says so by declaring `Capabilities.in_process`.
    `exit_timeout` is how long teardown waits for child processes to end. `setup_strategy`
    replaces the configurations drawn by default (`setups(in_process, max_workers, ...)`); its
    num_workers must suit the executor.

    The machine lets go of statecore's iterators and loader the way a training loop does, by
    dropping the last reference: that alone must stop their workers, as it does torch's.
    """
    if in_process is None:
        in_process = loads_in_process(executor)
    drawn = (
        setups(in_process, max_workers, max_items, max_batch_size, max_prefetch)
        if setup_strategy is None
        else setup_strategy
    )

    class ExecutorMachine(RuleBasedStateMachine):
        setup: Setup
        ours_loader: Any = None
        torch_loader: Any = None
        ours: Iterator[Any] | None = None
        theirs: Iterator[Any] | None = None
        children_before: frozenset[int] = frozenset()

        @initialize(setup=drawn)
        def start(self, setup: Setup) -> None:
            from statecore import DataLoader

            self.children_before = frozenset(child_processes())
            self.setup = setup
            dataset = setup.dataset()
            self.ours_loader = DataLoader(dataset, **setup.loader_arguments(), executor=executor)
            self.torch_loader = torch.utils.data.DataLoader(dataset, **setup.loader_arguments())
            self.epoch = 0
            self.ours_got: list[Outcome] = []
            self.torch_got: list[Outcome] = []

        # --- rules -----------------------------------------------------------------------------

        @rule()
        def take_next_batch(self) -> None:
            if self.ours is None:
                self._start_epoch()
            self._step()

        @rule()
        def break_out_and_start_next_epoch(self) -> None:
            if self.ours is not None:
                self._compare(finished=False)
            self._drop_epoch()
            self._start_epoch()

        @rule()
        def run_rest_of_epoch(self) -> None:
            if self.ours is None:
                self._start_epoch()
            while self.ours is not None:
                self._step()

        @invariant()
        def scheduler_invariants_hold(self) -> None:
            driver = getattr(self.ours, "_driver", None)
            state = getattr(driver, "state", None)
            if state is not None and (broken := violations(state)):
                raise ConformanceError(f"the scheduler broke its invariants: {broken}")

        def teardown(self) -> None:
            self._drop_epoch()
            # A persistent iterator lives in its loader: it goes with the loader.
            stop_torch_workers(getattr(self.torch_loader, "_iterator", None))
            self.ours_loader = self.torch_loader = None
            if sys.exc_info()[1] is not None:
                # A check already failed: its traceback may hold the loaders; report that error.
                return
            left = surviving_children(self.children_before, exit_timeout)
            if left:
                raise ConformanceError(
                    f"child processes survive the loaders by {exit_timeout:.0f} s: {left}"
                )

        # --- helpers ---------------------------------------------------------------------------

        def _start_epoch(self) -> None:
            self.epoch += 1
            self.ours_got, self.torch_got = [], []
            self.ours = iter(self.ours_loader)
            self.theirs = iter(self.torch_loader)

        def _drop_epoch(self) -> None:
            # A persistent iterator serves the next epoch too: only a one-epoch one is stopped.
            if self.theirs is not getattr(self.torch_loader, "_iterator", None):
                stop_torch_workers(self.theirs)
            self.ours = self.theirs = None

        def _step(self) -> None:
            assert self.ours is not None and self.theirs is not None
            mine = take_outcome(self.ours)
            theirs = take_outcome(self.theirs)
            if mine is not None:
                self.ours_got.append(mine)
            if theirs is not None:
                self.torch_got.append(theirs)
            if mine is None or theirs is None:
                # The epoch ended for one: run the other out, so the report shows both whole.
                if mine is not None:
                    self.ours_got.extend(rest_of_epoch(self.ours))
                if theirs is not None:
                    self.torch_got.extend(rest_of_epoch(self.theirs))
                self._compare(finished=True)
                self._drop_epoch()
            else:
                self._compare(finished=False)

        def _compare(self, finished: bool) -> None:
            ours, theirs = self.ours_got, self.torch_got
            if self.setup.in_order:
                same = ours == theirs  # every prefix too, so check as the epoch goes
            elif finished:
                same = collections.Counter(ours) == collections.Counter(theirs)
            else:
                return  # out of order: only the whole epoch must match
            if not same:
                order = "in order" if self.setup.in_order else "any order"
                state = "finished" if finished else "unfinished"
                raise ConformanceError(
                    f"epoch {self.epoch} ({state}, {order}) differs from torch's\n"
                    f"  statecore, executor={executor!r}: {ours}\n"
                    f"  torch:                         {theirs}"
                )

    ExecutorMachine.__name__ = ExecutorMachine.__qualname__ = f"ExecutorMachine[{executor!r}]"
    return ExecutorMachine
