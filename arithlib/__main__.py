"""``python -m arithlib run [OPTIONS]``: :mod:`arithlib.cli` (``--help`` lists the options)."""

import sys

from arithlib.cli import main

sys.exit(main())
