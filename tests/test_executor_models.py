"""The models drive the real executors: statecore's DataLoader hands over what torch's does."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import weakref
from typing import Any

import pytest
import torch
import torch.utils.data
from _broken import Blanking
from _datasets import LoggingSampler
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import statecore
from statecore.executors._inline import InlineExecutor
from statecore.models.conformance import (
    ConformanceError,
    InjectedFailure,
    MapDataset,
    ShardedIterable,
    canonical,
    child_processes,
    executor_machine,
    setups,
    surviving_children,
)

# Every example starts real loaders (for "mp", real processes), so runs stay few and short.
# Settings on top of the loaded profile (ci: derandomized), so CI runs the same examples always.
CHEAP = settings(max_examples=15, stateful_step_count=6, deadline=None, derandomize=True)
MANY_WORKERS = "ignore:This DataLoader will create:UserWarning"


@pytest.mark.timeout(300)
def test_the_machine_takes_an_executor_factory() -> None:
    machine = executor_machine(
        InlineExecutor, in_process=True, setup_strategy=setups(in_process=True, shuffle=False)
    )
    run_state_machine_as_test(machine, settings=settings(CHEAP, max_examples=4))


# --- the checks can fail --------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_the_machine_catches_an_executor_that_corrupts_batches() -> None:
    machine = executor_machine(
        Blanking, in_process=True, setup_strategy=setups(in_process=True, shuffle=False)
    )
    finding = settings(CHEAP, max_examples=50, phases=[Phase.explicit, Phase.generate])
    with pytest.raises(ConformanceError, match="differs from torch's"):
        run_state_machine_as_test(machine, settings=finding)


_SLEEPERS: list[subprocess.Popen[bytes]] = []


class _Leaking(InlineExecutor):
    """A broken executor: it starts a process it never stops."""

    def start(self) -> None:
        super().start()
        _SLEEPERS.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))


@pytest.mark.timeout(300)
def test_the_machine_catches_an_executor_that_leaves_a_process_behind() -> None:
    machine = executor_machine(_Leaking, in_process=True, exit_timeout=0.5)
    finding = settings(CHEAP, max_examples=5, phases=[Phase.explicit, Phase.generate])
    try:
        with pytest.raises(ConformanceError, match="child processes survive"):
            run_state_machine_as_test(machine, settings=finding)
    finally:
        for sleeper in _SLEEPERS:
            sleeper.kill()
            sleeper.wait()


def test_the_machine_refuses_an_unknown_executor_name() -> None:
    with pytest.raises(ValueError, match="available executors"):
        executor_machine("no-such-executor")


# --- the pieces -----------------------------------------------------------------------------------


def test_the_datasets_pickle_and_fail_where_told() -> None:
    data = pickle.loads(pickle.dumps(MapDataset(4, failing=2)))
    assert [data[0], data[1], data[3]] == [0, 1, 3]
    with pytest.raises(InjectedFailure):
        data[2]
    shard = iter(pickle.loads(pickle.dumps(ShardedIterable((3,), failing=1))))
    assert next(shard) == 0
    with pytest.raises(InjectedFailure):
        next(shard)
    assert list(shard) == [2]  # the epoch goes on after the failure


@pytest.mark.parametrize("loader_class", [torch.utils.data.DataLoader, statecore.DataLoader])
def test_an_iterable_goes_on_after_its_failure_in_the_main_process(loader_class: Any) -> None:
    loader = loader_class(ShardedIterable((3,), failing=1), batch_size=None)
    iterator, got = iter(loader), []
    while True:
        try:
            got.append(next(iterator))
        except InjectedFailure:
            got.append("failed")
        except StopIteration:
            break
    assert got == [0, "failed", 2]  # the main process loads worker 0's shard


@pytest.mark.filterwarnings(MANY_WORKERS)
@pytest.mark.parametrize("in_process", [True, False])
@settings(CHEAP, max_examples=60)
@given(data=st.data())
def test_setups_are_valid_loader_arguments(in_process: bool, data: st.DataObject) -> None:
    setup = data.draw(setups(in_process))
    torch.utils.data.DataLoader(setup.dataset(), **setup.loader_arguments())
    assert (setup.num_workers == 0) == in_process
    if setup.iterable:
        assert len(setup.lengths) == max(1, setup.num_workers)
        assert not setup.shuffle


def test_batches_compare_by_value() -> None:
    assert canonical(torch.tensor([1, 2])) == canonical(torch.tensor([1, 2]))
    assert canonical(torch.tensor([1, 2])) != canonical(torch.tensor([1.0, 2.0]))
    assert canonical([torch.tensor([1]), {"a": 2}]) == canonical([torch.tensor([1]), {"a": 2}])


@pytest.mark.timeout(60)
def test_child_processes_are_seen_until_they_end() -> None:
    before = set(child_processes())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_processes()
        assert child.pid in surviving_children(before, timeout=0.1)
    finally:
        child.kill()
        child.wait()
    assert surviving_children(before, timeout=5) == {}


# --- bugs these models found (at 6633eee), kept as regression tests -----------------------------


@pytest.mark.parametrize("loader_class", [torch.utils.data.DataLoader, statecore.DataLoader])
def test_in_process_loading_draws_each_index_when_its_batch_is_asked_for(loader_class: Any) -> None:
    # Was: iter() drew the first index, and each next() the index of the batch after it.
    sampler = LoggingSampler(3)
    iterator = iter(loader_class(list(range(3)), sampler=sampler, batch_size=None))
    assert sampler.drawn == []
    next(iterator)
    assert sampler.drawn == [0]


def test_an_epoch_abandoned_at_once_shuffles_the_next_as_torch_does() -> None:
    # Was: the shuffled order was drawn when the epoch started rather than at its first next(),
    # so abandoning an epoch at once left the generator elsewhere than torch leaves it.
    def order(loader_class: Any) -> list[int]:
        generator = torch.Generator().manual_seed(2)
        loader = loader_class(list(range(8)), batch_size=None, shuffle=True, generator=generator)
        iter(loader)  # start an epoch and take nothing
        return list(loader)

    assert order(statecore.DataLoader) == order(torch.utils.data.DataLoader)


@pytest.mark.timeout(120)
def test_dropping_an_iterator_stops_its_workers_without_the_garbage_collector() -> None:
    # Was: the iterator sat in a reference cycle (iterator -> driver -> bound _next_index), so
    # its workers lived on until the cyclic collector ran, in whatever thread it ran in.
    before = set(child_processes())
    gc.disable()  # the point is what happens without the collector
    iterator = iter(statecore.DataLoader(list(range(4)), batch_size=None, num_workers=1))
    kept = weakref.ref(iterator)
    try:
        next(iterator)
        del iterator
        assert kept() is None, "the iterator outlives its last reference"
        assert surviving_children(before, timeout=10) == {}
    finally:
        leftover = kept()
        if leftover is not None:
            leftover._shutdown()  # type: ignore[attr-defined]
        del leftover
        gc.enable()
