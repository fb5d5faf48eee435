"""Writing a folder's report: REPORT.md and REPORT.html with the findings, the fidelity table
and each notebook's section."""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..environment import environment_line
from ..outputs import write_text
from ..papers import CLEAR_GAP, HALF, NOISE_GAP, PAPERS_SHORT
from .findings import FINDINGS, findings_table, judge
from .tables import _RARE_VERDICTS, NOTEBOOKS, VERDICTS, Tables

# --------------------------------------------------------------------------- writing



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


def _summary_counts(table: pd.DataFrame) -> str:
    counts = table["verdict"].value_counts()
    return ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS if v not in _RARE_VERDICTS or counts.get(v, 0))


def _notebook_lines(tables: Tables, nb: str) -> list[str]:
    path = next(iter(sorted(tables.dir.glob(f"{nb}_findings.json"))), None)
    if path is None:
        return []
    try:
        return [str(x) for x in json.loads(path.read_text()).get("lines", [])]
    except (OSError, ValueError):
        return []


def _header(tables: Tables) -> tuple[str, list[str]]:
    info, params = tables.info(), tables.params()
    model = tables.model()
    quick = sorted(nb for nb, p in params.items() if p.get("quick"))
    facts = [f"notebooks run: {', '.join(sorted(params)) or 'none'}"]
    if info:
        facts.append(f"{info.get('n_layers')} layers x {info.get('n_heads')} heads, d_mlp {info.get('d_mlp')}")
    if quick:
        facts.append(f"QUICK mode in notebooks {', '.join(quick)}: smoke-test sizes, not evidence")
    return model, facts


def environment_lines(params: dict[str, dict]) -> list[str]:
    """Markdown lines stating the software each notebook's tables were computed with (its
    params JSON's ``environment``): the packages in one line when all notebooks agree,
    else one line per distinct set naming its notebooks, then the commit(s) of the code;
    runs from before environments were recorded are named as such."""
    def grouped(key) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for nb, p in sorted(params.items()):
            env = p.get("environment")
            text = key(env) if env else "not recorded (run before arithlib recorded its environment)"
            out.setdefault(text, []).append(nb)
        return out

    packages = grouped(environment_line)
    if len(packages) == 1:
        lines = [f"**Environment:** {next(iter(packages))}."]
    else:
        lines = ["**Environment** (differs between notebooks):", ""] + [
            f"- notebooks {', '.join(nbs)}: {text}" for text, nbs in packages.items()]
    commits = {c: nbs for c, nbs in grouped(lambda e: e.get("git_commit") or "unknown").items()
               if not c.startswith("not recorded")}
    if commits:
        lines.append("**Code:** " + "; ".join(f"commit {c} (notebooks {', '.join(nbs)})" for c, nbs in commits.items())
                     + ".")
    return lines


RULES_TEXT = ("Verdicts are computed, never typed in: each finding's rule is fixed from the paper's claim. "
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
              "'quick') are shown but 'not judged'; a computation that fails gives 'error'.")


def notebook_verdicts(fig_dir: str | os.PathLike, notebook: str) -> list[str]:
    """Markdown lines giving the report's verdict, our numbers and the rule for each finding
    of ``notebook`` ("01".."07"), from the tables already in ``fig_dir``: a notebook ends
    with the same verdicts as REPORT.md, by the same rules (one place for every rule)."""
    if notebook not in NOTEBOOKS:
        raise ValueError(f"unknown notebook {notebook!r}; choose one of {sorted(NOTEBOOKS)}")
    tables = Tables(fig_dir)
    return [f"- Report verdict, **{f.id}** ({PAPERS_SHORT[f.paper]}, {f.where}): **{out.verdict}**: {out.ours}. "
            f"Rule: {f.rule}. Paper: {f.paper_number}."
            for f in FINDINGS if f.notebook == notebook for out in [judge(f, tables)]]


def notebook_anchor(nb: str) -> str:
    """The anchor of notebook ``nb``'s section in REPORT.md (``REPORT.md#notebook-01``): an
    explicit one, since a code host derives heading anchors by rules of its own."""
    return f"notebook-{nb}"


