"""Hypothesis state machines that drive the scheduler through a simulated world.

`scheduler_machine(scenarios, step)` builds a `RuleBasedStateMachine` whose rules are the
world's actions (a consumer asking, a worker answering, dying or found stuck, a lost worker's
late answer, a timeout, an interrupt, the sampler raising, the executor breaking, a close, a new
epoch, a tuner retiring a worker or adding a retired one back or changing the prefetch bound, a
checkpoint resumed in a fresh
loader with any number of workers) and whose invariants are every
check of `statecore.models.world`, made on the real driver (`statecore.executors._driver`)
running the core. It takes the step function, so the same machine checks the real core, a
deliberately broken one (`statecore.models.mutants`), or any other step function.

Failures print as a runnable program: every rule argument is a small integer and every
scenario a valid Python expression.
"""

from __future__ import annotations

from typing import TypeVar

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from statecore import Config
from statecore import step as core_step
from statecore.models.reference import IterableSpec, MapSpec
from statecore.models.world import (
    Action,
    Add,
    Break,
    Close,
    Expire,
    Interrupt,
    Kill,
    Late,
    Next,
    Preempt,
    Prefetch,
    Restart,
    Retire,
    SamplerRaises,
    Scenario,
    Stall,
    StepFunction,
    Violation,
    Work,
    World,
    check_checkpoint,
)

__all__ = ["scenarios", "scheduler_machine"]

_Kind = TypeVar("_Kind", bound=Action)


