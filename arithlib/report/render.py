"""Writing a folder's report, readable in five minutes: REPORT.md and REPORT.html open with one
summary line per finding (paper, claim, our number with its 95 % interval, verdict), then one
short section per finding (the claim, what we measured, the rule, one figure with a caption,
the differences the offline model forces) and one line per notebook. What a reader may look up
but need not read first goes into two linked pages beside them (:mod:`.appendix`):
FIDELITY.md (every aspect of the paper's setting beside ours) and DETAILS.md (provenance, the
full rules, each notebook's own findings and every figure)."""

from __future__ import annotations

import html
import os
import re
from pathlib import Path

import pandas as pd

from ..core.papers import PAPERS_SHORT
from ..run.outputs import write_text
from .appendix import (
    DETAILS_FILE,
    FIDELITY_FILE,
    FIDELITY_TEXT,  # noqa: F401
    FIDELITY_TITLE,  # noqa: F401
    details_markdown,  # noqa: F401
    fidelity_markdown,
    forced_differences,
    report_fidelity,
)
from .captions import caption, headline
from .findings import FINDINGS, findings_table, judge
from .markup import (
    RULES_SHORT,
    RULES_TEXT,  # noqa: F401
    _md_cell,  # noqa: F401
    executed_notebook,
    markdown_table,  # noqa: F401
    notebook_anchor,
    notebook_links,  # noqa: F401
    section_anchor,
    summary_counts,
)
from .provenance import commit_summary, environment_lines  # noqa: F401
from .release import read_release, release_sentence
from .tables import NOT_RUN, NOTEBOOKS, Tables

_summary_counts = summary_counts  # the name the CLI and older callers use

SUMMARY_COLUMNS = ["finding", "paper", "claim", "ours (95 % interval)", "verdict"]
#: The summary's "ours" cell of a finding whose verdict reads no interval (not run, not
#: applicable, error): the reason is in its section.
NO_HEADLINE = "no interval (see its section)"


def _header(tables: Tables) -> tuple[str, list[str]]:
    info, params = tables.info(), tables.params()
    model = tables.model()
    quick = sorted(nb for nb, p in params.items() if p.get("quick"))
    facts = [f"notebooks run: {', '.join(sorted(params)) or 'none'}"]
    if info:
        facts.insert(0, f"{info.get('n_layers')} layers x {info.get('n_heads')} heads, d_mlp {info.get('d_mlp')}")
    if quick:
        facts.append(f"QUICK mode in notebooks {', '.join(quick)}: smoke-test sizes, not evidence")
    return model, facts


def summary_frame(table: pd.DataFrame) -> pd.DataFrame:
    """The summary: one row per finding, in :data:`FINDINGS` order: the finding (its id),
    the paper (short), the claim, our number with the 95 % interval its verdict reads
    (:data:`NO_HEADLINE` without one: not run, not applicable) and the verdict."""
    return pd.DataFrame(
        {
            "finding": table["id"],
            "paper": [PAPERS_SHORT[f.paper] for f in FINDINGS],
            "claim": table["claim"],
            "ours (95 % interval)": [
                headline(r.id, r.ci_estimate, r.ci_low, r.ci_high, r.ci_n) or NO_HEADLINE for r in table.itertuples()
            ],
            "verdict": table["verdict"],
        }
    )[SUMMARY_COLUMNS]


def _figure(tables: Tables, finding_id: str) -> Path | None:
    """The finding's first figure that this folder has (its PNG), or None."""
    f = next(f for f in FINDINGS if f.id == finding_id)
    return next((tables.dir / f"{n}.png" for n in f.figures if (tables.dir / f"{n}.png").is_file()), None)


def _sentence(text: str) -> str:
    text = str(text).strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _forced_text(pairs: list[tuple[str, str]]) -> str:
    return "; ".join(f"*{aspect}*: {text}" for aspect, text in pairs)


def _shown_before(tables: Tables, table: pd.DataFrame, finding_id: str) -> str | None:
    """The id of an earlier finding whose section already shows this finding's figure, or None."""
    fig = _figure(tables, finding_id)
    ids = list(table["id"])
    for other in ids[: ids.index(finding_id)]:
        if (
            fig is not None
            and _figure(tables, other) == fig
            and table.loc[table["id"] == other, "verdict"].item() != NOT_RUN
        ):
            return other
    return None


