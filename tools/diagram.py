"""The state diagram of the scheduler, drawn from the transition table.

docs/state-machine.md embeds the output of `python -m statecore diagram`; a test checks the two
agree, so the picture cannot drift from the code.
"""

from __future__ import annotations

from collections import defaultdict

from statecore import TRANSITIONS, Phase

__all__ = ["mermaid"]


def mermaid() -> str:
    """A Mermaid `stateDiagram-v2` with one edge per (phase, next phase), labelled by events."""
    edges: dict[tuple[Phase, Phase], list[str]] = defaultdict(list)
    for phase, moves in TRANSITIONS.items():
        for event, targets in moves.items():
            for target in targets:
                edges[(phase, target)].append(event.__name__)
    order = list(Phase)
    lines = ["stateDiagram-v2", "    [*] --> idle"]
    for (source, target), events in sorted(
        edges.items(), key=lambda item: (order.index(item[0][0]), order.index(item[0][1]))
    ):
        label = ", ".join(sorted(events))
        lines.append(f"    {source.value} --> {target.value}: {label}")
    lines.append("    closed --> [*]")
    return "\n".join(lines) + "\n"
