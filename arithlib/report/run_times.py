"""How long each model's committed run took: one row per notebook, one column per model.

A notebook's time is the wall time of its last committed run (``timings.csv``, column
``seconds``) plus what the sections that run loaded from the store took when they were
computed (``reused_s`` of its ``NN_timings.csv``), so that a run resumed from stored sections
does not understate a run from an empty cache; a section that loads another notebook's
product (:data:`FROM_ANOTHER_NOTEBOOK`) adds nothing, its time being in that notebook's. Its memory is the peak
resident memory of that run (``peak_rss_mib``). The README's "how long it takes" table is
:func:`run_time_markdown` of the committed model folders, written between
:data:`TIMES_START` and :data:`TIMES_END` by ``python -m arithlib.report --cross-in figures
--readme README.md``; a test checks that the committed README matches the committed figures.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ..run.outputs import section_timings
from .markup import markdown_table

TIMES_START = (
    "<!-- run times: written by `python -m arithlib.report --cross-in figures --readme README.md`; do not edit -->"
)
TIMES_END = "<!-- /run times -->"


#: Sections whose stored result a run of every notebook computes in an earlier notebook, so
#: that their reused seconds are already in that notebook's time: notebook 06 loads notebook
#: 05's reference LoRA model from the fine-tuning store.
FROM_ANOTHER_NOTEBOOK: dict[str, frozenset[str]] = {"06": frozenset({"data + reference LoRA"})}


def _reused_seconds(fig_dir: Path) -> dict[str, float]:
    """Notebook number -> seconds its run loaded from stored sections that a run from an
    empty cache computes in this notebook: the ``reused_s`` of the ``total`` row less that
    of the sections of :data:`FROM_ANOTHER_NOTEBOOK` (0 when the notebook's ``NN_timings``
    table has no ``reused_s``, as runs before the per-section timings did)."""
    out: dict[str, float] = {}
    for nb, rows in section_timings(fig_dir).items():
        if "reused_s" not in rows.columns:
            out[nb] = 0.0
            continue
        reused = dict(zip(rows["section"].astype(str), rows["reused_s"].fillna(0.0).astype(float)))
        total = sum(v for k, v in reused.items() if k.startswith("total"))
        out[nb] = total - sum(reused.get(k, 0.0) for k in FROM_ANOTHER_NOTEBOOK.get(nb, ()))
    return out


def notebook_times(fig_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per notebook of ``fig_dir``'s ``timings.csv``: ``notebook``, ``wall_s`` (wall
    seconds of its last run, truncated as the README's total counts them), ``reused_s`` (the
    seconds of the sections it loaded from the store, :func:`_reused_seconds`), ``seconds``
    (their sum: what a run from an empty cache takes) and ``peak_gib`` (NaN where the run
    recorded no peak)."""
    d = Path(fig_dir)
    path = d / "timings.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run the model's notebooks (./run_all.sh --model {d.name}) first")
    reused = _reused_seconds(d)
    rows = []
    with path.open() as fh:
        for r in csv.DictReader(fh):
            rows.append(
                {
                    "notebook": r["notebook"],
                    "wall_s": int(float(r["seconds"])),
                    "reused_s": reused.get(r["notebook"][:2], 0.0),
                    "peak_gib": float(r["peak_rss_mib"]) / 1024 if r.get("peak_rss_mib") else float("nan"),
                }
            )
    times = pd.DataFrame(rows, columns=["notebook", "wall_s", "reused_s", "peak_gib"])
    times.insert(1, "seconds", times["wall_s"] + times["reused_s"])
    return times


def total_seconds(times: pd.DataFrame) -> int:
    """A model's whole-run time from :func:`notebook_times`: the sum of the wall seconds plus
    the rounded sum of the reused seconds (the figure the README states for the default model)."""
    return int(times["wall_s"].sum() + round(times["reused_s"].sum()))


def _cell(seconds: float, peak_gib: float) -> str:
    memory = "peak not recorded" if pd.isna(peak_gib) else f"{peak_gib:.1f} GiB"
    return f"{seconds:,.0f} s, {memory}"


def run_time_table(fig_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Notebooks by models (in the order given): each cell "seconds, peak GiB"; a last row
    ``all notebooks`` with each model's :func:`total_seconds` (and hours) and its largest
    peak. A notebook a model did not run shows "not run"."""
    times = {Path(d).name: notebook_times(d).set_index("notebook") for d in fig_dirs}
    notebooks = sorted({nb for t in times.values() for nb in t.index})
    rows = []
    for nb in notebooks:
        row = {"notebook": f"`{nb}`"}
        for m, t in times.items():
            row[m] = _cell(t.at[nb, "seconds"], t.at[nb, "peak_gib"]) if nb in t.index else "not run"
        rows.append(row)
    total = {"notebook": "**all notebooks**"}
    for m, t in times.items():
        s = total_seconds(t.reset_index())
        peak = t["peak_gib"].max()
        total[m] = f"**{s:,} s ({s / 3600:.1f} h)**, largest peak " + (
            "not recorded" if pd.isna(peak) else f"{peak:.1f} GiB"
        )
    rows.append(total)
    return pd.DataFrame(rows)


def run_time_markdown(fig_dirs: Sequence[str | os.PathLike]) -> str:
    """:func:`run_time_table` as Markdown (the README's "how long it takes" block)."""
    return markdown_table(run_time_table(fig_dirs))
