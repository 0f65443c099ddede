"""However broken a worker's exception is, it reaches the consumer in its batch's turn.

An exception whose `__str__` or `__repr__` raises, that cannot be pickled, that cannot be built
from a message, whose type exists only in the worker or in a local scope: each is raised in the
main process, in the turn of the batch that failed, as an error that names its type, the worker,
the worker's pid, the dataset index and carries the worker's traceback. The worker lives on and
the rest of the epoch is delivered, as for any exception in torch.

Items are (index, pid of the worker), which is how the tests see that the worker that raised is
the one that delivers its later batches. With two workers, batches of one and batches in order,
index i is worker i % 2's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import multiprocess
import pytest
from _datasets import UnsendableAt
from torch.utils.data import Dataset

import statecore
from statecore import WorkerDiedError

pytestmark = pytest.mark.timeout(180)

FAILS_AT = 3  # worker 1's second index


# --- broken exceptions -------------------------------------------------------------------------


class StrFails(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ of this exception fails")


class NothingPrints(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ of this exception fails")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ of this exception fails")


class HoldsALock(Exception):
    """Its instances cannot be pickled: they hold a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class KeywordOnly(Exception):
    """Cannot be built from a message: its only argument is keyword-only."""

    def __init__(self, *, code: int) -> None:
        super().__init__(f"failed with code {code}")
        self.code = code


class ReduceFails(Exception):
    def __reduce__(self) -> Any:
        raise RuntimeError("__reduce__ of this exception fails")


class IgnoresItsMessage(Exception):
    """Built from any message, it says the same thing: the worker's story would be lost."""

    def __str__(self) -> str:
        return "something went wrong"


def local_type() -> type[Exception]:
    class LocalError(Exception):
        pass

    return LocalError


WORKER_ONLY = "statecore_test_worker_only_errors"


def define_worker_only_type(worker_id: int) -> None:
    """A worker_init_fn: an exception type in a module only the worker has."""
    module = types.ModuleType(WORKER_ONLY)
    exec("class WorkerOnlyError(Exception):\n    pass\n", module.__dict__)
    sys.modules[WORKER_ONLY] = module


def worker_only_type() -> type[Exception]:
    error: type[Exception] = sys.modules[WORKER_ONLY].WorkerOnlyError  # type: ignore[attr-defined]
    return error


# What each shape raises, and the type the consumer gets: the original type where an instance
# of it can be built from a message and says that message, RuntimeError otherwise.
SHAPES: dict[str, tuple[Callable[[], BaseException], str, type[BaseException]]] = {
    "str-fails": (lambda: StrFails("hidden"), "StrFails", RuntimeError),
    "nothing-prints": (lambda: NothingPrints("hidden"), "NothingPrints", RuntimeError),
    "unpicklable": (lambda: HoldsALock("marker-lock"), "HoldsALock", HoldsALock),
    "keyword-only-init": (lambda: KeywordOnly(code=7), "KeywordOnly", RuntimeError),
    "reduce-fails": (lambda: ReduceFails("marker-reduce"), "ReduceFails", ReduceFails),
    "ignores-message": (lambda: IgnoresItsMessage("x"), "IgnoresItsMessage", RuntimeError),
    "local-type": (
        lambda: local_type()("marker-local"),
        "local_type.<locals>.LocalError",
        RuntimeError,
    ),
    "worker-only-type": (
        lambda: worker_only_type()("marker-only"),
        "WorkerOnlyError",
        RuntimeError,
    ),
}


class Raising(Dataset):  # type: ignore[type-arg]
    """Item i is (i, pid); item `at` raises the exception of the shape named `shape`."""

    def __init__(self, n: int, at: int, shape: str) -> None:
        self.n, self.at, self.shape = n, at, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int]:
        if index == self.at:
            raise SHAPES[self.shape][0]()
        return index, os.getpid()


def epoch(loader: Any) -> list[Any]:
    """Every next() of one epoch: (index, pid) of each batch, or the exception raised."""
    seen: list[Any] = []
    iterator = iter(loader)
    while True:
        try:
            index, pid = next(iterator)
        except StopIteration:
            return seen
        except Exception as error:
            seen.append(error.with_traceback(None))
            if isinstance(error, WorkerDiedError):
                return seen
        else:
            seen.append((int(index), int(pid)))


def assert_reported(error: BaseException, type_name: str, worker: int, pid: int, index: int):
    text = str(error)
    assert f"Caught {type_name} in DataLoader worker {worker} (pid {pid})" in text, text
    assert f"at dataset index {index}" in text, text
    assert "Original traceback" in text, text
    assert "in __getitem__" in text, text  # the worker's own frames


def assert_epoch_goes_on(seen: list[Any], n: int, at: int) -> BaseException:
    """Every other index delivered in order by live workers; the error in `at`'s turn."""
    assert len(seen) == n, seen
    error = seen[at]
    assert isinstance(error, BaseException), seen
    delivered = seen[:at] + seen[at + 1 :]
    assert [index for index, _ in delivered] == [i for i in range(n) if i != at], seen
    pids = {index: pid for index, pid in delivered}
    # Each worker delivered every one of its indices, before and after the error, itself.
    for worker in (0, 1):
        assert len({pids[i] for i in pids if i % 2 == worker}) == 1, seen
    return error


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_broken_exception_is_raised_in_its_turn_and_the_epoch_goes_on(shape: str) -> None:
    _, type_name, expected = SHAPES[shape]
    loader = statecore.DataLoader(
        Raising(8, FAILS_AT, shape),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=define_worker_only_type,
    )
    seen = epoch(loader)
    error = assert_epoch_goes_on(seen, 8, FAILS_AT)
    assert type(error) is expected, error
    assert_reported(error, type_name, 1, seen[1][1], FAILS_AT)


