"""statecore: a data loader whose scheduling is a pure, checked state machine.

Layers, from the inside out:

- `statecore` (this package): the pure scheduler core. `step(state, event)` returns the next
  state and the commands to carry out. No I/O, threads, clocks or torch: importing it loads
  none of them.
- `statecore.executors`: the imperative shell that drives the core and moves the data.
- `statecore.models`: executable specifications (reference semantics, Hypothesis state
  machines, the exhaustive explorer), which run the shell's driver over the core.
- `statecore.tools`: the programs (`python -m statecore check | diagram | demo | bench`).
"""

from typing import Any

from statecore._commands import (
    Command,
    Deliver,
    DrawIndex,
    EndEpoch,
    RaiseError,
    ReplaceWorker,
    ResumeWorker,
    SendTask,
    Shutdown,
    StopWorker,
)
from statecore._errors import (
    ClosedError,
    ExecutorError,
    InternalError,
    LoaderCancelledError,
    LoaderTimeoutError,
    MisuseError,
    ProtocolError,
    StatecoreError,
    WorkerDiedError,
    WorkerHungError,
    WorkerRestartedWarning,
)
from statecore._events import (
    AddRequested,
    CloseRequested,
    Event,
    ExecutorFailed,
    IndexDrawn,
    Interrupted,
    NextRequested,
    PrefetchChangeRequested,
    ResetRequested,
    RetireRequested,
    SamplerExhausted,
    SamplerFailed,
    TaskCompleted,
    TaskFailed,
    TimedOut,
    WorkerDied,
    WorkerExhausted,
    WorkerResumed,
    WorkerStarted,
    WorkerStuck,
)
from statecore._frameworks import REPLACERS as _REPLACERS
from statecore._frameworks import build_before_a_census as _build_before_a_census
from statecore._frameworks import when_imported as _when_imported
from statecore._invariants import violations
from statecore._policy import DEFAULT_POLICY, Policy, policy_replaced
from statecore._progress import progress
from statecore._reshard import (
    EpochSplit,
    RankMergeError,
    RankPart,
    handed_positions,
    merge_ranks,
    received_samples,
    reshard,
)
from statecore._state import (
    RESOLVED,
    Cancelled,
    Config,
    ExecutorFailure,
    Failed,
    Failure,
    Lifecycle,
    Pending,
    Phase,
    Progress,
    Ready,
    Resolved,
    SamplerFailure,
    Slot,
    State,
    Stats,
    TaskFailure,
    Timeout,
    WorkerDeath,
    WorkerHang,
    WorkerLoss,
    WorkerStatus,
    initial_state,
)
from statecore._step import Transition, can_restart, step
from statecore._table import ECHOES, EDGES, RULES, TRANSITIONS, Rule
from statecore._tuning import (
    LoadWindow,
    PrefetchBudget,
    PrefetchDecision,
    PrefetchTuner,
    PrefetchTuning,
    Tuner,
    Tuning,
    TuningDecision,
    TuningMove,
    WorkerBudget,
    decide_prefetch,
    decide_workers,
    prefetch_change_bound,
    tuning_change_bound,
)

__all__ = [
    "DEFAULT_POLICY",
    "ECHOES",
    "EDGES",
    "RESOLVED",
    "RULES",
    "TRANSITIONS",
    "AddRequested",
    "Cancelled",
    "CloseRequested",
    "ClosedError",
    "Command",
    "Config",
    "Deliver",
    "EndEpoch",
    "Event",
    "ExecutorError",
    "ExecutorFailed",
    "ExecutorFailure",
    "Failed",
    "Failure",
    "EpochSplit",
    "IndexDrawn",
    "InternalError",
    "Interrupted",
    "Lifecycle",
    "LoaderCancelledError",
    "LoaderTimeoutError",
    "MisuseError",
    "NextRequested",
    "PrefetchChangeRequested",
    "Pending",
    "Phase",
    "Policy",
    "Progress",
    "ProtocolError",
    "DrawIndex",
    "RaiseError",
    "RankMergeError",
    "RankPart",
    "Ready",
    "ReplaceWorker",
    "ResetRequested",
    "Resolved",
    "ResumeWorker",
    "RetireRequested",
    "Rule",
    "SamplerExhausted",
    "SamplerFailed",
    "SamplerFailure",
    "SendTask",
    "Shutdown",
    "Slot",
    "State",
    "StatecoreError",
    "Stats",
    "StopWorker",
    "TaskCompleted",
    "TaskFailed",
    "TaskFailure",
    "TimedOut",
    "Timeout",
    "Transition",
    "WorkerDeath",
    "WorkerDied",
    "WorkerDiedError",
    "WorkerExhausted",
    "WorkerHang",
    "WorkerHungError",
    "WorkerLoss",
    "WorkerRestartedWarning",
    "WorkerResumed",
    "WorkerStarted",
    "WorkerStatus",
    "WorkerStuck",
    "can_restart",
    "handed_positions",
    "initial_state",
    "merge_ranks",
    "policy_replaced",
    "progress",
    "received_samples",
    "reshard",
    "step",
    "violations",
    "LoadWindow",
    "Tuner",
    "Tuning",
    "TuningDecision",
    "TuningMove",
    "WorkerBudget",
    "decide_workers",
    "tuning_change_bound",
    "PrefetchBudget",
    "PrefetchDecision",
    "PrefetchTuner",
    "PrefetchTuning",
    "decide_prefetch",
    "prefetch_change_bound",
]


_RENAMED = {"PullIndex": "DrawIndex"}


def __getattr__(name: str) -> Any:
    # The loader needs torch; load it only when asked, so the core stays importable without it.
    # `Trace`, `LoaderStats` and `LoaderCounters` are what its `trace_record()` and `stats()`
    # return.
    # `SharedSequence` keeps a dataset's small objects in one buffer its workers share.
    if name in (
        "DataLoader",
        "get_worker_info",
        "Trace",
        "LoaderStats",
        "LoaderCounters",
        "SharedSequence",
    ):
        from statecore import executors

        return getattr(executors, name)
    if name == "StatefulDataLoader":
        # torchdata's name for a loader with state_dict(): code written for it changes only
        # its import.
        from statecore import executors

        return executors.DataLoader
    # Renamed in 0.1: one verb for the act (`DrawIndex`, answered by `IndexDrawn`). Embedders
    # written against the old name keep working, with a warning that says what to write instead.
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(
            f"statecore.{name} was renamed statecore.{new}; import {new} instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module 'statecore' has no attribute {name!r}")


def _build_data_loader() -> object:
    from statecore import executors

    return executors.DataLoader


# Lightning patches only the DataLoader classes that exist when it asks for a loader: build ours
# before it can ask (statecore/_frameworks.py says why, and why not on importing torch).
_build_before_a_census(_build_data_loader)


def _keep_statecore_under_accelerate() -> None:
    from statecore import executors

    executors.keep_statecore_under_accelerate()


# accelerate's prepare builds a torch loader in place of ours: have it put ours back from the
# start (statecore/executors/frameworks.py says how).
_when_imported(_REPLACERS, _keep_statecore_under_accelerate)
