"""Deliberate bugs in the scheduler, to show that the models catch them.

A checker that never fails proves nothing. Each mutant here swaps one of the core's policies
(`statecore.Policy`, through the one seam `statecore.policy_replaced`), or one move of the
driver loop in `statecore.executors._driver`, for a plausible wrong version, the kind of slip
torch's hand-kept counters invite. `mutant.applied()` installs it for the duration of a `with`
block; the tests then run the explorer and the Hypothesis machines, which drive the real driver
over the core, and expect a violation.

Each mutant names its `witness`: a scenario of the explorer's default bounds in which the
explorer finds the bug within a second or two. The tests explore each mutant's witness, never a
scan of the scenarios; the exhaustive tier (`pytest -m exhaustive`) adds the Hypothesis
machine's full budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from statecore import (
    DEFAULT_POLICY,
    RESOLVED,
    Command,
    Config,
    EndEpoch,
    Event,
    ExecutorFailure,
    Failed,
    Failure,
    Interrupted,
    Pending,
    Phase,
    Progress,
    RaiseError,
    Ready,
    Slot,
    State,
    WorkerLoss,
    WorkerStatus,
    policy_replaced,
)
from statecore import progress as core_progress
from statecore.executors._driver import Driver
from statecore.models.explorer import default_scenarios, restart_scenarios, tuning_scenarios
from statecore.models.reference import IterableSpec, MapSpec
from statecore.models.world import Scenario

__all__ = ["LOADER_MUTANTS", "MUTANTS", "LoaderMutant", "Mutant"]


@attrs.frozen
class Mutant:
    """One deliberate bug: `replacements` maps fields of `statecore.Policy` (or, prefixed with
    `Driver.`, methods of the driver) to wrong versions."""

    name: str
    description: str
    replacements: Callable[[], dict[str, object]] = attrs.field(repr=False)
    witness: Scenario = attrs.field(repr=False)
    """A default scenario (`statecore.models.explorer.default_scenarios`), within `scope`,
    whose exploration reports the bug: chosen small, so that exploring it takes a second or
    two."""
    acts_in: Callable[[], Iterator[Scenario]] | None = attrs.field(default=None, repr=False)
    """Where alone the bug can act, if it differs from the real policy only in states few
    scenarios reach: a mutant of replacing (an incarnation past 0, a slot starting, a
    replacement's tasks, the restarts' count) acts only with restarts (`restart_scenarios`), one
    of retiring only where a tuner retires (`tuning_scenarios`). Its witness is one of those."""

    def scope(self) -> list[Scenario]:
        """The default scenarios, in order, where this bug can act."""
        return list((self.acts_in or default_scenarios)())

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Install the bug in the core while the block runs; restore the real code after."""
        replacements = self.replacements()
        methods = {
            name.removeprefix("Driver."): value
            for name, value in replacements.items()
            if name.startswith("Driver.")
        }
        policies = {n: v for n, v in replacements.items() if not n.startswith("Driver.")}
        saved_methods = {name: vars(Driver)[name] for name in methods}
        try:
            for name, value in methods.items():
                setattr(Driver, name, value)
            with policy_replaced(**policies):
                yield
        finally:
            for name, value in saved_methods.items():
                setattr(Driver, name, value)


def _prefetch_off_by_one() -> dict[str, object]:
    real = DEFAULT_POLICY.pick_worker

    def pick(
        config: Config, workers: tuple[WorkerStatus, ...], loads: tuple[int, ...], cursor: int
    ) -> int | None:
        # `<=` where `<` was meant: one task more per worker than prefetch_factor allows.
        roomier = attrs.evolve(config, prefetch_factor=config.prefetch_factor + 1)
        return real(roomier, workers, loads, cursor)

    return {"pick_worker": pick}


def _early_delivery() -> dict[str, object]:
    real = DEFAULT_POLICY.deliverable

    def deliverable(window: tuple[object, ...], in_order: bool) -> int | None:
        return real(window, False)  # type: ignore[arg-type]

    return {"deliverable": deliverable}


