"""A worker thread ended by SystemExit or KeyboardInterrupt is reported for what it is.

Such an exception, raised by the dataset or by worker_init_fn, ends the worker thread: it runs
none of the dataset's code after that. The consumer gets a WorkerDiedError, in the turn of the
task the worker had in hand, naming the worker thread and the exception (kept as the cause);
every later task of that worker fails the same way, and nothing waits for it.
"""

from __future__ import annotations

import pytest
from _datasets import FailsAt, Numbers
from _side_by_side import threaded

from statecore import WorkerDiedError

ENDINGS = [
    pytest.param(SystemExit(3), "SystemExit", id="SystemExit"),
    pytest.param(KeyboardInterrupt(), "KeyboardInterrupt", id="KeyboardInterrupt"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("error", "name"), ENDINGS)
def test_the_consumer_gets_an_error_naming_the_worker_thread_and_the_exception(
    error: BaseException, name: str
) -> None:
    received: list[int] = []
    with pytest.raises(WorkerDiedError) as raised:
        for batch in threaded(FailsAt(8, [5], error)):
            received.append(int(batch))
    assert received == [0, 1, 2, 3, 4]  # the error comes in the turn of index 5, worker 1's
    message = str(raised.value)
    assert "worker thread 1" in message
    assert name in message
    assert "dataset indices [5]" in message
    assert "out of memory" not in message
    assert raised.value.worker == 1
    assert raised.value.__cause__ is error


@pytest.mark.timeout(60)
def test_a_system_exit_code_is_the_errors_exit_code() -> None:
    with pytest.raises(WorkerDiedError) as raised:
        list(threaded(FailsAt(4, [0], SystemExit(3))))
    assert raised.value.exitcode == 3


@pytest.mark.timeout(60)
def test_the_other_workers_go_on_and_the_ended_workers_later_tasks_fail_too() -> None:
    outcomes: list[int | str] = []
    iterator = iter(threaded(FailsAt(8, [1], SystemExit(0))))
    while True:
        try:
            outcomes.append(int(next(iterator)))
        except StopIteration:
            break
        except WorkerDiedError as error:
            assert "worker thread 1" in str(error)
            outcomes.append("ended")
    assert outcomes == [0, "ended", 2, "ended", 4, "ended", 6, "ended"]


def exits_in_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        raise SystemExit(2)


@pytest.mark.timeout(60)
def test_a_system_exit_in_worker_init_fn_is_reported_in_that_workers_first_turn() -> None:
    received: list[int] = []
    with pytest.raises(WorkerDiedError, match=r"worker thread 1 .*SystemExit.*worker_init_fn"):
        for batch in threaded(Numbers(8), worker_init_fn=exits_in_worker_1):
            received.append(int(batch))
    assert received == [0]
