"""The report's two linked pages: FIDELITY.md (the paper's setting beside ours, finding by
finding, aspect by aspect) and DETAILS.md (how the run was made, the full verdict rules and
each notebook's own findings and figures): what a reader of REPORT.md may look up but does
not need in its first five minutes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from .findings import FINDINGS
from .markup import (
    RULES_TEXT,
    executed_notebook,
    markdown_table,
    notebook_anchor,
    notebook_html_if_tracked,
    section_anchor,
)
from .provenance import DIRTY, environment_lines
from .tables import NOTEBOOKS, Tables

FIDELITY_FILE = "FIDELITY.md"
DETAILS_FILE = "DETAILS.md"
FIDELITY_TITLE = "Fidelity: the paper's setting beside ours"
FIDELITY_TEXT = (
    "Each finding's setting in its paper beside ours, aspect by aspect: ours is read from this "
    'folder\'s params JSONs ("not recorded" where a run predates a parameter); the last column names '
    "the differences the small offline models force. Every other difference is a choice of this "
    "reimplementation, shown so it can be judged."
)
FORCED_COLUMN = "forced by the offline model"


def report_fidelity(tables: Tables, table: pd.DataFrame) -> pd.DataFrame:
    """:func:`fidelity.fidelity_table` of this folder's params (rows keyed by finding id and
    aspect), the prompts row of each finding ending with the number of prompts behind its
    verdict's interval."""
    from .fidelity import fidelity_table

    fid = fidelity_table(tables.params(), {f.id: f.notebook for f in FINDINGS})
    n_of = dict(zip(table["id"], table["ci_n"]))
    prompts = fid["aspect"] == "prompts"
    fid.loc[prompts, "ours"] = [
        f"{o}; n = {int(n_of[f])} behind the verdict's interval" if n_of.get(f) else o
        for f, o in zip(fid.loc[prompts, "finding"], fid.loc[prompts, "ours"])
    ]
    return fid


def forced_differences(fid: pd.DataFrame) -> tuple[list[tuple[str, str]], dict[str, list[tuple[str, str]]]]:
    """The differences the offline models force, from :func:`report_fidelity`'s rows: those
    every finding shares (aspect, text), stated once, and per finding id the others."""
    rows = fid[fid[FORCED_COLUMN].astype(str).str.len() > 0]
    pairs = {f: list(zip(g["aspect"], g[FORCED_COLUMN])) for f, g in rows.groupby("finding", sort=False)}
    ids = list(dict.fromkeys(fid["finding"]))
    common = [p for p in pairs.get(ids[0], []) if all(p in pairs.get(i, []) for i in ids)] if ids else []
    return common, {i: [p for p in pairs.get(i, []) if p not in common] for i in ids}


def fidelity_markdown(tables: Tables, table: pd.DataFrame) -> str:
    """FIDELITY.md: per finding (an anchor named by its id) its five aspects, the paper's
    setting beside ours and what the offline model forces."""
    fid = report_fidelity(tables, table)
    verdict = dict(zip(table["id"], table["verdict"]))
    out = [f"# {FIDELITY_TITLE}: `{tables.model()}`", "", f"Back to [the report](REPORT.md). {FIDELITY_TEXT}", ""]
    for fid_id, rows in fid.groupby("finding", sort=False):
        out += [
            f'<a id="{section_anchor(fid_id)}"></a>',
            "",
            f"## {fid_id} ([{verdict.get(fid_id, '')}](REPORT.md#{section_anchor(fid_id)}))",
            "",
            markdown_table(rows[["aspect", "paper", "ours", FORCED_COLUMN]]),
            "",
        ]
    return "\n".join(out).rstrip("\n") + "\n"


def _notebook_lines(tables: Tables, nb: str) -> list[str]:
    """The lines notebook ``nb`` wrote into ``NN_findings.json`` (what it found), or none."""
    path = next(iter(sorted(tables.dir.glob(f"{nb}_findings.json"))), None)
    if path is None:
        return []
    try:
        return [str(x) for x in json.loads(path.read_text()).get("lines", [])]
    except (OSError, ValueError):
        return []


def details_markdown(tables: Tables, table: pd.DataFrame) -> str:
    """DETAILS.md: the run's provenance (software, the commit of each notebook's tables),
    the full verdict rules, then per notebook (anchor ``notebook-NN``) its executed copy,
    its findings, what it found in its own words and every figure it wrote."""
    params = tables.params()
    out = [
        f"# Run details: `{tables.model()}`",
        "",
        "Back to [the report](REPORT.md).",
        "",
        '<a id="provenance"></a>',
        "",
        "## Provenance",
        "",
    ]
    if params:
        out += [
            *environment_lines(params),
            "",
            f'A commit ending in "{DIRTY}" ran from a work tree with uncommitted changes: that code is in no commit.',
            "",
        ]
    else:
        out += ["No notebook recorded its parameters in this folder.", ""]
    out += ['<a id="rules"></a>', "", "## How verdicts are given", "", RULES_TEXT, ""]
    for nb, title in NOTEBOOKS.items():
        pngs = sorted(p.name for p in tables.dir.glob(f"{nb}_*.png"))
        lines = _notebook_lines(tables, nb)
        out += [f'<a id="{notebook_anchor(nb)}"></a>', "", f"## {nb} · {title}", ""]
        if not pngs and not lines and nb not in params:
            out += ["Not run for this model.", ""]
            continue
        executed = executed_notebook(tables, nb)
        if executed is not None:
            rel = executed.relative_to(tables.dir).as_posix()
            page = notebook_html_if_tracked(executed)
            html_link = f" ([HTML]({page.relative_to(tables.dir).as_posix()}))" if page is not None else ""
            out += [f"Executed notebook, with its outputs: [{rel}]({rel}){html_link}", ""]
        sub = table[table["notebook"] == nb]
        out += [f"- [{r.id}](REPORT.md#{section_anchor(r.id)}): **{r.verdict}**" for r in sub.itertuples()]
        if lines:
            out += ["", "What the notebook found:", "", *lines]
        if pngs:
            out += ["", "Figures: " + " · ".join(f"[{Path(p).stem}]({p})" for p in pngs)]
        out.append("")
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n") + "\n"
