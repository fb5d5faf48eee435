#!/usr/bin/env bash
# Register the set-up virtual environment as a Jupyter kernel named "arithlib" (display
# name "Python (arithlib)", for your user; rerunning replaces it) and open JupyterLab on
# notebooks/. Arguments go to `jupyter lab` (e.g. --no-browser --port 8890);
# --kernel-only registers the kernel and stops, for a Jupyter or editor outside the venv.
#
#   scripts/lab.sh [--kernel-only] [jupyter lab options]
#
# The environment is the one run_all.sh and run_tests.sh set up ($ARITHLIB_VENV, default
# .venv); run one of them (or scripts/setup.sh) first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${ARITHLIB_VENV:-$ROOT/.venv}/bin/python"
if [ ! -x "$PY" ]; then
    echo "scripts/lab.sh: no environment at ${PY%/bin/python}: run scripts/setup.sh (or ./run_tests.sh) first" >&2
    exit 1
fi
"$PY" -m ipykernel install --user --name arithlib --display-name "Python (arithlib)"
if [ "${1:-}" = "--kernel-only" ]; then exit 0; fi
cd "$ROOT/notebooks"
exec "$PY" -m jupyter lab "$@"
