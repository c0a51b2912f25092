"""The `verispec` command line: one module per subcommand, dispatched from main.py."""

from __future__ import annotations

import shlex
import sys


def invocation() -> str:
    """This run's command as a user would type it (`verispec bench …`), however it was started
    (the console script or `python -m verispec.cli.main`), for the reports that record it."""
    return "verispec " + shlex.join(sys.argv[1:])
