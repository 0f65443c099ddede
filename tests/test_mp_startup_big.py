"""Starting spawn and forkserver workers on a big dataset: pickled once, started side by side.

torch pickles the dataset once per worker, and writes each pickle into the new process's
arguments, which the process reads only once it has imported what they name: every start
waits for the one before (pytorch#139792). Here the setup is pickled once, by the C pickler
where it can, written once to a file of the executor's directory, and every worker reads that
file: starting one never waits for another, and a tensor's storage reaches every worker
through shared memory, not inside the pickle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, ClassVar

import multiprocess.process
import multiprocess.reduction
import pytest
import torch
from _processes import Snapshot, wait_no_leaks
from torch.utils.data import Dataset

import statecore
from statecore.executors._mp import executor as executor_module
from statecore.executors._mp import stacks
from statecore.executors._mp.executor import MultiprocessExecutor
from statecore.executors._mp.wire import Shipment, unpack_setup
from statecore.executors._worker import WorkerSetup

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),  # more workers than cores
]

GONE_WITHIN = 20.0


class CountsPickles(Dataset):  # type: ignore[type-arg]
    """Counts, in the process that made it, how often it was pickled; item i is i."""

    pickled: ClassVar[int] = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __getstate__(self) -> dict[str, Any]:
        CountsPickles.pickled += 1
        return {"n": self.n}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def test_the_dataset_is_pickled_once_however_many_workers_start() -> None:
    CountsPickles.pickled = 0
    loader = statecore.DataLoader(
        CountsPickles(16), batch_size=2, num_workers=4, multiprocessing_context="forkserver"
    )
    assert [int(x) for batch in loader for x in batch] == list(range(16))
    assert CountsPickles.pickled == 1


def setup_of(dataset: object, collate_fn: Any = None) -> WorkerSetup:
    return WorkerSetup(
        dataset=dataset,
        dataset_kind=0,
        auto_collation=True,
        collate_fn=collate_fn,
        drop_last=False,
        base_seed=1,
        num_workers=2,
    )


class Tensors(Dataset):  # type: ignore[type-arg]
    """A 32 MiB tensor and a Python index over its rows."""

    def __init__(self) -> None:
        self.data = torch.zeros(2**13, 2**10, dtype=torch.float32)
        self.index = {f"row-{row}": row for row in range(2**13)}

    def __len__(self) -> int:
        return 2**13

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[self.index[f"row-{index}"]]


def test_a_dataset_tensor_reaches_each_worker_as_a_shared_memory_handle_not_as_bytes() -> None:
    dataset = Tensors()
    shipment = Shipment.pack(setup_of(dataset))
    assert shipment.by_name, "a module-level dataset went to dill"
    first, second = shipment.for_worker()[1], shipment.for_worker()[1]
    # The pickle holds the index; the tensor's 32 MiB went to shared memory, once, and each
    # worker gets a handle of its own to the same memory.
    assert len(shipment.setup) + len(first) + len(second) < dataset.data.nbytes // 100
    assert dataset.data.is_shared()
    unpacked = unpack_setup(shipment.setup, first)
    assert unpacked.dataset.index == dataset.index
    assert torch.equal(unpacked.dataset.data, dataset.data)
    # Written to from here, the memory the handle maps changes there too: the same pages.
    dataset.data[5, 7] = 3.0
    assert float(unpacked.dataset.data[5, 7]) == 3.0


def test_a_setup_holding_code_without_a_findable_name_is_pickled_by_dill() -> None:
    shipment = Shipment.pack(setup_of(CountsPickles(3), collate_fn=lambda batch: len(batch)))
    assert not shipment.by_name
    unpacked = unpack_setup(*shipment.for_worker())
    assert unpacked.collate_fn is not None and unpacked.collate_fn([1, 2]) == 2
    assert unpacked.dataset.n == 3


def script_class(base: type, name: str) -> type:
    """A class as a script's `__main__` defines it, adding nothing to `base`: only dill can send
    it (a worker started by spawn may not have it)."""
    return type(name, (base,), {"__module__": "__main__", "__qualname__": name})


def test_a_script_dataset_that_inherits_every_method_keeps_its_parents_in_the_worker() -> None:
    # Every torch dataset inherits `__orig_bases__` from Dataset(Generic[T_co]); dill 0.4.1
    # rebuilt such a class from the inherited value, without the parent that holds its methods.
    Labelled = script_class(torch.utils.data.TensorDataset, "Labelled")
    shipment = Shipment.pack(setup_of(Labelled(torch.arange(4))))
    assert not shipment.by_name
    unpacked = unpack_setup(*shipment.for_worker()).dataset
    assert type(unpacked) is not Labelled  # rebuilt from its pickle, as a worker would
    assert isinstance(unpacked, torch.utils.data.TensorDataset)
    assert [int(unpacked[i][0]) for i in range(len(unpacked))] == [0, 1, 2, 3]
    assert "__orig_bases__" not in Labelled.__dict__  # the user's class is left as it was


@pytest.mark.timeout(180)
def test_a_spawned_worker_loads_a_script_dataset_whose_methods_are_all_inherited(
    tmp_path: Any,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, statecore\n"
        "from torch.utils.data import TensorDataset\n"
        "class Labelled(TensorDataset):\n"
        "    pass\n"
        "if __name__ == '__main__':\n"
        "    loader = statecore.DataLoader(Labelled(torch.arange(8)), batch_size=4,\n"
        "        num_workers=2, multiprocessing_context='spawn')\n"
        "    print([batch[0].tolist() for batch in loader])\n"
    )
    ran = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip().splitlines()[-1] == "[[0, 1, 2, 3], [4, 5, 6, 7]]"


def test_a_workers_process_arguments_hold_no_dataset_whatever_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a new process's arguments hold goes through a pipe that the process reads only once
    # it has imported what they name: a start writing megabytes there waits for those imports.
    written: list[int] = []
    dump = multiprocess.reduction.dump

    def measured(obj: object, file: Any, protocol: int | None = None) -> None:
        before = file.tell()
        dump(obj, file, protocol)
        if isinstance(obj, multiprocess.process.BaseProcess):
            written.append(file.tell() - before)

    monkeypatch.setattr(multiprocess.reduction, "dump", measured)
    dataset = Tensors()
    loader = statecore.DataLoader(
        dataset, batch_size=64, num_workers=2, multiprocessing_context="forkserver"
    )
    assert len([batch for batch in loader]) == len(dataset) // 64
    assert len(written) == 2
    # The index alone pickles to over 100 kB, the tensor to 32 MiB.
    assert max(written) < 16 * 1024, f"process arguments of {written} bytes"


class FailsInWorkers(Dataset):  # type: ignore[type-arg]
    """Unpickles in the process that made it, and fails to anywhere else."""

    def __init__(self) -> None:
        self.home = os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if os.getpid() != state["home"]:
            raise ValueError("this dataset cannot be unpickled in a worker")
        self.__dict__.update(state)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize(
    "method", ["forkserver", pytest.param("spawn", marks=pytest.mark.exhaustive)]
)
def test_a_worker_whose_dataset_fails_to_unpickle_is_named_and_nothing_leaks(method: str) -> None:
    # A loader first, so that what any loader opens once per process is not counted as a leak.
    assert list(statecore.DataLoader(range(2), num_workers=1, multiprocessing_context=method))
    before = Snapshot.take()
    loader = statecore.DataLoader(FailsInWorkers(), num_workers=2, multiprocessing_context=method)
    # Both workers fail; which death the loader meets first depends on the two processes'
    # timing, and the error names that one.
    with pytest.raises(RuntimeError, match=r"statecore worker [01]\b") as raised:
        list(loader)
    assert "exited" in str(raised.value) or "died" in str(raised.value)
    del loader, raised
    assert wait_no_leaks(before, GONE_WITHIN) == []


def still_importing(executor: MultiprocessExecutor) -> int:
    """The executor's workers started and not yet done importing (not listening for stack
    requests, the first thing a worker does once its modules are imported)."""
    home = executor.home
    if home is None:
        return 0
    return sum(
        not stacks.listening(stacks.stack_file(home.tempdir, worker, 0))
        for worker, process in executor.processes.items()
        if process.exitcode is None
    )


def test_spawn_workers_start_no_more_importing_at_once_than_cores_less_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two cores: one for the loader's process, so one worker imports at a time, and the one
    # that holds the first batch imports at full speed.
    monkeypatch.setattr(executor_module, "_cores", lambda: 2, raising=False)
    importing: list[int] = []
    start = MultiprocessExecutor._start_process

    def counted(self: MultiprocessExecutor, worker: int, restart: Any = None) -> None:
        importing.append(still_importing(self))
        start(self, worker, restart)

    monkeypatch.setattr(MultiprocessExecutor, "_start_process", counted)
    loader = statecore.DataLoader(
        range(8), batch_size=2, num_workers=2, multiprocessing_context="spawn"
    )
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert importing == [0, 0]
