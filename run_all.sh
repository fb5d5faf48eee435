#!/usr/bin/env bash
# Set up the local environment and execute every notebook in notebooks/ in order with
# papermill. Figures and tables go to figures/<model>/, executed notebooks and logs to
# outputs/<model>/. Stops at the first failing notebook (naming it); what earlier
# notebooks produced is kept.
#
#   ./run_all.sh [--model NAME] [--device cpu|cuda|auto] [--quick] [--seed N]
#                [--figures DIR] [--only NN[,NN...]] [--force]
#
# A notebook whose code (its notebook and the arithlib modules it uses), data,
# parameters and input tables (from earlier notebooks) are unchanged since its last
# successful run is skipped (key in outputs/<model>/<notebook>.key); --force reruns it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL="qwen2.5-coder-0.5b"; DEVICE="cpu"; QUICK="False"; SEED=0
FIGURES="$ROOT/figures"; ONLY=""; FORCE=0
usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
while [ "$#" -gt 0 ]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --quick) QUICK="True"; shift ;;
        --seed) SEED="$2"; shift 2 ;;
        --figures) FIGURES="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        --force) FORCE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "run_all.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

"$ROOT/scripts/setup.sh"
PY="${ARITHLIB_VENV:-$ROOT/.venv}/bin/python"
# Fail early, with the library's own message, on an unknown model or a missing GPU.
"$PY" -c "from arithlib.models import check_model_name, resolve_device; check_model_name('$MODEL'); resolve_device('$DEVICE')"

OUT="$ROOT/outputs/${MODEL//\//__}"
mkdir -p "$OUT" "$FIGURES"
TIMES="$OUT/timings.csv"
echo "notebook,seconds,status,peak_rss_mib" > "$TIMES"
total_start=$(date +%s)
for nb in "$ROOT"/notebooks/[0-9][0-9]_*.ipynb; do
    name="$(basename "$nb" .ipynb)"
    KEY="$("$PY" "$ROOT/scripts/run_key.py" "$nb" "$OUT" "$MODEL" "$DEVICE" "$QUICK" "$SEED" "$FIGURES")"
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",${name:0:2},"* ]]; then continue; fi
    if [ "$FORCE" -eq 0 ] && [ -f "$OUT/$name.key" ] && [ "$(cat "$OUT/$name.key")" = "$KEY" ]; then
        echo "=== $name is up to date (key $KEY); skipped (--force reruns it)"
        echo "$name,$(cat "$OUT/$name.seconds" 2>/dev/null || echo NA),cached,$(cat "$OUT/$name.peak_mib" 2>/dev/null || echo NA)" >> "$TIMES"
        continue
    fi
    echo "=== $name (model=$MODEL device=$DEVICE quick=$QUICK seed=$SEED)"
    rm -f "$OUT/$name.key"
    start=$(date +%s)
    set +e
    "$PY" "$ROOT/scripts/peak_memory.py" "$OUT/$name.peak_mib.tmp" "$PY" -m papermill "$nb" "$OUT/$name.ipynb" --cwd "$ROOT/notebooks" -k python3 \
        -p model "$MODEL" -p device "$DEVICE" -p quick "$QUICK" -p seed "$SEED" -p out_dir "$FIGURES" \
        2>&1 | tee "$OUT/$name.log"
    status=${PIPESTATUS[0]}
    set -e
    secs=$(( $(date +%s) - start ))
    if [ "$status" -eq 0 ]; then
        echo "$KEY" > "$OUT/$name.key.tmp" && mv "$OUT/$name.key.tmp" "$OUT/$name.key"
        echo "$secs" > "$OUT/$name.seconds"
        mv "$OUT/$name.peak_mib.tmp" "$OUT/$name.peak_mib" 2>/dev/null || echo NA > "$OUT/$name.peak_mib"
        echo "$name,$secs,ok,$(cat "$OUT/$name.peak_mib")" >> "$TIMES"
        echo "=== $name done in ${secs}s"
    else
        echo "$name,$secs,failed,$(cat "$OUT/$name.peak_mib.tmp" 2>/dev/null || echo NA)" >> "$TIMES"
        echo "run_all.sh: notebook $name FAILED (exit $status) after ${secs}s; see $OUT/$name.ipynb and $OUT/$name.log." >&2
        echo "run_all.sh: what the notebooks before it produced is kept in $FIGURES/${MODEL//\//__}/." >&2
        exit 1
    fi
done
echo "=== all notebooks done in $(( $(date +%s) - total_start ))s; timings in $TIMES"
FIG="$FIGURES/${MODEL//\//__}"
# Wall time and peak memory (resident MiB of the notebook's kernel) of each notebook's last
# successful run (this run's or the cached one's), beside its figures.
{ echo "notebook,seconds,this_run,peak_rss_mib"
  for nb in "$ROOT"/notebooks/[0-9][0-9]_*.ipynb; do
      name="$(basename "$nb" .ipynb)"
      [ -f "$OUT/$name.seconds" ] || continue
      echo "$name,$(cat "$OUT/$name.seconds"),$(grep -q "^$name,[^,]*,ok," "$TIMES" && echo ran || echo cached),$(cat "$OUT/$name.peak_mib" 2>/dev/null || echo NA)"
  done; } > "$FIG/timings.csv.tmp" && mv "$FIG/timings.csv.tmp" "$FIG/timings.csv"
"$PY" -m arithlib.report "$FIG"  # REPORT.md / REPORT.html from the tables above
# Findings across every model run into $FIGURES so far (not the toy model): CROSS_MODEL.md/.csv/.png there.
others=()
for d in "$FIGURES"/*/; do
    d="${d%/}"
    if [ "$(basename "$d")" != "toy-arith" ] && compgen -G "$d/[0-9][0-9]_*_params.json" > /dev/null; then others+=("$d"); fi
done
if [ "${#others[@]}" -ge 2 ]; then "$PY" -m arithlib.report --cross-only "${others[@]}"; fi
