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
