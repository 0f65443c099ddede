"""`python -m statecore check`: a row per configuration, and the step benchmark's goals.

The exploration and the timing are replaced by made-up results here: what is checked is what
the command prints about them, not how long anything takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import pytest

from statecore import Config
from statecore.models.explorer import Bounds, Report, default_scenarios
from statecore.models.reference import IterableSpec, MapSpec
from statecore.models.world import Scenario
from statecore.tools import cli, step_bench
from statecore.tools.cli import main, scenario_label
from statecore.tools.step_bench import BenchResult


def _made_up_reports(scenarios: Iterable[Scenario], processes: int = 1) -> list[Report]:
    return [
        Report(scenario, worlds=10 + n, states=frozenset({n}), transitions=20 + n)
        for n, scenario in enumerate(scenarios)
    ]


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


def test_the_step_bench_says_which_goal_is_missed_and_by_how_much() -> None:
    text = BenchResult(events=1000, rounds=15, core_us=5.5, baseline_us=1.25).describe()
    assert "goal: step / bookkeeping <= 3x     MISSED by 1.40x (47% over): 4.40x" in text
    assert "goal: step per event < 5 us        MISSED by 0.50 us (10% over): 5.50 us" in text


def test_the_step_bench_says_a_goal_is_met_and_with_how_much_to_spare() -> None:
    text = BenchResult(events=1000, rounds=15, core_us=2.0, baseline_us=1.0).describe()
    assert "goal: step / bookkeeping <= 3x     met with 1.00x (33%) to spare: 2.00x" in text
    assert "goal: step per event < 5 us        met with 3.00 us (60%) to spare: 2.00 us" in text


def test_each_goal_is_met_or_missed_by_its_own_figure() -> None:
    slow_but_close = BenchResult(events=1000, rounds=15, core_us=6.0, baseline_us=2.5)
    assert [goal.met for goal in slow_but_close.goals] == [True, False]
    fast_but_far = BenchResult(events=1000, rounds=15, core_us=4.0, baseline_us=1.0)
    assert [goal.met for goal in fast_but_far.goals] == [False, True]


def test_a_missed_step_goal_is_printed_but_does_not_fail_check(
    explored: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def slow(batches: int = 5000, rounds: int = 15) -> BenchResult:
        return BenchResult(events=1000, rounds=rounds, core_us=5.5, baseline_us=1.25)

    monkeypatch.setattr(step_bench, "run_bench", slow)
    assert main(["check", "--bench", "--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "step goals met: 0 of 2" in out
    assert "MISSED by 1.40x" in out
