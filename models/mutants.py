"""Deliberate bugs in the scheduler, to show that the models catch them.

A checker that never fails proves nothing. Each mutant here swaps one piece of policy in
`statecore._step`, or one move of the driver loop in `statecore.executors._driver`, for a
plausible wrong version, the kind of slip torch's hand-kept counters invite. `mutant.applied()`
installs it for the duration of a `with` block; the tests then run the explorer and the
Hypothesis machines, which drive the real driver over the core, and expect a violation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from statecore import (
    RESOLVED,
    Command,
    Config,
    EndEpoch,
    Event,
    ExecutorFailure,
    Failed,
    Interrupted,
    Pending,
    Phase,
    Progress,
    Ready,
    SamplerFailure,
    State,
    Transition,
    WorkerDied,
    WorkerResumed,
    WorkerStatus,
)
from statecore import _step as core
from statecore import progress as core_progress
from statecore.executors._driver import Driver

__all__ = ["LOADER_MUTANTS", "MUTANTS", "LoaderMutant", "Mutant"]


@attrs.frozen
class Mutant:
    """One deliberate bug: `replacements` maps names in `statecore._step` (or, prefixed with
    `Driver.`, methods of the driver) to wrong versions."""

    name: str
    description: str
    replacements: Callable[[], dict[str, object]] = attrs.field(repr=False)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Install the bug in the core while the block runs; restore the real code after."""
        replacements = self.replacements()
        methods = {
            name.removeprefix("Driver."): value
            for name, value in replacements.items()
            if name.startswith("Driver.")
        }
        replacements = {n: v for n, v in replacements.items() if not n.startswith("Driver.")}
        saved = {name: getattr(core, name) for name in replacements}
        saved_methods = {name: vars(Driver)[name] for name in methods}
        saved_handlers = dict(core._HANDLERS)
        saved_routes = core._ROUTES
        try:
            for name, value in methods.items():
                setattr(Driver, name, value)
            for name, value in replacements.items():
                setattr(core, name, value)
            # Handlers are looked up through the dispatch table, not by name, and `step` through
            # the routes drawn from it.
            for event_type, handler in list(core._HANDLERS.items()):
                replacement = replacements.get(handler.__name__)
                if replacement is not None:
                    core._HANDLERS[event_type] = replacement  # type: ignore[assignment]
            core._ROUTES = core._routes()
            yield
        finally:
            for name, value in saved_methods.items():
                setattr(Driver, name, value)
            for name, value in saved.items():
                setattr(core, name, value)
            core._HANDLERS.clear()
            core._HANDLERS.update(saved_handlers)
            core._ROUTES = saved_routes


def _prefetch_off_by_one() -> dict[str, object]:
    real = core._pick_worker

    def pick(
        config: Config, workers: tuple[WorkerStatus, ...], loads: tuple[int, ...], cursor: int
    ) -> int | None:
        # `<=` where `<` was meant: one task more per worker than prefetch_factor allows.
        roomier = attrs.evolve(config, prefetch_factor=config.prefetch_factor + 1)
        return real(roomier, workers, loads, cursor)

    return {"_pick_worker": pick}


def _early_delivery() -> dict[str, object]:
    real = core._deliverable

    def deliverable(window: tuple[object, ...], in_order: bool) -> int | None:
        return real(window, False)  # type: ignore[arg-type]

    return {"_deliverable": deliverable}


def _dry_worker_gets_tasks() -> dict[str, object]:
    real = core._pick_worker

    def pick(
        config: Config, workers: tuple[WorkerStatus, ...], loads: tuple[int, ...], cursor: int
    ) -> int | None:
        # Treats "ran dry" as "active", as torch would if it forgot to clear _workers_status.
        awake = tuple(
            WorkerStatus.ACTIVE if status is WorkerStatus.EXHAUSTED else status
            for status in workers
        )
        return real(config, awake, loads, cursor)

    return {"_pick_worker": pick}


def _dispatch_before_resume() -> dict[str, object]:
    return {"_resume_complete": lambda workers: True}


def _death_loses_tasks() -> dict[str, object]:
    def on_died(state: State, event: Event) -> Transition:
        # Quietly writes the worker off instead of failing the loader: its tasks are lost.
        assert isinstance(event, WorkerDied)
        workers = list(state.life.workers)
        workers[event.worker] = WorkerStatus.STOPPED
        life = attrs.evolve(state.life, workers=tuple(workers))
        return Transition(state._replace(life=life), ())

    return {"_on_died": on_died}