def notebook_links(stem: str, model: str | None = None) -> str:
    """The Markdown line a notebook in ``notebooks/`` opens with (``stem``: its file name
    without ``.ipynb``): links, relative to ``notebooks/``, to its executed copy and to its
    section of the report of ``model`` (default: the default model's committed run)."""
    if model is None:
        from ..models import DEFAULT_MODEL as model
    folder = f"../figures/{model.replace('/', '__')}"
    return (f"**Results** ({model}, the committed run): [this notebook executed, with its outputs]"
            f"({folder}/notebooks/{stem}.ipynb) · [its section of the report]"
            f"({folder}/REPORT.md#{notebook_anchor(stem[:2])})")


def _executed_notebook(tables: Tables, nb: str) -> Path | None:
    """The executed copy of notebook ``nb`` beside the figures (``notebooks/NN_*.ipynb``), if any."""
    return next(iter(sorted((tables.dir / "notebooks").glob(f"{nb}_*.ipynb"))), None)


def _md_image(name: str) -> str:
    return f"![{name}]({name}.png)"


FIDELITY_TITLE = "Fidelity: the paper's setting beside ours"
FIDELITY_TEXT = ("Each finding's setting in its paper beside ours, aspect by aspect: ours is read from this "
                 "folder's params JSONs (\"not recorded\" where a run predates a parameter); the last column names "
                 "the differences the small offline models force. Every other difference is a choice of this "
                 "reimplementation, shown so it can be judged.")


def report_fidelity(tables: Tables, table: pd.DataFrame) -> pd.DataFrame:
    """:func:`fidelity.fidelity_table` of this folder's params, the prompts row of each
    finding ending with the number of prompts behind its verdict's interval."""
    from .fidelity import fidelity_table

    fid = fidelity_table(tables.params(), {f.id: f.notebook for f in FINDINGS})
    n_of = dict(zip(table["id"], table["ci_n"]))
    prompts = fid["aspect"] == "prompts"
    fid.loc[prompts, "ours"] = [f"{o}; n = {int(n_of[f])} behind the verdict's interval" if n_of.get(f) else o
                                for f, o in zip(fid.loc[prompts, "finding"], fid.loc[prompts, "ours"])]
    return fid


def report_markdown(fig_dir: str | os.PathLike, table: pd.DataFrame | None = None) -> str:
    """REPORT.md's text: the findings table, the rules, and a section per notebook with
    each finding's figure beside it, then the notebook's other figures, all inline."""
    tables = Tables(fig_dir)
    table = findings_table(fig_dir) if table is None else table
    model, facts = _header(tables)
    figures_of = {f.id: f.figures for f in FINDINGS}
    out = [f"# Reproduction report: `{model}`", "", "; ".join(facts) + ".", "",
           *(environment_lines(tables.params()) + [""] if tables.params() else []),
           f"**Verdicts:** {_summary_counts(table)}.", "", RULES_TEXT, "", "## Findings", "",
           markdown_table(table[["id", "paper", "where", "paper_number", "ours", "interval", "verdict"]]), "",
           "### Claims, rules and sources", ""]
    for r in table.itertuples():
        out.append(f"- **{r.id}** ({r.paper}, {r.where}): {r.claim} *Rule:* {r.rule}. *Paper number from:* {r.source}.")
    out += ["", f"## {FIDELITY_TITLE}", "", FIDELITY_TEXT, "",
            markdown_table(report_fidelity(tables, table))]
    for nb, title in NOTEBOOKS.items():
        pngs = [p.stem for p in sorted(tables.dir.glob(f"{nb}_*.png"))]
        sub = table[table.notebook == nb]
        lines = _notebook_lines(tables, nb)
        out += ["", f'<a id="{notebook_anchor(nb)}"></a>', "", f"## {nb} · {title}", ""]
        if not pngs and not lines:
            out.append("Not run for this model.")
            continue
        executed = _executed_notebook(tables, nb)
        if executed is not None:
            rel = executed.relative_to(tables.dir).as_posix()
            out += [f"Executed notebook, with its outputs: [{rel}]({rel})", ""]
        shown: set[str] = set()
        for r in sub.itertuples():
            out.append(f"- {r.id}: **{r.verdict}** — {r.ours}")
            for name in (n for n in figures_of.get(r.id, ()) if n in pngs):
                if name in shown:
                    out[-1] += f" (figure above: [{name}]({name}.png))"
                else:
                    out += ["", f"  {_md_image(name)}", ""]
                    shown.add(name)
        if len(sub):
            out.append("")
        if lines:
            out += ["", "What the notebook found:", ""] + lines + [""]
        rest = [n for n in pngs if n not in shown]
        if rest:
            out += ["More figures:" if shown else "Figures:", ""]
            for name in rest:
                out += [_md_image(name), ""]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n") + "\n"  # one blank line between blocks


