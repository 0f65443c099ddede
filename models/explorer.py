"""Exhaustive, breadth-first exploration of every reachable world of small configurations.

Where the Hypothesis machines sample runs, the explorer visits every world reachable from the
start of a scenario: every order in which workers answer, every moment at which the consumer
asks, a worker dies or is found stuck (and is replaced while restarts are left, a late answer of
the lost one arriving at any moment after), a wait times out or is interrupted, the sampler
raises, the executor breaks, the consumer closes or starts another epoch, all through the real
driver. Every world
is checked as it is reached (all the checks of `World.apply`), and two more are made here:

- no world is stuck: a waiting consumer always has some worker that owes it an answer;
- a world from which nothing more can happen has reached an end (an epoch completed, or an
  error raised or a close).

Task numbers only grow and every budget (deaths, hangs, restarts, closes, interrupts, epochs)
only shrinks, so
the space is finite and a breadth-first search ends. Exploring breadth first means the first
violation found comes with one of the shortest traces that reach it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import attrs

from statecore import Config, Phase
from statecore import step as core_step
from statecore.models.reference import IterableSpec, MapSpec
from statecore.models.world import (
    Action,
    Preempt,
    Scenario,
    StepFunction,
    Violation,
    World,
    check_checkpoint,
)

__all__ = [
    "Bounds",
    "Report",
    "default_scenarios",
    "explore",
    "explore_all",
    "representative_scenarios",
    "restart_scenarios",
    "tuning_scenarios",
]


@attrs.frozen
class Report:
    """What exploring one scenario found."""

    scenario: Scenario
    worlds: int
    """Distinct worlds (scheduler state plus environment) reached."""
    states: frozenset[object] = attrs.field(repr=False)
    """Distinct scheduler states reached (payloads do not count towards distinctness)."""
    transitions: int
    violation: str | None = None
    trace: tuple[Action, ...] = ()
    edges: frozenset[tuple[Phase, type, Phase]] = attrs.field(default=frozenset(), repr=False)
    """Every (phase, event type, next phase) the scheduler went through."""

    @property
    def ok(self) -> bool:
        return self.violation is None

    def describe(self) -> str:
        if self.ok:
            return f"{self.scenario!r}: ok"
        steps = "\n".join(f"    {action!r}" for action in self.trace)
        return (
            f"{self.scenario!r}\n  violation: {self.violation}\n"
            f"  shortest trace from World.start ({len(self.trace)} actions):\n{steps}"
        )


def explore(scenario: Scenario, step: StepFunction = core_step, checkpoints: bool = True) -> Report:
    """Visit every world reachable in `scenario`; stop at the first violation.

    With `checkpoints`, every world is also checkpointed and resumed in a fresh loader, with
    as many workers and (map-style datasets) with another number, and run to the end of its
    epoch (`statecore.models.world.check_checkpoint`). Worlds that checkpoint alike (the same
    epoch, progress and batches handed over) resume alike, so each such checkpoint runs once.
    """
    edges: set[tuple[Phase, type, Phase]] = set()

    def seen(before: Phase, event: type, after: Phase) -> None:
        edges.add((before, event, after))

    try:
        start = World.start(scenario, step, seen)
    except Violation as violation:
        return Report(scenario, 0, frozenset(), 0, str(violation), ())
    parents: dict[World, tuple[World, Action] | None] = {start: None}
    frontier = deque([start])
    transitions = 0

    def failed(world: World, message: str, last: Action | None = None) -> Report:
        trace: list[Action] = [] if last is None else [last]
        node = parents[world]
        while node is not None:
            trace.append(node[1])
            node = parents[node[0]]
        trace.reverse()
        states = frozenset(w.core for w in parents)
        return Report(
            scenario, len(parents), states, transitions, message, tuple(trace), frozenset(edges)
        )

    n = scenario.config.num_workers
    # A map-style epoch resumes on any number of workers; an iterable one on its own workers.
    counts = (n, 1 if n > 1 else 2) if isinstance(scenario.dataset, MapSpec) else (n,)
    checked: set[tuple[object, ...]] = set()
    while frontier:
        world = frontier.popleft()
        if world.stuck():
            return failed(world, "deadlock: a consumer waits and no worker owes an answer")
        if checkpoints:
            key = (world.epoch, world.checkpoint(), world.delivered, world.ended)
            if key not in checked:
                checked.add(key)
                for workers in counts:
                    try:
                        check_checkpoint(world, workers, step, seen)
                    except Violation as violation:
                        message = f"resumed from a checkpoint with {workers} workers: {violation}"
                        return failed(world, message, Preempt(workers))
        moved = False
        for action in world.actions():
            moved = True
            transitions += 1
            try:
                successor = world.apply(action, step, seen)
            except Violation as violation:
                return failed(world, str(violation), action)
            if successor not in parents:
                parents[successor] = (world, action)
                frontier.append(successor)
        if not moved and not world.finished():
            return failed(world, "a run stopped without finishing an epoch or raising an error")
    states = frozenset(w.core for w in parents)
    return Report(scenario, len(parents), states, transitions, edges=frozenset(edges))


@attrs.frozen
class Bounds:
    """The sizes of configuration `default_scenarios` ranges over."""

    workers: tuple[int, ...] = (1, 2, 3)
    prefetch: tuple[int, ...] = (1, 2)
    batches: int = 6
    """Map-style: indices the sampler yields. Iterable: the most any shard yields in all."""


def _shard_lengths(workers: int, total: int) -> tuple[int, ...]:
    """Uneven shards, so workers run dry at different times; one worker may have nothing."""
    lengths = [0] * workers
    for i in range(total):
        lengths[i % workers] += 1
    if workers > 1:
        lengths[-1] = 0  # a worker whose shard is empty runs dry on its first task
        lengths[0] += 1
    return tuple(lengths)


def default_scenarios(bounds: Bounds = Bounds()) -> Iterator[Scenario]:
    """Every combination of workers, prefetch, dataset kind, order and persistence in `bounds`.

    Each scenario allows one worker death, one interrupted wait, timeouts and closes at any
    moment; persistent scenarios run a second epoch on the same workers. One task in each dataset
    raises. Configurations of one or two workers are explored once more with the sampler
    raising and the executor breaking instead. Persistent scenarios of one or two workers and
    prefetch 1 also get a third epoch, so that an `iter()` interrupted while workers resume is
    followed by another `iter()`.
    """
    combos = itertools.product(
        bounds.workers, bounds.prefetch, (False, True), (True, False), (False, True)
    )
    for workers, prefetch, iterable, in_order, persistent in combos:
        config = Config(
            num_workers=workers,
            prefetch_factor=prefetch,
            in_order=in_order,
            iterable=iterable,
            persistent_workers=persistent,
        )
        total = bounds.batches
        dataset: MapSpec | IterableSpec
        if iterable:
            dataset = IterableSpec(_shard_lengths(workers, total - 1), frozenset({(0, 1)}))
        else:
            dataset = MapSpec(total, frozenset({1}))
        epochs = 2 if persistent else 1
        yield Scenario(config, dataset, epochs=epochs, interrupts=1)
        if workers <= 2:
            # The sampler raising and the executor breaking, at any moment, on their own.
            yield Scenario(
                config,
                dataset,
                epochs=epochs,
                deaths=0,
                timeouts=False,
                sampler_failures=1,
                executor_failures=1,
            )
        if persistent and workers <= 2 and prefetch == 1:
            yield Scenario(config, _short(dataset), epochs=3, deaths=0, interrupts=1)
        if workers == 1 and prefetch == 1 and not persistent:
            # Loading in the calling thread: one worker, reading the sampler only on demand.
            yield Scenario(attrs.evolve(config, lazy=True), dataset, interrupts=1)
    # Last, so that each mutant's witness stays the first scenario that shows its bug.
    yield from restart_scenarios(bounds)


_RESTARTS = {1: 2, 2: 2, 3: 1}
"""Restarts per number of workers in `restart_scenarios`: two where one slot may lose a
replacement too (its worker restored twice), one with three workers, where the worlds multiply."""


def restart_scenarios(bounds: Bounds = Bounds()) -> Iterator[Scenario]:
    """Workers that come and go: every combination of workers, dataset kind, order and
    persistence in `bounds` (prefetch 1), with restarts (`_RESTARTS`), and one loss more than
    restarts (a death, or a hang: the worker the consumer waits for found stuck), so that the
    restarts are spent and the last loss fails the loader. The answers a lost worker had sent
    may arrive late. Persistent scenarios run two epochs of two batches. Then a loss with no
    restart (torch's default), and a stuck worker that cannot be killed (a thread): fatal.
    """
    combos = itertools.product(bounds.workers, (False, True), (True, False), (False, True))
    for workers, iterable, in_order, persistent in combos:
        if workers == 1 and not in_order:
            continue  # one worker answers in order anyway
        restarts = _RESTARTS.get(workers, 1)
        config = Config(
            num_workers=workers,
            prefetch_factor=1,
            in_order=in_order,
            iterable=iterable,
            persistent_workers=persistent,
            restarts=restarts,
        )
        dataset: MapSpec | IterableSpec
        if iterable:
            dataset = IterableSpec(
                _shard_lengths(workers, bounds.batches // 2), frozenset({(0, 1)})
            )
        else:
            dataset = MapSpec(bounds.batches - 2, frozenset({1}))
        if persistent:
            dataset = _short(dataset)
        yield Scenario(
            config,
            dataset,
            epochs=2 if persistent else 1,
            deaths=restarts + 1,
            hangs=1,
            timeouts=False,
            closes=False,
        )
    for restarts, killable in ((0, True), (1, False)):
        config = Config(num_workers=2, prefetch_factor=1, restarts=restarts)
        yield Scenario(
            config, MapSpec(bounds.batches - 2, frozenset({1})), hangs=1, killable=killable
        )
    yield from tuning_scenarios(bounds)


def tuning_scenarios(bounds: Bounds = Bounds()) -> Iterator[Scenario]:
    """A tuner retiring workers and adding them back at any step between the consumer's calls
    (map-style datasets only), and changing the prefetch bound: in order and not, over two and
    three workers, a retiring worker that may die and be replaced, and persistent workers whose
    next epoch resumes only the slots not retired."""
    dataset = MapSpec(bounds.batches - 2, frozenset({1}))
    for workers, in_order, deaths in ((2, True, 1), (2, False, 1), (3, True, 0)):
        config = Config(num_workers=workers, prefetch_factor=1, in_order=in_order, restarts=1)
        # Three workers: the bound raised to 2 (and lowered back) at any step as well.
        prefetches = 2 if workers == 3 else 0
        yield Scenario(
            config,
            dataset,
            deaths=deaths,
            tunes=2,
            prefetches=prefetches,
            timeouts=False,
            closes=False,
        )
    # Prefetch 2, more batches than the window holds: a retiring worker still holding a task
    # would have room for another. The bound lowered to 1 or raised to 3 at any step, twice:
    # tasks held over a lowered bound stay, and the workers holding them are sent none.
    config = Config(num_workers=2, prefetch_factor=2)
    yield Scenario(
        config,
        MapSpec(bounds.batches),
        deaths=0,
        tunes=1,
        prefetches=2,
        timeouts=False,
        closes=False,
    )
    config = Config(num_workers=2, prefetch_factor=1, persistent_workers=True)
    yield Scenario(config, _short(dataset), epochs=2, deaths=0, tunes=3, timeouts=False)
    # Slots that begin retired (num_workers="auto" starts a few of its slots): only a tuner's
    # add starts them.
    config = Config(num_workers=3, prefetch_factor=1, started=1)
    yield Scenario(config, dataset, deaths=0, tunes=2, timeouts=False, closes=False)


def representative_scenarios(bounds: Bounds = Bounds()) -> Iterator[Scenario]:
    """The default scenarios without the largest: out of order only with one worker, three
    workers only without persistence, prefetch 2 only without persistence; of those where
    workers come and go (`restart_scenarios`), none that is persistent on an iterable dataset,
    none of two workers (with two restarts) out of order or persistent, none of three in order
    and not persistent; every tuning scenario.

    Out-of-order runs of several workers, and persistent runs of three, are where the worlds
    multiply (one three-worker persistent scenario alone has more worlds than all of these
    together); these keep every edge of the transition table that the default bounds reach,
    every number of workers and prefetch, and every combination of dataset kind, order and
    persistence, at about a tenth of the cost. The default test tier explores these; the
    exhaustive tier and `python -m statecore check` explore them all.
    """
    for scenario in default_scenarios(bounds):
        config = scenario.config
        if scenario.tunes:
            yield scenario
        elif config.restarts or scenario.hangs:
            # Workers that come and go: all but where these worlds multiply.
            two = config.num_workers == 2 and config.restarts == 2
            if two and (config.persistent_workers or not config.in_order):
                continue
            if config.iterable and config.persistent_workers:
                continue
            if config.num_workers == 3 and config.in_order and not config.persistent_workers:
                continue
            yield scenario
        elif (
            (config.in_order or config.num_workers == 1)
            and (config.num_workers <= 2 or not config.persistent_workers)
            and (config.prefetch_factor == 1 or not config.persistent_workers)
        ):
            yield scenario


def _short(dataset: MapSpec | IterableSpec) -> MapSpec | IterableSpec:
    """A dataset of two batches in all, for scenarios that run more epochs."""
    if isinstance(dataset, MapSpec):
        return MapSpec(2, frozenset({1}))
    return IterableSpec(_shard_lengths(len(dataset.lengths), 1), frozenset())


def _explore_one(args: tuple[Scenario, StepFunction]) -> Report:
    return explore(*args)


def explore_all(
    scenarios: Iterable[Scenario],
    step: StepFunction = core_step,
    processes: int = 1,
    on_progress: Callable[[Report], None] | None = None,
) -> list[Report]:
    """Explore each scenario, in `processes` worker processes when more than one.

    `on_progress`, if given, hears each report as it is collected, in the scenarios' order.
    """
    jobs = [(scenario, step) for scenario in scenarios]
    heard = on_progress or (lambda report: None)
    reports: list[Report] = []
    if processes <= 1:
        for job in jobs:
            reports.append(_explore_one(job))
            heard(reports[-1])
        return reports
    # The stdlib pool is enough here: the jobs are plain picklable values.
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(processes) as pool:
        for report in pool.map(_explore_one, jobs):
            reports.append(report)
            heard(report)
    return reports
