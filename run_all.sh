#!/usr/bin/env bash
# Set up the local environment and execute every notebook in notebooks/ with papermill,
# each after the notebooks whose tables it reads. Figures and tables go to
# figures/<model>/, the executed notebooks (outputs kept, widget state dropped) to
# figures/<model>/notebooks/ (.ipynb and .html), keys, logs and raw copies to
# outputs/<model>/. A notebook writes into this run's own staging folder first; only when it
# succeeds do its files replace its old ones in figures/<model>/, whole or not at all (a failed
# or stopped one, or a full disk, leaves them as they were). After a failing notebook (named,
# with its log) no other starts; what the others produced is kept. One run at a time per
# outputs and figures folder: a second one stops at once, naming the first.
#   ./run_all.sh [--model NAME] [--device auto|cpu|cuda] [--quick] [--seed N]
#                [--dtype auto|float32|bfloat16] [--device-map auto|balanced|JSON]
#                [-p NAME VALUE ...] [--figures DIR] [--only NN[,NN...]] [--force]
#                [--jobs N] [--threads N]
#
# --device: auto (default) takes the GPU when torch sees one, else the CPU.
# --dtype: auto (default) is bfloat16 on a GPU, float32 on a CPU. --device-map splits the
# model across devices through TransformerLens/accelerate ('{"model.layers.0": 0, ...}'
# names HF modules); an unknown value, or a device that does not exist, stops the run.
# -p NAME VALUE: set a variable of the notebooks' parameters cell, typed as its default
# (true/false for a boolean, any case), e.g. ./run_all.sh --only 01 -p key_threshold -0.1;
# an unknown NAME is an error listing the valid ones. --quick never overrides a -p value.
# A run with changed settings (--quick, --seed other than 0, any -p) writes to
# outputs/scratch/figures/<model>/ (first a copy of figures/<model>/), never over the
# committed figures/, unless --figures DIR says where.
# --jobs: notebooks run at once (default 2 on a CPU with 2+ cores, else 1; each gets
# --threads torch threads, default cores / jobs; see scripts/run_notebooks.py).
# Every minute the console shows each running notebook's cells done and its minutes
# against its last run's (figures/<model>/timings.csv).
#
# A notebook whose code (its notebook and the arithlib modules it uses), data,
# parameters and input tables (from earlier notebooks) are unchanged since its last
# successful run is skipped (key in outputs/<model>/<notebook>.key); --force reruns it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# this command as typed: a second run on the same folders names it (scripts/run_lock.py)
export ARITHLIB_RUN_COMMAND="$0${*:+ $*}"
MODEL="qwen2.5-coder-0.5b"; DEVICE="auto"; QUICK="False"; SEED=0; DTYPE="auto"; DEVICE_MAP=""
FIGURES=""; ONLY=""; FORCE=""; JOBS=""; THREADS=""; PARAMS=()
usage() { sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; }
while [ "$#" -gt 0 ]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --dtype) DTYPE="$2"; shift 2 ;;
        --device-map) DEVICE_MAP="$2"; shift 2 ;;
        --quick) QUICK="True"; shift ;;
        --seed) SEED="$2"; shift 2 ;;
        -p|--param)
            if [ "$#" -lt 3 ]; then echo "run_all.sh: $1 takes a NAME and a VALUE, e.g. -p fewshot 3" >&2; exit 2; fi
            PARAMS+=(--param "$2" "$3"); shift 3 ;;
        --figures) FIGURES="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        --force) FORCE="--force"; shift ;;
        --jobs) JOBS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "run_all.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

"$ROOT/scripts/setup.sh"
PY="${ARITHLIB_VENV:-$ROOT/.venv}/bin/python"
# Fail early, with the library's own message, on an unknown model or a missing GPU.
# An installed model whose weight files changed since install is refused here (arithlib.weights).
RESOLVED="$("$PY" -c "
import sys
from arithlib.models import check_model_name, resolve_device
from arithlib.weights import ModelFilesChanged, check_installed
check_model_name('$MODEL')
try:
    check_installed('$MODEL')
except ModelFilesChanged as err:
    sys.exit(f'run_all.sh: {err}')
print(resolve_device('$DEVICE'))")"

# The notebooks, two at a time on a CPU (scripts/run_notebooks.py says why and how), on
# the resolved device. Writes outputs/<model>/timings.csv (this run) and $FIG/timings.csv
# (each notebook's last run).
RUN=("$PY" "$ROOT/scripts/run_notebooks.py" --model "$MODEL" --device "$RESOLVED" --quick "$QUICK"
     --dtype "$DTYPE" ${DEVICE_MAP:+--device-map "$DEVICE_MAP"}
     --seed "$SEED" --only "$ONLY" ${FIGURES:+--figures "$FIGURES"} ${JOBS:+--jobs "$JOBS"}
     ${THREADS:+--threads "$THREADS"} ${PARAMS[@]+"${PARAMS[@]}"})
# Checks -p, --only, --dtype and --device-map before anything runs, and names the figures folder (the scratch rule above).
"${RUN[@]}" --print-figures >/dev/null
# The notebooks, then (--report) REPORT.md / REPORT.html from their tables and the findings
# across every model run into the figures root so far (not the toy model): CROSS_MODEL.md/.csv/.png
# there; the README's verdict table shows the committed runs, so it is rewritten only for the
# repository's own figures/. All under one lock on the outputs and figures folders: a second run
# on them stops at once, naming this one.
exec "${RUN[@]}" $FORCE --report
