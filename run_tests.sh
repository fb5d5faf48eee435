#!/usr/bin/env bash
# Set up the local environment (scripts/setup.sh) and run the test suite.
# Extra arguments go to pytest, e.g. `./run_tests.sh -m slow` or `./run_tests.sh -m real_model`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$ROOT/scripts/setup.sh" dev
cd "$ROOT"
exec "${ARITHLIB_VENV:-$ROOT/.venv}/bin/python" -m pytest "$@"