def _dry_worker_gets_tasks() -> dict[str, object]:
    real = DEFAULT_POLICY.pick_worker

    def pick(
        config: Config, workers: tuple[WorkerStatus, ...], loads: tuple[int, ...], cursor: int
    ) -> int | None:
        # Treats "ran dry" as "active", as torch would if it forgot to clear _workers_status.
        awake = tuple(
            WorkerStatus.ACTIVE if status is WorkerStatus.EXHAUSTED else status
            for status in workers
        )
        return real(config, awake, loads, cursor)

    return {"pick_worker": pick}


def _retiring_worker_gets_tasks() -> dict[str, object]:
    real = DEFAULT_POLICY.pick_worker

    def pick(
        config: Config, workers: tuple[WorkerStatus, ...], loads: tuple[int, ...], cursor: int
    ) -> int | None:
        # Treats "retiring" as "active": the turn of a worker a tuner retired is not passed by.
        awake = tuple(
            WorkerStatus.ACTIVE if status is WorkerStatus.RETIRING else status for status in workers
        )
        return real(config, awake, loads, cursor)

    return {"pick_worker": pick}


def _dispatch_before_resume() -> dict[str, object]:
    def resume_complete(workers: tuple[WorkerStatus, ...]) -> bool:
        return WorkerStatus.ACTIVE in workers  # one acknowledgement, where all were needed

    return {"resume_complete": resume_complete}


def _death_loses_tasks() -> dict[str, object]:
    def death_is_fatal(workers: tuple[WorkerStatus, ...], worker: int) -> bool:
        # Quietly writes the worker off instead of failing the loader: its tasks are lost.
        return False

    return {"death_is_fatal": death_is_fatal}


def _resent_task_delivered_twice() -> dict[str, object]:
    def resent(window: tuple[Slot, ...], worker: int) -> tuple[int, ...]:
        # Hands the replacement every task in the window still unanswered, as if they were all
        # the lost worker's: those other workers hold are computed, and delivered, twice.
        return tuple(i for i, slot in enumerate(window) if type(slot) is Pending)

    return {"resent": resent}


def _late_answer_accepted() -> dict[str, object]:
    def lost(incarnation: int, current: int) -> bool:
        # Forgets to compare incarnations: what a lost worker sent before it died, arriving
        # after its replacement started, is taken for the replacement's.
        return False

    return {"lost": lost}


def _lost_tasks_never_resent() -> dict[str, object]:
    def resent(window: tuple[Slot, ...], worker: int) -> tuple[int, ...]:
        # Starts the replacement afresh, with nothing owed: the tasks its slot holds (the lost
        # worker's) are never sent again.
        return ()

    return {"resent": resent}


def _sent_before_started() -> dict[str, object]:
    def sent_at_once(status: WorkerStatus) -> bool:
        # Takes a replacement for running as soon as it was asked for: a task given to it goes
        # out before it has started.
        return status is WorkerStatus.ACTIVE or status is WorkerStatus.STARTING

    return {"sent_at_once": sent_at_once}


def _restarts_not_counted() -> dict[str, object]:
    real = DEFAULT_POLICY.may_replace

    def may_replace(restarts: int, replaced: tuple[WorkerLoss, ...], loss: WorkerLoss) -> bool:
        # Reads worker_restarts as "replace lost workers", never counting the replacements.
        return restarts > 0 and real(restarts, (), loss)

    return {"may_replace": may_replace}


def _finishes_before_asked() -> dict[str, object]:
    def epoch_over(window: tuple[object, ...], drawing_for: int | None, waiting: bool) -> bool:
        # Ends the epoch as soon as its last task is resolved, as if a consumer were asking:
        # the shutdown then rides on the last batch, and the consumer is told the end later.
        return not window and drawing_for is None

    return {"epoch_over": epoch_over}