def _finishes_before_asked() -> dict[str, object]:
    real = core._settle

    def settle(*arguments: Any) -> Transition:
        # Ends the epoch as soon as its last task is resolved, as if a consumer were asking:
        # the shutdown then rides on the last batch, and the consumer is told the end later.
        settled: Transition = real(*arguments)
        after = settled.state
        over = core._epoch_over(after.window, after.drawing_for)
        if after.phase is not Phase.DRAINING or not over:
            return settled
        again = (after.config, after.life, after.rcvd_idx, after.window, after.loads, after.cursor)
        early = real(*again, after.drawing_for, True, settled.commands)
        assert early.commands[-1] == EndEpoch()
        return Transition(early.state, early.commands[:-1])  # no one asked, so no one is told

    return {"_settle": settle}


def _interrupt_skips_the_batch() -> dict[str, object]:
    real = core._on_interrupted

    def on_interrupted(state: State, event: Event) -> Transition:
        # Gives up on the batch the consumer was waiting for, as torch does without workers
        # when Ctrl-C lands in the dataset: the batch is never handed over.
        assert isinstance(event, Interrupted)
        if state.waiting and state.window and state.config.in_order:
            slot = state.window[0]
            rcvd_idx, window = core._resolve(state.rcvd_idx, state.window, 0)
            loads = core._add(state.loads, slot.worker, -1)  # type: ignore[union-attr]
            state = state._replace(rcvd_idx=rcvd_idx, window=window, loads=loads)
        return real(state, event)

    return {"_on_interrupted": on_interrupted}


def _abandoned_acknowledgements_count() -> dict[str, object]:
    real = core._on_resumed

    def on_resumed(state: State, event: Event) -> Transition:
        # Takes every acknowledgement for one of the current epoch, including those answering
        # a reset the consumer abandoned by interrupting iter().
        assert isinstance(event, WorkerResumed)
        return real(state, attrs.evolve(event, epoch=state.life.epoch))

    return {"_on_resumed": on_resumed}


def _sampler_error_overtakes_the_batch() -> dict[str, object]:
    real = core._on_sampler_failed

    def on_sampler_failed(state: State, event: Event) -> Transition:
        # Raises the sampler's error at once, as if the consumer were still waiting, although
        # it was handed a batch in this same call: the batch is lost.
        return real(state._replace(waiting=True), event)  # type: ignore[arg-type]

    return {"_on_sampler_failed": on_sampler_failed}


def _sampler_error_repeats() -> dict[str, object]:
    real = core._on_next

    def on_next(state: State, event: Event) -> Transition:
        # Forgets that the sampler's error was given: every request raises it again, where
        # torch's spent sampler ends the epoch.
        life = state.life
        if life.phase is Phase.FAILED and type(life.failure) is SamplerFailure:
            state = state._replace(life=attrs.evolve(life, reported=False))
        return real(state, event)  # type: ignore[arg-type]

    return {"_on_next": on_next}


def _sampler_error_passes_iter() -> dict[str, object]:
    real = core._on_sampler_failed

    def on_sampler_failed(state: State, event: Event) -> Transition:
        # Overlooks that the consumer is inside iter(): iter() returns, and the error waits for
        # the first next().
        life = attrs.evolve(state.life, resetting=False)
        return real(state._replace(life=life), event)  # type: ignore[arg-type]

    return {"_on_sampler_failed": on_sampler_failed}


def _executor_failure_forgotten() -> dict[str, object]:
    real = core._on_next

    def on_next(state: State, event: Event) -> Transition:
        # After the executor broke, later requests are told the epoch ended, not the failure.
        if state.life.phase is Phase.FAILED and type(state.life.failure) is ExecutorFailure:
            return Transition(state, (EndEpoch(),))
        return real(state, event)  # type: ignore[arg-type]

    return {"_on_next": on_next}


def _driver_forgets_interrupts() -> dict[str, object]:
    real = Driver._feed

    def feed(self: Driver, event: Event) -> None:
        # The driver re-raises an interrupt without telling the scheduler, which goes on
        # believing the consumer waits.
        if type(event) is not Interrupted:
            real(self, event)

    return {"Driver._feed": feed}


