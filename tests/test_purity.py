"""The core is pure: no I/O, threads, clocks, randomness or torch, statically and at import."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import statecore

CORE = Path(statecore.__file__).parent
FORBIDDEN = {
    "torch",
    "numpy",
    "multiprocess",
    "multiprocessing",
    "threading",
    "queue",
    "time",
    "random",
    "os",
    "signal",
    "subprocess",
    "socket",
    "select",
    "asyncio",
    "dill",
    "hypothesis",
}
# The shell lives outside the core; `python -m statecore` only hands over to it.
NOT_CORE = {"__main__.py"}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_core_module_imports_anything_impure() -> None:
    offenders = {
        path.name: sorted(_imported_roots(path) & FORBIDDEN)
        for path in CORE.glob("*.py")
        if path.name not in NOT_CORE
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_importing_the_core_loads_no_heavy_or_impure_module() -> None:
    # os and threading are loaded by the interpreter or by attrs before our code runs, and
    # `time` by the interpreter itself; the static test above covers our own modules for them.
    probe = (
        "import sys, json; before = set(sys.modules); import statecore; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd="/",
    ).stdout
    loaded = {name.split(".")[0] for name in json.loads(out)}
    heavy = FORBIDDEN - {"os", "threading", "time"}
    assert loaded & heavy == set()


def _module_state() -> dict[str, str]:
    """repr of every module-level container of the core: lists, dicts, sets and the like."""
    import sys

    found = {}
    for name, module in sorted(sys.modules.items()):
        if name != "statecore" and not name.startswith("statecore._"):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, (list, dict, set, bytearray)):
                found[f"{name}.{attr}"] = repr(value)
    return found


def test_stepping_changes_no_module_level_value_of_the_core() -> None:
    # Two loaders step in two threads: any cache the core fills as it runs can record one
    # loader's task against another's worker. The core's only state is the value it returns.
    before = _module_state()
    state = statecore.initial_state(statecore.Config(num_workers=61, prefetch_factor=1))
    state, _ = statecore.step(state, statecore.ResetRequested())
    for index in range(61):
        state, _ = statecore.step(state, statecore.IndexDrawn(index))
    assert len(state.window) == 61
    assert _module_state() == before
