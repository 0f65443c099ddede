"""`python -m statecore`: the command line lives in statecore.tools.cli, outside the core."""

from statecore.tools.cli import run

raise SystemExit(run())
