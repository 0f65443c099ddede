"""The steady state of an epoch: a batch's three steps made whole by the steady handlers, held
equal to the general route, and the values they build cheaply.

While RUNNING, `IndexDrawn`, `TaskCompleted` and `NextRequested` are routed to handlers that
finish a steady state's step themselves and hand every other to the general route (the guards,
the handler, `_settle`). The explorer's every (state, event) is stepped both ways here and must
give the same transition, or the same refusal. The `fast` class methods of the events, commands
and slots built for every batch must give exactly what their constructors give.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextlib import suppress

import pytest
from _drive import config, feed, fill, only, start

from statecore import (
    Deliver,
    DrawIndex,
    Event,
    IndexDrawn,
    NextRequested,
    Pending,
    ProtocolError,
    Ready,
    SendTask,
    State,
    TaskCompleted,
    Transition,
    step,
)
from statecore import _step as core
from statecore.models.explorer import default_scenarios, explore, representative_scenarios
from statecore.models.world import Scenario

_general_step = core._general_step


def _opaque(values: Iterable[object]) -> list[object]:
    """What equality leaves out of window slots and commands: payloads and indices, by identity."""
    return [id(getattr(value, field, None)) for value in values for field in ("payload", "index")]


def _assert_same(steady: Transition, general: Transition, state: State, event: Event) -> None:
    where = f"{event!r} in {state!r}"
    assert steady == general, f"{where}: steady {steady!r}, general {general!r}"
    assert repr(steady) == repr(general), where
    assert [type(c) for c in steady.commands] == [type(c) for c in general.commands], where
    assert _opaque(steady.state.window) == _opaque(general.state.window), where
    assert _opaque(steady.commands) == _opaque(general.commands), where


def _stepped_both_ways(state: State, event: Event) -> Transition:
    """`step(state, event)`, asserted equal to the general route's transition or refusal."""
    try:
        general = _general_step(state, event)
    except ProtocolError as refused:
        with pytest.raises(type(refused)) as also:
            step(state, event)
        assert str(also.value) == str(refused), f"{event!r} in {state!r}"
        raise
    steady = step(state, event)
    _assert_same(steady, general, state, event)
    return steady


def _probes(state: State) -> Iterable[Event]:
    """The steady handlers' events, as the shell could send them in `state`: a request, a drawn
    index, and answers from each pending task's worker, another worker and an older
    incarnation, and for a task past the window. Most are refused in most states."""
    yield NextRequested()
    yield IndexDrawn(["index"])
    life, n = state.life, state.config.num_workers
    for i, slot in enumerate(state.window):
        if type(slot) is Pending:
            task, w = state.rcvd_idx + i, slot.worker
            yield TaskCompleted(task, w, ["batch"], incarnation=life.incarnations[w])
            yield TaskCompleted(task, (w + 1) % n, ["batch"], incarnation=0)
            if life.incarnations[w]:
                yield TaskCompleted(task, w, ["batch"], incarnation=life.incarnations[w] - 1)
    yield TaskCompleted(state.send_idx, 0, ["batch"])