def _interrupt_skips_the_batch() -> dict[str, object]:
    real = DEFAULT_POLICY.interrupt

    def interrupt(state: State) -> State:
        # Gives up on the batch the consumer was waiting for, as torch does without workers
        # when Ctrl-C lands in the dataset: the batch is never handed over.
        if state.waiting and state.window and state.config.in_order:
            worker = state.window[0].worker  # type: ignore[union-attr]  # never RESOLVED
            rcvd_idx, window = state.rcvd_idx + 1, state.window[1:]
            while window and window[0] is RESOLVED:
                rcvd_idx, window = rcvd_idx + 1, window[1:]
            loads = list(state.loads)
            loads[worker] -= 1
            state = state._replace(rcvd_idx=rcvd_idx, window=window, loads=tuple(loads))
        return real(state)

    return {"interrupt": interrupt}


def _abandoned_acknowledgements_count() -> dict[str, object]:
    def abandoned(acknowledged: int, epoch: int) -> bool:
        # Takes every acknowledgement for one of the current epoch, including those answering
        # a reset the consumer abandoned by interrupting iter().
        return False

    return {"abandoned": abandoned}


def _sampler_error_overtakes_the_batch() -> dict[str, object]:
    def sampler_error_now(waiting: bool, resetting: bool) -> bool:
        # Raises the sampler's error at once, as if the consumer were still waiting, although
        # it was handed a batch in this same call: the batch is lost.
        return True

    return {"sampler_error_now": sampler_error_now}


def _sampler_error_repeats() -> dict[str, object]:
    def failed_request(failure: Failure, reported: bool) -> Command:
        # Forgets that the sampler's error was given: every request raises it again, where
        # torch's spent sampler ends the epoch.
        return RaiseError(failure)

    return {"failed_request": failed_request}


def _sampler_error_passes_iter() -> dict[str, object]:
    def sampler_error_now(waiting: bool, resetting: bool) -> bool:
        # Overlooks that the consumer is inside iter(): iter() returns, and the error waits for
        # the first next().
        return waiting

    return {"sampler_error_now": sampler_error_now}


def _executor_failure_forgotten() -> dict[str, object]:
    real = DEFAULT_POLICY.failed_request

    def failed_request(failure: Failure, reported: bool) -> Command:
        # After the executor broke, later requests are told the epoch ended, not the failure.
        if type(failure) is ExecutorFailure:
            return EndEpoch()
        return real(failure, reported)

    return {"failed_request": failed_request}


def _driver_forgets_interrupts() -> dict[str, object]:
    real = Driver._feed

    def feed(self: Driver, event: Event) -> None:
        # The driver re-raises an interrupt without telling the scheduler, which goes on
        # believing the consumer waits.
        if type(event) is not Interrupted:
            real(self, event)

    return {"Driver._feed": feed}


def _driver_waits_only_in_next() -> dict[str, object]:
    def finish(self: Driver) -> Command | None:
        # Waits while a batch is awaited, but not while iter() is still resetting: iter()
        # returns before every persistent worker resumed.
        while self.handed is None and self.state.waiting:
            self.wait()
        return self.handed

    return {"Driver.finish": finish}


def _with_window(real: Callable[[Driver], Progress], change: Callable[[State], State]) -> Any:
    def progress(self: Driver) -> Progress:
        saved = self.state
        self.state = change(saved)
        try:
            return real(self)
        finally:
            self.state = saved

    return progress


def _checkpoint_counts_buffered_batches() -> dict[str, object]:
    # Takes every answer that arrived for handed over, including those still waiting in the
    # window for their turn or for a consumer: a resumed loader never produces them.
    def buffered_as_handed(state: State) -> State:
        window = [RESOLVED if type(slot) in (Ready, Failed) else slot for slot in state.window]
        rcvd_idx = state.rcvd_idx
        while window and window[0] is RESOLVED:
            rcvd_idx, window = rcvd_idx + 1, window[1:]
        return state._replace(rcvd_idx=rcvd_idx, window=tuple(window))

    return {"Driver.progress": _with_window(Driver.progress, buffered_as_handed)}


