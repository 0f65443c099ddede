"""Telling the user of each lost worker the scheduler replaced: one warning per restart.

The scheduler decides whether a lost worker is replaced (`statecore._policy.may_replace`); this
observer only says so, once per `ReplaceWorker` it sees go out, and counts the restarts the
loader has spent, since `worker_restarts` is a budget per loader while a scheduler lives one
iterator.
"""

from __future__ import annotations

import warnings

from statecore import (
    Event,
    Pending,
    ReplaceWorker,
    State,
    Transition,
    WorkerLoss,
    WorkerRestartedWarning,
)
from statecore.executors._observe.seam import Observer

__all__ = ["RestartBudget", "restart_message"]


class RestartBudget:
    """A loader's `worker_restarts`, and how many of them its iterators spent so far."""

    def __init__(self, restarts: int) -> None:
        self.restarts = restarts
        self.spent = 0

    @property
    def left(self) -> int:
        return max(0, self.restarts - self.spent)

    def observer(self) -> Observer:
        return Observer(transition=self._transition, owner=self)

    def _transition(self, before: State, event: Event, transition: Transition) -> None:
        for command in transition.commands:
            after = transition.state
            if type(command) is not ReplaceWorker or after.life.added > before.life.added:
                continue  # a retired slot started again (`AddRequested`) spends no restart
            self.spent += 1
            loss = after.life.replaced[-1]
            resent = sum(
                1
                for slot in before.window
                if type(slot) is Pending and slot.worker == command.worker
            )
            left = after.config.restarts - len(after.life.replaced)
            warnings.warn(
                WorkerRestartedWarning(restart_message(loss, command, resent, left)),
                stacklevel=2,
            )


def restart_message(loss: WorkerLoss, command: ReplaceWorker, resent: int, left: int) -> str:
    """The warning for one restart: who was lost and how, what is sent again, what is left."""
    what = loss.describe_alone()
    # A hang's description ends with the stack it was stuck in: the rest goes below it.
    stop = ".\n" if "\n" in what else ". "
    return (
        f"{what}{stop}It was replaced in its slot (incarnation {command.incarnation}), set up as "
        f"the lost one was; the {resent} batch(es) it held are sent to the replacement, so "
        f"nothing is lost or repeated. {left} restart(s) left (worker_restarts)."
    )
