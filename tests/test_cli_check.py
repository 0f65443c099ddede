"""`python -m statecore check`: a row per configuration, and the step benchmark's goals.

The exploration and the timing are replaced by made-up results here: what is checked is what
the command prints about them, not how long anything takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import pytest

from statecore import Config
from statecore.models.explorer import Bounds, Report, default_scenarios
from statecore.models.reference import IterableSpec, MapSpec
from statecore.models.world import Scenario
from statecore.tools import cli, step_bench
from statecore.tools.cli import main, scenario_label
from statecore.tools.step_bench import SCALE_WORKERS, BenchResult, ScalePoint


def _made_up_reports(
    scenarios: Iterable[Scenario],
    processes: int = 1,
    on_progress: Callable[[Report], None] | None = None,
) -> list[Report]:
    reports = [
        Report(scenario, worlds=10 + n, states=frozenset({n}), transitions=20 + n)
        for n, scenario in enumerate(scenarios)
    ]
    if on_progress is not None:
        for report in reports:
            on_progress(report)
    return reports


@pytest.fixture
def explored(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check` reports made-up explorations instead of running them."""
    monkeypatch.setattr(cli, "explore_all", _made_up_reports)


# --- check --verbose ----------------------------------------------------------------------------


def _rows(out: str) -> list[str]:
    lines = out.splitlines()
    header = next(n for n, line in enumerate(lines) if line.strip().startswith("configuration"))
    end = next(n for n, line in enumerate(lines) if line.startswith("configurations:"))
    return lines[header + 1 : end]


def test_check_verbose_labels_every_configuration_differently(
    explored: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--verbose", "--processes", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == len(list(default_scenarios(Bounds())))
    labels = [" ".join(row.split()[:-3]) for row in rows]  # the three counts end each row
    assert sorted(label for label in labels if labels.count(label) > 1) == []


def _changed(value: Any, field: str) -> Any:
    """`value` with one field changed, to whatever else is valid for it."""
    old = getattr(value, field)
    if old is None and field == "started":
        # Every slot named as started: as valid for an iterable dataset as for a map-style one.
        return attrs.evolve(value, started=value.num_workers)
    if isinstance(old, bool):
        return attrs.evolve(value, **{field: not old})
    if isinstance(old, int):
        return attrs.evolve(value, **{field: old + 1})
    if isinstance(old, tuple):
        return attrs.evolve(value, **{field: (*old[1:], old[0])})
    if isinstance(old, frozenset):
        return attrs.evolve(value, **{field: frozenset()})
    raise AssertionError(f"no way to change {field}={old!r}: teach this test one")


def _persistent(iterable: bool) -> Scenario:
    """A scenario in which every field can change on its own and stay valid."""
    config = Config(num_workers=2, iterable=iterable, persistent_workers=True)
    dataset = IterableSpec((2, 1), frozenset({(0, 1)})) if iterable else MapSpec(4, frozenset({1}))
    return Scenario(config, dataset, epochs=2)


def _every_change(scenario: Scenario) -> list[tuple[str, Scenario]]:
    changes = []
    for field in attrs.fields(Scenario):
        if field.name in ("config", "dataset"):
            continue
        changes.append((field.name, _changed(scenario, field.name)))
    for field in attrs.fields(Config):
        if field.name not in ("iterable", "num_workers"):  # both must match the dataset
            config = _changed(scenario.config, field.name)
            epochs = scenario.epochs if config.persistent_workers else 1
            changed = attrs.evolve(scenario, config=config, epochs=epochs)
            changes.append((f"config.{field.name}", changed))
    for field in attrs.fields(type(scenario.dataset)):
        dataset = _changed(scenario.dataset, field.name)
        changes.append((f"dataset.{field.name}", attrs.evolve(scenario, dataset=dataset)))
    return changes


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_a_label_changes_with_every_field_of_the_scenario(iterable: bool) -> None:
    scenario = _persistent(iterable)
    same = [
        name
        for name, changed in _every_change(scenario)
        if scenario_label(changed) == scenario_label(scenario)
    ]
    assert same == []


def test_a_label_tells_the_dataset_kind_and_the_number_of_workers() -> None:
    one = Scenario(Config(num_workers=1), MapSpec(4))
    assert scenario_label(one) != scenario_label(Scenario(Config(num_workers=2), MapSpec(4)))
    shards = Scenario(Config(num_workers=1, iterable=True), IterableSpec((4,)))
    assert scenario_label(one) != scenario_label(shards)


# --- check --bench ------------------------------------------------------------------------------


def _scale(*costs: float) -> tuple[ScalePoint, ...]:
    """Made-up scale figures, one per worker count of the scale part."""
    return tuple(
        ScalePoint(workers, 3000, us) for workers, us in zip(SCALE_WORKERS, costs, strict=True)
    )


def _bench(core_us: float, baseline_us: float, scale: tuple[ScalePoint, ...] = ()) -> BenchResult:
    return BenchResult(
        events=1000,
        rounds=15,
        core_us=core_us,
        baseline_us=baseline_us,
        scale=scale,
        scale_batches=1000 if scale else 0,
        scale_rounds=9 if scale else 0,
    )


def _goal_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("goal:")]