def _checkpoint_forgets_early_deliveries() -> dict[str, object]:
    # Records only the prefix of the epoch handed over, as a count of batches yielded would:
    # out of order, batches handed over ahead of the prefix are produced again on resume.
    def handed_as_pending(state: State) -> State:
        window = tuple(Pending(0) if slot is RESOLVED else slot for slot in state.window)
        return state._replace(window=window)

    return {"Driver.progress": _with_window(Driver.progress, handed_as_pending)}


def _checkpoint_at_the_end_starts_the_epoch_over() -> dict[str, object]:
    real = Driver.progress

    def progress(self: Driver) -> Progress:
        # The epoch's counters are reset as it ends: a checkpoint taken between epochs says
        # nothing was handed over, and a resumed loader runs the finished epoch again.
        if self.state.phase is Phase.FINISHED:
            return Progress()
        return real(self)

    return {"Driver.progress": progress}


def _checkpoint_counts_what_the_consumer_never_got() -> dict[str, object]:
    def progress(self: Driver) -> Progress:
        # Believes the scheduler: a batch it handed over counts, even when an interrupt kept it
        # in the driver for the next request, or the executor's failure was raised instead.
        return core_progress(self.state)

    return {"Driver.progress": progress}


def _iterable_resume_forgets_the_turn() -> dict[str, object]:
    def resume_turn(config: Config, resume: Progress) -> int:
        # Resumes an iterable dataset's workers with worker 0's turn, as a fresh epoch starts:
        # the same batches come back, in another order.
        return 0

    return {"resume_turn": resume_turn}


def _worker_marks_count_prefetched_batches() -> dict[str, object]:
    real = Driver.wait

    def wait(self: Driver) -> Command | None:
        # Keeps each worker's latest mark as it arrives, as a loader that saves its workers'
        # latest state would: the batches buffered behind the consumer are lost on resume.
        outcome = real(self)
        marks = self.worker_marks
        if marks is not None:
            for task, _ in marks.answered:
                marks = marks.receive(task)
            self.worker_marks = marks
        return outcome

    return {"Driver.wait": wait}


# --- witnesses: default scenarios (see `default_scenarios`) that show each bug ------------------

_SIX = MapSpec(6, frozenset({1}))
"""The default bounds' map-style dataset: six batches, the second one raising."""
_FAULTS: dict[str, Any] = {"interrupts": 1}
"""What may go wrong in a default scenario: a death, a timeout, a close, an interrupt."""
_FAILURES: dict[str, Any] = {
    "deaths": 0,
    "timeouts": False,
    "sampler_failures": 1,
    "executor_failures": 1,
}
"""...or instead the sampler raising and the executor breaking (one or two workers)."""


def _config(workers: int, restarts: int = 0, **flags: bool) -> Config:
    return Config(num_workers=workers, prefetch_factor=1, restarts=restarts, **flags)


