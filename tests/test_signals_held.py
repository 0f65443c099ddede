"""While a message is half received, signal handlers wait for it to be stored."""

from __future__ import annotations

import signal
import threading

import pytest
from _interrupting import TimeLimit, time_limit

from statecore.executors._signals import HeldSignals


def test_ctrl_c_inside_the_block_is_raised_when_it_ends() -> None:
    finished = []
    with pytest.raises(KeyboardInterrupt), HeldSignals():
        signal.raise_signal(signal.SIGINT)
        finished.append("the message was stored")
    assert finished == ["the message was stored"]


def test_the_handlers_are_back_after_the_block() -> None:
    before = signal.getsignal(signal.SIGINT)
    with HeldSignals():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_a_handler_of_the_users_runs_at_the_end_of_the_block() -> None:
    previous = signal.signal(signal.SIGALRM, time_limit)
    try:
        finished = []
        with pytest.raises(TimeLimit), HeldSignals():
            signal.raise_signal(signal.SIGALRM)
            finished.append("stored")
        assert finished == ["stored"]
        assert signal.getsignal(signal.SIGALRM) is time_limit
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_block_without_a_signal_raises_nothing() -> None:
    with HeldSignals():
        pass


@pytest.mark.timeout(30)
def test_outside_the_main_thread_the_block_changes_no_handler() -> None:
    seen = []

    def in_a_thread() -> None:
        with HeldSignals():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]
