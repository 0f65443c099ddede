"""The observers' seam (executors/_observe/seam.py): each transition told once to each observer
that wants its event's type, the driver's marks taken through the same lookup, and the tracer
reading the epoch from the transition it is told of."""

from __future__ import annotations

import gc
import os
import sys
from collections import deque
from typing import Any

import pytest

from statecore import (
    Config,
    Deliver,
    Event,
    IndexDrawn,
    LoaderTimeoutError,
    NextRequested,
    Phase,
    ResetRequested,
    ResumeWorker,
    SamplerExhausted,
    SendTask,
    State,
    TaskCompleted,
    Transition,
    WorkerResumed,
    initial_state,
    step,
)
from statecore.executors import Driver
from statecore.executors._driver import WorkerMarks
from statecore.executors._observe.flight import FlightRecorder
from statecore.executors._observe.seam import Observer, observed
from statecore.executors._observe.tracer import Tracer

_OBSERVE = os.path.dirname(observed.__code__.co_filename)
"""Where the observers' code lives: the calls counted are those of its functions."""

_ONE_WORKER = Config(num_workers=1, prefetch_factor=1, lazy=True, persistent_workers=True)


def _epoch(watched: Any, state: State, batches: int) -> State:
    """Drive `watched` through one epoch of one worker and `batches` batches."""
    state, _ = watched(state, ResetRequested())
    if state.phase is Phase.RESUMING:
        state, _ = watched(state, WorkerResumed(0, state.life.epoch))
    for index in range(batches):
        state, _ = watched(state, NextRequested())
        state, _ = watched(state, IndexDrawn.fast(index))
        state, _ = watched(state, TaskCompleted(state.rcvd_idx, 0, index))
    state, _ = watched(state, NextRequested())
    state, _ = watched(state, SamplerExhausted())
    assert state.phase is Phase.FINISHED
    return state


class _Told:
    """An observer's hook that notes every transition it is told of."""

    def __init__(self) -> None:
        self.told: list[tuple[State, Event, Transition]] = []

    def __call__(self, state: State, event: Event, transition: Transition) -> None:
        self.told.append((state, event, transition))

    def events(self) -> list[type]:
        return [type(event) for _, event, _ in self.told]


def test_the_seam_tells_every_observer_of_each_transition_once_with_the_states_around_it() -> None:
    first, second = _Told(), _Told()
    seen: list[tuple[State, Event, Transition]] = []

    def stepped(state: State, event: Event) -> Transition:
        transition = step(state, event)
        seen.append((state, event, transition))
        return transition

    watched = observed(stepped, [Observer(first), Observer(second)])
    _epoch(watched, initial_state(_ONE_WORKER), 2)
    assert first.told == seen
    assert second.told == seen


def test_an_observer_is_told_only_of_the_event_types_it_names() -> None:
    requests, rest = _Told(), _Told()
    only_requests = Observer(None, on={NextRequested: requests})
    all_but_draws = Observer(rest, on={IndexDrawn: None})
    _epoch(observed(step, [only_requests, all_but_draws]), initial_state(_ONE_WORKER), 2)
    assert requests.events() == [NextRequested] * 3
    assert IndexDrawn not in rest.events()
    assert rest.events().count(NextRequested) == 3
    assert rest.events().count(TaskCompleted) == 2


def test_a_refused_event_is_told_to_every_observer_once_and_to_no_hook() -> None:
    told = _Told()
    refused: list[tuple[Event, BaseException]] = []
    observer = Observer(told, lambda state, event, error: refused.append((event, error)))
    watched = observed(step, [observer, observer])
    with pytest.raises(Exception) as raised:
        watched(initial_state(_ONE_WORKER), NextRequested())  # no epoch started
    assert refused == [(NextRequested(), raised.value)] * 2
    assert told.told == []


class _CountedHashes(type):
    """A metaclass that counts how often its classes are hashed, as a lookup by type does."""

    hashed = 0

    def __hash__(cls) -> int:
        _CountedHashes.hashed += 1
        return id(cls)


class _Counted(Event, metaclass=_CountedHashes):
    pass


