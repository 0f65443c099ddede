"""A tuner changing the prefetch bound mid-epoch: raised, more is sent at once; lowered, nothing
already sent is cancelled, and a worker over the new bound is sent nothing until it holds
fewer tasks than the bound."""

from __future__ import annotations

import attrs
import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    Deliver,
    DrawIndex,
    ExecutorError,
    IndexDrawn,
    NextRequested,
    Phase,
    PrefetchChangeRequested,
    ResetRequested,
    SamplerExhausted,
    SendTask,
    State,
    TaskCompleted,
    initial_state,
    step,
    violations,
)


def _full(prefetch: int = 2, **flags: bool) -> State:
    """Two workers, each holding `prefetch` tasks, no index being drawn."""
    state, _ = fill(start(config(num_workers=2, prefetch_factor=prefetch, **flags))[0])
    assert state.loads == (prefetch, prefetch) and state.drawing_for is None
    return state


def _sent_to(state: State, worker: int, *answers: int) -> tuple[State, list[int]]:
    """Answer `answers` (tasks of `worker`) and hand each over; the tasks then sent to it."""
    sent: list[int] = []
    for task in answers:
        state, commands = feed(state, TaskCompleted(task=task, worker=worker), NextRequested())
        state, more = fill(state)
        sends = only([*commands, *more], SendTask)
        sent += [command.task for command in sends if command.worker == worker]
    return state, sent


def test_raising_the_bound_draws_for_a_worker_with_room_at_once() -> None:
    state, commands = feed(_full(prefetch=1), PrefetchChangeRequested(2))
    assert only(commands, DrawIndex)
    assert state.config.prefetch_factor == 2


def test_raising_the_bound_fills_every_worker_to_it() -> None:
    state, _ = feed(_full(prefetch=1), PrefetchChangeRequested(3))
    state, commands = fill(state)
    assert state.loads == (3, 3)
    assert len(only(commands, SendTask)) == 4


def test_lowering_the_bound_cancels_no_task_already_sent() -> None:
    before = _full(prefetch=3)
    state, commands = feed(before, PrefetchChangeRequested(1))
    assert commands == []
    assert (state.window, state.loads) == (before.window, before.loads)


def test_the_tasks_held_over_a_lowered_bound_are_all_delivered() -> None:
    state, _ = feed(_full(prefetch=2), PrefetchChangeRequested(1))
    delivered = []
    for task in range(4):
        state, commands = feed(state, TaskCompleted(task=task, worker=task % 2), NextRequested())
        delivered += [c.task for c in only(commands, Deliver)]
    assert delivered == [0, 1, 2, 3]


def test_a_worker_over_a_lowered_bound_is_sent_nothing_until_it_holds_fewer() -> None:
    # Worker 0 holds tasks 0, 2, 4 under prefetch 3; lowered to 1, it must answer two of them
    # (holding one, at the bound) and then one more before it is sent another.
    state, _ = feed(_full(prefetch=3), PrefetchChangeRequested(1))
    state, sent = _sent_to(state, 0, 0)
    assert sent == []
    state, _ = feed(state, TaskCompleted(task=1, worker=1), NextRequested())
    state, sent = _sent_to(state, 0, 2)
    assert sent == []
    state, _ = feed(state, TaskCompleted(task=3, worker=1), NextRequested())
    state, sent = _sent_to(state, 0, 4)
    assert len(sent) == 1


def test_out_of_order_a_worker_over_a_lowered_bound_is_sent_nothing() -> None:
    state, _ = feed(_full(prefetch=2, in_order=False), PrefetchChangeRequested(1))
    state, commands = feed(state, TaskCompleted(task=0, worker=0), NextRequested())
    state, more = fill(state)
    assert only([*commands, *more], SendTask) == []
    assert state.loads == (1, 2)


def test_the_bound_set_stays_for_the_next_epoch_of_persistent_workers() -> None:
    state, _ = feed(_full(prefetch=1, persistent_workers=True), PrefetchChangeRequested(2))
    state, _ = feed(state, SamplerExhausted(), ResetRequested())
    assert state.phase is Phase.RESUMING
    assert state.config.prefetch_factor == 2


def test_the_bound_may_be_changed_while_draining() -> None:
    # Task 0 answered and handed over: an index is drawn for worker 0, and the sampler is out.
    state, _ = feed(
        _full(prefetch=2), TaskCompleted(task=0, worker=0), NextRequested(), SamplerExhausted()
    )
    state, commands = feed(state, PrefetchChangeRequested(1))
    assert (state.phase, commands) == (Phase.DRAINING, [])


def _refusal(state: State, event: PrefetchChangeRequested) -> str:
    with pytest.raises(ExecutorError) as caught:
        step(state, event)
    assert caught.value.event == event
    return str(caught.value)


def test_the_bound_is_not_changed_before_an_epoch_runs() -> None:
    message = _refusal(initial_state(config()), PrefetchChangeRequested(3))
    assert "only while an epoch runs" in message and "idle" in message


def test_the_bound_is_not_changed_once_the_epoch_finished() -> None:
    state, _ = start(config(), SamplerExhausted(), NextRequested())
    assert state.phase is Phase.FINISHED
    assert "finished" in _refusal(state, PrefetchChangeRequested(3))


@pytest.mark.parametrize("bound", [0, -1, True, 1.5])
def test_a_bound_that_is_not_a_positive_integer_is_refused(bound: object) -> None:
    message = _refusal(_full(), PrefetchChangeRequested(bound))  # type: ignore[arg-type]
    assert "at least 1" in message and repr(bound) in message


def test_the_bound_in_force_is_refused_as_no_change() -> None:
    assert "is 2 already" in _refusal(_full(prefetch=2), PrefetchChangeRequested(2))


def test_a_scheduler_loading_on_request_has_no_bound_to_change() -> None:
    state, _ = start(config(num_workers=1, prefetch_factor=1, lazy=True))
    assert "prefetches nothing" in _refusal(state, PrefetchChangeRequested(2))


def test_lowering_below_what_the_worker_drawn_for_holds_is_refused() -> None:
    # Worker 0 holds one task and an index is being drawn for it: lowered to 1, that index
    # would be sent one over the bound.
    state, _ = start(config(num_workers=2, prefetch_factor=2), IndexDrawn(0), IndexDrawn(1))
    assert state.drawing_for == 0 and state.loads[0] == 1
    assert "being drawn for worker 0" in _refusal(state, PrefetchChangeRequested(1))


def test_raising_while_an_index_is_drawn_is_accepted() -> None:
    state, _ = start(config(num_workers=2, prefetch_factor=2), IndexDrawn(0), IndexDrawn(1))
    state, commands = feed(state, PrefetchChangeRequested(3))
    assert commands == [] and state.drawing_for == 0


def test_tasks_sent_under_a_lowered_bound_are_checked_against_it() -> None:
    # The invariant lets worker 0 hold three tasks once the bound is lowered to 1 (they were
    # sent before), and not if they had been sent under it.
    state, _ = feed(_full(prefetch=3), PrefetchChangeRequested(1))
    assert violations(state) == []
    forged = state._replace(life=attrs.evolve(state.life, lowered_at=0))
    assert any("sent under prefetch 1" in found for found in violations(forged))
