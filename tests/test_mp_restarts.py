"""Worker processes that come and go: a killed or hung mp worker replaced mid-epoch, exactly.

With `worker_restarts=N` a worker process that dies (SIGKILL) or hangs past `worker_timeout`
is replaced in its slot, set up as the lost one was (worker id, seed, `worker_init_fn`, the
epoch's seed, its dataset where its last answer left it), and the epoch's batches equal those of
torch's own DataLoader run without the fault. The user is told once per restart, with the
worker, its pid and how it ended (for a hang, the dataset's line it hung on); nothing of the
lost process is left behind. Past N restarts the loader fails naming every loss.

The faults are the datasets' own doing, once: marker files in the test's directory count the
loads of the chosen index across processes, so a replacement loads it again unharmed. A hang is
`threading.Event().wait()`, the dataset's behaviour under test, not a synchronisation.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import Augmented
from _launch import launch
from _processes import Snapshot, faulted, load_number, wait_no_leaks
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import statecore
from statecore import (
    ReplaceWorker,
    SendTask,
    TaskCompleted,
    WorkerDiedError,
    WorkerHungError,
    WorkerRestartedWarning,
    WorkerStarted,
)
from statecore.executors import pinned
from statecore.executors._mp import MultiprocessExecutor
from statecore.executors._protocol import capabilities_of
from statecore.executors._registry import BUILT_IN

pytestmark = pytest.mark.timeout(120)

# Bounded waits on loaded two-core machines: generous, and they return as soon as they can.
GONE_WITHIN = 30.0

METHODS = [
    "fork",
    pytest.param("spawn", marks=pytest.mark.exhaustive),
    pytest.param("forkserver", marks=pytest.mark.exhaustive),
]

_INIT: list[int] = []
"""What `mark_init` set in this worker process: that the replacement ran worker_init_fn."""


def mark_init(worker_id: int) -> None:
    _INIT[:] = [1000 + worker_id]


def _fault(marker: Path | None, faults: tuple[int, ...], how: str) -> None:
    """Kill or hang this process on the loads of the chosen index that `faults` numbers."""
    if marker is None or load_number(marker) not in faults:
        return
    info = get_worker_info()
    Path(f"{marker}-{how}-{os.getpid()}").write_text(str(None if info is None else info.id))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait()  # hangs here


class Probe(Dataset):  # type: ignore[type-arg]
    """Item i is [i, worker id, worker seed, what worker_init_fn set]: what a worker set up as
    torch's shows. Loading `index` faults (`how`: "kill" or "hang") on the loads `faults`
    numbers, counted across processes by files next to `marker`; no marker, no fault."""

    def __init__(
        self,
        n: int,
        index: int = 17,
        marker: Path | None = None,
        faults: tuple[int, ...] = (1,),
        how: str = "kill",
    ) -> None:
        self.n, self.index, self.marker, self.faults, self.how = n, index, marker, faults, how

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.index:
            _fault(self.marker, self.faults, self.how)
        info = get_worker_info()
        assert info is not None
        init = _INIT[0] if _INIT else -1
        return torch.tensor([i, info.id, info.seed % (1 << 31), init])


class AugmentedKilled(Augmented):
    """Augmented (a map-style dataset with a state: its generator), whose worker loading
    `index` is killed on the loads `faults` numbers (with a marker)."""

    def __init__(self, n: int, index: int, marker: Path, faults: tuple[int, ...] = (1,)) -> None:
        super().__init__(n)
        self.index, self.marker, self.faults = index, marker, faults

    def __getitem__(self, index: int) -> list[int]:
        if index == self.index:
            _fault(self.marker, self.faults, "kill")
        return super().__getitem__(index)


class Positions:
    """An iterator over items that says where it is (torchdata's Stateful protocol)."""

    def __init__(self, items: list[int], dataset: ShardKilled) -> None:
        self.items, self.at, self.dataset = items, 0, dataset

    def __iter__(self) -> Positions:
        return self

    def __next__(self) -> int:
        if self.at >= len(self.items):
            raise StopIteration
        item = self.items[self.at]
        self.dataset.check(item)
        self.at += 1
        return item

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


class ShardKilled(IterableDataset):  # type: ignore[type-arg]
    """This worker's share of range(n), dealt round by worker id; the worker reading `item`
    the first time is killed (with a marker). `stateful`: its iterator keeps its position
    (`Positions`); otherwise a plain generator, which a replacement fast-forwards."""

    def __init__(self, n: int, item: int, marker: Path | None, stateful: bool) -> None:
        self.n, self.item, self.marker, self.stateful = n, item, marker, stateful

    def check(self, item: int) -> None:
        if item == self.item:
            _fault(self.marker, (1,), "kill")

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        items = list(range(self.n))
        if info is not None:
            items = items[info.id :: info.num_workers]
        if self.stateful:
            return Positions(items, self)
        return self._plain(items)

    def _plain(self, items: list[int]) -> Iterator[int]:
        for item in items:
            self.check(item)
            yield item


def torch_batches(dataset: Any, epochs: int = 1, **options: Any) -> list[list[torch.Tensor]]:
    """torch's own DataLoader's batches, epoch by epoch, from seed 0."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(dataset, **options)
    return [list(loader) for _ in range(epochs)]


def our_batches(
    dataset: Any, epochs: int = 1, **options: Any
) -> tuple[list[list[torch.Tensor]], list[str]]:
    """statecore's batches, epoch by epoch, from seed 0, and its restart warnings' texts."""
    torch.manual_seed(0)
    loader = statecore.DataLoader(dataset, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [list(loader) for _ in range(epochs)]
    del loader
    told = [str(w.message) for w in caught if issubclass(w.category, WorkerRestartedWarning)]
    return batches, told


def equal(a: Any, b: Any) -> bool:
    """Whether two batches hold the same tensors (dtype and values), in the same structure."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return bool(a == b)


def assert_same(ours: list[list[Any]], theirs: list[list[Any]]) -> None:
    assert len(ours) == len(theirs)
    for epoch, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
        assert len(mine) == len(torchs), f"epoch {epoch}"
        for batch, (a, b) in enumerate(zip(mine, torchs, strict=True)):
            assert equal(a, b), f"epoch {epoch}, batch {batch}: {a} != {b}"


@pytest.fixture
def settled(request: pytest.FixtureRequest) -> Snapshot:
    """What this process holds once the start method's own helpers (a fork server, a resource
    tracker) run: one small epoch first, so that they are not counted as leaks. Under the
    test's `method` parameter, fork if it has none."""
    callspec = getattr(request.node, "callspec", None)
    method = "fork" if callspec is None else callspec.params.get("method", "fork")
    assert len(list(statecore.DataLoader(Probe(2), num_workers=1, multiprocessing_context=method)))
    return Snapshot.take()


def line_of(text: str) -> int:
    """The line of this file that is `text` (once), indented."""
    lines = Path(__file__).read_text().splitlines()
    found = [number for number, line in enumerate(lines, 1) if line.strip() == text]
    assert len(found) == 1, found
    return found[0]


# --- a worker killed -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_a_killed_worker_is_replaced_and_the_epoch_equals_torchs(
    method: str, tmp_path: Path, settled: Snapshot
) -> None:
    marker = tmp_path / "load"
    options = dict(batch_size=2, num_workers=2, worker_init_fn=mark_init)
    ours, told = our_batches(
        Probe(40, marker=marker),
        worker_restarts=1,
        multiprocessing_context=method,
        **options,
    )
    assert_same(ours, torch_batches(Probe(40), **options))
    [(pid, worker)] = faulted(marker, "kill")
    assert len(told) == 1, told
    assert f"worker {worker} (pid {pid})" in told[0]
    assert "signal 9" in told[0]
    assert wait_no_leaks(settled, GONE_WITHIN, [pid]) == []