def test_the_seam_looks_an_events_type_up_once_per_transition_for_all_its_observers() -> None:
    told = [_Told() for _ in range(3)]
    observers = [Observer(t) for t in told[:2]] + [Observer(None, on={_Counted: told[2]})]
    transition = Transition(initial_state(_ONE_WORKER), ())
    watched = observed(lambda state, event: transition, observers)
    watched(transition[0], _Counted())  # the first of a type finds whom it goes to
    _CountedHashes.hashed = 0
    for _ in range(5):
        watched(transition[0], _Counted())
    assert _CountedHashes.hashed == 5
    assert [len(t.told) for t in told] == [6, 6, 6]


def test_a_later_observer_that_joins_the_earlier_ones_hook_is_the_one_call_of_a_transition() -> (
    None
):
    earlier = _Told()
    order: list[str] = []
    asked: list[type] = []

    def joined(kind: type[Event], before: Any) -> Any:
        asked.append(kind)
        if kind is not NextRequested:
            return None  # the seam joins these itself

        def both(state: State, event: Event, transition: Transition) -> None:
            before(state, event, transition)
            order.append("later")

        return both

    later = Observer(_Told(), joined=joined)
    watched = observed(step, [Observer(lambda *told: order.append("earlier")), later])
    _epoch(watched, initial_state(_ONE_WORKER), 2)
    assert NextRequested in asked and IndexDrawn in asked
    # A request: the later observer's joined hook, which calls the earlier one's first.
    assert order.count("later") == 3
    assert order.count("earlier") == len(order) - 3
    assert earlier.told == []


def _calls_per_batch(observers: Any) -> float:
    """Python calls of the observers' code (executors/_observe) each batch of an epoch (its
    request, its draw, its answer) makes through the seam with the observers `observers()`
    gives: two epochs' calls, of 8 and 72 batches,
    told apart, so that what an epoch's start and end cost drops out."""
    counted = []
    for batches in (8, 72):
        calls = 0

        def count(frame: Any, what: str, argument: Any) -> None:
            nonlocal calls
            calls += what == "call" and frame.f_code.co_filename.startswith(_OBSERVE)

        watched = observed(step, observers())
        gc.disable()  # no finalizer's calls among those counted
        sys.setprofile(count)
        try:
            _epoch(watched, initial_state(_ONE_WORKER), batches)
        finally:
            sys.setprofile(None)
            gc.enable()
        counted.append(calls)
    return (counted[1] - counted[0]) / 64


def test_a_traced_batch_calls_the_flight_recorder_from_the_tracers_hooks() -> None:
    def recorder() -> Observer:
        return FlightRecorder(_ONE_WORKER).observer()

    def tracer() -> Observer:
        return Tracer(1, True, True, "test").observer()

    seam = _calls_per_batch(lambda: [Observer(None)])  # the seam and the core, no hook
    recorded = _calls_per_batch(lambda: [recorder()])
    traced = _calls_per_batch(lambda: [tracer()])
    both = _calls_per_batch(lambda: [recorder(), tracer()])
    # The tracer's hooks for a batch's events call the recorder's themselves: joining the two
    # costs no call of its own (the seam's joining call was three a batch).
    assert both == recorded + traced - seam


def _calls_per_answer(observer: Observer) -> list[int]:
    """Python calls of the observers' code (executors/_observe) each answer of an epoch of 4
    batches makes through the seam with `observer`: in `_ONE_WORKER`'s epoch each comes while
    the consumer waits for it."""
    watched, state = observed(step, [observer]), initial_state(_ONE_WORKER)
    state, _ = watched(state, ResetRequested())
    if state.phase is Phase.RESUMING:
        state, _ = watched(state, WorkerResumed(0, state.life.epoch))
    counted = []
    for index in range(4):
        state, _ = watched(state, NextRequested())
        state, _ = watched(state, IndexDrawn.fast(index))
        calls = 0

        def count(frame: Any, what: str, argument: Any) -> None:
            nonlocal calls
            calls += what == "call" and frame.f_code.co_filename.startswith(_OBSERVE)

        gc.disable()  # no finalizer's calls among those counted
        sys.setprofile(count)
        try:
            state, commands = watched(state, TaskCompleted(state.rcvd_idx, 0, index))
        finally:
            sys.setprofile(None)
            gc.enable()
        assert [type(command) for command in commands][:1] == [Deliver]
        counted.append(calls)
    return counted