@st.composite
def scenarios(
    draw: st.DrawFn, max_workers: int = 4, max_prefetch: int = 3, max_batches: int = 12
) -> Scenario:
    """Configurations larger than the explorer can afford, with failing tasks sprinkled in."""
    workers = draw(st.integers(1, max_workers), label="workers")
    persistent = draw(st.booleans(), label="persistent")
    config = Config(
        num_workers=workers,
        prefetch_factor=draw(st.integers(1, max_prefetch), label="prefetch"),
        in_order=draw(st.booleans(), label="in_order"),
        iterable=draw(st.booleans(), label="iterable"),
        persistent_workers=persistent,
        lazy=draw(st.booleans(), label="lazy") if workers == 1 else False,
        restarts=draw(st.integers(0, 2), label="restarts"),
    )
    dataset: MapSpec | IterableSpec
    if config.iterable:
        lengths = tuple(
            draw(
                st.lists(st.integers(0, max_batches // workers), min_size=workers, max_size=workers)
            )
        )
        pairs = [(w, k) for w, length in enumerate(lengths) for k in range(length)]
        failing = draw(st.frozensets(st.sampled_from(pairs), max_size=2)) if pairs else frozenset()
        dataset = IterableSpec(lengths, failing)
    else:
        batches = draw(st.integers(0, max_batches), label="batches")
        failing_map = (
            draw(st.frozensets(st.integers(0, batches - 1), max_size=2)) if batches else frozenset()
        )
        dataset = MapSpec(batches, failing_map)
    epochs = draw(st.integers(1, 3), label="epochs") if persistent else 1
    # Faults end runs early; scenarios without some of them let runs go long and deep.
    scenario = Scenario(
        config,
        dataset,
        epochs=epochs,
        # Up to one loss more than the restarts, to spend them all and fail the loader.
        deaths=draw(st.integers(0, config.restarts + 1), label="deaths"),
        hangs=draw(st.integers(0, 1), label="hangs"),
        killable=draw(st.booleans(), label="killable"),
        timeouts=draw(st.booleans(), label="timeouts"),
        closes=draw(st.booleans(), label="closes"),
        interrupts=draw(st.integers(0, 2), label="interrupts"),
        # One run in four each: a broken executor ends a run at once, and would otherwise
        # crowd out the long runs (several epochs, interrupted resets) other bugs need.
        sampler_failures=draw(st.sampled_from((0, 0, 0, 1)), label="sampler_failures"),
        executor_failures=draw(st.sampled_from((0, 0, 0, 1)), label="executor_failures"),
    )
    if not (isinstance(dataset, IterableSpec) or workers == 1):
        # A worker is retired only if another stays to take the tasks, and never an iterable
        # dataset's: its shard would be lost with it. Drawn after the draws above, so that
        # they (and the runs they shape) stay as they were.
        tunes = draw(st.integers(0, 4), label="tunes")
        if tunes:
            # A tuner's choice matters while the sampler has indices left to give: more
            # batches than the window holds, so that a retiring worker could be handed another.
            window = workers * config.prefetch_factor
            batches = max(dataset.batches, window + draw(st.integers(1, 4), label="beyond"))
            dataset = MapSpec(batches, dataset.failing)
        scenario = attrs.evolve(scenario, dataset=dataset, tunes=tunes)
    if config.lazy:
        return scenario  # read on demand: nothing is prefetched, so there is no bound to change
    # Last: a tuner changing the prefetch bound, of any dataset's workers.
    return attrs.evolve(scenario, prefetches=draw(st.integers(0, 3), label="prefetches"))


def scheduler_machine(
    scenario_strategy: st.SearchStrategy[Scenario] | None = None,
    step: StepFunction = core_step,
) -> type[RuleBasedStateMachine]:
    """A state machine class checking `step` in scenarios drawn from `scenario_strategy`.

    Run it with `run_state_machine_as_test(scheduler_machine())` or expose its `TestCase`
    attribute to pytest.
    """
    drawn = scenarios() if scenario_strategy is None else scenario_strategy

    class SchedulerMachine(RuleBasedStateMachine):
        world: World

        def _apply(self, action: Action) -> None:
            self.world = self.world.apply(action, step)

        listed: tuple[World | None, tuple[Action, ...]] = (None, ())
        """The world whose actions were listed last, and those actions: each rule's
        precondition asks for one kind of them, so they are listed once per world."""

        def _enabled(self, kind: type[_Kind]) -> list[_Kind]:
            world, actions = self.listed
            if world is not self.world:
                actions = tuple(self.world.actions())
                self.listed = (self.world, actions)
            return [action for action in actions if type(action) is kind]

        @initialize(scenario=drawn)
        def start(self, scenario: Scenario) -> None:
            self.world = World.start(scenario, step)

        @precondition(lambda self: bool(self._enabled(Next)))
        @rule()
        def consumer_asks(self) -> None:
            self._apply(Next())

        @precondition(lambda self: bool(self._enabled(Work)))
        @rule(choice=st.integers(0, 7))
        def worker_answers(self, choice: int) -> None:
            options = self._enabled(Work)
            self._apply(options[choice % len(options)])

        @precondition(lambda self: bool(self._enabled(Kill)))
        @rule(choice=st.integers(0, 7))
        def worker_dies(self, choice: int) -> None:
            options = self._enabled(Kill)
            self._apply(options[choice % len(options)])

        @precondition(lambda self: bool(self._enabled(Late)))
        @rule(choice=st.integers(0, 7))
        def lost_worker_answers_late(self, choice: int) -> None:
            options = self._enabled(Late)
            self._apply(options[choice % len(options)])

        @precondition(lambda self: bool(self._enabled(Stall)))
        @rule()
        def awaited_worker_is_found_stuck(self) -> None:
            self._apply(Stall())

        @precondition(lambda self: bool(self._enabled(Expire)))
        @rule()
        def wait_times_out(self) -> None:
            self._apply(Expire())

        @precondition(lambda self: bool(self._enabled(Interrupt)))
        @rule()
        def consumer_is_interrupted(self) -> None:
            self._apply(Interrupt())

        @precondition(lambda self: bool(self._enabled(Interrupt)))
        @rule()
        def consumer_interrupts_and_starts_over(self) -> None:
            # The notebook user's habit: Ctrl-C in a cell, then run the cell again.
            self._apply(Interrupt())
            if self._enabled(Restart):
                self._apply(Restart())

        @precondition(lambda self: bool(self._enabled(SamplerRaises)))
        @rule()
        def sampler_raises(self) -> None:
            self._apply(SamplerRaises())

        @precondition(lambda self: bool(self._enabled(Break)))
        @rule()
        def executor_breaks(self) -> None:
            self._apply(Break())

        @precondition(lambda self: bool(self._enabled(Close)))
        @rule()
        def consumer_closes(self) -> None:
            self._apply(Close())

        @precondition(lambda self: bool(self._enabled(Restart)))
        @rule()
        def consumer_starts_next_epoch(self) -> None:
            self._apply(Restart())

        @precondition(lambda self: bool(self._enabled(Retire)))
        @rule(choice=st.integers(0, 7))
        def tuner_retires_a_worker(self, choice: int) -> None:
            # Between the consumer's calls, while an epoch runs or drains: a running worker with
            # no index drawn for it, another worker staying to take tasks (the world offers
            # only what the core accepts).
            options = self._enabled(Retire)
            self._apply(options[choice % len(options)])

        @precondition(lambda self: bool(self._enabled(Retire)))
        @rule(choice=st.integers(0, 7), back=st.booleans())
        def tuner_retires_a_worker_and_the_loader_goes_on(self, choice: int, back: bool) -> None:
            # What a retirement is for: the consumer goes on asking, the retiring worker answers
            # what it holds (others when it owes nothing the consumer waits for), until it is
            # stopped; then, if `back`, the tuner changes its mind and adds the slot back. Each
            # step alone is one of the rules here; in a row, they reach what a random walk
            # seldom does before a fault or a checkpoint intervenes: the retiring worker's turn
            # coming round while it has room for another task.
            options = self._enabled(Retire)
            worker = options[choice % len(options)].worker
            self._apply(Retire(worker))
            for _ in range(4 * self.world.scenario.config.num_workers * (self._batches() + 1)):
                if worker not in self.world.retiring or self.world.outcome is not None:
                    break
                own = [a for a in self._enabled(Work) if a.worker == worker]
                going_on: list[Action] = [*own] or [*self._enabled(Next), *self._enabled(Work)]
                if not going_on:
                    return  # the invariant tells a deadlock from a consumer that is served
                self._apply(going_on[0])
            if back and Add(worker) in self._enabled(Add):
                self._apply(Add(worker))

        def _batches(self) -> int:
            spec = self.world.scenario.dataset
            return spec.batches if isinstance(spec, MapSpec) else sum(spec.lengths)

        @precondition(lambda self: bool(self._enabled(Prefetch)))
        @rule(choice=st.integers(0, 7))
        def tuner_changes_the_prefetch_bound(self, choice: int) -> None:
            # One up or one down, at any step between the consumer's calls: lowered, the tasks
            # sent stay sent, and no send goes over the new bound (the world checks both).
            options = self._enabled(Prefetch)
            self._apply(options[choice % len(options)])

        @precondition(lambda self: bool(self._enabled(Add)))
        @rule(choice=st.integers(0, 7))
        def tuner_adds_a_retired_worker_back(self, choice: int) -> None:
            options = self._enabled(Add)
            self._apply(options[choice % len(options)])

        @rule(workers=st.integers(1, 4), to_the_end=st.booleans())
        def program_checkpoints_and_goes_on_in_a_fresh_loader(
            self, workers: int, to_the_end: bool
        ) -> None:
            # At any moment, even in the middle of a call (a preempted job): the resumed run,
            # and runs resumed from it, must end with exactly the reference epoch. An iterable
            # dataset's workers each go on with their own shard: as many as before.
            if not isinstance(self.world.scenario.dataset, MapSpec):
                workers = self.world.scenario.config.num_workers
            if to_the_end:
                # The run may stop before the resumed epoch ends, leaving the resume unchecked:
                # a copy goes on to the end first, without faults, as the explorer's does.
                check_checkpoint(self.world, workers, step)
            self._apply(Preempt(workers))

        @rule()
        def run_ends_when_nothing_can_happen(self) -> None:
            # Always enabled, so a run that has ended can still take steps; it changes nothing.
            if not any(True for _ in self.world.actions()) and not self.world.finished():
                raise Violation("a run stopped without finishing an epoch or raising an error")

        @invariant()
        def no_consumer_waits_forever(self) -> None:
            if hasattr(self, "world") and self.world.stuck():
                raise Violation("deadlock: a consumer waits and no worker owes an answer")

    return SchedulerMachine
