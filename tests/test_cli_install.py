"""The README's install lines give every command it advertises.

The README's "Run it" section installs the package with `pip install -e .` and then runs
`demo`, `bench`, `check` and `diagram`; only `bench --plot` asks for more, and names the extra
that brings it. So every third-party module the installed package imports, at the top of a
module or inside a function, must come with that install, except the optional ones listed
here, which must be imported only inside functions and only from the extra the README names.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import shlex
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

from statecore.tools.loader_bench import INSTALL_HINT

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("statecore", "executors", "models", "tools")
OPTIONAL = {"matplotlib": "bench", "PIL": "peers"}
"""Third-party modules the base install lacks, each with the extra that brings it."""
INTEGRATIONS = {"lightning": "executors/_lightning.py"}
"""Frameworks the base install lacks, each with the one module that imports it: a module only
the framework itself loads (through its entry point) or a function that the user calls with the
framework installed, so importing the framework at its top is its purpose."""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match is not None, f"unreadable requirement {requirement!r}"
        names.add(_normalized(match.group()))
    return names


def _project() -> dict[str, object]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert isinstance(project, dict)
    return project


def _readme_run_it() -> str:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Run it\n(.*?)^## ", text, re.S | re.M)
    assert section is not None, "README.md has no 'Run it' section"
    return section.group(1)


def _installed_extras(command: str) -> set[str] | None:
    """The extras a shell line installs this project with (`pip install -e '.[x]'`), or None."""
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:3] == ["pip", "install", "-e"] and len(words) == 4:
            target = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", words[3])
            assert target is not None, f"unexpected install target {words[3]!r}"
            return set(target.group(1).split(",")) if target.group(1) else set()
    return None


def _readme_install_line() -> str:
    block = re.search(r"```sh\n(.*?)```", _readme_run_it(), re.S)
    assert block is not None, "the 'Run it' section has no shell block"
    return block.group(1).strip()


def _imports() -> dict[str, list[tuple[Path, ast.AST, bool]]]:
    """Each third-party top-level module the package imports: where, and whether at top level."""
    found: dict[str, list[tuple[Path, ast.AST, bool]]] = {}
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            top_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    module = name.partition(".")[0]
                    if module in sys.stdlib_module_names or module in ("statecore", "__future__"):
                        continue
                    found.setdefault(module, []).append((path, node, id(node) in top_level))
    return found


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution(module: str) -> str:
    distributions = _packages_distributions().get(module)
    assert distributions, f"{module} is imported but belongs to no installed distribution"
    return _normalized(distributions[0])


def test_the_readme_runs_the_commands_after_a_plain_install_of_the_project() -> None:
    line = _readme_install_line()
    assert _installed_extras(line) == set(), line
    assert "python -m statecore demo" in line


def test_every_third_party_module_is_a_dependency_of_the_readme_install() -> None:
    extras = _installed_extras(_readme_install_line())
    assert extras is not None
    project = _project()
    requirements = list(project["dependencies"])  # type: ignore[call-overload]
    optional = project["optional-dependencies"]
    assert isinstance(optional, dict)
    for extra in extras:
        requirements += optional[extra]
    declared = _requirement_names(requirements)
    missing = {
        module: sorted({str(path.relative_to(ROOT)) for path, _, _ in places})
        for module, places in _imports().items()
        if module not in OPTIONAL
        and module not in INTEGRATIONS
        and _distribution(module) not in declared
    }
    assert missing == {}, f"imported but not installed by `{_readme_install_line()}`"


def test_an_optional_module_is_imported_only_inside_a_function() -> None:
    at_top = [
        f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        for module, places in _imports().items()
        if module in OPTIONAL
        for path, node, top_level in places
        if top_level
    ]
    assert at_top == [], "an optional module imported at module level breaks the base install"


def test_a_framework_is_imported_only_by_its_own_integration_module() -> None:
    elsewhere = [
        f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        for module, places in _imports().items()
        if module in INTEGRATIONS
        for path, node, _ in places
        if str(path.relative_to(ROOT)) != INTEGRATIONS[module]
    ]
    assert elsewhere == []


def test_an_integration_module_is_imported_by_the_package_only_inside_a_function() -> None:
    at_top = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module is not None:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                for integration in INTEGRATIONS.values():
                    dotted = "statecore." + integration.removesuffix(".py").replace("/", ".")
                    if dotted in names:
                        at_top.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert at_top == [], "a framework integration imported at module level breaks the base install"


def test_an_optional_module_comes_with_the_extra_the_readme_and_the_error_name() -> None:
    optional = _project()["optional-dependencies"]
    assert isinstance(optional, dict)
    run_it = _readme_run_it()
    for module, extra in OPTIONAL.items():
        assert _distribution(module) in _requirement_names(optional[extra])
        assert f"pip install -e '.[{extra}]'" in run_it
    assert "pip install -e '.[bench]'" in INSTALL_HINT  # what `bench --plot` says without it
    for module in INTEGRATIONS:
        assert _distribution(module) in _requirement_names(optional["frameworks"])


def _ci_script() -> str:
    return (ROOT / ".ci" / "run").read_text()


def test_ci_runs_the_readme_install_line_exactly_as_the_readme_writes_it() -> None:
    assigned = re.search(r'^README_RUN_IT="([^"]*)"$', _ci_script(), re.M)
    assert assigned is not None, ".ci/run no longer names the README's line"
    assert assigned.group(1) == _readme_install_line()


def test_ci_runs_the_readme_line_in_a_fresh_environment_without_the_machines_packages() -> None:
    script = _ci_script()
    venv = re.search(r"^python -m venv (.*)$", script, re.M)
    assert venv is not None and "--system-site-packages" not in venv.group(1)
    assert 'bash -c "$README_RUN_IT --quick"' in script
    # ... and before CI installs the extras, so that nothing they bring can hide a gap
    assert script.index("$README_RUN_IT --quick") < script.index("pip install --quiet -e")


def test_the_readme_line_ends_with_the_demo_so_ci_can_ask_for_the_quick_one() -> None:
    assert _readme_install_line().endswith("python -m statecore demo")


def _readme_test_it() -> str:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Test it\n(.*?)^## ", text, re.S | re.M)
    assert section is not None, "README.md has no 'Test it' section"
    return section.group(1)


def test_ci_runs_each_test_tier_the_readme_names_as_its_own_step() -> None:
    blocks = re.findall(r"```sh\n(.*?)```", _readme_test_it(), re.S)
    tiers = [blocks[0].strip().rsplit("&& ", 1)[-1], *(block.strip() for block in blocks[1:])]
    assert tiers == ["pytest", "pytest -m exhaustive"]
    steps = [line for line in _ci_script().splitlines() if line.startswith("pytest")]
    assert len(steps) == len(tiers)
    # In the README's order, each on a line of its own; options may follow (--durations).
    for step, tier in zip(steps, tiers, strict=True):
        assert shlex.split(step)[: len(shlex.split(tier))] == shlex.split(tier)
        assert "--durations" in step