def _section_markdown(r, tables: Tables, forced: list[tuple[str, str]], earlier: str | None = None) -> list[str]:
    anchor = section_anchor(r.id)
    out = [
        f'<a id="{anchor}"></a>',
        "",
        f"### {r.id}: {r.verdict}",
        "",
        f"**Claim** ({r.paper}, {r.where}): {r.claim} **Paper's number:** {_sentence(r.paper_number)}",
        "",
        f"**Ours** (notebook {r.notebook}): {_sentence(r.ours)}"
        + (f" **95 % interval:** {r.interval}." if r.interval != "none" else ""),
        "",
        "<details><summary>Rule</summary>",
        "",
        f"{_sentence(r.rule)} Paper's number from: {_sentence(r.source)}",
        "",
        "</details>",
        "",
    ]
    fig = _figure(tables, r.id)
    if fig is not None and earlier is not None and r.verdict != NOT_RUN:
        out += [f"Figure: the one shown under [{earlier}](#{section_anchor(earlier)}).", ""]
    elif fig is not None and r.verdict != NOT_RUN:
        out += [f"![{r.id}: figure]({fig.name})", "", f"*{caption(fig.stem)}*", ""]
    elif fig is not None:  # its tables could not be judged: the figure of the older run only linked
        out += [f"Figure of the tables this verdict could not use: [{fig.name}]({fig.name}).", ""]
    where = f"[FIDELITY.md]({FIDELITY_FILE}#{anchor})"
    out.append(
        f"**Differences from the paper's setting** forced by the offline model: {_forced_text(forced)} "
        f"(every aspect, and our other choices, in {where})."
        if forced
        else f"**Differences from the paper's setting:** none forced beyond the model; every aspect in {where}."
    )
    return out + [""]


def _notebook_markdown(tables: Tables, table: pd.DataFrame, nb: str, title: str) -> str:
    sub = table[table["notebook"] == nb]
    parts = []
    if len(sub):
        parts.append(
            "findings " + ", ".join(f"[{r.id}](#{section_anchor(r.id)}) ({r.verdict})" for r in sub.itertuples())
        )
    executed = executed_notebook(tables, nb)
    if executed is not None:
        rel = executed.relative_to(tables.dir).as_posix()
        parts.append(f"[executed notebook]({rel})")
    if nb in tables.params() or executed is not None or any(tables.dir.glob(f"{nb}_*.png")):
        parts.append(f"[what it found, every figure]({DETAILS_FILE}#{notebook_anchor(nb)})")
    else:
        parts.append("not run for this model")
    return f'- <a id="{notebook_anchor(nb)}"></a>**{nb} · {title}**: ' + " · ".join(parts)


def report_markdown(fig_dir: str | os.PathLike, table: pd.DataFrame | None = None) -> str:
    """REPORT.md's text: the header (model, commits, verdict counts, the rules in brief), the
    summary (one line per finding), one short section per finding and one line per notebook."""
    tables = Tables(fig_dir)
    table = findings_table(fig_dir) if table is None else table
    model, facts = _header(tables)
    common, forced = forced_differences(report_fidelity(tables, table))
    summary = summary_frame(table).assign(finding=[f"[{i}](#{section_anchor(i)})" for i in table["id"]])
    out = [f"# Reproduction report: `{model}`", "", "; ".join(facts) + ".", ""]
    if tables.params():
        out += [commit_summary(tables.params()), ""]
        released = release_sentence(tables.params(), read_release())
        out += [released, ""] if released else []
    out += [
        f"**Verdicts:** {summary_counts(table)}. {RULES_SHORT} The full rules: [DETAILS.md]({DETAILS_FILE}#rules); "
        f"the papers' settings beside ours: [FIDELITY.md]({FIDELITY_FILE}).",
        "",
        "## Summary",
        "",
        markdown_table(summary),
        "",
        "## Findings",
        "",
    ]
    if common:
        out += [f"Every finding differs from its paper by what the offline model forces: {_forced_text(common)}.", ""]
    for r in table.itertuples():
        out += _section_markdown(r, tables, forced.get(r.id, []), _shown_before(tables, table, r.id))
    out += ["## Notebooks", ""] + [_notebook_markdown(tables, table, nb, title) for nb, title in NOTEBOOKS.items()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n") + "\n"  # one blank line between blocks


_CSS = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.4}"
    "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px 6px;"
    "vertical-align:top}th{background:#eee}img{max-width:100%;margin:0.5em 0}figcaption{font-style:italic}"
    "details{margin:0.5em 0}summary{cursor:pointer}"
    ".reproduced{background:#d4f4d4}.partly{background:#fff3c4}.not-reproduced{background:#f8d0d0}"
    ".not-run{background:#e8e8e8}.error{background:#f0a0a0}.inconclusive{background:#dde6f8}"
    ".undecidable-here{background:#e6dcf5}.not-applicable{background:#f0f0f0}"
)


