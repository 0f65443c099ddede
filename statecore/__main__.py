"""`python -m statecore`: the command line lives in statecore.models.cli, outside the core."""

from statecore.models.cli import main

raise SystemExit(main())
