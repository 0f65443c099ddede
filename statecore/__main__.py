"""`python -m statecore`: the command line lives in statecore.tools.cli, outside the core."""

import os
import sys

from statecore.tools.cli import main

try:
    status = main()
    sys.stdout.flush()
except BrokenPipeError:
    # The reader went away (`... | head`): what was left to print has nobody to read it. The
    # interpreter's own flush at exit would fail again and print a traceback, so stdout is
    # pointed at /dev/null first; the exit status is the one a shell gives a broken pipe.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    status = 128 + 13  # SIGPIPE
raise SystemExit(status)
