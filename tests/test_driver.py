"""The driver loop (executors/_driver.py): what it gives the sampler, and its own state between
calls, taken and put back as one value."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from _launch import launch

from statecore import (
    Config,
    Deliver,
    EndEpoch,
    RaiseError,
    State,
    TaskCompleted,
    TaskFailure,
    Timeout,
    WorkerExhausted,
)
from statecore.executors import Driver
from statecore.executors._driver import Ledger, WorkerMarks, handed_task, restorer
from statecore.executors._inline import InlineExecutor
from statecore.executors._seeding import BatchSeeds

ROOT = Path(__file__).resolve().parent.parent


def _epoch(driver: Driver) -> list[int]:
    got = []
    while True:
        try:
            got.append(int(driver.next()))
        except StopIteration:
            return got


def _inline_driver(size: int, draw: Callable[[State], Any]) -> Driver:
    executor = InlineExecutor(launch(torch.arange(size), 1))
    executor.start()
    return Driver(Config(num_workers=1, prefetch_factor=1, lazy=True), executor, draw, timeout=0)


@pytest.mark.timeout(60)
def test_the_sampler_is_given_the_state_each_draw_is_asked_in() -> None:
    asked: list[State] = []
    indices = iter([[2], [0], [1]])

    def draw(state: State) -> Any:
        asked.append(state)
        return next(indices)

    driver = _inline_driver(3, draw)
    driver.start_epoch()
    assert _epoch(driver) == [2, 0, 1]
    # One state per draw, the last finding the sampler's end: each one asking for that draw.
    assert len(asked) == 4
    assert all(state.drawing_for is not None for state in asked)
    driver.close()


class _Interrupting(InlineExecutor):
    """Ctrl-C lands in the next poll once `armed`."""

    armed = False

    def poll(self, timeout: float | None) -> Any:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return super().poll(timeout)


@pytest.mark.timeout(60)
def test_a_driver_restored_from_a_snapshot_goes_on_where_the_first_stood() -> None:
    executor = _Interrupting(launch(torch.arange(4), 1))
    executor.start()
    indices = iter([[0], [1], [2], [3]])
    first = Driver(
        Config(num_workers=1, prefetch_factor=1), executor, lambda state: next(indices), 0
    )
    first.start_epoch()
    assert int(first.next()) == 0
    executor.armed = True
    with pytest.raises(KeyboardInterrupt):
        first.next()
    taken = first.snapshot()
    assert taken == first.snapshot()  # a value: taking it changes nothing
    second = Driver(
        Config(num_workers=1, prefetch_factor=1), executor, lambda state: next(indices), 0
    )
    second.restore(taken)
    assert second.snapshot() == taken
    assert _epoch(second) == [1, 2, 3]


@pytest.mark.timeout(60)
def test_a_restorer_makes_the_driver_a_new_one_restored_from_the_snapshot() -> None:
    executor = _Interrupting(launch(torch.arange(4), 1))
    executor.start()
    indices = iter([[0], [1], [2], [3]])

    def draw(state: State) -> Any:
        return next(indices)

    config = Config(num_workers=1, prefetch_factor=1)
    driver = Driver(config, executor, draw, 0, worker_timeout=30.0)
    restore = restorer(driver)
    driver.start_epoch()
    assert int(driver.next()) == 0
    taken = driver.snapshot()
    # What a call may leave outside the snapshot: a watch on a task, and the epoch's seeds.
    driver.watch = (1, 0, 30.0)
    driver.seeds = BatchSeeds(7)
    restore(taken)
    new = Driver(config, executor, draw, 0, worker_timeout=30.0)
    new.restore(taken)
    assert vars(driver) == vars(new)
    assert _epoch(driver) == [1, 2, 3]


def test_a_mark_becomes_its_workers_once_the_consumer_receives_its_task() -> None:
    marks = WorkerMarks.of({1: (4, "state")})
    marks = marks.answer(TaskCompleted(7, 0, None, (2, "zero")), base=5)
    marks = marks.answer(TaskCompleted(8, 1, None, (5, ...)), base=5)  # no state sent: ...
    assert marks.received == ((1, (4, "state")),)
    marks = marks.receive(8)
    # A mark without a state takes the worker's last one.
    assert marks.received == ((1, (5, "state")),)
    assert marks.receive(7).received == ((0, (2, "zero")), (1, (5, "state")))
    assert marks.receive(7).answered == ()


def test_a_stale_answer_is_never_received_but_moves_where_its_worker_was_left() -> None:
    marks = WorkerMarks().answer(TaskCompleted(3, 0, None, (1, None)), base=4)
    assert (marks.received, marks.answered, marks.recorded) == ((), (), ())
    assert marks.receive(3) == marks
    # Loaded after the break all the same: the worker's dataset went on into this epoch from it.
    assert marks.left == ((0, (1, None)),)
    assert marks.latest(0) is None


def test_the_latest_mark_is_the_last_answer_recorded_received_or_not() -> None:
    marks = WorkerMarks.of({1: (4, "state")})
    assert marks.latest(1) == (4, "state")  # nothing recorded yet: the received one
    assert marks.latest(0) is None
    marks = marks.answer(TaskCompleted(5, 1, None, (1, "one")), base=5)
    marks = marks.answer(TaskCompleted(6, 1, None, (2, ...)), base=5)
    # Not received, yet where worker 1's dataset stands; a mark without a state takes the
    # state of the worker's last answer.
    assert marks.latest(1) == (2, "one")
    assert marks.receive(5).received == ((1, (1, "one")),)
    assert marks.receive(5).latest(1) == (2, "one")


def test_a_mark_without_a_state_first_of_its_epoch_takes_the_received_workers_state() -> None:
    marks = WorkerMarks.of({0: (3, "saved")}).answer(TaskCompleted(9, 0, None, (4, ...)), base=9)
    assert marks.latest(0) == (4, "saved")


def test_where_each_worker_stands_becomes_where_it_was_left_as_the_next_epoch_begins() -> None:
    marks = WorkerMarks.of({0: (1, "zero")})
    marks = marks.answer(TaskCompleted(4, 1, None, (0, "one")), base=4)
    marks = marks.answer(TaskCompleted(5, 1, None, (1, ...)), base=4)  # loaded ahead
    begun = marks.begin({})
    assert begun.left == ((0, (1, "zero")), (1, (1, "one")))
    assert (begun.received, begun.answered, begun.recorded) == ((), (), ())
    # An answer of the epoch left, loaded after the break, moves it on.
    begun = begun.answer(TaskCompleted(6, 1, None, (2, ...)), base=8)
    assert begun.left == ((0, (1, "zero")), (1, (2, "one")))
    # The next epoch's answers are its own: they leave `left` as it stood.
    begun = begun.answer(TaskCompleted(8, 1, None, (1, None)), base=8)
    assert begun.left == ((0, (1, "zero")), (1, (2, "one")))
    assert begun.latest(1) == (1, None)


def test_a_worker_found_dry_is_noted_and_stays_so_in_where_it_was_left() -> None:
    marks = WorkerMarks().answer(WorkerExhausted(4, 1), base=4)
    assert marks.dry == (1,)
    begun = marks.begin({})
    assert (begun.dry, begun.left_dry) == ((), (1,))
    # Found dry only after the break, by a task of the epoch left: its part had run dry too.
    assert begun.answer(WorkerExhausted(5, 0), base=8).left_dry == (0, 1)


def test_a_map_style_replacement_with_no_answer_this_epoch_is_restored_to_where_it_was_left() -> (
    None
):
    marks = WorkerMarks().answer(TaskCompleted(2, 0, None, (0, {"dataset": 7})), base=0)
    begun = marks.begin({})
    # A persistent map-style worker began this epoch with its dataset as its last answer
    # left it: a replacement lost before answering anything of it starts there.
    assert begun.restoring(0, iterable=False) == (0, {"dataset": 7})
    # An iterable part moved on past that mark (run dry, iter() again): not a position in
    # this epoch's iterator, so the executor's own start of the epoch instead.
    assert begun.restoring(0, iterable=True) is None
    # Once it answered this epoch, its own mark, whichever the kind.
    answered = begun.answer(TaskCompleted(9, 0, None, (0, {"dataset": 8})), base=8)
    assert answered.restoring(0, iterable=False) == (0, {"dataset": 8})
    assert answered.restoring(0, iterable=True) == (0, {"dataset": 8})


def test_only_a_batch_or_a_tasks_error_hands_a_task_over() -> None:
    failure = TaskFailure(task=5, worker=1, error="boom")
    assert handed_task(Deliver(3, 0, None)) == (3, 0)
    assert handed_task(RaiseError(failure)) == (5, 1)
    assert handed_task(RaiseError(Timeout(1.0))) is None
    assert handed_task(EndEpoch()) is None
    assert handed_task(None) is None


# What the models' world may use of the driver: the consumer's calls, a tuner's, the rest of a
# call that waited, the state a checkpoint records, and the driver's state as one value.
_DRIVER_SURFACE = {
    "start_epoch",
    "next",
    "close",
    "retire",
    "add",
    "prefetch",
    "go_on",
    "progress",
    "marks",
    "state",
    "snapshot",
    "restore",
}


def test_the_models_world_uses_the_driver_only_through_its_calls_and_snapshots() -> None:
    tree = ast.parse((ROOT / "models" / "world.py").read_text())
    used, written = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name == "driver":
                used.add(node.attr)
                if isinstance(node.ctx, ast.Store | ast.Del):
                    written.add(node.attr)
    assert written == set()
    assert used <= _DRIVER_SURFACE, used - _DRIVER_SURFACE


@pytest.mark.timeout(60)
def test_the_ledger_a_snapshot_takes_after_carry_out_holds_the_outcome_and_the_void() -> None:
    # The driver holds an outcome and the void apart (`handed`, `void`); its snapshot must pair
    # them in the very value the constructor gives, void tasks and all.
    driver = _inline_driver(4, lambda state: 0)
    outcome = Deliver(3, 1, ["batch"])
    for void in ((), ((2, 0),)):
        driver.restore(attrs.evolve(driver.snapshot(), todo=(outcome,), ledger=Ledger(None, void)))
        assert driver.carry_out() is outcome
        held, built = driver.snapshot().ledger, Ledger(outcome, void)
        assert type(held) is Ledger
        assert (held, hash(held), repr(held)) == (built, hash(built), repr(built))
        assert held.handed is outcome
