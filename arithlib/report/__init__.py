"""The run's report: each headline finding of the three papers, the paper's number, ours
(computed from the CSV tables the notebooks wrote into a figures folder) and a verdict
by a rule stated in words and applied in code.

A finding is a small declarative :class:`Finding`: where the claim is in the paper, the
paper's number (quoted from the published papers, cited by section in :data:`ZHANG_TXT`
and its neighbours; where the paper gives none, the qualitative claim), the tables it needs, a function computing our numbers and the
verdict rule. Rules are fixed from the papers' claims, with three shared constants:

* a quantitative claim is *reproduced* when our effect is at least half the paper's
  (:data:`HALF`);
* "much more" claims without a number need a gap of at least :data:`CLEAR_GAP`
  (10 points) to be reproduced;
* a gap of at least :data:`NOISE_GAP` (5 points) in the paper's direction is *partly*.

A finding whose tables are missing (notebook not run, or a study skipped for this
model) gets the verdict "not run"; one whose computation raises (a bug, a malformed
table) gets "error" with the exception in its text, so a crash never passes for a
study that was not run.

The report is written to be read in five minutes: one summary line per finding, then a short
section per finding (claim, our number, rule, one captioned figure, the differences the
offline model forces) and a line per notebook; the full fidelity table goes to FIDELITY.md
and the run's provenance, the full rules and each notebook's own findings to DETAILS.md,
both linked from it (:mod:`.render`, :mod:`.appendix`).

Usage: ``python -m arithlib.report figures/<model> [figures/<model2> ...]`` writes
``REPORT.md``, ``REPORT.html``, ``FIDELITY.md`` and ``DETAILS.md`` into each folder and, for two or more folders,
``CROSS_MODEL.md`` / ``CROSS_MODEL.csv`` next to them (layer positions as
layer / n_layers, so models of different depth compare). ``python -m arithlib.report
--cross-in figures --readme README.md`` (what ``run_all.sh`` calls) writes the cross-model
files over every model folder in ``figures`` and the verdict table into the README.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..core.papers import CLEAR_GAP, HALF, NOISE_GAP, PAPERS, PAPERS_SHORT
from ..core.stats import INCONCLUSIVE, NOT_APPLICABLE, NOT_REPRODUCED, PARTLY, REPRODUCED, UNDECIDABLE
from .appendix import DETAILS_FILE, FIDELITY_FILE, details_markdown, fidelity_markdown
from .cross_model import (
    CROSS_CURVES,
    CROSS_METRICS,
    README_END,
    README_START,
    TOY_FOLDER,
    cross_model_curves,
    cross_model_metrics,
    cross_model_table,
    model_folders,
    models_by_size,
    n_params,
    replace_readme_block,
    size_order,
    size_trend,
    size_trends,
    verdict_markdown,
    verdict_table,
    write_cross_model,
)
from .findings import FINDINGS, findings_table, judge, smoke_test_reason
from .links import broken_links, committed_pages
from .render import (
    RULES_TEXT,
    _summary_counts,
    commit_summary,
    environment_lines,
    markdown_table,
    notebook_anchor,
    notebook_links,
    notebook_verdicts,
    report_html,
    report_markdown,
    summary_frame,
    write_report,
)
from .rules import Finding, Outcome
from .tables import ERROR, NOT_JUDGED, NOT_RUN, NOTEBOOKS, VERDICTS, MissingTable, NotApplicable, NotRun, Tables

__all__ = [
    "CLEAR_GAP",
    "CROSS_CURVES",
    "CROSS_METRICS",
    "DETAILS_FILE",
    "ERROR",
    "FIDELITY_FILE",
    "FINDINGS",
    "HALF",
    "INCONCLUSIVE",
    "NOISE_GAP",
    "NOTEBOOKS",
    "NOT_APPLICABLE",
    "NOT_JUDGED",
    "NOT_REPRODUCED",
    "NOT_RUN",
    "PAPERS",
    "PAPERS_SHORT",
    "PARTLY",
    "README_END",
    "README_START",
    "REPRODUCED",
    "RULES_TEXT",
    "TOY_FOLDER",
    "UNDECIDABLE",
    "VERDICTS",
    "Finding",
    "MissingTable",
    "NotApplicable",
    "NotRun",
    "Outcome",
    "Tables",
    "broken_links",
    "commit_summary",
    "committed_pages",
    "cross_model_curves",
    "cross_model_metrics",
    "cross_model_table",
    "details_markdown",
    "environment_lines",
    "fidelity_markdown",
    "findings_table",
    "judge",
    "main",
    "markdown_table",
    "model_folders",
    "models_by_size",
    "n_params",
    "notebook_anchor",
    "notebook_links",
    "notebook_verdicts",
    "replace_readme_block",
    "report_html",
    "report_markdown",
    "size_order",
    "size_trend",
    "size_trends",
    "smoke_test_reason",
    "summary_frame",
    "verdict_markdown",
    "verdict_table",
    "write_cross_model",
    "write_report",
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arithlib.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("fig_dirs", nargs="*", help="figures/<model> folders written by the notebooks")
    parser.add_argument(
        "--cross-in",
        default=None,
        help="cross-model files over every model folder in this folder (model_folders; the toy model left out)",
    )
    parser.add_argument(
        "--cross-out", default=None, help="folder for CROSS_MODEL.md/.csv (default: the first folder's parent)"
    )
    parser.add_argument(
        "--cross-only",
        action="store_true",
        help="write only the cross-model files (the folders' own reports are left as they are)",
    )
    parser.add_argument(
        "--readme",
        default=None,
        help="also write the verdict table into this README's verdict "
        "block (between the lines README_START and README_END)",
    )
    args = parser.parse_args(argv)
    if args.cross_in:
        if args.fig_dirs or args.cross_only:
            parser.error("--cross-in takes no folders and implies --cross-only")
        args.fig_dirs, args.cross_only = model_folders(args.cross_in), True
    elif not args.fig_dirs:
        parser.error("give figures/<model> folders or --cross-in figures")
    for d in [] if args.cross_only else args.fig_dirs:
        md, page = write_report(d)
        table = findings_table(d)
        print(f"{md}, {page.name}, {FIDELITY_FILE} and {DETAILS_FILE} written ({_summary_counts(table)})")
    if len(args.fig_dirs) >= 2:
        md, csv = write_cross_model(args.fig_dirs, args.cross_out, args.readme)
        print(f"{md} and {csv.name} written" + (f"; verdict table into {args.readme}" if args.readme else ""))
    elif args.readme:
        print(f"{args.readme} left as it is: the verdict table needs two or more model folders")
    return 0
