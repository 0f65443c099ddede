"""The state diagram of the scheduler, drawn from the transition table and its rules.

docs/state-machine.md embeds the output of `python -m statecore diagram`; a test checks the two
agree, so the picture cannot drift from the code.
"""

from __future__ import annotations

from collections import defaultdict

from statecore import ECHOES, RULES, TRANSITIONS, Phase

__all__ = ["mermaid"]


def mermaid() -> str:
    """A Mermaid `stateDiagram-v2`: one edge per (phase, next phase) of the table's moves,
    labelled by events; one per state-triggered rule, labelled by its name in brackets; and a
    loop for the echoes a phase drops where no move of that event already stays in it."""
    edges: dict[tuple[Phase, Phase], list[str]] = defaultdict(list)
    for phase, moves in TRANSITIONS.items():
        for event, target in moves.items():
            edges[(phase, target)].append(event.__name__)
            if event in ECHOES[phase] and target is not phase:
                edges[(phase, phase)].append(f"{event.__name__} (echo)")
    for rule in RULES:
        edges[(rule.source, rule.target)].append(f"[{rule.name}]")
    order = list(Phase)
    lines = ["stateDiagram-v2", "    [*] --> idle"]
    for (source, target), events in sorted(
        edges.items(), key=lambda item: (order.index(item[0][0]), order.index(item[0][1]))
    ):
        label = ", ".join(sorted(events))
        lines.append(f"    {source.value} --> {target.value}: {label}")
    lines.append("    closed --> [*]")
    return "\n".join(lines) + "\n"
