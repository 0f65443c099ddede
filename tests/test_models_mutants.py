"""The checkers can fail: every deliberate bug is caught by the explorer and by Hypothesis.

Each mutant names the scenario that witnesses it, and both tiers explore that one: a scan of
every default scenario would prove no more than that the explorer catches the bug, which the
witness shows. The exhaustive tier (`pytest -m exhaustive`) also runs the Hypothesis machine's
full budget against each mutant.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from statecore import Config, step
from statecore.executors._checkpoint import parse
from statecore.models.explorer import default_scenarios, explore
from statecore.models.loader import Setup, loader_machine, setups
from statecore.models.loader import Violation as LoaderViolation
from statecore.models.machines import scheduler_machine
from statecore.models.mutants import LOADER_MUTANTS, MUTANTS, LoaderMutant, Mutant
from statecore.models.reference import MapSpec
from statecore.models.world import (
    Break,
    Kill,
    Late,
    Next,
    Scenario,
    Violation,
    Work,
    World,
    check_checkpoint,
)


def test_there_are_at_least_five_deliberate_bugs() -> None:
    assert len(MUTANTS) >= 5
    assert len({mutant.name for mutant in MUTANTS}) == len(MUTANTS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_explorer_catches_each_mutant_in_its_witness(mutant: Mutant) -> None:
    with mutant.applied():
        report = explore(mutant.witness)
    assert not report.ok, f"the explorer missed in {mutant.witness!r}: {mutant.description}"
    assert report.violation


def test_every_witness_is_a_default_scenario() -> None:
    # A witness never widens the bounds, and lies where its bug can act.
    defaults = set(default_scenarios())
    assert [m.name for m in MUTANTS if m.witness not in defaults] == []
    assert [m.name for m in MUTANTS if m.witness not in m.scope()] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mutant", [m for m in MUTANTS if m.acts_in is not None], ids=lambda m: m.name
)
def test_a_mutant_leaves_the_scenarios_outside_where_it_acts_as_they_were(
    mutant: Mutant,
) -> None:
    # Why `acts_in` names where it acts: elsewhere no worker is replaced or retired, and the
    # bug cannot act. Two of those with neither, deaths and timeouts at every step, explore
    # clean: the first and the last of them.
    plain = [s for s in default_scenarios() if not s.config.restarts and not s.tunes]
    for scenario in (plain[0], plain[-1]):
        with mutant.applied():
            report = explore(scenario)
        assert report.ok, report.describe()


# Bugs whose only witness is an interleaving random runs rarely reach, with the reason. The
# explorer catches them (above); the machine's budget would have to grow tenfold to.
RARE_FOR_THE_MACHINE = {
    # It needs an answer buffered at the head of the window, and the executor breaking in the
    # very call that hands it over: about one uniform random run in 150 of the configuration
    # the explorer reports (the test below replays its trace).
    "checkpoint-counts-what-the-consumer-never-got",
    # Both need a long run of a persistent loader: a second epoch whose iter() is interrupted
    # (or whose sampler fails) while its workers resume. Within the budget the machine finds
    # them in some test orders and not in others; until this session a false alarm of the
    # world (a resumed loader's epochs misnumbered, now fixed) reported them instead.
    "abandoned-acknowledgements-count",
    "sampler-error-passes-iter",
}


def test_every_mutant_the_machine_may_miss_is_a_mutant() -> None:
    assert RARE_FOR_THE_MACHINE.issubset(mutant.name for mutant in MUTANTS)


@pytest.mark.exhaustive
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "mutant",
    [m for m in MUTANTS if m.name not in RARE_FOR_THE_MACHINE],
    ids=lambda m: m.name,
)
def test_the_hypothesis_machine_catches(mutant: Mutant) -> None:
    # Finding the bug is the point here; shrinking it to the smallest example is not. Each is
    # found within the budget; derandomized, so that whether a mutant is caught does not
    # depend on a coin toss in CI.
    no_shrinking = settings(
        settings(),
        max_examples=3000,
        phases=[Phase.explicit, Phase.generate],
        derandomize=True,
        database=None,
    )
    with mutant.applied(), pytest.raises((Violation, ExceptionGroup)) as caught:
        run_state_machine_as_test(scheduler_machine(), settings=no_shrinking)
    if isinstance(caught.value, ExceptionGroup):
        assert all(isinstance(e, Violation) for e in caught.value.exceptions)


@pytest.mark.timeout(300)
def test_the_machine_catches_a_retiring_worker_given_tasks_in_the_default_tier() -> None:
    # The bug needs a worker retired while it holds a task, room for another coming with its
    # answer, and its turn: the machine's tuner rules reach that within the `ci` profile's
    # budget, derandomized, so the default tier shows it and not only the exhaustive one.
    (mutant,) = [m for m in MUTANTS if m.name == "retiring-worker-gets-tasks"]
    budget = settings(
        settings.get_profile("ci"),
        phases=[Phase.explicit, Phase.generate],
        derandomize=True,
        database=None,
    )
    with mutant.applied(), pytest.raises((Violation, ExceptionGroup)) as caught:
        run_state_machine_as_test(scheduler_machine(), settings=budget)
    if isinstance(caught.value, ExceptionGroup):
        assert all(isinstance(e, Violation) for e in caught.value.exceptions)


def test_the_trace_the_explorer_finds_for_a_rare_mutant_shows_it() -> None:
    scenario = Scenario(
        Config(num_workers=2, prefetch_factor=1),
        MapSpec(6, frozenset({1})),
        deaths=0,
        timeouts=False,
        executor_failures=1,
    )
    (mutant,) = [m for m in MUTANTS if m.name == "checkpoint-counts-what-the-consumer-never-got"]
    trace = (Next(), Work(1), Work(0), Break(), Next())
    world = World.start(scenario)
    for action in trace:
        world = world.apply(action)
    check_checkpoint(world, 2)  # the real driver does not count the error it never raised
    with mutant.applied(), pytest.raises(Violation, match="reference model"):
        check_checkpoint(world, 2)


def test_a_mutant_is_removed_when_its_block_ends() -> None:
    before = step.__code__
    scenario = Scenario(Config(num_workers=2, prefetch_factor=1), MapSpec(4))
    for mutant in MUTANTS:
        with mutant.applied():
            pass
    assert explore(scenario).ok
    assert step.__code__ is before


# The configurations where a loader mutant's bug lives, which the uniform draw meets too
# rarely for the budget: each drawn setup is moved there, keeping its other choices.
LOADER_MUTANT_FOCUS: dict[str, Callable[[Setup], Setup]] = {
    # Shuffled map-style loaders with persistent workers, resumed between epochs.
    "persistent-resume-draws-a-fresh-seed": lambda s: attrs.evolve(
        s,
        executor="thread",
        workers=max(s.workers, 1),
        dataset="map",
        counts=(4,),
        shuffle=True,
        persistent=True,
        understated=0,
    ),
    # Iterable datasets that go back to their start once dry, with uneven shards (in-process
    # too: one part), each ending in a short batch (1 or 5 items, in batches of 2 or 3), so
    # that a worker runs dry mid-epoch, as its short last batch is loaded.
    "dry-worker-starts-its-part-again": lambda s: attrs.evolve(
        s,
        dataset="rewinding",
        counts=tuple(1 + 4 * ((s.counts[0] + k) % 2) for k in range(max(s.workers, 1))),
        batch_size=2 + s.batch_size % 2,
        shuffle=False,
        understated=0,
    ),
    # Persistent workers over a map-style dataset with a state, loading ahead of a break: in
    # batches of one or two of five to nine items, so that something is left to load ahead.
    "loaded-ahead-is-forgotten": lambda s: attrs.evolve(
        s,
        executor="thread",
        workers=max(s.workers, 1),
        dataset="stateful-map",
        counts=(5 + s.counts[0] % 5,),
        batch_size=1 + s.batch_size % 2,
        understated=0,
        persistent=True,
        in_order=True,
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mutant", LOADER_MUTANTS, ids=lambda m: m.name)
def test_the_loader_machine_catches(mutant: LoaderMutant) -> None:
    # Derandomized, without shrinking: whether a bug is caught does not depend on luck.
    no_shrinking = settings(
        settings(), phases=[Phase.explicit, Phase.generate], derandomize=True, database=None
    )
    focus = LOADER_MUTANT_FOCUS.get(mutant.name)
    drawn = setups() if focus is None else setups().map(focus)
    with mutant.applied(), pytest.raises((AssertionError, ExceptionGroup)) as caught:
        run_state_machine_as_test(loader_machine(drawn), settings=no_shrinking)
    if isinstance(caught.value, ExceptionGroup):
        assert all(isinstance(e, LoaderViolation) for e in caught.value.exceptions)
    else:
        assert isinstance(caught.value, LoaderViolation)


def test_a_loader_mutant_is_removed_when_its_block_ends() -> None:
    from statecore.executors import _loader
    from statecore.executors._worker import WorkerRuntime

    before = {name: vars(_loader.DataLoader).get(name) for name in vars(_loader.DataLoader)}
    mark = WorkerRuntime._mark
    for mutant in LOADER_MUTANTS:
        with mutant.applied():
            pass
    assert _loader.parse is parse
    assert WorkerRuntime._mark is mark
    assert {name: vars(_loader.DataLoader).get(name) for name in vars(_loader.DataLoader)} == before


def test_a_late_answer_taken_for_the_replacements_is_seen_handed_over() -> None:
    # The world itself tells a late answer from its replacement's: the batch worker 0 had sent
    # before it died, arriving once its replacement has started, must not reach the consumer.
    scenario = Scenario(Config(num_workers=1, prefetch_factor=1, restarts=1), MapSpec(2), deaths=1)
    trace = (Next(), Kill(0), Work(0), Late(0))
    world = World.start(scenario)
    for action in trace:
        world = world.apply(action)  # the real core drops it
    (mutant,) = [m for m in MUTANTS if m.name == "late-answer-accepted"]
    with mutant.applied(), pytest.raises(Violation, match="lost incarnation sent after its loss"):
        world = World.start(scenario)
        for action in trace:
            world = world.apply(action)