_ONE_WORKER = Scenario(_config(1), _SIX, **_FAULTS)
_ONE_WORKER_FAILING = Scenario(_config(1), _SIX, **_FAILURES)
_TWO_ITERABLE = Scenario(
    _config(2, iterable=True), IterableSpec((4, 0), frozenset({(0, 1)})), **_FAULTS
)
"""Two iterable workers, the second with an empty shard."""
_COME_AND_GO: dict[str, Any] = {"deaths": 3, "hangs": 1, "timeouts": False, "closes": False}
"""What may go wrong where workers come and go (`restart_scenarios`): with two restarts, three
deaths and a hang."""
_ONE_WORKER_RESTARTED = Scenario(_config(1, restarts=2), MapSpec(4, frozenset({1})), **_COME_AND_GO)
_TWO_WORKERS_RESTARTED = Scenario(
    _config(2, restarts=2), MapSpec(4, frozenset({1})), **_COME_AND_GO
)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "prefetch-off-by-one",
        "a worker may hold prefetch_factor + 1 unresolved tasks",
        _prefetch_off_by_one,
        witness=_ONE_WORKER,
    ),
    Mutant(
        "early-delivery",
        "with in_order=True, an answer is handed over as soon as it arrives",
        _early_delivery,
        witness=_ONE_WORKER,
    ),
    Mutant(
        "dry-worker-gets-tasks",
        "a worker whose iterable ran dry is still given tasks",
        _dry_worker_gets_tasks,
        witness=_TWO_ITERABLE,
    ),
    Mutant(
        "dispatch-before-resume",
        "tasks are sent once any persistent worker has acknowledged the new epoch",
        _dispatch_before_resume,
        witness=Scenario(_config(2, persistent_workers=True), _SIX, epochs=2, **_FAULTS),
    ),
    Mutant(
        "death-loses-tasks",
        "a dead worker is written off silently and its tasks are lost",
        _death_loses_tasks,
        witness=_ONE_WORKER,
    ),
    Mutant(
        "finishes-before-asked",
        "the epoch finishes, and stops workers that do not persist, with the last batch",
        _finishes_before_asked,
        witness=_ONE_WORKER,
    ),
    Mutant(
        "interrupt-skips-the-batch",
        "an interrupted next() gives up the batch it waited for",
        _interrupt_skips_the_batch,
        witness=_ONE_WORKER,
    ),
    Mutant(
        "abandoned-acknowledgements-count",
        "after an interrupted iter(), acknowledgements of the abandoned reset count for the new",
        _abandoned_acknowledgements_count,
        witness=Scenario(
            _config(1, persistent_workers=True),
            MapSpec(2, frozenset({1})),
            epochs=3,
            deaths=0,
            interrupts=1,
        ),
    ),
    Mutant(
        "sampler-error-overtakes-the-batch",
        "the sampler's error is raised in the call that was handed a batch, which is lost",
        _sampler_error_overtakes_the_batch,
        witness=_ONE_WORKER_FAILING,
    ),
    Mutant(
        "sampler-error-repeats",
        "after the sampler's error was raised, later requests raise it again instead of ending",
        _sampler_error_repeats,
        witness=_ONE_WORKER_FAILING,
    ),
    Mutant(
        "sampler-error-passes-iter",
        "a sampler failing while iter() draws the first indices does not fail iter()",
        _sampler_error_passes_iter,
        witness=Scenario(_config(1, persistent_workers=True), _SIX, epochs=2, **_FAILURES),
    ),
    Mutant(
        "executor-failure-forgotten",
        "after the executor broke, later requests end the epoch instead of raising",
        _executor_failure_forgotten,
        witness=_ONE_WORKER_FAILING,
    ),
    Mutant(
        "driver-forgets-interrupts",
        "the driver does not tell the scheduler that a wait was interrupted",
        _driver_forgets_interrupts,
        witness=_ONE_WORKER,
    ),
    Mutant(
        "driver-waits-only-in-next",
        "the driver's iter() returns without waiting for persistent workers to resume",
        _driver_waits_only_in_next,
        witness=Scenario(_config(1, persistent_workers=True), _SIX, epochs=2, **_FAULTS),
    ),
    Mutant(
        "checkpoint-counts-buffered-batches",
        "a checkpoint counts batches buffered for the consumer as handed over: resumes drop them",
        _checkpoint_counts_buffered_batches,
        witness=Scenario(_config(2), _SIX, **_FAULTS),
    ),
    Mutant(
        "checkpoint-forgets-early-deliveries",
        "out of order, a checkpoint forgets batches handed over early: resumes repeat them",
        _checkpoint_forgets_early_deliveries,
        witness=Scenario(_config(2, in_order=False), _SIX, **_FAULTS),
    ),
    Mutant(
        "checkpoint-at-the-end-starts-the-epoch-over",
        "a checkpoint between epochs resumes the finished epoch again instead of the next",
        _checkpoint_at_the_end_starts_the_epoch_over,
        witness=_ONE_WORKER,
    ),
    Mutant(
        "checkpoint-counts-what-the-consumer-never-got",
        "a checkpoint counts a batch an interrupt or an executor failure kept from the consumer",
        _checkpoint_counts_what_the_consumer_never_got,
        witness=Scenario(_config(2), _SIX, **_FAILURES),
    ),
    Mutant(
        "iterable-resume-forgets-the-turn",
        "an iterable dataset's resumed epoch starts with worker 0's turn, not the next worker's",
        _iterable_resume_forgets_the_turn,
        witness=Scenario(
            _config(3, iterable=True), IterableSpec((3, 2, 0), frozenset({(0, 1)})), **_FAULTS
        ),
    ),
    Mutant(
        "worker-marks-count-prefetched-batches",
        "a checkpoint keeps each iterable worker's latest state, past batches not yet handed over",
        _worker_marks_count_prefetched_batches,
        witness=_TWO_ITERABLE,
    ),
    Mutant(
        "resent-task-delivered-twice",
        "a started replacement is sent the tasks other workers hold too: each would come twice",
        _resent_task_delivered_twice,
        witness=_TWO_WORKERS_RESTARTED,
        acts_in=restart_scenarios,
    ),
    Mutant(
        "late-answer-accepted",
        "news a lost worker sent before it ended (an answer, its death), arriving late, is taken "
        "for its replacement's",
        _late_answer_accepted,
        witness=_ONE_WORKER_RESTARTED,
        acts_in=restart_scenarios,
    ),
    Mutant(
        "lost-tasks-never-resent",
        "the tasks a lost worker held are never sent to its replacement",
        _lost_tasks_never_resent,
        witness=_ONE_WORKER_RESTARTED,
        acts_in=restart_scenarios,
    ),
    Mutant(
        "sent-before-started",
        "a task given to a replacement goes out before the replacement has started",
        _sent_before_started,
        # Only a slot with room takes a task while its replacement starts: one lost while the
        # workers resume for a new epoch, holding nothing.
        witness=Scenario(
            _config(1, restarts=2, persistent_workers=True),
            MapSpec(2, frozenset({1})),
            epochs=2,
            **_COME_AND_GO,
        ),
        acts_in=restart_scenarios,
    ),
    Mutant(
        "restarts-not-counted",
        "lost workers are replaced however many were before: worker_restarts is never spent",
        _restarts_not_counted,
        witness=_ONE_WORKER_RESTARTED,
        acts_in=restart_scenarios,
    ),
    Mutant(
        "retiring-worker-gets-tasks",
        "a worker a tuner retired still takes its turns, so it is never stopped",
        _retiring_worker_gets_tasks,
        witness=Scenario(
            Config(num_workers=2, prefetch_factor=2),
            MapSpec(6),
            deaths=0,
            tunes=1,
            prefetches=2,
            timeouts=False,
            closes=False,
        ),
        acts_in=tuning_scenarios,
    ),
)