def _goal(goal: str, verdict: str) -> str:
    """A goal line as printed: the goal in a column of its own, then the verdict."""
    return f"{goal:54} {verdict}"


def test_the_step_bench_says_which_goal_is_missed_and_by_how_much() -> None:
    lines = _goal_lines(_bench(5.5, 1.25, _scale(1.0, 1.1, 1.2, 1.5, 2.5)).describe())
    assert lines == [
        _goal("goal: step / bookkeeping <= 3x", "MISSED by 1.40x (47% over): 4.40x"),
        _goal("goal: step per event < 5 us", "MISSED by 0.50 us (10% over): 5.50 us"),
        _goal(
            "goal: per-event cost from 2 to 256 workers within 2x",
            "MISSED by 0.50x (25% over): 2.50x",
        ),
    ]


def test_the_step_bench_says_a_goal_is_met_and_with_how_much_to_spare() -> None:
    lines = _goal_lines(_bench(2.0, 1.0, _scale(1.2, 1.0, 1.1, 1.3, 1.5)).describe())
    assert lines == [
        _goal("goal: step / bookkeeping <= 3x", "met with 1.00x (33%) to spare: 2.00x"),
        _goal("goal: step per event < 5 us", "met with 3.00 us (60%) to spare: 2.00 us"),
        _goal(
            "goal: per-event cost from 2 to 256 workers within 2x",
            "met with 0.50x (25%) to spare: 1.50x",
        ),
    ]


def test_each_goal_is_met_or_missed_by_its_own_figure() -> None:
    slow_but_close = _bench(6.0, 2.5, _scale(6.0, 6.0, 6.0, 6.0, 6.0))
    assert [goal.met for goal in slow_but_close.goals] == [True, False, True]
    fast_but_far = _bench(4.0, 1.0, _scale(1.0, 1.0, 1.0, 1.0, 2.01))
    assert [goal.met for goal in fast_but_far.goals] == [False, True, False]


def test_a_limit_itself_meets_the_ratio_and_scale_goals_but_not_the_per_event_one() -> None:
    at_the_limits = _bench(5.0, 5.0 / 3, _scale(2.5, 5.0, 5.0, 5.0, 5.0))
    assert at_the_limits.ratio == pytest.approx(3.0)
    assert at_the_limits.spread == 2.0
    assert [goal.met for goal in at_the_limits.goals] == [True, False, True]


def test_the_scale_goal_is_the_dearest_worker_count_over_the_cheapest_wherever_they_are() -> None:
    # Neither end of the range need be the cheapest or the dearest.
    result = _bench(2.0, 1.0, _scale(1.5, 1.2, 3.0, 2.0, 2.4))
    assert result.spread == pytest.approx(2.5)
    assert not result.goals[2].met


def test_the_step_bench_prints_a_line_per_worker_count_and_says_how_it_measured_them() -> None:
    text = _bench(2.0, 1.0, _scale(1.84, 1.76, 2.43, 2.91, 4.16)).describe()
    lines = text.splitlines()
    start = lines.index("step by workers: prefetch 2, 1000 batches each, median of 9 rounds")
    assert lines[start + 1 : start + 7] == [
        "    2 workers,  3000 events   1.84 us/event",
        "    8 workers,  3000 events   1.76 us/event",
        "   32 workers,  3000 events   2.43 us/event",
        "   64 workers,  3000 events   2.91 us/event",
        "  256 workers,  3000 events   4.16 us/event",
        "  dearest / cheapest        2.36x",
    ]
    assert lines[-1].startswith("step goals met: 2 of 3 ")


def test_without_the_scale_part_there_are_two_goals_and_no_scale_lines() -> None:
    text = _bench(2.0, 1.0).describe()
    assert "step by workers" not in text
    assert "dearest" not in text
    assert len(_goal_lines(text)) == 2
    assert text.splitlines()[-1].startswith("step goals met: 2 of 2 ")


def test_a_missed_step_goal_is_printed_but_does_not_fail_check(
    explored: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def slow() -> BenchResult:
        return _bench(5.5, 1.25, _scale(1.0, 1.1, 1.2, 1.5, 2.5))

    monkeypatch.setattr(step_bench, "run_bench", slow)
    assert main(["check", "--bench", "--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "step goals met: 0 of 3" in out
    assert "MISSED by 1.40x" in out
    assert "256 workers" in out


def test_a_short_bench_run_measures_every_worker_count_and_hands_over_every_batch() -> None:
    # Shape only: a real run, far too short to say anything about speed.
    result = step_bench.run_bench(batches=40, rounds=1, scale_batches=40, scale_rounds=1)
    assert result.events == len(step_bench.record_trace(40))
    assert [point.workers for point in result.scale] == list(SCALE_WORKERS)
    for point in result.scale:
        assert point.events == len(step_bench.record_trace(40, point.workers))
    assert len(result.goals) == 3
    assert step_bench.run_bench(batches=40, rounds=1, scale_rounds=0).scale == ()