@pytest.mark.parametrize("method", METHODS)
def test_persistent_workers_replaced_in_the_second_epoch_give_three_exact_epochs(
    method: str, tmp_path: Path, settled: Snapshot
) -> None:
    # Index 17's second load is in the second epoch: the replacement starts in that epoch.
    marker = tmp_path / "load"
    options = dict(
        batch_size=2, num_workers=2, shuffle=True, persistent_workers=True, worker_init_fn=mark_init
    )
    ours, told = our_batches(
        Probe(40, marker=marker, faults=(2,)),
        epochs=3,
        worker_restarts=1,
        multiprocessing_context=method,
        **options,
    )
    assert_same(ours, torch_batches(Probe(40), epochs=3, **options))
    [(pid, worker)] = faulted(marker, "kill")
    assert len(told) == 1, told
    assert f"worker {worker} (pid {pid})" in told[0]
    assert wait_no_leaks(settled, GONE_WITHIN, [pid]) == []


def test_restarts_spent_fail_the_loader_naming_every_death(tmp_path: Path) -> None:
    marker = tmp_path / "load"
    loader = statecore.DataLoader(
        Probe(40, marker=marker, faults=(1, 2)),
        batch_size=2,
        num_workers=2,
        worker_restarts=1,
        multiprocessing_context="fork",
    )
    with (
        warnings.catch_warnings(record=True),
        pytest.raises(WorkerDiedError) as raised,
    ):
        warnings.simplefilter("always")
        list(loader)
    deaths = faulted(marker, "kill")
    assert len(deaths) == 2
    message = str(raised.value)
    for pid, _ in deaths:
        assert f"pid {pid}" in message, message
    assert "worker_restarts" in message


