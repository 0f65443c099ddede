"""Answers kept until the driver confirms them, so that an interrupt loses none.

Ctrl-C (or whatever a Python signal handler raises) may land just as `poll` returns, and the
answer it took from its workers is then dropped along with the return value. An executor that
declares `Capabilities.confirms_answers` keeps each answer it hands out: every later `poll`
returns that answer again, until the driver calls `confirm()` once the scheduler's state holds
it. `Confirming` is those steps, written once for every built-in executor: `poll` starts with
`if self._unconfirmed is not None: return self._unconfirmed` and hands an answer out with
`_hand_out`; `confirm` forgets it.
"""

from __future__ import annotations

from typing import Any, Protocol

from statecore import Event

__all__ = ["Confirming"]


class _Taken(Protocol):
    """Where an answer came from: a list or deque whose first item it is (or was made from)."""

    def __getitem__(self, index: int, /) -> Any: ...

    def __delitem__(self, index: int, /) -> None: ...


class Confirming:
    """A mixin for executors: the answer `poll` handed out last, kept until confirmed."""

    _unconfirmed: Event | None = None
    """The answer `poll` returned last, until the driver confirms it was recorded."""

    def confirm(self) -> None:
        """The scheduler's state holds the answer `poll` returned last: forget it.

        Calling it again, with no `poll` in between, does nothing: the driver does, when an
        interrupt cut its first call short.
        """
        self._unconfirmed = None

    def _hand_out(self, answer: Event, source: _Taken) -> Event:
        """`answer`, kept, and then `source[0]` (which it is, or was made from) removed.

        Kept, then removed, with no call in between: an interrupt either finds the answer
        still in `source` or kept here, never in neither (nor in both).
        """
        self._unconfirmed = answer
        del source[0]
        return answer