# --- the loader's checkpoint code ---------------------------------------------------------------


@attrs.frozen
class LoaderMutant:
    """One deliberate bug in the loader's checkpoint code (`statecore.executors._loader`),
    which the loader-level machine (`statecore.models.loader`) must catch. `replacements`
    maps attribute names of `_loader`'s classes and functions ("DataLoader._position",
    "parse") to wrong versions; a name with a module before a colon is that module's
    ("statecore.executors._worker:WorkerRuntime._mark": the worker's side of a checkpoint,
    which runs in this process under the inline and thread executors)."""

    name: str
    description: str
    replacements: Callable[[], dict[str, object]] = attrs.field(repr=False)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Install the bug while the block runs; restore the real code after."""
        import importlib

        from statecore.executors import _loader

        saved: list[tuple[object, str, object]] = []
        try:
            for path, value in self.replacements().items():
                module, _, path = path.rpartition(":")
                *owners, name = path.split(".")
                owner: object = importlib.import_module(module) if module else _loader
                for part in owners:
                    owner = getattr(owner, part)
                saved.append((owner, name, vars(owner)[name]))
                setattr(owner, name, value)
            yield
        finally:
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)


def _break_then_save_restarts_the_epoch() -> dict[str, object]:
    from statecore.executors._loader import DataLoader

    def position(self: DataLoader[Any]) -> Any:
        # Only an iterator someone still holds is asked: the one a `break` dropped is not.
        iterator = self._latest() if self._latest is not None else None
        if iterator is not None and iterator._epoch is not None:
            return iterator._position()
        return None

    return {"DataLoader._position": position}


def _persistent_resume_draws_a_fresh_seed() -> dict[str, object]:
    from statecore.executors._loader import _Iterator

    real = _Iterator.__init__

    def init(self: _Iterator, loader: Any) -> None:
        # A state taken between epochs forgets its base seed: the resumed loader draws one,
        # which the original's persistent iterator never drew.
        resume = loader._resume
        if resume is not None and resume.complete:
            loader._resume = attrs.evolve(resume, base_seed=None)
        real(self, loader)

    return {"_Iterator.__init__": init}


def _short_len_cuts_the_epoch() -> dict[str, object]:
    from statecore.executors._loader import _Iterator

    real = _Iterator._position

    def position(self: _Iterator) -> Any:
        # Complete once len(sampler) batches were handed over, as if __len__ could not lie.
        where = real(self)
        try:
            promised = len(self._index_sampler)
        except TypeError:
            return where
        if where is not None and not where.complete and where.progress.done >= promised:
            return attrs.evolve(where, complete=True)
        return where

    return {"_Iterator._position": position}


def _dry_worker_starts_its_part_again() -> dict[str, object]:
    from statecore.executors._loader import _Iterator
    from statecore.executors._worker import Mark, WorkerRuntime

    real_position = _Iterator._position
    real_mark = WorkerRuntime._mark

    def position(self: _Iterator) -> Any:
        # The checkpoint forgets which workers were found dry: the resumed scheduler asks them.
        where = real_position(self)
        if where is None:
            return None
        return attrs.evolve(where, progress=attrs.evolve(where.progress, dry=frozenset()))

    def mark(self: WorkerRuntime) -> Mark:
        # And a short last batch, which ran the iterator dry, sends the state as it stands
        # then: a dataset that goes back to its start when dry says "the start". Either half
        # alone is covered by the other's fix; together they are defect 3 as it was.
        fetcher = self.fetcher
        ended, fetcher.ended = fetcher.ended, False
        try:
            return real_mark(self)
        finally:
            fetcher.ended = ended

    return {
        "_Iterator._position": position,
        "statecore.executors._worker:WorkerRuntime._mark": mark,
    }


def _loaded_ahead_is_forgotten() -> dict[str, object]:
    from statecore.executors._checkpoint import EpochRecord
    from statecore.executors._worker import Mark

    def carried_in(
        record: EpochRecord, driver: Driver, workers: int, iterable: bool
    ) -> tuple[list[Mark | None] | None, frozenset[int]]:
        # An epoch broken out of leaves each worker where the epoch before had left it, as if
        # the workers had loaded nothing in it that no one received.
        carried = None if record.carried is None else list(record.carried)
        return carried, record.carried_open

    return {"_carried_in": carried_in}


LOADER_MUTANTS: tuple[LoaderMutant, ...] = (
    LoaderMutant(
        "break-then-save-restarts-the-epoch",
        "a state taken after a break describes no epoch: the resumed run skips the rest",
        _break_then_save_restarts_the_epoch,
    ),
    LoaderMutant(
        "persistent-resume-draws-a-fresh-seed",
        "a state taken after StopIteration resumes the next epoch with a freshly drawn seed",
        _persistent_resume_draws_a_fresh_seed,
    ),
    LoaderMutant(
        "short-len-cuts-the-epoch",
        "a sampler's __len__ marks the epoch complete, though the sampler yields more",
        _short_len_cuts_the_epoch,
    ),
    LoaderMutant(
        "dry-worker-starts-its-part-again",
        "a worker that ran dry is asked again on resume, from the state its dataset went back "
        "to: its part of an iterable dataset comes out again",
        _dry_worker_starts_its_part_again,
    ),
    LoaderMutant(
        "loaded-ahead-is-forgotten",
        "persistent workers broken out of had loaded batches ahead that no one received: a "
        "state taken in the next epoch resumes their datasets from before those batches",
        _loaded_ahead_is_forgotten,
    ),
)
