#!/usr/bin/env bash
# Set up the local environment (scripts/setup.sh), then execute the numbered notebooks in
# notebooks/ with papermill, each after the notebooks whose tables it reads, and write the
# report: `python -m arithlib run` (arithlib/cli.py) with this script's arguments.
#   ./run_all.sh --help      every option with its default, the models and the notebooks
#   ./run_all.sh [--model NAME] [--device auto|cpu|cuda] [--quick] [--seed N] [-p NAME VALUE ...]
#                [--only NN[,NN...]] [--force] [--jobs N] [--threads N] [--figures DIR] ...
#   ./run_all.sh --teach [--jobs N] [--skip-run]
#                set up a class: the toy model's quick run, the exercises checked, the course
#                site built into outputs/site/ (python -m arithlib teach; docs/teaching.md)
#   ./run_all.sh ... --executor slurm [--models A,B] [--partition P] [--gpus-per-job N] [--status]
#                submits one Slurm job per notebook instead (docs/cluster.md)
# Figures and tables go to figures/<model>/ (a run with changed settings: --quick, a --seed
# other than 0 or any -p, to outputs/scratch/figures/<model>/), keys and logs to
# outputs/<model>/. Every option is checked before anything runs: a bad value stops the
# command with one line and exit status 2.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# this command as typed: a second run on the same folders names it (scripts/run_lock.py)
export ARITHLIB_RUN_COMMAND="$0${*:+ $*}"
"$ROOT/scripts/setup.sh"
if [ "${1:-}" = "--teach" ]; then
    shift
    exec "${ARITHLIB_VENV:-$ROOT/.venv}/bin/python" -m arithlib teach "$@"
fi
# the options are parsed once, by the CLI; its usage line and messages carry this script's name
ARITHLIB_PROG="$0" exec "${ARITHLIB_VENV:-$ROOT/.venv}/bin/python" -m arithlib run "$@"
