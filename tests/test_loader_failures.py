"""A timeout or a dead worker ends the epoch with torch's error, without waiting on the worker.

Compared with torch's DataLoader as tests/_side_by_side.py says.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.utils.data
from _datasets import BlocksAt, ExitsAt
from _side_by_side import LOADERS, QUIET, WORKERS, as_lists, close

import statecore

pytestmark = QUIET


def first_failure(loader: Any) -> tuple[list[Any], BaseException]:
    """The batches loaded before the iterator failed, and its error."""
    iterator = iter(loader)
    batches: list[Any] = []
    try:
        for batch in iterator:
            batches.append(as_lists(batch))
    except Exception as error:
        return batches, error
    finally:
        close(iterator)
    raise AssertionError(f"the loader did not fail; it loaded {batches}")


def load_until_timeout(loader_class: type) -> tuple[list[Any], BaseException, float]:
    """Load until a worker stuck on index 2 makes the loader time out (timeout=0.5).

    Returns the batches before, the error, and the seconds from iter() to the error.
    """
    read, write = os.pipe()
    loader = loader_class(BlocksAt(8, 2, read), batch_size=None, num_workers=2, timeout=0.5)
    batches: list[Any] = []
    started = time.monotonic()
    iterator = iter(loader)
    try:
        for batch in iterator:
            batches.append(as_lists(batch))
    except Exception as error:
        return batches, error, time.monotonic() - started
    finally:
        os.write(write, b"xx")  # let the stuck worker go, if it is still there
        close(iterator)
        os.close(read)
        os.close(write)
    raise AssertionError(f"the loader did not time out; it loaded {batches}")


@WORKERS
def test_a_timeout_raises_torchs_error() -> None:
    batches, error, _ = load_until_timeout(statecore.DataLoader)
    expected_batches, expected, _ = load_until_timeout(torch.utils.data.DataLoader)
    assert batches == expected_batches
    assert isinstance(error, type(expected))
    assert str(error) == str(expected) == "DataLoader timed out after 0.5 seconds"


@pytest.mark.parametrize("loader_class", LOADERS)
@WORKERS
def test_a_timeout_is_raised_without_waiting_for_the_stuck_worker(loader_class: type) -> None:
    _, error, waited = load_until_timeout(loader_class)
    assert "timed out" in str(error)
    assert waited < 3.0  # torch raises after about 0.5 s; the bound leaves room for a busy host


@pytest.mark.parametrize("loader_class", LOADERS)
@WORKERS
def test_a_dead_worker_raises_a_runtime_error_like_torch(loader_class: type) -> None:
    batches, error = first_failure(loader_class(ExitsAt(8, 3), batch_size=None, num_workers=2))
    assert isinstance(error, RuntimeError)
    assert "exited unexpectedly" in str(error)
    assert batches == [0, 1, 2][: len(batches)]  # what came before the death, in order
