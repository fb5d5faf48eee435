"""Which software and which commit of the code each notebook's tables come from: the
environment each ``NN_*_params.json`` records, compactly for REPORT.md's header and in full
for DETAILS.md."""

from __future__ import annotations

from ..run.environment import environment_line

NOT_RECORDED_ENV = "not recorded (run before arithlib recorded its environment)"
DIRTY = "+dirty"


def _grouped(params: dict[str, dict], key) -> dict[str, list[str]]:
    """Text -> the notebooks whose environment reads it (``key`` of the environment)."""
    out: dict[str, list[str]] = {}
    for nb, p in sorted(params.items()):
        env = p.get("environment")
        out.setdefault(key(env) if env else NOT_RECORDED_ENV, []).append(nb)
    return out


def commits_by_notebook(params: dict[str, dict]) -> dict[str, list[str]]:
    """Commit of the code (as recorded, "+dirty" when the work tree had uncommitted changes)
    -> the notebooks run from it; notebooks that record none are left out."""
    return {
        c: nbs
        for c, nbs in _grouped(params, lambda e: e.get("git_commit") or "unknown").items()
        if c != NOT_RECORDED_ENV
    }


def environment_lines(params: dict[str, dict]) -> list[str]:
    """Markdown lines stating the software each notebook's tables were computed with (its
    params JSON's ``environment``): the packages in one line when all notebooks agree,
    else one line per distinct set naming its notebooks, then the commit(s) of the code;
    runs from before environments were recorded are named as such."""
    packages = _grouped(params, environment_line)
    if len(packages) == 1:
        lines = [f"**Environment:** {next(iter(packages))}."]
    else:
        lines = ["**Environment** (differs between notebooks):", ""] + [
            f"- notebooks {', '.join(nbs)}: {text}" for text, nbs in packages.items()
        ]
    commits = commits_by_notebook(params)
    if commits:
        lines.append(
            "**Code:** " + "; ".join(f"commit {c} (notebooks {', '.join(nbs)})" for c, nbs in commits.items()) + "."
        )
    return lines


def _short(commit: str) -> str:
    return commit[:7] + (DIRTY if commit.endswith(DIRTY) else "") if commit != "unknown" else commit


def commit_summary(params: dict[str, dict], link: bool = True) -> str:
    """One sentence on the commits the results come from: the commit when every notebook ran
    from one, else how many, which notebooks ran from a work tree with uncommitted changes
    ("+dirty": their exact code is in no commit) and which recorded none; ``link``: ending
    with a link to the per-notebook list in DETAILS.md."""
    commits = commits_by_notebook(params)
    unrecorded = sorted(set(params) - {nb for nbs in commits.values() for nb in nbs})
    if not commits:
        text = "**Code:** no notebook recorded the commit it ran from"
    elif len(commits) == 1:
        text = f"**Code:** results from commit {_short(next(iter(commits)))}"
    else:
        text = f"**Code:** results from {len(commits)} commits (the notebooks were run at different times)"
    dirty = sorted(nb for c, nbs in commits.items() if c.endswith(DIRTY) for nb in nbs)
    if dirty:
        text += (
            f"; notebook{'s' if len(dirty) > 1 else ''} {', '.join(dirty)} ran with uncommitted changes "
            '("+dirty": that code is in no commit)'
        )
    if unrecorded and commits:
        text += f"; notebook{'s' if len(unrecorded) > 1 else ''} {', '.join(unrecorded)} recorded no commit"
    if link and commits:
        text += "; per notebook, with the software, in [DETAILS.md](DETAILS.md#provenance)"
    return text + "."