_CSS = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px 6px;"
        "vertical-align:top}th{background:#eee}img{max-width:100%;margin:0.5em 0}"
        ".reproduced{background:#d4f4d4}.partly{background:#fff3c4}.not-reproduced{background:#f8d0d0}"
        ".not-run{background:#e8e8e8}.error{background:#f0a0a0}.inconclusive{background:#dde6f8}")


def _html_findings(table: pd.DataFrame) -> str:
    cols = ["id", "paper", "where", "paper_number", "ours", "interval", "verdict", "rule"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in table[cols].itertuples(index=False):
        cls = str(r.verdict).replace(" ", "-")
        body.append("<tr>" + "".join(f'<td class="{cls}">{html.escape(str(v))}</td>' if c == "verdict"
                                     else f"<td>{html.escape(str(v))}</td>" for c, v in zip(cols, r)) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _html_table(frame: pd.DataFrame) -> str:
    """A plain HTML table of ``frame`` (escaped)."""
    e = html.escape
    head = "".join(f"<th>{e(str(c))}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in r) + "</tr>"
                   for r in frame.itertuples(index=False))
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(path: Path) -> str:
    """A figure that links the PNG beside REPORT.html (relative path).

    Linked, not base64-embedded: the page lies in the same folder as its PNGs, and an
    embedded page (6 MB per model) would add its whole size to the repository's history
    on every committed rerun.
    """
    name = html.escape(path.name, quote=True)
    return (f'<figure><img alt="{html.escape(path.stem)}" src="{name}">'
            f"<figcaption>{html.escape(path.name)}</figcaption></figure>")


def report_html(fig_dir: str | os.PathLike, table: pd.DataFrame | None = None) -> str:
    """REPORT.html's text: the findings table and each notebook's figures, shown inline (linked PNGs beside it)."""
    tables = Tables(fig_dir)
    table = findings_table(fig_dir) if table is None else table
    model, facts = _header(tables)
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Report: {e(model)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>Reproduction report: {e(model)}</h1>",
             f"<p>{e('; '.join(facts))}.</p>", f"<p><b>Verdicts:</b> {e(_summary_counts(table))}.</p>",
             f"<p>{e(RULES_TEXT)}</p>", "<h2>Findings</h2>", _html_findings(table),
             "<h2 id='fidelity'>" + e(FIDELITY_TITLE) + "</h2>", f"<p>{e(FIDELITY_TEXT)}</p>",
             _html_table(report_fidelity(tables, table))]
    for nb, title in NOTEBOOKS.items():
        pngs = sorted(tables.dir.glob(f"{nb}_*.png"))
        sub = table[table.notebook == nb]
        lines = _notebook_lines(tables, nb)
        parts.append(f'<h2 id="{notebook_anchor(nb)}">{e(nb)} · {e(title)}</h2>')
        if not pngs and not lines:
            parts.append("<p>Not run for this model.</p>")
            continue
        executed = _executed_notebook(tables, nb)
        if executed is not None:  # not its HTML rendering: not committed, a link to it would break in a clone
            rel = e(executed.relative_to(tables.dir).as_posix(), quote=True)
            parts.append(f'<p>Executed notebook, with its outputs: <a href="{rel}">{rel}</a></p>')
        if len(sub):
            parts.append("<ul>" + "".join(f"<li>{e(r.id)}: <b>{e(r.verdict)}</b> — {e(r.ours)}</li>"
                                          for r in sub.itertuples()) + "</ul>")
        if lines:
            parts.append("<p>What the notebook found:</p><ul>"
                         + "".join(f"<li>{e(x.lstrip('- '))}</li>" for x in lines) + "</ul>")
        parts += [_img(p) for p in pngs]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(fig_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``REPORT.md`` and ``REPORT.html`` into ``fig_dir`` (atomically); return both paths."""
    fig_dir = Path(fig_dir)
    if not fig_dir.is_dir():
        raise FileNotFoundError(f"{fig_dir} is not a folder of notebook outputs")
    table = findings_table(fig_dir)
    md = write_text(fig_dir / "REPORT.md", report_markdown(fig_dir, table))
    page = write_text(fig_dir / "REPORT.html", report_html(fig_dir, table))
    return md, page
