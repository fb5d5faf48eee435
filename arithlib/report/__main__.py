"""``python -m arithlib.report``: see :func:`arithlib.report.main`."""

from . import main

raise SystemExit(main())
