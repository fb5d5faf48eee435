#!/usr/bin/env python
"""Benchmark: glibc's default malloc against settings that keep freed memory in the
process (``MALLOC_ENV``: no mmap for large blocks, no trimming), which ``run_all.sh``
gave each notebook on trial. Two default runs settled it: 1,632 s with, 1,641 s without
(RESULTS.md), so the notebooks run with glibc's defaults; this script stays to re-measure.

Runs a benchmark script twice in a fresh process, once per setting, and reports wall
time, system (kernel) time, minor page faults and peak memory of each run; appends the
table to ``benchmarks/RESULTS.md``. The default workload is ``benchmarks/layer_inputs.py``
(notebook 06's evaluations, one thread).

    python benchmarks/malloc.py
    python benchmarks/malloc.py --script optimizer.py --script-args --model random-llama
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import results  # noqa: E402

#: The tried settings: freed memory kept for reuse instead of handed back to the kernel,
#: which must fault and zero every page again (about 10 us per 4 KB page on the 2-core VM).
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30), "MALLOC_TOP_PAD_": str(2**30)}


def run_once(cmd: list[str], env: dict[str, str]) -> dict:
    """Wall and kernel seconds, minor faults and peak RSS (MiB) of one child run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall": wall,
        "sys": after.ru_stime - before.ru_stime,
        "faults": after.ru_minflt - before.ru_minflt,
        "peak_mib": after.ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--script", default="layer_inputs.py", help="a script in benchmarks/")
    ap.add_argument("--script-args", nargs=argparse.REMAINDER, default=[], help="its arguments (--no-append is added)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the runs (run_all.sh: 1 per notebook)")
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    cmd = [sys.executable, str(ROOT / "benchmarks" / a.script), *a.script_args, "--no-append"]
    base = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    base.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    rows = []
    for name, env in (("glibc default", base), ("MALLOC_ENV (kept memory)", {**base, **MALLOC_ENV})):
        rows.append({"setting": name, **run_once(cmd, env)})
    lines = [
        "| workload | malloc | wall (s) | kernel time (s) | minor page faults | peak memory (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| `{a.script} {' '.join(a.script_args)}`".rstrip() + f" | {r['setting']} | {r['wall']:.1f} | "
        f"{r['sys']:.1f} | {r['faults']:,} | {r['peak_mib']:,.0f} |"
        for r in rows
    ]
    print("\n".join(lines))
    if not a.no_append:
        note = (
            "`MALLOC_ENV` = "
            + ", ".join(f"`{k}={v}`" for k, v in MALLOC_ENV.items())
            + f"; {a.threads} thread(s). Wall time includes loading the model."
        )
        results.append(
            results.section(
                "Keeping freed memory in the process (glibc malloc settings)",
                lines,
                where=platform.machine(),
                argv=argv,
                note=note,
            )
        )
    return rows


if __name__ == "__main__":
    main()