def _html_summary(table: pd.DataFrame) -> str:
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in SUMMARY_COLUMNS)
    body = []
    for fid, r in zip(table["id"], summary_frame(table).itertuples(index=False)):
        cls = str(r.verdict).replace(" ", "-")
        body.append(
            f'<tr><td><a href="#{e(section_anchor(fid), quote=True)}">{e(fid)}</a></td><td>{e(r.paper)}</td>'
            f'<td>{e(r.claim)}</td><td>{e(r[3])}</td><td class="{cls}">{e(r.verdict)}</td></tr>'
        )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _md_links_to_html(text: str) -> str:
    """Escaped ``text`` with its *emphasis* as <i> (the forced-difference lines)."""
    return re.sub(r"\*([^*]+)\*", r"<i>\1</i>", html.escape(text))


def _section_html(r, tables: Tables, forced: list[tuple[str, str]], earlier: str | None = None) -> str:
    e = html.escape
    anchor = e(section_anchor(r.id), quote=True)
    parts = [
        f'<h3 id="{anchor}">{e(r.id)}: <span class="{str(r.verdict).replace(" ", "-")}">{e(r.verdict)}</span></h3>',
        f"<p><b>Claim</b> ({e(r.paper)}, {e(r.where)}): {e(r.claim)} <b>Paper's number:</b> "
        f"{e(_sentence(r.paper_number))}</p>",
        f"<p><b>Ours</b> (notebook {e(r.notebook)}): {e(_sentence(r.ours))}"
        + (f" <b>95 % interval:</b> {e(r.interval)}." if r.interval != "none" else "")
        + "</p>",
        f"<details><summary>Rule</summary><p>{e(_sentence(r.rule))} Paper's number from: "
        f"{e(_sentence(r.source))}</p></details>",
    ]
    fig = _figure(tables, r.id)
    if fig is not None and earlier is not None and r.verdict != NOT_RUN:
        parts.append(
            f'<p>Figure: the one shown under <a href="#{e(section_anchor(earlier), quote=True)}">{e(earlier)}</a>.</p>'
        )
    elif fig is not None and r.verdict != NOT_RUN:
        name = e(fig.name, quote=True)
        parts.append(
            f'<figure><img alt="{e(r.id)}: figure" src="{name}"><figcaption>{e(caption(fig.stem))}'
            "</figcaption></figure>"
        )
    elif fig is not None:
        parts.append(
            f'<p>Figure of the tables this verdict could not use: <a href="{e(fig.name, quote=True)}">'
            f"{e(fig.name)}</a>.</p>"
        )
    where = f'<a href="{FIDELITY_FILE}#{anchor}">{FIDELITY_FILE}</a>'
    parts.append(
        f"<p><b>Differences from the paper's setting</b> forced by the offline model: "
        f"{_md_links_to_html(_forced_text(forced))} (every aspect, and our other choices, in {where}).</p>"
        if forced
        else f"<p><b>Differences from the paper's setting:</b> none forced beyond the model; every "
        f"aspect in {where}.</p>"
    )
    return "\n".join(parts)


