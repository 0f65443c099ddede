"""The public surface of the core is exactly what `statecore.__all__` names."""

from __future__ import annotations

import inspect

import statecore


def test_every_exported_name_exists() -> None:
    missing = [name for name in statecore.__all__ if not hasattr(statecore, name)]
    assert missing == []


def test_every_public_class_or_function_of_the_core_is_exported() -> None:
    defined_here = {
        name
        for name, value in vars(statecore).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", "").startswith("statecore._")
    }
    assert defined_here <= set(statecore.__all__)


def test_states_events_and_commands_are_hashable_values() -> None:
    config = statecore.Config(num_workers=2)
    state = statecore.initial_state(config)
    assert hash(state) == hash(statecore.initial_state(config))
    assert state == statecore.initial_state(config)
    assert hash(statecore.SendTask(0, 1, [3, 4])) == hash(statecore.SendTask(0, 1, [5]))


def test_reprs_are_python_that_rebuilds_the_value() -> None:
    namespace = vars(statecore)
    for value in (
        statecore.Config(num_workers=3, prefetch_factor=1, in_order=False),
        statecore.WorkerDied(worker=1, pid=42, exitcode=-9),
        statecore.SendTask(worker=0, task=3, index=[1, 2]),
        statecore.Phase.RUNNING,
        statecore.initial_state(statecore.Config(num_workers=2)),
    ):
        assert eval(repr(value), dict(namespace)) == value
