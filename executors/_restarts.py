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

    def observer(self, afresh: bool = False) -> Observer:
        """The observer of one loader iterator's scheduler. `afresh`: a replacement in an epoch
        after the iterator's first starts from the dataset as the loader was given it, not
        from the state the lost worker's copy carried into the epoch (persistent workers, an
        iterable dataset without `state_dict`), and its warning says what that may repeat."""
        if not afresh:
            return Observer(transition=self._transition, owner=self)

        def warn_afresh(before: State, event: Event, made: Transition) -> None:
            self._transition(before, event, made, afresh=True)

        return Observer(transition=warn_afresh, owner=self)

    def _transition(
        self, before: State, event: Event, transition: Transition, afresh: bool = False
    ) -> None:
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
            # A driver's epochs after its first are a persistent iterator's.
            fresh = afresh and command.epoch > 1
            warnings.warn(
                WorkerRestartedWarning(restart_message(loss, command, resent, left, fresh)),
                stacklevel=2,
            )


def restart_message(
    loss: WorkerLoss, command: ReplaceWorker, resent: int, left: int, afresh: bool = False
) -> str:
    """The warning for one restart: who was lost and how, what is sent again, what is left.
    `afresh`: the replacement's dataset could not be brought to where the lost one's stood as
    the epoch began (see `RestartBudget.observer`), and the warning says what may repeat."""
    what = loss.describe_alone()
    # A hang's description ends with the stack it was stuck in: the rest goes below it.
    stop = ".\n" if "\n" in what else ". "
    sent = (
        f"{what}{stop}It was replaced in its slot (incarnation {command.incarnation}), set up as "
        f"the lost one was; the {resent} batch(es) it held are sent to the replacement"
    )
    if not afresh:
        return f"{sent}, so nothing is lost or repeated. {left} restart(s) left (worker_restarts)."
    w = command.worker
    return (
        f"{sent}. But the dataset has no state_dict()/load_state_dict(), so the replacement "
        f"cannot be brought to where worker {w}'s persistent copy of it stood as this epoch "
        f"(epoch {command.epoch} of these workers) began: it starts from the dataset as the "
        f"loader was given it. If the dataset's __iter__ depends on what a worker's copy kept "
        f"from earlier epochs (an epoch counter, a shuffling seed it moves on), worker {w}'s "
        f"part of this epoch may repeat an earlier epoch's items. Give the dataset state_dict() "
        f"and load_state_dict() (torchdata's Stateful protocol) to restore it exactly. "
        f"{left} restart(s) left (worker_restarts)."
    )
