"""docs/ stays true to the code: the diagram and the vocabulary match what the core defines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import statecore
from statecore import Command, Event, Phase
from statecore.models.explorer import Bounds, default_scenarios
from statecore.tools.diagram import mermaid
from statecore.tools.step_bench import BenchResult, ScalePoint

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_state_diagram_in_the_docs_is_the_one_the_table_draws() -> None:
    text = (DOCS / "state-machine.md").read_text()
    block = re.search(
        r"<!-- diagram:start -->\n```mermaid\n(.*?)```\n<!-- diagram:end -->", text, re.S
    )
    assert block is not None
    assert block.group(1) == mermaid()


def test_every_phase_event_and_command_is_documented() -> None:
    text = (DOCS / "state-machine.md").read_text()
    names = [phase.name for phase in Phase]
    names += [
        name
        for name in statecore.__all__
        if isinstance(getattr(statecore, name), type)
        and issubclass(getattr(statecore, name), (Event, Command))
        and getattr(statecore, name) not in (Event, Command)
    ]
    assert [name for name in names if f"`{name}" not in text] == []


@pytest.mark.timeout(120)
def test_the_embedding_guide_runs_as_written_and_prints_what_it_fetched(tmp_path: Path) -> None:
    # Every Python block of the guide, in order, as one program run as a script.
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "embedding.md").read_text(), re.S)
    assert blocks, "the embedding guide has no Python code"
    program = tmp_path / "embedding_example.py"
    program.write_text("\n\n".join(blocks))
    done = subprocess.run(
        [sys.executable, str(program)], capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(index) for index in range(10)], done.stdout


def test_the_step_bench_output_in_the_docs_is_what_the_command_prints_for_its_figures() -> None:
    text = (DOCS / "performance.md").read_text()
    block = re.search(r"```\n(step benchmark: .*?)```", text, re.S)
    assert block is not None, "docs/performance.md shows no output of check --bench"
    shown = block.group(1)
    header = re.search(r"(\d+) events, median of (\d+) rounds", shown)
    assert header is not None
    events, rounds = header.groups()
    core = re.search(r"statecore\.step +([\d.]+) us/event", shown)
    baseline = re.search(r"bookkeeping +([\d.]+) us/event", shown)
    assert core is not None and baseline is not None
    scale_header = re.search(r"(\d+) batches each, median of (\d+) rounds", shown)
    assert scale_header is not None, "the docs show no scale part"
    batches, scale_rounds = scale_header.groups()
    scale = tuple(
        ScalePoint(int(workers), int(count), float(us))
        for workers, count, us in re.findall(r"(\d+) workers, +(\d+) events +([\d.]+) us", shown)
    )
    result = BenchResult(
        int(events),
        int(rounds),
        float(core.group(1)),
        float(baseline.group(1)),
        scale,
        int(batches),
        int(scale_rounds),
    )
    assert shown == result.describe() + "\n"


def test_the_readme_counts_the_configurations_check_explores() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    said = re.search(r"explores every reachable state of the scheduler in (\d+) small", readme)
    assert said is not None
    assert int(said.group(1)) == len(list(default_scenarios(Bounds())))


def test_the_architecture_page_lists_every_module_of_the_package() -> None:
    root = DOCS.parent
    listing = (DOCS / "architecture.md").read_text()
    unlisted = [
        str(path.relative_to(root))
        for folder in ("statecore", "executors", "models", "tools")
        for path in sorted((root / folder).rglob("*.py"))
        if path.name != "__init__.py" and not re.search(rf"\b{re.escape(path.name)}\b", listing)
    ]
    assert unlisted == [], "docs/architecture.md's file tree does not name these"