def _driver_waits_only_in_next() -> dict[str, object]:
    def finish(self: Driver, outcome: Command | None) -> Command | None:
        # Waits while a batch is awaited, but not while iter() is still resetting: iter()
        # returns before every persistent worker resumed.
        while outcome is None and self.state.waiting:
            outcome = self.wait()
        return outcome

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
        rcvd_idx, window = state.rcvd_idx, state.window
        arrived = [i for i, slot in enumerate(window) if type(slot) in (Ready, Failed)]
        while arrived:
            rcvd_idx, window = core._resolve(rcvd_idx, window, arrived[0])
            arrived = [i for i, slot in enumerate(window) if type(slot) in (Ready, Failed)]
        return state._replace(rcvd_idx=rcvd_idx, window=window)

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
    real = core._on_reset

    def _on_reset(state: State, event: Any) -> Transition:
        # Resumes an iterable dataset's workers with worker 0's turn, as a fresh epoch starts:
        # the same batches come back, in another order.
        if event.resume is not None:
            event = attrs.evolve(event, resume=attrs.evolve(event.resume, turn=0))
        return real(state, event)

    return {"_on_reset": _on_reset}


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


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "prefetch-off-by-one",
        "a worker may hold prefetch_factor + 1 unresolved tasks",
        _prefetch_off_by_one,
    ),
    Mutant(
        "early-delivery",
        "with in_order=True, an answer is handed over as soon as it arrives",
        _early_delivery,
    ),
    Mutant(
        "dry-worker-gets-tasks",
        "a worker whose iterable ran dry is still given tasks",
        _dry_worker_gets_tasks,
    ),
    Mutant(
        "dispatch-before-resume",
        "tasks are sent once any persistent worker has acknowledged the new epoch",
        _dispatch_before_resume,
    ),
    Mutant(
        "death-loses-tasks",
        "a dead worker is written off silently and its tasks are lost",
        _death_loses_tasks,
    ),
    Mutant(
        "finishes-before-asked",
        "the epoch finishes, and stops workers that do not persist, with the last batch",
        _finishes_before_asked,
    ),
    Mutant(
        "interrupt-skips-the-batch",
        "an interrupted next() gives up the batch it waited for",
        _interrupt_skips_the_batch,
    ),
    Mutant(
        "abandoned-acknowledgements-count",
        "after an interrupted iter(), acknowledgements of the abandoned reset count for the new",
        _abandoned_acknowledgements_count,
    ),
    Mutant(
        "sampler-error-overtakes-the-batch",
        "the sampler's error is raised in the call that was handed a batch, which is lost",
        _sampler_error_overtakes_the_batch,
    ),
    Mutant(
        "sampler-error-repeats",
        "after the sampler's error was raised, later requests raise it again instead of ending",
        _sampler_error_repeats,
    ),
    Mutant(
        "sampler-error-passes-iter",
        "a sampler failing while iter() draws the first indices does not fail iter()",
        _sampler_error_passes_iter,
    ),
    Mutant(
        "executor-failure-forgotten",
        "after the executor broke, later requests end the epoch instead of raising",
        _executor_failure_forgotten,
    ),
    Mutant(
        "driver-forgets-interrupts",
        "the driver does not tell the scheduler that a wait was interrupted",
        _driver_forgets_interrupts,
    ),
    Mutant(
        "driver-waits-only-in-next",
        "the driver's iter() returns without waiting for persistent workers to resume",
        _driver_waits_only_in_next,
    ),
    Mutant(
        "checkpoint-counts-buffered-batches",
        "a checkpoint counts batches buffered for the consumer as handed over: resumes drop them",
        _checkpoint_counts_buffered_batches,
    ),
    Mutant(
        "checkpoint-forgets-early-deliveries",
        "out of order, a checkpoint forgets batches handed over early: resumes repeat them",
        _checkpoint_forgets_early_deliveries,
    ),
    Mutant(
        "checkpoint-at-the-end-starts-the-epoch-over",
        "a checkpoint between epochs resumes the finished epoch again instead of the next",
        _checkpoint_at_the_end_starts_the_epoch_over,
    ),
    Mutant(
        "checkpoint-counts-what-the-consumer-never-got",
        "a checkpoint counts a batch an interrupt or an executor failure kept from the consumer",
        _checkpoint_counts_what_the_consumer_never_got,
    ),
    Mutant(
        "iterable-resume-forgets-the-turn",
        "an iterable dataset's resumed epoch starts with worker 0's turn, not the next worker's",
        _iterable_resume_forgets_the_turn,
    ),
    Mutant(
        "worker-marks-count-prefetched-batches",
        "a checkpoint keeps each iterable worker's latest state, past batches not yet handed over",
        _worker_marks_count_prefetched_batches,
    ),
)


# --- the loader's checkpoint code ---------------------------------------------------------------


@attrs.frozen
class LoaderMutant:
    """One deliberate bug in the loader's checkpoint code (`statecore.executors._loader`),
    which the loader-level machine (`statecore.models.loader`) must catch. `replacements`
    maps attribute names of `_loader`'s classes and functions ("DataLoader._position",
    "parse") to wrong versions."""

    name: str
    description: str
    replacements: Callable[[], dict[str, object]] = attrs.field(repr=False)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Install the bug while the block runs; restore the real code after."""
        from statecore.executors import _loader

        saved: list[tuple[object, str, object]] = []
        try:
            for path, value in self.replacements().items():
                *owners, name = path.split(".")
                owner: object = _loader
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
)