class _BothWays:
    """A step function for the explorer: `step`, checked against the general route on every
    (state, event); counts the steps the steady handlers made whole."""

    def __init__(self) -> None:
        self.routed: Counter[type[Event]] = Counter()
        self.handed_on: Counter[type[Event]] = Counter()

    def __call__(self, state: State, event: Event) -> Transition:
        transition = _stepped_both_ways(state, event)
        if core._ROUTES[state.life.phase][type(event)][0] in core._STEADY.values():
            self.routed[type(event)] += 1
        return transition

    def count_hand_ons(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def handed_on(state: State, event: Event) -> Transition:
            self.handed_on[type(event)] += 1
            return _general_step(state, event)

        monkeypatch.setattr(core, "_general_step", handed_on)


def _explore_both_ways(
    scenarios: Iterable[Scenario], monkeypatch: pytest.MonkeyPatch, *, mostly_steady: bool
) -> None:
    both = _BothWays()
    both.count_hand_ons(monkeypatch)
    reports = [explore(scenario, both) for scenario in scenarios]
    assert [report.describe() for report in reports if not report.ok] == []
    # Not vacuous: the steady handlers made steps whole, and over the representative scenarios
    # most of a batch's steps in RUNNING (a part of the default bounds may be mostly lazy draws
    # or retirements, which hand on).
    for kind in core._STEADY:
        assert both.routed[kind] > (2 * both.handed_on[kind] if mostly_steady else 0), (
            kind,
            both.routed,
            both.handed_on,
        )
    # And the events the shell could send in each state reached, refused ones included.
    for state in {state for report in reports for state in report.states}:
        assert isinstance(state, State)
        for event in _probes(state):
            with suppress(ProtocolError):  # refused alike
                _stepped_both_ways(state, event)


@pytest.mark.timeout(300)
def test_the_steady_handlers_step_every_explored_state_as_the_general_route_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _explore_both_ways(representative_scenarios(), monkeypatch, mostly_steady=True)


# The default bounds in eight interleaved parts, so that the exhaustive tier's processes share
# them (all of them in one process take some 5 minutes here).
_PARTS = 8


@pytest.mark.exhaustive
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("part", range(_PARTS))
def test_the_steady_handlers_step_every_state_of_the_default_bounds_as_the_general_route_does(
    part: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _explore_both_ways(list(default_scenarios())[part::_PARTS], monkeypatch, mostly_steady=False)


def test_a_steady_epochs_batches_never_take_the_general_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for cfg in (config(num_workers=2), config(num_workers=1, prefetch_factor=1, lazy=True)):
        state = fill(start(cfg)[0])[0]
        both = _BothWays()
        both.count_hand_ons(monkeypatch)
        for _ in range(6):
            state, commands = both(state, NextRequested())
            while not only(commands, Deliver):
                if state.drawing_for is not None:
                    state, commands = both(state, IndexDrawn(state.send_idx))
                else:
                    task = state.rcvd_idx
                    worker = state.window[0].worker  # type: ignore[union-attr]
                    state, commands = both(state, TaskCompleted(task, worker, payload=[task]))
            state = fill(state)[0]
        assert both.handed_on == Counter(), cfg
        assert both.routed[NextRequested] == 6, cfg


def _same_value(built: object, constructed: object) -> None:
    assert type(built) is type(constructed)
    assert built == constructed
    assert hash(built) == hash(constructed)
    assert repr(built) == repr(constructed)


def test_what_a_batch_builds_equals_what_the_constructors_build() -> None:
    state, commands = fill(start(config(num_workers=2))[0])  # fill answers with task numbers
    send = only(commands, SendTask)[0]
    state, _ = feed(state, TaskCompleted(0, 0, payload=["batch"]))
    ready = state.window[0]
    state, commands = feed(state, NextRequested())
    deliver = only(commands, Deliver)[0]
    _same_value(send, SendTask(0, 0, 0))
    _same_value(ready, Ready(0, ["batch"]))
    _same_value(deliver, Deliver(0, 0, ["batch"]))
    assert deliver.payload is ready.payload  # type: ignore[union-attr]
    assert only(commands, DrawIndex) == [DrawIndex()]


def test_the_shells_fast_events_equal_the_constructors_events() -> None:
    payload, mark, timing = ["batch"], object(), object()
    _same_value(IndexDrawn.fast([3, 4]), IndexDrawn([3, 4]))
    fast = TaskCompleted.fast(5, 1, payload, mark, timing)
    _same_value(fast, TaskCompleted(5, 1, payload, mark, timing))
    assert (fast.payload, fast.mark, fast.timing) == (payload, mark, timing)
    _same_value(TaskCompleted.fast(5, 1, payload), TaskCompleted(5, 1, payload))


def test_a_worker_past_the_shared_pending_slots_is_sent_tasks_like_any_other() -> None:
    workers = core._SHARED_PENDINGS + 3
    state, commands = fill(start(config(num_workers=workers, prefetch_factor=1))[0])
    assert [send.worker for send in only(commands, SendTask)] == list(range(workers))
    assert state.window == tuple(Pending(w) for w in range(workers))
    state, commands = feed(state, TaskCompleted(0, 0, "batch"), NextRequested())
    assert only(commands, Deliver) == [Deliver(0, 0, "batch")]
    assert state.drawing_for == 0
