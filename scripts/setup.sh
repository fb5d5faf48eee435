#!/usr/bin/env bash
# Create or reuse the local virtual environment and install what is missing.
#   - Reuses $ARITHLIB_VENV (default: .venv in the repository root).
#   - PyTorch: an installed torch is kept (a user's CUDA build stays). Without one, a
#     machine with an NVIDIA GPU gets the default (CUDA) wheel; a machine without one
#     gets a CPU build (a local wheel if pip's find-links has one, else the PyTorch CPU
#     index), never several GB of CUDA libraries it cannot use.
#   - Then installs arithlib in editable mode with its dependencies (and extras given
#     as arguments, e.g. `scripts/setup.sh dev`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ARITHLIB_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_q() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[setup] NVIDIA GPU found: installing the default (CUDA) PyTorch wheel"
        pip_q "torch>=2.4"
    else
        echo "[setup] no GPU: installing a CPU build of PyTorch"
        # A local CPU wheel (pip's find-links) first, without its dependencies, which
        # then come from the normal index; else the PyTorch CPU index.
        if pip_q --no-index --no-deps "torch>=2.4" 2>/dev/null; then
            pip_q "torch>=2.4"
        else
            if ! pip_q --retries 1 --timeout 30 "torch>=2.4" --index-url https://download.pytorch.org/whl/cpu; then
                echo "[setup] ERROR: could not install a CPU build of PyTorch (no local wheel, and" >&2
                echo "        https://download.pytorch.org/whl/cpu is unreachable). Install one by hand," >&2
                echo "        e.g. '$VPY -m pip install torch --index-url <your CPU wheel index>', then rerun." >&2
                exit 1
            fi
        fi
    fi
fi

extras=""
if [ "$#" -gt 0 ]; then extras="[$(IFS=,; echo "$*")]"; fi
stamp="$VENV/.arithlib-installed$extras"
# Reinstall when the venv's arithlib is another checkout's (an editable install made elsewhere):
# the notebooks would otherwise run that copy's code.
where="$(cd / && "$VPY" -c 'import arithlib, os; print(os.path.dirname(os.path.dirname(os.path.realpath(arithlib.__file__))))' 2>/dev/null || true)"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$where" != "$(cd "$ROOT" && pwd -P)" ]; then
    echo "[setup] installing arithlib$extras and its dependencies"
    pip_q -e "$ROOT$extras"
    touch "$stamp"
fi
"$VPY" -c "import torch, transformers, transformer_lens; print(f'[setup] torch {torch.__version__} (cuda available: {torch.cuda.is_available()}), transformers {transformers.__version__}, transformer-lens {transformer_lens.__version__ if hasattr(transformer_lens, \"__version__\") else \"4.x\"}')"
