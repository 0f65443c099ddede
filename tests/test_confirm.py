"""Executors keep each answer until the driver confirms it: an interrupt loses none, and none is
recorded twice (executors/_confirm.py, `Capabilities.confirms_answers`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _launch import launch

import statecore
from statecore import Event, ResumeWorker, SendTask, TaskCompleted, WorkerResumed
from statecore.executors import Capabilities, Declared, Executor, Launch
from statecore.executors._inline import InlineExecutor
from statecore.executors._mp import MultiprocessExecutor
from statecore.executors._pinned import PinnedExecutor
from statecore.executors._protocol import confirmer_of
from statecore.executors._registry import lookup
from statecore.executors._thread import ThreadExecutor
from statecore.models.loader import Forwarding

WAIT = 30.0


def _launch(workers: int) -> Launch:
    return launch(torch.arange(8), workers)


def _inline() -> Executor:
    return InlineExecutor(_launch(1))


def _pinned_inline() -> Executor:
    return PinnedExecutor(InlineExecutor(_launch(1)), lambda batch: batch, threaded=False)


def _pinned_thread() -> Executor:
    return PinnedExecutor(ThreadExecutor(_launch(1)), lambda batch: batch, threaded=True)


EXECUTORS: dict[str, Callable[[], Executor]] = {
    "inline": _inline,
    "thread": lambda: ThreadExecutor(_launch(1)),
    "mp": lambda: MultiprocessExecutor(_launch(1)),
    "pinned-inline": _pinned_inline,
    "pinned-thread": _pinned_thread,
}


def _answer(executor: Executor) -> Event:
    event = executor.poll(WAIT)
    assert event is not None, "no answer in time"
    return event


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_poll_gives_an_answer_again_until_it_is_confirmed(name: str) -> None:
    executor = EXECUTORS[name]()
    confirm = confirmer_of(executor)
    assert confirm is not None
    executor.start()
    try:
        executor.resume(ResumeWorker(0, 1))
        executor.dispatch(SendTask(0, 0, [3]))
        resumed = _answer(executor)
        assert type(resumed) is WorkerResumed
        # As after an interrupt that landed as poll returned: the same answer, not the next.
        assert _answer(executor) is resumed
        confirm()
        confirm()  # again, with no poll in between: as the driver does after an interrupt
        loaded = _answer(executor)
        assert type(loaded) is TaskCompleted and loaded.task == 0
        assert _answer(executor) is loaded
        confirm()
        assert executor.poll(0) is None
    finally:
        executor.shutdown()


class _ConfirmInterrupted(Forwarding):
    """An executor whose confirmation of the third batch is cut short by Ctrl-C before it
    takes effect: the scheduler's state holds the batch, and the executor still gives it."""

    def __init__(self, inner: Executor) -> None:
        super().__init__(inner)
        self.last: Event | None = None
        self.interrupted = False

    def poll(self, timeout: float | None) -> Event | None:
        self.last = super().poll(timeout)
        return self.last

    def confirm(self) -> None:
        last = self.last
        if not self.interrupted and type(last) is TaskCompleted and last.task == 2:
            self.interrupted = True
            raise KeyboardInterrupt("landed in confirm")
        super().confirm()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inner", ["inline", "thread"])
def test_an_interrupt_inside_confirm_neither_loses_nor_repeats_a_batch(inner: str) -> None:
    made: list[_ConfirmInterrupted] = []

    def factory(launch: Launch) -> Executor:
        made.append(_ConfirmInterrupted(lookup(inner)[0](launch)))
        return made[-1]

    capabilities = Capabilities(in_process=inner == "inline", confirms_answers=True)
    loader = statecore.DataLoader(
        torch.arange(6),
        batch_size=None,
        num_workers=0 if inner == "inline" else 2,
        executor=Declared(factory, capabilities),
    )
    got: list[int] = []
    interrupts = 0
    iterator: Iterator[Any] = iter(loader)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except KeyboardInterrupt:
            interrupts += 1
            continue
        got.append(int(batch))
    assert made[0].interrupted and interrupts == 1
    assert got == list(range(6))


class _DeclaresWithoutConfirm(InlineExecutor):
    """Declares that it confirms answers, as written for the protocol before `confirm()`."""

    confirm = None  # type: ignore[assignment]


def test_an_executor_declaring_confirmation_without_confirm_is_refused_before_it_starts() -> None:
    loader = statecore.DataLoader(torch.arange(3), executor=_DeclaresWithoutConfirm)
    with pytest.raises(TypeError, match=r"confirms_answers but has no method confirm\(\)"):
        iter(loader)
