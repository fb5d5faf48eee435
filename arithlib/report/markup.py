"""The pieces every generated page shares: Markdown tables, the verdict counts and rules in
words, the anchors of findings and notebooks, and the links to a notebook's executed copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..core.papers import CLEAR_GAP, HALF, NOISE_GAP
from .links import is_tracked
from .tables import _RARE_VERDICTS, VERDICTS, Tables


def _md_cell(x) -> str:
    if isinstance(x, float):
        x = "" if not np.isfinite(x) else f"{x:.3g}"
    return str(x).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-style Markdown table (no extra dependency)."""
    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(_md_cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_md_cell(v) for v in row) + " |")
    return "\n".join(lines)


def summary_counts(table: pd.DataFrame) -> str:
    """ "2 reproduced, 4 partly, ..." over the findings table's verdicts (rare ones only when present)."""
    counts = table["verdict"].value_counts()
    return ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS if v not in _RARE_VERDICTS or counts.get(v, 0))


RULES_TEXT = (
    "Verdicts are computed, never typed in: each finding's rule is fixed from the paper's claim. "
    f"A quantitative claim is reproduced when our effect is at least {HALF:.0%} of the paper's; a "
    f"qualitative 'much more' claim needs a gap of {100 * CLEAR_GAP:.0f} points; a gap of "
    f"{100 * NOISE_GAP:.0f} points in the paper's direction is 'partly'. Each rule is judged on the 95 % "
    "interval of the number it reads (exact binomial for an accuracy, a bootstrap over prompts otherwise): "
    "a verdict is given only when the whole interval lies on one side of every threshold, and an interval "
    "that straddles a threshold gives 'inconclusive' when more prompts from the same population would decide "
    "(the report estimates how many) and 'undecidable here' when that population is exhausted (every "
    "1-digit operand pair, a fixed list of professions). A finding whose premise fails on the model (no "
    "arithmetic-specific head, a baseline accuracy that cannot carry the test) is 'not applicable', with "
    "the premise named. Missing tables give "
    "'not run'; numbers measured at smoke-test sizes (a notebook's quick mode, fine-tuning at scale "
    "'quick') are shown but 'not judged'; a computation that fails gives 'error'."
)

#: :data:`RULES_TEXT` in two sentences, for the top of REPORT.md (the whole text is in DETAILS.md).
RULES_SHORT = (
    f"Each verdict applies a rule fixed from the paper's claim (a quantitative claim is reproduced when "
    f"our effect is at least {HALF:.0%} of the paper's) to the 95 % interval of our number; "
    "'inconclusive' means more prompts would decide, 'undecidable here' that every possible prompt is "
    "already measured, 'not applicable' that a premise fails on this model."
)


def notebook_anchor(nb: str) -> str:
    """The anchor of notebook ``nb``'s line in REPORT.md (``REPORT.md#notebook-01``) and of
    its section in DETAILS.md: an explicit one, since a code host derives heading anchors by
    rules of its own."""
    return f"notebook-{nb}"


def section_anchor(finding_id: str) -> str:
    """The anchor of a finding's section in REPORT.md and of its rows in FIDELITY.md: its id."""
    return finding_id


def notebook_links(stem: str, model: str | None = None) -> str:
    """The Markdown line a notebook in ``notebooks/`` opens with (``stem``: its file name
    without ``.ipynb``): links, relative to ``notebooks/``, to its executed copy and to its
    section of the report of ``model`` (default: the default model's committed run)."""
    if model is None:
        from ..core.models import DEFAULT_MODEL as model
    folder = f"../figures/{model.replace('/', '__')}"
    return (
        f"**Results** ({model}, the committed run): [this notebook executed, with its outputs]"
        f"({folder}/notebooks/{stem}.ipynb) · [its section of the report]"
        f"({folder}/REPORT.md#{notebook_anchor(stem[:2])})"
    )


def executed_notebook(tables: Tables, nb: str) -> Path | None:
    """The executed copy of notebook ``nb`` beside the figures (``notebooks/NN_*.ipynb``), if any."""
    return next(iter(sorted((tables.dir / "notebooks").glob(f"{nb}_*.ipynb"))), None)


def notebook_html_if_tracked(executed: Path) -> Path | None:
    """The HTML rendering of an executed notebook, only when git tracks it: run_all.sh writes
    one beside the .ipynb, but it is ignored (not committed), and a page must not link a file
    a clean clone lacks."""
    page = executed.with_suffix(".html")
    return page if page.is_file() and is_tracked(page) else None
