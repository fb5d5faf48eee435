#!/usr/bin/env python
"""Benchmark table: every section of a model's notebooks against its arithmetic floor.

Reads the ``NN_timings.csv`` tables a run wrote (:mod:`arithlib.run.floor`: each
section's wall seconds, the GFLOP it counted, and the matrix-product peak the notebook
measured on its machine) and writes one table per model: wall time, GFLOP, floor
(GFLOP / peak) and their ratio, section by section, with the whole run's sum. The goal it
holds: no section whose floor is above ``--min-floor`` seconds runs above ``--goal``
times it. Appends the table to benchmarks/RESULTS.md.

    python benchmarks/floor.py figures/qwen2.5-coder-0.5b
    python benchmarks/floor.py outputs/scratch/figures/toy-arith --no-write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

from arithlib.run.outputs import section_timings  # noqa: E402


def section_table(folder: Path) -> pd.DataFrame:
    """Every counted section of the notebooks in ``folder`` (``total`` rows left out):
    notebook, section, wall_s, gflop, floor_s, ratio_to_floor, peak_gflop_s. Notebooks
    whose timings predate the count are left out."""
    frames = [
        t[t.section != "total"].assign(notebook=nn) for nn, t in section_timings(folder).items() if "gflop" in t.columns
    ]
    if not frames:
        return pd.DataFrame(columns=["notebook", "section", "wall_s", "gflop", "floor_s", "ratio_to_floor"])
    cols = ["notebook", "section", "wall_s", "reused_s", "gflop", "floor_s", "ratio_to_floor", "peak_gflop_s"]
    return pd.concat(frames, ignore_index=True)[cols]


def markdown(table: pd.DataFrame, goal: float, min_floor: float) -> list[str]:
    """The table as markdown lines, sections with a floor above ``min_floor`` seconds
    marked when their ratio exceeds ``goal``, then the sum over every section."""
    lines = [
        "| notebook | section | wall s | GFLOP | floor s | wall / floor | peak GFLOP/s | within goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        judged = r.floor_s > min_floor
        mark = ("yes" if r.ratio_to_floor <= goal else "**no**") if judged else "(floor under the bar)"
        floor = f"{r.floor_s:,.1f}" if r.floor_s == r.floor_s else "–"
        ratio = f"{r.ratio_to_floor:.1f}" if r.ratio_to_floor == r.ratio_to_floor else "–"
        lines.append(
            f"| {r.notebook} | {r.section} | {r.wall_s:,.1f} | {r.gflop:,.1f} | {floor} | {ratio} | "
            f"{r.peak_gflop_s:,.0f} | {mark} |"
        )
    wall, floor = table.wall_s.sum(), table.floor_s.fillna(0).sum()
    lines.append(
        f"| all | every section | {wall:,.1f} | {table.gflop.sum():,.1f} | {floor:,.1f} | "
        f"{wall / floor if floor else float('nan'):.1f} | | |"
    )
    return lines


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a model's figures folder (figures/<model>)")
    ap.add_argument("--goal", type=float, default=1.5, help="the largest wall / floor ratio the goal allows")
    ap.add_argument("--min-floor", type=float, default=60.0, help="seconds of floor above which a section is judged")
    ap.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    if not a.folder.is_dir():
        ap.error(f"{a.folder} is not a folder (give a model's figures folder, e.g. figures/qwen2.5-coder-0.5b)")
    table = section_table(a.folder)
    if table.empty:
        ap.error(f"{a.folder} has no NN_timings.csv with counted GFLOP (rerun the notebooks with this version)")
    lines = markdown(table, a.goal, a.min_floor)
    print("\n".join(lines))
    if not a.no_write:
        results.append(
            results.section(
                f"Each section against its arithmetic floor: {a.folder.name}",
                lines,
                argv=argv,
                note=(
                    "Floor = the GFLOP the section counted (matrix products and attention, forward and backward) "
                    "at the matrix-product peak its notebook measured (the higher of two readings, at its start and end, "
                    "where the run took both: `arithlib.run.floor`); "
                    f"sections with a floor above {a.min_floor:g} s are held to {a.goal:g}x. Results loaded "
                    "from a store count neither time nor GFLOP here."
                ),
            )
        )
    return table


if __name__ == "__main__":
    main()