@pytest.mark.exhaustive
@pytest.mark.parametrize("shape", ["nothing-prints", "local-type"])
def test_a_broken_exception_from_a_spawned_worker_is_raised_and_the_epoch_goes_on(
    shape: str,
) -> None:
    _, type_name, expected = SHAPES[shape]
    loader = statecore.DataLoader(
        Raising(6, FAILS_AT, shape), batch_size=None, num_workers=2, multiprocessing_context="spawn"
    )
    seen = epoch(loader)
    error = assert_epoch_goes_on(seen, 6, FAILS_AT)
    assert type(error) is expected, error
    assert_reported(error, type_name, 1, seen[1][1], FAILS_AT)


def test_the_text_of_an_exception_whose_str_fails_says_so_and_keeps_the_traceback() -> None:
    loader = statecore.DataLoader(
        Raising(4, 0, "str-fails"), batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    seen = epoch(loader)
    text = str(seen[0])
    assert "__str__ of this exception fails" in text  # why the message is missing
    assert "SHAPES[self.shape][0]()" in text  # the line that raised, from the traceback
    assert [item[0] for item in seen[1:]] == [1, 2, 3]


def unprintable_init(worker_id: int) -> None:
    raise NothingPrints("hidden")


def test_a_worker_init_fn_exception_that_cannot_print_is_raised_for_its_worker() -> None:
    loader = statecore.DataLoader(
        Raising(4, -1, "str-fails"),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=unprintable_init,
    )
    iterator = iter(loader)
    with pytest.raises(RuntimeError) as caught:
        next(iterator)
    text = str(caught.value)
    assert "Caught NothingPrints in DataLoader worker 0" in text
    assert "in worker_init_fn" in text
    assert "in unprintable_init" in text
    del caught, iterator


MAIN_SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    import statecore
    from torch.utils.data import Dataset


    class MainError(Exception):
        def __str__(self):
            raise RuntimeError("__str__ of this exception fails")


    class Raising(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, index):
            if index == 3:
                raise MainError()
            return index, os.getpid()


    if __name__ == "__main__":
        loader = statecore.DataLoader(
            Raising(), batch_size=None, num_workers=2, multiprocessing_context=sys.argv[1]
        )
        iterator = iter(loader)
        for _ in range(6):
            try:
                index, pid = next(iterator)
            except Exception as error:
                print("raised", type(error).__name__, repr(str(error)), flush=True)
            else:
                print("item", int(index), int(pid), flush=True)
    """
)


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.exhaustive)])
def test_an_exception_type_defined_in_main_is_raised_and_the_epoch_goes_on(
    tmp_path: Path, method: str
) -> None:
    script = tmp_path / "main_error.py"
    script.write_text(MAIN_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), method], capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout + done.stderr[-3000:]
    items = [line.split() for line in lines if line.startswith("item")]
    assert [int(item[1]) for item in items] == [0, 1, 2, 4, 5]
    pids = {int(item[1]): int(item[2]) for item in items}
    assert pids[5] == pids[1]  # worker 1 raised and lived on
    assert lines[3].startswith("raised RuntimeError")
    assert f"Caught MainError in DataLoader worker 1 (pid {pids[1]})" in lines[3]
    assert "at dataset index 3" in lines[3]
    assert "in __getitem__" in lines[3]


# --- sending the batch back --------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["nothing-prints", "local-type", "keyword-only-init"])
def test_a_batch_that_fails_to_pickle_with_a_broken_exception_is_raised_and_the_epoch_goes_on(
    shape: str,
) -> None:
    _, type_name, expected = SHAPES[shape]
    loader = statecore.DataLoader(
        UnsendableAt(8, FAILS_AT, SHAPES[shape][0]),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
    )
    seen = epoch(loader)
    error = assert_epoch_goes_on(seen, 8, FAILS_AT)
    assert type(error) is expected, error
    text = str(error)
    assert f"Caught {type_name} in DataLoader worker 1 (pid {seen[1][1]})" in text, text
    assert "while sending the batch back at dataset index 3" in text, text
    assert "in __reduce__" in text, text


def break_sending(worker_id: int) -> None:
    """A worker_init_fn: the worker's result pipe fails with an error no send expects."""

    def send_bytes(*args: Any, **kwargs: Any) -> None:
        raise SystemError("the result pipe is broken")

    multiprocess.connection.Connection.send_bytes = send_bytes


def test_a_worker_whose_sending_thread_breaks_is_reported_dead() -> None:
    # The sending thread cannot send anything: the worker must end, so that its death is
    # reported, rather than live on answering nothing (the timeout only bounds a regression).
    loader = statecore.DataLoader(
        Raising(4, -1, "str-fails"),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=break_sending,
        timeout=60,
    )
    iterator = iter(loader)
    with pytest.raises(WorkerDiedError) as caught:
        next(iterator)
    assert caught.value.exitcode == 1
    del caught, iterator
