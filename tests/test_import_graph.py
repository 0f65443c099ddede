"""The layers import only downward: core, then executors, then models, then tools.

Every module of statecore/, executors/, models/ and tools/ is parsed, not imported, and each
import in it is counted wherever it sits: at module level, inside a function, under
`TYPE_CHECKING`, or as `importlib.import_module` with a literal name (or an f-string's literal
start). Each module belongs to the layer its installed name says: `statecore.X` is the core,
`statecore.executors.X` the executors, `statecore.models.X` the models, `statecore.tools.X`
the tools. Relative imports are resolved against the importing module's package.

The rules:

- the core imports no module of the executors, the models or the tools, save the two
  exceptions in `CORE_EXCEPTIONS`;
- the executors import nothing from the models or the tools;
- the models import nothing from the tools;
- in the observability wing (`executors/_observe/`), the readers import no recorder: the
  recorders (`RECORDERS`) import the readers, never the reverse.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent

CORE, EXECUTORS, MODELS, TOOLS = "core", "executors", "models", "tools"
FOLDERS = {
    CORE: (ROOT / "statecore", "statecore"),
    EXECUTORS: (ROOT / "executors", "statecore.executors"),
    MODELS: (ROOT / "models", "statecore.models"),
    TOOLS: (ROOT / "tools", "statecore.tools"),
}
"""Each layer's folder in the checkout and the package it installs as."""

CORE_EXCEPTIONS = {
    # `statecore.DataLoader` and `statecore.get_worker_info` are the names torch users reach
    # for, but the loader needs torch and the core must import without it: the package's
    # `__getattr__` (and the hooks that build the loader class once a training framework is
    # imported, and keep accelerate's prepare from replacing it) import the executors on
    # first use, inside functions only.
    ("statecore", "statecore.executors"): "the lazy DataLoader/get_worker_info hook",
    # `python -m statecore` runs statecore/__main__.py; the command line itself is a program,
    # so __main__ only hands over to it. Nothing imports __main__.
    ("statecore.__main__", "statecore.tools.cli"): "`python -m statecore` hands over",
}
"""(importing module, imported module) pairs the core may have, each with its reason."""

INSIDE_FUNCTIONS_ONLY = {
    ("statecore", "statecore.executors"),
}
"""Exceptions that hold only for an import inside a function, never at module level."""

MINIMUM_MODULES = {CORE: 8, EXECUTORS: 10, MODELS: 8, TOOLS: 7}
"""Fewer modules found than this means the test is looking in the wrong place."""


@attrs.frozen
class Import:
    importer: str
    imported: str
    path: Path
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = self.path.relative_to(ROOT)
        return f"{self.importer} -> {self.imported} ({where}:{self.line})"


