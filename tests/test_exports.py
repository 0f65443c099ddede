"""The public surface is exported: every public class of the core, and the executors' surface.

The core's classes are found, not listed: a public class defined in a core module
(statecore/_*.py: states, events, commands, failures, errors) that `statecore` does not export
fails here. The executors' surface is what `statecore.executors.__all__` names; each of those
names must load.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from types import ModuleType

import pytest

import statecore
import statecore.executors

# statecore/_frameworks.py only builds the DataLoader early for Lightning: plumbing, not API.
PLUMBING = {"statecore._frameworks"}


def core_modules() -> list[ModuleType]:
    """statecore/_*.py (not __main__, which runs the command line when imported)."""
    return [
        importlib.import_module(f"statecore.{found.name}")
        for found in pkgutil.iter_modules(statecore.__path__)
        if found.name.startswith("_") and not found.name.startswith("__")
    ]


def public_classes(module: ModuleType) -> list[type]:
    """The classes `module` defines (not imports) under a name without a leading underscore."""
    return [
        value
        for name, value in vars(module).items()
        if not name.startswith("_")
        and inspect.isclass(value)
        and value.__module__ == module.__name__
    ]


CORE_CLASSES = [cls for module in core_modules() for cls in public_classes(module)]
CORE_NAMES = [
    (module, name)
    for module in core_modules()
    if module.__name__ not in PLUMBING
    for name in module.__all__
]


def test_the_core_classes_are_found_in_every_kind_of_core_module() -> None:
    # Guards the tests below against passing because nothing was found.
    kinds = {statecore.State, statecore.Event, statecore.Command, statecore.StatecoreError}
    assert kinds <= set(CORE_CLASSES)


@pytest.mark.parametrize(
    "cls", [pytest.param(cls, id=f"{cls.__module__}.{cls.__name__}") for cls in CORE_CLASSES]
)
def test_every_public_class_of_the_core_is_exported(cls: type) -> None:
    assert cls.__name__ in statecore.__all__
    assert getattr(statecore, cls.__name__, None) is cls


@pytest.mark.parametrize(
    ("module", "name"),
    [pytest.param(module, name, id=f"{module.__name__}.{name}") for module, name in CORE_NAMES],
)
def test_every_name_a_core_module_exports_is_exported_by_the_package(
    module: ModuleType, name: str
) -> None:
    assert name in statecore.__all__
    assert getattr(statecore, name, None) is getattr(module, name)


def test_every_exported_name_exists() -> None:
    missing = [name for name in statecore.__all__ if not hasattr(statecore, name)]
    assert missing == []


def test_every_public_class_or_function_in_the_package_namespace_is_in_all() -> None:
    defined_here = {
        name
        for name, value in vars(statecore).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", "").startswith("statecore._")
    }
    assert defined_here <= set(statecore.__all__)


# --- the executors' surface ----------------------------------------------------------------------
# statecore.executors loads its names on first use; each must load, and `dir()` must list it.


@pytest.mark.parametrize("name", statecore.executors.__all__)
def test_every_name_of_the_executors_surface_loads(name: str) -> None:
    assert hasattr(statecore.executors, name)
    assert name in dir(statecore.executors)


def executors_classes_and_functions() -> list[str]:
    found = [getattr(statecore.executors, name, None) for name in statecore.executors.__all__]
    return [
        value.__name__ for value in found if inspect.isclass(value) or inspect.isfunction(value)
    ]


@pytest.mark.parametrize("name", executors_classes_and_functions())
def test_every_class_and_function_of_the_executors_surface_is_public_in_its_module(
    name: str,
) -> None:
    value = getattr(statecore.executors, name)
    assert value.__module__.startswith("statecore.executors.")
    assert name in sys.modules[value.__module__].__all__


@pytest.mark.parametrize("name", ["Trace", "LoaderStats", "LoaderCounters"])
def test_what_the_loaders_trace_record_and_stats_return_is_exported_beside_the_loader(
    name: str,
) -> None:
    # Returned by public methods, so importable wherever DataLoader is.
    assert name in statecore.executors.__all__
    assert getattr(statecore, name) is getattr(statecore.executors, name)


# --- values --------------------------------------------------------------------------------------


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


def test_the_old_name_for_draw_index_still_imports_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="renamed statecore.DrawIndex"):
        old = statecore.PullIndex  # type: ignore[attr-defined]
    assert old is statecore.DrawIndex
