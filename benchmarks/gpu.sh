#!/usr/bin/env bash
# The GPU benchmarks: every benchmark in benchmarks/ on random-weight models of
# Llama-3-8B's shape (arithlib.core.random_models.FULL_SHAPES; no weights to download), in bf16 on
# one GPU. Each script prints its table and appends it, with the command that produced
# it, to benchmarks/RESULTS.md: times, counted FLOPs, achieved TFLOP/s and the fraction
# of the GPU's datasheet peak (benchmarks/roofline.py).
#
#   benchmarks/gpu.sh [NAME ...]     # NAME: gemm patching cna stacked layer_inputs
#                                    #       answer_logits evaluate optimizer (default: all)
#   benchmarks/gpu.sh --check [NAME ...]   # the same commands on a tiny random model on
#                                    # the CPU, appending nothing (tested in the suite)
#
# Needs the environment run_all.sh sets up (scripts/setup.sh), and a GPU with 80 GB
# (the optimizer benchmark steps the first 8 of the 32 blocks: all of them, with
# gradients, two moments and the benchmark's copies, need about 130 GB). A script that
# fails is reported and the others still run; the exit status is the number that failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-${ARITHLIB_VENV:-$ROOT/.venv}/bin/python}"
[ -x "$PY" ] || PY=python3
if [ "${1:-}" = "--check" ]; then
    shift
    M=(--model random-llama --device cpu --dtype float32); NO=--no-append
    GEMM="--models smollm2-135m --rows 1 8 --seconds 0.01 --no-write"; PATCH="--shape tiny --device cpu --dtype float32 --no-write"
    SMALL=(--n 8); CNA_N=(--n-prompts 8)
else
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'benchmarks/gpu.sh: no GPU visible to torch (it runs the CUDA benchmarks only; --check runs them on a tiny model on the CPU)')" || exit 1
    M=(--model random-llama:llama3-8b --device cuda --dtype bfloat16); NO=""
    GEMM="--models qwen2.5-coder-1.5b llama3-8b --device cuda --dtype bfloat16 --seconds 0.5"; PATCH=""
    SMALL=(); CNA_N=()
fi
declare -A CMD=(
    [gemm]="benchmarks/gemm.py $GEMM"
    [patching]="benchmarks/patching.py --mode gpu --loop-components 64 $PATCH"
    [cna]="benchmarks/cna.py ${M[*]} --loop-neurons 64 --repeats 1 ${CNA_N[*]} $NO"
    [stacked]="benchmarks/stacked.py ${M[*]} ${SMALL[*]} $NO"
    [layer_inputs]="benchmarks/layer_inputs.py ${M[*]} ${SMALL[*]} $NO"
    [answer_logits]="benchmarks/answer_logits.py ${M[*]} ${SMALL[*]} $NO"
    [evaluate]="benchmarks/evaluate.py ${M[*]} --n-per-template ${SMALL[1]:-10} $NO"
    [optimizer]="benchmarks/optimizer.py ${M[*]} --blocks 8 $NO"
)
ORDER=(gemm patching cna stacked layer_inputs answer_logits evaluate optimizer)
[ "$#" -gt 0 ] && ORDER=("$@")
failed=0
for name in "${ORDER[@]}"; do
    if [ -z "${CMD[$name]+x}" ]; then echo "benchmarks/gpu.sh: unknown benchmark '$name' (known: ${!CMD[*]})" >&2; exit 2; fi
    echo "=== $name: python ${CMD[$name]}"
    t0=$(date +%s)
    # shellcheck disable=SC2086  # the command is a word list
    if "$PY" ${CMD[$name]}; then status=ok; else status=FAILED; failed=$((failed + 1)); fi
    echo "=== $name $status in $(( $(date +%s) - t0 )) s"
done
exit "$failed"
