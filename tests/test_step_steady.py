"""The steady state of an epoch: the handlers that finish a batch's steps themselves.

`_on_index`, `_on_answer` and `_on_next` finish their step without `_settle` while RUNNING
(statecore/_step.py, "the steady state"), and build the batch's `SendTask`, `Ready` and
`Deliver` without attrs' __init__. Both shortcuts must be invisible: the transitions are those
`_settle` gives, and the values those the constructors give.
"""

from __future__ import annotations

import random

import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    Command,
    Config,
    Deliver,
    DrawIndex,
    Event,
    Failed,
    IndexDrawn,
    Interrupted,
    NextRequested,
    Pending,
    Phase,
    Ready,
    SendTask,
    State,
    TaskCompleted,
    TaskFailed,
    Transition,
    step,
)
from statecore import _step as core


def _epoch(cfg: Config, seed: int) -> list[tuple[State, Event]]:
    """Every (state, event) of one epoch in which answers come in a random order, the consumer
    asks at random moments, sometimes stops waiting (Interrupted) and some tasks fail."""
    rng = random.Random(seed)
    state, _ = start(cfg)
    steps: list[tuple[State, Event]] = []
    sent: list[SendTask] = []
    drawn = 0
    while state.phase is Phase.RUNNING and drawn < 60:
        choices: list[Event] = []
        if state.drawing_for is not None:
            choices.append(IndexDrawn(f"index {drawn}"))
        if sent:
            task = sent[rng.randrange(len(sent))]
            if rng.random() < 0.1:
                choices.append(TaskFailed(task.task, task.worker, ValueError(task.task)))
            else:
                choices.append(TaskCompleted(task.task, task.worker, [task.task]))
        if not state.waiting and not state.life.resetting:
            choices.append(NextRequested())
        if state.waiting and rng.random() < 0.05:
            choices.append(Interrupted())
        event = rng.choice(choices)
        steps.append((state, event))
        state, commands = feed(state, event)
        if isinstance(event, IndexDrawn):
            drawn += 1
        if isinstance(event, (TaskCompleted, TaskFailed)):
            sent = [task for task in sent if task.task != event.task]
        sent += only(commands, SendTask)
    return steps


def _settled(state: State, event: Event) -> Transition | None:
    """What `_settle` makes of the steady-state step, or None if the step is not one."""
    config_, life, rcvd_idx, window, loads, cursor, drawing_for, waiting = state
    if life.phase is not Phase.RUNNING or life.resetting or config_.lazy:
        return None
    if isinstance(event, NextRequested):
        return core._settle(config_, life, rcvd_idx, window, loads, cursor, drawing_for, True, ())
    if isinstance(event, (TaskCompleted, TaskFailed)):
        i = event.task - rcvd_idx
        if isinstance(event, TaskCompleted):
            arrived: Ready | Failed = Ready(event.worker, event.payload)
        else:
            arrived = Failed(event.worker, event.error)
        window = (*window[:i], arrived, *window[i + 1 :])
        return core._settle(
            config_, life, rcvd_idx, window, loads, cursor, drawing_for, waiting, ()
        )
    if isinstance(event, IndexDrawn):
        assert drawing_for is not None
        send = SendTask(drawing_for, state.send_idx, event.index)
        return core._settle(
            config_,
            life,
            rcvd_idx,
            (*window, Pending(drawing_for)),
            core._add(loads, drawing_for, 1),
            (drawing_for + 1) % config_.num_workers,
            None,
            waiting,
            (send,),
        )
    return None


def _payloads(state: State, commands: tuple[Command, ...]) -> list[object]:
    """What equality does not compare: the batches, by identity."""
    held = [getattr(slot, "payload", None) for slot in state.window]
    handed = [command.payload for command in commands if isinstance(command, Deliver)]
    return [id(payload) for payload in held + handed]


CONFIGS = [
    Config(num_workers=workers, prefetch_factor=prefetch, in_order=in_order)
    for workers in (1, 2, 3)
    for prefetch in (1, 2)
    for in_order in (True, False)
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
def test_the_steady_state_handlers_finish_a_step_as_settle_does(cfg: Config) -> None:
    compared = 0
    for seed in range(5):
        for state, event in _epoch(cfg, seed):
            expected = _settled(state, event)
            if expected is None:
                continue
            got = step(state, event)
            assert got == expected, f"{event!r} on {state!r}"
            assert _payloads(*got) == _payloads(*expected)
            compared += 1
    assert compared > 100


def test_what_a_batch_builds_equals_what_the_constructors_build() -> None:
    state, commands = fill(start(config(num_workers=2))[0])  # fill answers with task numbers
    send = only(commands, SendTask)[0]
    state, _ = feed(state, TaskCompleted(0, 0, payload=["batch"]))
    ready = state.window[0]
    state, commands = feed(state, NextRequested())
    deliver = only(commands, Deliver)[0]
    for built, constructed in [
        (send, SendTask(0, 0, 0)),
        (ready, Ready(0, ["batch"])),
        (deliver, Deliver(0, 0, ["batch"])),
    ]:
        assert type(built) is type(constructed)
        assert built == constructed
        assert hash(built) == hash(constructed)
        assert repr(built) == repr(constructed)
    assert deliver.payload is ready.payload  # type: ignore[union-attr]
    assert only(commands, DrawIndex) == [DrawIndex()]


def test_a_worker_past_the_shared_pending_slots_is_sent_tasks_like_any_other() -> None:
    workers = core._SHARED_PENDINGS + 3
    state, commands = fill(start(config(num_workers=workers, prefetch_factor=1))[0])
    assert [send.worker for send in only(commands, SendTask)] == list(range(workers))
    assert state.window == tuple(Pending(w) for w in range(workers))
    state, commands = feed(state, TaskCompleted(0, 0, "batch"), NextRequested())
    assert only(commands, Deliver) == [Deliver(0, 0, "batch")]
    assert state.drawing_for == 0