# --- a worker hung -------------------------------------------------------------------------------

HANG_LINE = line_of("threading.Event().wait()  # hangs here")


def test_a_hung_worker_is_replaced_and_the_warning_shows_where_it_hung(
    tmp_path: Path, settled: Snapshot
) -> None:
    marker = tmp_path / "load"
    options = dict(batch_size=2, num_workers=2, worker_init_fn=mark_init)
    ours, told = our_batches(
        Probe(40, marker=marker, how="hang"),
        worker_restarts=1,
        worker_timeout=2,
        multiprocessing_context="fork",
        **options,
    )
    assert_same(ours, torch_batches(Probe(40), **options))
    [(pid, worker)] = faulted(marker, "hang")
    assert len(told) == 1, told
    assert f"worker {worker} (pid {pid})" in told[0]
    assert f'File "{__file__}", line {HANG_LINE}, in _fault' in told[0], told[0]
    assert wait_no_leaks(settled, GONE_WITHIN, [pid]) == []


def test_a_hung_worker_without_restarts_fails_with_where_it_hung(tmp_path: Path) -> None:
    marker = tmp_path / "load"
    loader = statecore.DataLoader(
        Probe(40, marker=marker, how="hang"),
        batch_size=2,
        num_workers=2,
        worker_timeout=2,
        multiprocessing_context="fork",
    )
    with pytest.raises(WorkerHungError) as raised:
        list(loader)
    [(pid, _)] = faulted(marker, "hang")
    assert raised.value.pid == pid
    message = str(raised.value)
    assert f'File "{__file__}", line {HANG_LINE}, in _fault' in message, message
    assert "threading.Event().wait()" in message


# --- iterable datasets ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "fast-forwarded"])
def test_an_iterable_worker_killed_mid_shard_loses_and_repeats_nothing(
    stateful: bool, method: str, tmp_path: Path, settled: Snapshot
) -> None:
    marker = tmp_path / "load"
    options = dict(batch_size=2, num_workers=2)
    ours, told = our_batches(
        ShardKilled(40, 17, marker, stateful),
        worker_restarts=1,
        multiprocessing_context=method,
        **options,
    )
    assert_same(ours, torch_batches(ShardKilled(40, 17, None, stateful), **options))
    [(pid, worker)] = faulted(marker, "kill")
    assert len(told) == 1, told
    assert f"worker {worker} (pid {pid})" in told[0]
    assert wait_no_leaks(settled, GONE_WITHIN, [pid]) == []


def test_a_map_style_dataset_with_a_state_is_restored_in_the_replacement(tmp_path: Path) -> None:
    # Each answer carries the dataset's state after it: the replacement loads the last one the
    # main process recorded, and draws on where the lost worker's generator stood.
    options = dict(batch_size=2, num_workers=2)
    ours, told = our_batches(
        AugmentedKilled(40, 17, tmp_path / "load"),
        worker_restarts=1,
        multiprocessing_context="fork",
        **options,
    )
    assert_same(ours, torch_batches(Augmented(40), **options))
    assert len(told) == 1, told


def test_a_persistent_worker_lost_before_its_first_answer_of_an_epoch_keeps_its_state(
    tmp_path: Path,
) -> None:
    # Index 0's second load is worker 0's first task of the second epoch: it dies having
    # answered nothing of that epoch. Its replacement's generator goes on from where the lost
    # worker's stood as the epoch began (its last answer of the first), not from its seed.
    options = dict(batch_size=2, num_workers=2, persistent_workers=True)
    ours, told = our_batches(
        AugmentedKilled(40, 0, tmp_path / "load", faults=(2,)),
        epochs=3,
        worker_restarts=1,
        multiprocessing_context="fork",
        **options,
    )
    assert_same(ours, torch_batches(Augmented(40), epochs=3, **options))
    [(_, worker)] = faulted(tmp_path / "load", "kill")
    assert worker == 0
    assert len(told) == 1, told