def _md_inline_to_html(line: str) -> str:
    """One generated Markdown line (links, bold, an ``<a id>``) as HTML, the rest escaped."""
    anchor = re.match(r'- <a id="([^"]+)"></a>', line)
    text = line[anchor.end() :] if anchor else line
    text = html.escape(text, quote=False)
    text = re.sub(
        r"\[([^\]]+)\]\(([^)]+)\)", lambda m: f'<a href="{html.escape(m.group(2), quote=True)}">{m.group(1)}</a>', text
    )
    text = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)
    return f'<li id="{anchor.group(1)}">{text}</li>' if anchor else f"<p>{text}</p>"


def report_html(fig_dir: str | os.PathLike, table: pd.DataFrame | None = None) -> str:
    """REPORT.html's text: REPORT.md's content as a page (the figures linked beside it, not embedded)."""
    tables = Tables(fig_dir)
    table = findings_table(fig_dir) if table is None else table
    model, facts = _header(tables)
    common, forced = forced_differences(report_fidelity(tables, table))
    e = html.escape
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Report: {e(model)}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Reproduction report: {e(model)}</h1>",
        f"<p>{e('; '.join(facts))}.</p>",
    ]
    if tables.params():
        parts.append(_md_inline_to_html(commit_summary(tables.params())))
        released = release_sentence(tables.params(), read_release())
        if released:
            parts.append(_md_inline_to_html(released))
    parts += [
        f"<p><b>Verdicts:</b> {e(summary_counts(table))}. {e(RULES_SHORT)} The full rules: "
        f'<a href="{DETAILS_FILE}#rules">{DETAILS_FILE}</a>; the papers\' settings beside ours: '
        f'<a href="{FIDELITY_FILE}">{FIDELITY_FILE}</a>.</p>',
        "<h2 id='summary'>Summary</h2>",
        _html_summary(table),
        "<h2 id='findings'>Findings</h2>",
    ]
    if common:
        parts.append(
            "<p>Every finding differs from its paper by what the offline model forces: "
            f"{_md_links_to_html(_forced_text(common))}.</p>"
        )
    parts += [
        _section_html(r, tables, forced.get(r.id, []), _shown_before(tables, table, r.id)) for r in table.itertuples()
    ]
    parts += ["<h2 id='notebooks'>Notebooks</h2>", "<ul>"]
    parts += [_md_inline_to_html(_notebook_markdown(tables, table, nb, title)) for nb, title in NOTEBOOKS.items()]
    parts += ["</ul>", "</body></html>"]
    return "\n".join(parts)


def notebook_verdicts(fig_dir: str | os.PathLike, notebook: str) -> list[str]:
    """Markdown lines giving the report's verdict, our numbers and the rule for each finding
    of ``notebook`` ("01".."07"), from the tables already in ``fig_dir``: a notebook ends
    with the same verdicts as REPORT.md, by the same rules (one place for every rule)."""
    if notebook not in NOTEBOOKS:
        raise ValueError(f"unknown notebook {notebook!r}; choose one of {sorted(NOTEBOOKS)}")
    tables = Tables(fig_dir)
    return [
        f"- Report verdict, **{f.id}** ({PAPERS_SHORT[f.paper]}, {f.where}): **{out.verdict}**: {out.ours}. "
        f"Rule: {f.rule}. Paper: {f.paper_number}."
        for f in FINDINGS
        if f.notebook == notebook
        for out in [judge(f, tables)]
    ]


def write_report(fig_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``REPORT.md`` and ``REPORT.html`` into ``fig_dir``, with the pages they link
    (``FIDELITY.md``, ``DETAILS.md``), each atomically; return the report's two paths."""
    fig_dir = Path(fig_dir)
    if not fig_dir.is_dir():
        raise FileNotFoundError(f"{fig_dir} is not a folder of notebook outputs")
    table = findings_table(fig_dir)
    tables = Tables(fig_dir)
    write_text(fig_dir / FIDELITY_FILE, fidelity_markdown(tables, table))
    write_text(fig_dir / DETAILS_FILE, details_markdown(tables, table))
    md = write_text(fig_dir / "REPORT.md", report_markdown(fig_dir, table))
    page = write_text(fig_dir / "REPORT.html", report_html(fig_dir, table))
    return md, page
