#!/usr/bin/env python
"""Compare the CSV tables of two figures folders (the check that a refactor changes
no result): every table in either folder (``*.csv``, or ``*.csv.gz`` for a row-level one: a
table stored plainly on one side and compressed on the other is compared by its contents,
:func:`arithlib.run.outputs.read_table`) is reported as identical (byte for byte, uncompressed),
identical but for its run-time columns, equal up to float rounding (same columns and rows, text cells equal, numbers within
``--rtol``/``--atol``), different, or missing on one side. Timing tables
(``*timings*.csv``) and columns that hold run-time measurements (``--skip-columns``) are
left out. Exit status: the number of tables that differ or are missing.

    python scripts/compare_tables.py figures/qwen2.5-coder-0.5b outputs/scratch/figures/qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's arithlib
from arithlib.run.outputs import find_table, read_table, table_name  # noqa: E402

#: Columns that measure the run, not the result (seconds, rates, memory).
RUN_COLUMNS = (
    "seconds",
    "wall_s",
    "reused_s",
    "samples_per_second",
    "train_seconds",
    "forward_min_s",
    "forward_s",
    "speedup",
    "peak_rss_mib",
    "start_s",
    "end_s",
    "this_run",
    "threads",
)


def _text(path: Path) -> bytes:
    """A table file's bytes, uncompressed."""
    data = path.read_bytes()
    return gzip.decompress(data) if path.name.endswith(".gz") else data


#: A table whose result columns are equal cell for cell and only run-time columns differ.
RUN_ONLY = "identical but for run-time columns"


def compare(a: Path, b: Path, rtol: float, atol: float, skip: set[str]) -> str:
    """ "identical", RUN_ONLY, "rounding" or a one-line description of the first difference."""
    if _text(a) == _text(b):
        return "identical"
    fa, fb = read_table(a), read_table(b)
    fa, fb = fa.drop(columns=[c for c in fa if c in skip]), fb.drop(columns=[c for c in fb if c in skip])
    if list(fa.columns) == list(fb.columns) and fa.astype(str).equals(fb.astype(str)):
        return RUN_ONLY
    if list(fa.columns) != list(fb.columns):
        return f"columns differ: {sorted(set(fa.columns) ^ set(fb.columns))}"
    if len(fa) != len(fb):
        return f"{len(fa)} vs {len(fb)} rows"
    for col in fa.columns:
        x, y = fa[col], fb[col]
        if pd.api.types.is_numeric_dtype(x) and pd.api.types.is_numeric_dtype(y):
            xv, yv = x.to_numpy(float), y.to_numpy(float)
            ok = np.isclose(xv, yv, rtol=rtol, atol=atol, equal_nan=True)
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                return f"column {col!r} row {i}: {xv[i]!r} vs {yv[i]!r} ({int((~ok).sum())} cells)"
        elif not x.astype(str).equals(y.astype(str)):
            i = int(np.flatnonzero(x.astype(str).to_numpy() != y.astype(str).to_numpy())[0])
            return f"column {col!r} row {i}: {str(x.iloc[i])[:60]!r} vs {str(y.iloc[i])[:60]!r}"
    return "rounding"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--atol", type=float, default=1e-8)
    ap.add_argument("--skip-columns", nargs="*", default=list(RUN_COLUMNS))
    args = ap.parse_args(argv)
    names = sorted(
        {
            table_name(p)
            for d in (args.a, args.b)
            for pattern in ("*.csv", "*.csv.gz")
            for p in d.glob(pattern)
            if "timings" not in p.name
        }
    )
    counts: dict[str, int] = {}
    bad = 0
    for table in names:
        pa, pb = find_table(args.a, table), find_table(args.b, table)
        name = (pa or pb).name
        if not (pa and pb):
            verdict = f"missing in {args.b if pa else args.a}"
        else:
            verdict = compare(pa, pb, args.rtol, args.atol, set(args.skip_columns))
        kind = verdict if verdict in ("identical", RUN_ONLY, "rounding") else "different"
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "different":
            bad += 1
            print(f"{name}: {verdict}")
        elif kind == "rounding":
            print(f"{name}: equal up to float rounding")
    print(", ".join(f"{n} {k}" for k, n in counts.items()) + f" ({len(names)} tables)")
    return bad


if __name__ == "__main__":
    sys.exit(main())