class KillsOnLoad:
    """A datapipe's map function: the identity, except that the process mapping `item` on the
    loads `faults` numbers is killed (with a marker)."""

    def __init__(self, item: int, marker: Path, faults: tuple[int, ...]) -> None:
        self.item, self.marker, self.faults = item, marker, faults

    def __call__(self, item: int) -> int:
        if item == self.item:
            _fault(self.marker, self.faults, "kill")
        return item


def test_a_datapipe_worker_replaced_in_a_later_epoch_shuffles_with_that_epochs_seed(
    tmp_path: Path,
) -> None:
    from torch.utils.data.datapipes.iter import IterableWrapper

    def pipe(marker: Path | None) -> Any:
        shuffled = IterableWrapper(range(40)).shuffle().sharding_filter()
        return shuffled if marker is None else shuffled.map(KillsOnLoad(17, marker, (2,)))

    options = dict(batch_size=2, num_workers=2, persistent_workers=True)
    ours, told = our_batches(
        pipe(tmp_path / "load"),
        epochs=3,
        worker_restarts=1,
        multiprocessing_context="fork",
        **options,
    )
    assert_same(ours, torch_batches(pipe(None), epochs=3, **options))
    assert len(told) == 1, told


# --- the executor itself -------------------------------------------------------------------------


def test_a_replacement_answers_first_that_it_started_then_under_its_incarnation() -> None:
    executor = MultiprocessExecutor(launch(Probe(8), 1))
    executor.start()
    try:
        executor.dispatch(SendTask(0, 0, [0]))
        first = executor.poll(60)
        executor.confirm()
        assert type(first) is TaskCompleted and first.incarnation == 0
        # Replaced while alive, with answers of its own on their way: none of them, and no
        # death of it, is reported after its replacement's start.
        for task in (1, 2, 3):
            executor.dispatch(SendTask(0, task, [task]))
        executor.replace(ReplaceWorker(0, 1, 0), None)
        started = executor.poll(60)
        executor.confirm()
        assert started == WorkerStarted(0, 1)
        executor.dispatch(SendTask(0, 1, [1]))
        answer = executor.poll(60)
        executor.confirm()
        assert type(answer) is TaskCompleted
        assert (answer.task, answer.incarnation) == (1, 1)
        assert answer.payload[0].tolist() == [1, 0, 0, -1]
    finally:
        executor.shutdown()


def test_pinned_over_mp_replaces_a_killed_worker(tmp_path: Path) -> None:
    pinned_batches: list[int] = []

    def pin(batch: Any) -> Any:
        pinned_batches.append(1)
        return batch

    executor = pinned("mp", pin=pin)
    marker = tmp_path / "load"
    options = dict(batch_size=2, num_workers=2)
    ours, told = our_batches(
        Probe(40, marker=marker),
        worker_restarts=1,
        multiprocessing_context="fork",
        executor=executor,
        **options,
    )
    assert_same(ours, torch_batches(Probe(40), **options))
    assert len(told) == 1
    assert len(pinned_batches) >= 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_pin_memory_over_mp_replaces_a_killed_worker_and_pins_every_batch(
    tmp_path: Path,
) -> None:
    options = dict(batch_size=2, num_workers=2, pin_memory=True)
    ours, told = our_batches(
        Probe(40, marker=tmp_path / "load"),
        worker_restarts=1,
        multiprocessing_context="fork",
        **options,
    )
    assert all(batch.is_pinned() for batch in ours[0])
    assert_same(ours, torch_batches(Probe(40), **options))
    assert len(told) == 1, told


def test_the_mp_executor_declares_that_it_replaces_and_kills_workers() -> None:
    for declarer in (MultiprocessExecutor, BUILT_IN["mp"][0]):
        declared = capabilities_of(declarer)
        assert declared.replaces_workers and declared.kills_stuck_workers


def test_a_worker_not_listening_yet_is_reported_starting_not_stuck(tmp_path: Path) -> None:
    # A spawned worker importing its modules has not written its stack file's header: the
    # driver then watches it again instead of replacing it (tests/test_driver_restarts.py).
    from statecore.executors._mp import stacks

    path = str(tmp_path / "stack-0-0")
    assert not stacks.listening(path)
    Path(path).write_text("")
    assert not stacks.listening(path)
    Path(path).write_text("listening\n")  # what a worker's `stacks.listen` writes first
    assert stacks.listening(path)