def _module_name(path: Path, folder: Path, package: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _modules() -> dict[str, tuple[str, Path]]:
    """Every module of the four layers: its import name -> (layer, file)."""
    found = {}
    for layer, (folder, package) in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            found[_module_name(path, folder, package)] = (layer, path)
    return found


MODULES = _modules()


def layer_of(name: str) -> str | None:
    """The layer of an imported module name; None outside statecore."""
    for layer in (EXECUTORS, MODELS, TOOLS):
        package = FOLDERS[layer][1]
        if name == package or name.startswith(package + "."):
            return layer
    if name == "statecore" or name.startswith("statecore."):
        return CORE
    return None


def _resolve(importer: str, path: Path, level: int, module: str | None) -> str:
    """The absolute name of `from <level dots><module> import ...` in `importer`."""
    if level == 0:
        return module or ""
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def _literal_start(node: ast.expr) -> str | None:
    """The literal module name of an `import_module(...)` argument, or an f-string's start."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.rstrip(".")
    return None


def _is_dynamic_import(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__") and bool(node.args)


class _Collector(ast.NodeVisitor):
    def __init__(self, importer: str, path: Path) -> None:
        self.importer, self.path = importer, path
        self.depth = 0
        self.found: list[Import] = []

    def _add(self, imported: str, node: ast.AST) -> None:
        line = getattr(node, "lineno", 0)
        self.found.append(Import(self.importer, imported, self.path, line, self.depth > 0))

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.importer, self.path, node.level, node.module)
        for alias in node.names:
            # `from statecore import executors` imports the module statecore.executors;
            # `from statecore import step` imports statecore.
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in MODULES else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_dynamic_import(node):
            name = _literal_start(node.args[0])
            if name is not None:
                self._add(name, node)
        self.generic_visit(node)


def _imports() -> Iterator[Import]:
    for name, (_, path) in MODULES.items():
        collector = _Collector(name, path)
        collector.visit(ast.parse(path.read_text(), str(path)))
        yield from collector.found


IMPORTS = list(_imports())


def _offending(importer_layer: str, forbidden: set[str]) -> list[str]:
    return [
        str(found)
        for found in IMPORTS
        if MODULES[found.importer][0] == importer_layer
        and layer_of(found.imported) in forbidden
        and not _allowed(found)
    ]


def _allowed(found: Import) -> bool:
    pair = (found.importer, found.imported)
    if pair not in CORE_EXCEPTIONS:
        return False
    return found.in_function or pair not in INSIDE_FUNCTIONS_ONLY


def _message(rule: str, offending: list[str]) -> str:
    return f"{rule}, but:\n" + "\n".join(f"  {line}" for line in offending)


@pytest.mark.parametrize("layer", [CORE, EXECUTORS, MODELS, TOOLS])
def test_the_graph_sees_every_layer_and_its_imports(layer: str) -> None:
    modules = [name for name, (found, _) in MODULES.items() if found == layer]
    assert len(modules) >= MINIMUM_MODULES[layer], f"only {modules} found for {layer}"
    statecore_imports = [
        found
        for found in IMPORTS
        if MODULES[found.importer][0] == layer and layer_of(found.imported) is not None
    ]
    assert statecore_imports, f"no module of {layer} imports anything of statecore"


def test_the_exceptions_still_exist_and_the_lazy_hook_stays_inside_functions() -> None:
    # An exception nobody uses any more should go; one used at module level breaks the rule.
    for pair in CORE_EXCEPTIONS:
        uses = [found for found in IMPORTS if (found.importer, found.imported) == pair]
        assert uses, f"{pair[0]} -> {pair[1]} is allowed but no longer imported: drop it"
    at_module_level = [
        str(found)
        for found in IMPORTS
        if (found.importer, found.imported) in INSIDE_FUNCTIONS_ONLY and not found.in_function
    ]
    assert at_module_level == [], _message(
        "the lazy hook imports inside functions", at_module_level
    )


def test_the_core_imports_no_executor_model_or_tool() -> None:
    offending = _offending(CORE, {EXECUTORS, MODELS, TOOLS})
    assert offending == [], _message(
        "the core (statecore/) may import only itself (exceptions: CORE_EXCEPTIONS)", offending
    )


def test_the_executors_import_no_model_or_tool() -> None:
    offending = _offending(EXECUTORS, {MODELS, TOOLS})
    assert offending == [], _message("executors/ may import only the core and itself", offending)


def test_the_models_import_no_tool() -> None:
    offending = _offending(MODELS, {TOOLS})
    assert offending == [], _message("models/ may import anything but tools/", offending)


OBSERVE = "statecore.executors._observe"
RECORDERS = {f"{OBSERVE}.tracer", f"{OBSERVE}.flight"}
"""The observability wing's recorders, on the hot path of every step; the wing's other modules
(the readers: a trace's figures, the Chrome export, the flight file and its replay; and the
seam, which the driver imports) import none of them."""


def test_the_observability_wings_readers_import_no_recorder() -> None:
    wing = {name for name in MODULES if name.startswith(OBSERVE + ".")}
    readers = wing - RECORDERS
    assert wing >= RECORDERS, f"the recorders moved: {sorted(wing)}"
    assert len(readers) >= 3, f"only {sorted(readers)} found as readers"
    offending = [
        str(found) for found in IMPORTS if found.importer in readers and found.imported in RECORDERS
    ]
    assert offending == [], _message("a reader of the wing imports no recorder", offending)


def test_relative_imports_resolve_to_their_package() -> None:
    package = ROOT / "executors" / "_mp" / "__init__.py"
    module = ROOT / "executors" / "_mp" / "worker.py"
    assert _resolve("statecore.executors._mp", package, 1, "wire") == "statecore.executors._mp.wire"
    assert _resolve("statecore.executors._mp.worker", module, 1, "wire") == (
        "statecore.executors._mp.wire"
    )
    assert _resolve("statecore.executors._mp.worker", module, 2, None) == "statecore.executors"
    assert layer_of("statecore.executors._mp.wire") == EXECUTORS
    assert layer_of("statecore._step") == CORE
    assert layer_of("statecorex") is None
