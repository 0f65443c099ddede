"""docs/ stays true to the code: the diagram and the vocabulary match what the core defines."""

from __future__ import annotations

import re
from pathlib import Path

import statecore
from statecore import Command, Event, Phase
from statecore.models.diagram import mermaid

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
