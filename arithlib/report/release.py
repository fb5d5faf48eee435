"""A release's record: which commit a release is, and whether a model's committed results
all come from it.

A release is declared in ``CITATION.cff`` (``version``, ``date-released`` and ``commit``,
the Citation File Format's own keys); a git tag may not travel with a clone, the recorded
commit does. A model's results are that release's record when every notebook's params
JSON (``environment.git_commit``, written by the run) and every executed copy
(``metadata.arithlib.git_commit``) name the release commit, none with "+dirty", each
notebook has both, and the report's header says so (:func:`release_sentence`). That the
copies' code cells are the notebook sources at that commit is checked for every copy by
``tests/notebooks/test_executed_copies.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .provenance import DIRTY

#: The repository's citation file (absent from an installed package: then no release).
CITATION = Path(__file__).resolve().parents[2] / "CITATION.cff"


@dataclass(frozen=True)
class Release:
    """A release as ``CITATION.cff`` records it."""

    version: str
    date: str
    commit: str


def read_release(path: str | Path = CITATION) -> Release | None:
    """The release ``path`` (a CITATION.cff) declares, or None when it records no ``commit``
    (or does not exist). Top-level keys only, read as ``key: value`` lines."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    keys = {}
    for key in ("version", "date-released", "commit"):
        m = re.search(rf"^{re.escape(key)}:\s*\"?([^\"\n]+?)\"?\s*$", text, re.M)
        keys[key] = m.group(1) if m else None
    if not keys["commit"]:
        return None
    if not re.fullmatch(r"[0-9a-f]{7,40}", keys["commit"]):
        raise ValueError(f"{path}: commit {keys['commit']!r} is not a git commit hash (7-40 hex digits)")
    return Release(version=keys["version"] or "?", date=keys["date-released"] or "?", commit=keys["commit"])


def is_commit(recorded: str | None, commit: str) -> bool:
    """Whether a recorded commit (full, possibly "+dirty") is ``commit`` (full or abbreviated),
    clean."""
    if not recorded or recorded.endswith(DIRTY):
        return False
    return recorded.startswith(commit) or commit.startswith(recorded)


def release_sentence(params: dict[str, dict], release: Release | None) -> str | None:
    """The header's sentence naming the release, when every notebook of ``params`` (number
    -> params JSON) ran at the release commit with no uncommitted change; else None (a
    report never names a release its results do not all come from). The date stays in
    ``CITATION.cff``: a report carries no calendar dates."""
    if release is None or not params:
        return None
    if not all(is_commit((p.get("environment") or {}).get("git_commit"), release.commit) for p in params.values()):
        return None
    return (
        f"**Release {release.version}** (commit {release.commit[:7]}): every result on "
        "this page comes from that commit."
    )


def record_problems(fig_dir: str | Path, release: Release) -> list[str]:
    """What keeps ``fig_dir``'s committed results (one model's folder) from being the record
    of ``release``: a params JSON or executed copy naming another commit (or "+dirty", or
    none), a notebook with only one of the two, no report, or a report header without the
    release sentence. Empty when the record holds."""
    fig_dir = Path(fig_dir)
    problems = []
    params = sorted(fig_dir.glob("[0-9][0-9]_*_params.json"))
    copies = sorted((fig_dir / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if not params:
        problems.append(f"{fig_dir}: no notebook params (no run recorded)")
    for path in params:
        try:
            recorded = (json.loads(path.read_text()).get("environment") or {}).get("git_commit")
        except (OSError, ValueError) as exc:
            problems.append(f"{path.name}: unreadable ({exc})")
            continue
        if not is_commit(recorded, release.commit):
            problems.append(f"{path.name}: ran at {recorded or 'no recorded commit'}, not {release.commit[:12]}")
    for path in copies:
        try:
            recorded = json.loads(path.read_text()).get("metadata", {}).get("arithlib", {}).get("git_commit")
        except (OSError, ValueError) as exc:
            problems.append(f"notebooks/{path.name}: unreadable ({exc})")
            continue
        if not is_commit(recorded, release.commit):
            problems.append(
                f"notebooks/{path.name}: executed at {recorded or 'no recorded commit'}, not {release.commit[:12]}"
            )
    ran = {p.name.removesuffix("_params.json") for p in params}
    shown = {p.stem for p in copies}
    problems += [f"{nb}: params but no executed copy in notebooks/" for nb in sorted(ran - shown)]
    problems += [f"notebooks/{nb}.ipynb: executed copy but no params" for nb in sorted(shown - ran)]
    report = fig_dir / "REPORT.md"
    if not report.exists():
        problems.append("REPORT.md missing")
    elif f"**Release {release.version}** (commit {release.commit[:7]}" not in report.read_text():
        problems.append(f"REPORT.md: its header does not name release {release.version} (regenerate the report)")
    return problems