def test_an_answer_handed_over_at_once_costs_the_tracer_one_call() -> None:
    tracer = Tracer(1, True, True, "test")
    seam = _calls_per_answer(Observer(None))
    traced = _calls_per_answer(tracer.observer())
    assert [ours - theirs for ours, theirs in zip(traced, seam, strict=True)] == [1] * 4
    waits = tracer.trace().waits
    assert [wait.task for wait in waits] == [0, 1, 2, 3]
    batches = tracer.trace().batches
    assert [batch.handed for batch in batches] == [wait.got for wait in waits]


def test_a_traced_flight_recorder_records_each_event_once() -> None:
    recorder, tracer = FlightRecorder(_ONE_WORKER), Tracer(1, True, True, "test")
    _epoch(observed(step, [recorder.observer(), tracer.observer()]), initial_state(_ONE_WORKER), 5)
    alone = FlightRecorder(_ONE_WORKER)
    _epoch(observed(step, [alone.observer()]), initial_state(_ONE_WORKER), 5)
    assert list(map(repr, recorder.ring)) == list(map(repr, alone.ring))
    assert tracer.stats().batches == 5


# --- the driver's marks, taken through the seam ----------------------------------------------


class _Marking:
    """An executor whose one worker answers each task with a mark (its task number), the
    answers it owes in the order they were sent. `lost` answers are never sent, as an
    executor that does not confirm answers loses one an interrupt cut short."""

    def __init__(self) -> None:
        self.owed: deque[SendTask] = deque()
        self.lost = 0

    def start(self) -> None:
        pass

    def dispatch(self, command: SendTask) -> None:
        self.owed.append(command)

    def resume(self, command: ResumeWorker) -> None:
        pass

    def stop_worker(self, worker: int) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def poll(self, timeout: float | None) -> Event | None:
        if not self.owed:
            return None
        sent = self.owed.popleft()
        return TaskCompleted(sent.task, sent.worker, sent.index, (sent.task, None))


def _marked_driver(observers: list[Observer], timeout: float = 0) -> Driver:
    indices = iter(range(3))
    config = Config(num_workers=1, prefetch_factor=1)
    return Driver(
        config, _Marking(), lambda state: next(indices), timeout, observers=observers, marked=True
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("watched", [False, True], ids=["no observer", "observed"])
def test_a_driver_takes_each_answers_mark_once_received(watched: bool) -> None:
    # Observed, the seam notes the answer for the driver; with no observer there is no seam.
    told = _Told()
    driver = _marked_driver([Observer(told)] if watched else [])
    driver.start_epoch()
    assert driver.next() == 0
    assert driver.marks == {0: (0, None)}
    assert driver.next() == 1
    assert driver.marks == {0: (1, None)}
    assert told.events().count(TaskCompleted) == (2 if watched else 0)


@pytest.mark.timeout(60)
def test_an_answer_whose_state_an_interrupt_dropped_leaves_no_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = _marked_driver([Observer(_Told())], timeout=0.01)
    driver.start_epoch()
    answer = WorkerMarks.answer

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(WorkerMarks, "answer", answer)
        raise KeyboardInterrupt

    monkeypatch.setattr(WorkerMarks, "answer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        driver.next()  # the answer is lost: the executor does not send it again
    with pytest.raises(LoaderTimeoutError):
        driver.next()
    assert driver.worker_marks == WorkerMarks()


# --- the tracer reads the epoch from the transition ------------------------------------------


def _epochs_named(tracer: Tracer) -> list[tuple[str, str | None]]:
    return [(mark.kind, mark.detail) for mark in tracer.trace().marks if "epoch" in mark.kind]


def test_the_tracer_names_the_epoch_the_scheduler_began() -> None:
    # A scheduler that ran two epochs before the tracer watched it: its third is the third.
    state = initial_state(_ONE_WORKER)
    for _ in range(2):
        state = _epoch(step, state, 1)
    tracer = Tracer(1, True, True, "inline")
    _epoch(tracer.wrap(step), state, 1)
    assert _epochs_named(tracer) == [("epoch start", "epoch 3"), ("epoch end", "epoch 3")]


def test_a_later_iterators_epochs_follow_the_earlier_ones() -> None:
    tracer = Tracer(1, True, False, "inline")
    first = tracer.wrap(step)
    state = _epoch(first, initial_state(_ONE_WORKER), 1)
    _epoch(first, state, 1)
    _epoch(tracer.wrap(step), initial_state(_ONE_WORKER), 1)
    assert _epochs_named(tracer) == [
        (kind, f"epoch {n}") for n in (1, 2, 3) for kind in ("epoch start", "epoch end")
    ]
