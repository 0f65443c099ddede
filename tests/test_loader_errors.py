"""A dataset's or worker_init_fn's exception reaches the consumer with its type, like torch's.

Compared with torch's DataLoader as tests/_side_by_side.py says.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import BadSample, FailsAt, Numbers, RaisesBadSample, failing_init
from _side_by_side import LOADERS, QUIET, WORKERS, as_lists, close, multiset

import statecore

pytestmark = QUIET

# A dataset's exception reaches the consumer in its batch's turn, with the dataset's exception
# type, and the epoch goes on with the next batch.


def outcomes(loader: Any) -> list[Any]:
    """Every batch of one epoch, with an error shown as [exception type name, first line]."""
    iterator = iter(loader)
    result: list[Any] = []
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return result
        except Exception as error:
            result.append([type(error).__name__, "bad index" in str(error)])
        else:
            result.append(as_lists(batch))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="in-process"),
        pytest.param({"num_workers": 2}, id="w2"),
        pytest.param({"num_workers": 3, "prefetch_factor": 1}, id="w3-p1"),
    ],
)
@WORKERS
def test_dataset_errors_come_in_their_turn_like_torchs(kwargs: dict[str, Any]) -> None:
    def run_with(loader_class: type) -> list[Any]:
        return outcomes(loader_class(FailsAt(13, [2, 5, 6]), batch_size=2, **kwargs))

    expected = run_with(torch.utils.data.DataLoader)
    assert run_with(statecore.DataLoader) == expected
    assert expected[1] == ["KeyError", True]


@WORKERS
def test_out_of_order_dataset_errors_are_torchs_in_some_order() -> None:
    def run_with(loader_class: type) -> Counter[str]:
        loader = loader_class(FailsAt(13, [2, 5]), batch_size=2, num_workers=2, in_order=False)
        return multiset(outcomes(loader))

    assert run_with(statecore.DataLoader) == run_with(torch.utils.data.DataLoader)


@WORKERS
def test_worker_init_fn_error_is_raised_with_its_type_like_torchs() -> None:
    def first_error(loader_class: type) -> tuple[type[BaseException], bool]:
        loader = loader_class(Numbers(6), num_workers=2, worker_init_fn=failing_init)
        iterator = iter(loader)
        try:
            next(iterator)
        except Exception as error:
            return type(error), "worker_init_fn failed in worker 0" in str(error)
        finally:
            close(iterator)
        raise AssertionError("worker_init_fn's error was not raised")

    expected = first_error(torch.utils.data.DataLoader)
    assert first_error(statecore.DataLoader) == expected
    assert expected == (RuntimeError, True)


@pytest.mark.parametrize("loader_class", LOADERS)
def test_in_process_loading_raises_the_datasets_own_exception(loader_class: type) -> None:
    loader = loader_class(RaisesBadSample(), batch_size=None)
    with pytest.raises(BadSample) as raised:
        next(iter(loader))
    assert raised.value.index == 0
    assert str(raised.value) == "bad sample 0"


class LooksUpInAnUnreachableStore(torch.utils.data.Dataset[int]):
    """Looks up the attributes it lacks in a store that no worker can reach: in a worker, every
    such lookup raises (statecore's own lookups too, as a worker starts), not AttributeError."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or torch.utils.data.get_worker_info() is None:
            raise AttributeError(name)
        raise OSError(f"the store is out of reach, looking up {name!r}")


@pytest.mark.parametrize("executor", ["mp", "thread"])
@WORKERS
def test_an_error_as_a_worker_starts_comes_with_its_first_task_wherever_it_runs(
    executor: str,
) -> None:
    # Every worker starts through one path: where a worker thread answers its first task with
    # the error, a worker process does too, rather than dying of it.
    loader = statecore.DataLoader(
        LooksUpInAnUnreachableStore(), batch_size=2, num_workers=1, executor=executor
    )
    iterator = iter(loader)
    try:
        with pytest.raises(OSError, match="the store is out of reach"):
            next(iterator)
    finally:
        close(iterator)
