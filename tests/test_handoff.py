"""The hand-over of answers from worker threads to the polling thread (`executors/_handoff.py`).

What a poller relies on: an answer appended by another thread wakes it, however the two
interleave, and none is lost or taken; a wait ends at its timeout, or once nothing may still
produce an answer. And what it costs: the poller sleeps and wakes, and a worker signals, in the
interpreter's own C code, running no Python-level synchronisation (`threading.py`) at all, since
on large batches that code runs once a batch with caches the loading threads have emptied.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest

from statecore.executors._handoff import Handoff

WITHIN = 30.0


def take(handoff: Handoff[int]) -> int:
    """The first answer, once the poller is done with it (as the executors do)."""
    return handoff.items.popleft()


@pytest.mark.timeout(60)
def test_every_answer_another_thread_appends_wakes_the_poller_and_none_is_lost() -> None:
    handoff: Handoff[int] = Handoff()
    turn: Handoff[int] = Handoff()  # the poller's answer back: the two take turns

    def answer() -> None:
        for number in range(500):
            handoff.put(number)
            assert turn.wait(WITHIN)
            take(turn)

    producer = threading.Thread(target=answer)
    producer.start()
    seen = []
    for _ in range(500):
        assert handoff.wait(WITHIN), "the poller slept through an answer"
        seen.append(take(handoff))
        turn.put(0)
    producer.join(WITHIN)
    assert seen == list(range(500))


@pytest.mark.timeout(60)
def test_answers_of_many_threads_at_once_all_arrive() -> None:
    handoff: Handoff[int] = Handoff()
    producers = [
        threading.Thread(target=lambda start=start: [handoff.put(start + n) for n in range(250)])
        for start in range(0, 1000, 250)
    ]
    for producer in producers:
        producer.start()
    seen = []
    while len(seen) < 1000:
        assert handoff.wait(WITHIN)
        while handoff.items:
            seen.append(take(handoff))
    for producer in producers:
        producer.join(WITHIN)
    assert sorted(seen) == list(range(1000))
    assert not handoff.wait(0)


def test_an_answer_already_there_is_found_without_waiting_and_not_taken() -> None:
    handoff: Handoff[str] = Handoff()
    handoff.put("done")
    assert handoff.wait(0) and handoff.wait(None)
    assert list(handoff.items) == ["done"]


@pytest.mark.timeout(60)
def test_a_wait_with_no_answer_ends_at_its_timeout() -> None:
    handoff: Handoff[int] = Handoff()
    assert not handoff.wait(0)
    assert not handoff.wait(0.1)


@pytest.mark.timeout(60)
def test_a_wait_ends_once_nothing_may_still_produce_an_answer() -> None:
    handoff: Handoff[int] = Handoff()
    asked = []

    def producing() -> bool:
        asked.append(True)
        return len(asked) < 3

    # No answer comes, and the last producer said nothing as it went: the wait still ends.
    assert not handoff.wait(None, producing)
    assert len(asked) == 3


@contextmanager
def python_calls_into(filename: str) -> Iterator[list[str]]:
    """The Python functions of `filename` this thread calls meanwhile."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith(filename):
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


@pytest.mark.timeout(60)
def test_sleeping_and_waking_run_no_python_synchronisation_code() -> None:
    handoff: Handoff[int] = Handoff()
    asleep: queue.SimpleQueue[None] = queue.SimpleQueue()  # C code: not profiled below

    def answer_once_asleep() -> None:
        asleep.get(timeout=WITHIN)
        handoff.put(1)

    def producing() -> bool:
        # Asked once the poller's first sleep found nothing: it has slept, now it is answered.
        asleep.put(None)
        return True

    producer = threading.Thread(target=answer_once_asleep)
    producer.start()
    with python_calls_into("threading.py") as polled:
        assert handoff.wait(WITHIN, producing)
    producer.join(WITHIN)
    assert polled == []
    with python_calls_into("threading.py") as signalled:
        handoff.put(2)
    assert signalled == []
