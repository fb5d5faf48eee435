"""What users read speaks of the project, not of its making.

The README is a short user's guide (at most ``README_MAX_LINES`` lines); the user documentation
(``docs/``), the notebooks' jupytext sources, every model's REPORT.md and CROSS_MODEL.md, and the
sources of the library, scripts, benchmarks and tests name no tracker issue and carry no diary
of work sessions (dates of runs, "this session's machine").
Measurement diaries belong in ``benchmarks/RESULTS.md`` and the history of changes in
``CHANGELOG.md``; both are exempt. Every relative markdown link of the README and of ``docs/``
points to a file of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

# --------------------------------------------------------------------------- the detector

#: A tracker reference: "issue 28", "Issues #31", "issue #7's", "PR 12", "pull request #3".
_ISSUE_WORDS = re.compile(r"\b(?:[Ii]ssues?|PRs?|[Pp]ull requests?)\s*#?\d+")
#: A bare "#NN" reference: two to five digits after a "#" that starts a token (not a markdown anchor
#: such as "(#notebook-01)" or "#01-identify-heads", an HTML entity "&#8212;", a hex colour
#: "#1f77b4", or a "# 01" comment).
_BARE_REF = re.compile(r"(?<![\w&/(#])#\d{2,5}(?![\w-])")
#: An ISO date (2026-11-27), the mark of a dated run narrative.
_ISO_DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
#: The project's own working sessions: "this session's machine", "the previous session".
_SESSION = re.compile(
    r"\b(?:this|that|previous|earlier|last|today's|yesterday's)\s+(?:working\s+)?sessions?\b"
    r"|\bsession's\b|\bsessions?\s+of\s+issue\b",
    re.IGNORECASE,
)

PATTERNS = {"issue reference": _ISSUE_WORDS, "bare #number": _BARE_REF, "ISO date": _ISO_DATE, "work session": _SESSION}


def process_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, matched text) of every tracker reference, dated diary line or
    mention of the project's working sessions in ``text``."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for kind, pattern in PATTERNS.items():
            hits += [(n, kind, m.group(0)) for m in pattern.finditer(line)]
    return hits


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_CODE = re.compile(r"```.*?```", re.DOTALL)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """The relative link targets in markdown file ``path`` that name no file or folder inside
    ``root`` (the anchor after '#' is not checked; web, mail and pure-anchor links are skipped;
    fenced code is not read)."""
    text = _CODE.sub("", path.read_text(encoding="utf-8"))
    bad = []
    for target in [*_LINK.findall(text), *_REF_LINK.findall(text)]:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (path.parent / file).resolve()
        if not resolved.exists() or not resolved.is_relative_to(root.resolve()):
            bad.append(target)
    return bad


# --------------------------------------------------------------------------- the detector itself


@pytest.mark.parametrize(
    "text",
    [
        "Before issue 29 that was what notebooks 05 and 06 did",
        "(issue 31): one place for the rules",
        "Issues #28 and 29 changed the sizes",
        "the head sweep of issue 28's sizes",
        "fixed in #123.",
        "see PR 12",
        "rerun on 2026-11-25 in 3,153 s",
        "measured on the previous session's machine",
        "this session's fresh machine",
        "no GPU was lent to that session",
    ],
)
def test_detector_flags_process_words(text):
    assert process_words(text), text


@pytest.mark.parametrize(
    "text",
    [
        "Table 4's top 10 are neurons of layers 18-22",
        "[its section of the report](../figures/qwen2.5-coder-0.5b/REPORT.md#notebook-01)",
        "see [notebook 01](#01-identify-heads)",
        "Zhang 2024, Sec. 5.1, Fig. 2; Yu 2024, Sec. 3.4, Table 2",
        "color='#1f77b4'",
        "an em dash &#8212; in HTML",
        "# 01 · Identify heads",
        "layers 12-17 of 32, 2,000 test sentences, lr 2e-5",
        "a run longer than one working session carries its stored results",
        "issues in the prompts are named in the report",
        "year = {2024}, eprint = {2409.01659}",
    ],
)
def test_detector_passes_ordinary_text(text):
    assert not process_words(text), process_words(text)


def test_link_check_finds_a_missing_file(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "here.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](../here.md#part) [web](https://example.org) [anchor](#top) "
        "[gone](../missing.md)\n[ref]: ../also-missing.md\n```\n[in code](nowhere.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == ["../missing.md", "../also-missing.md"]


# --------------------------------------------------------------------------- the repository's text


def _docs() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


def _product_text() -> list[Path]:
    notebooks = ROOT / "notebooks"
    return [
        ROOT / "README.md",
        *_docs(),
        *sorted(notebooks.glob("*.py")),
        *sorted(notebooks.glob("exercises/*.py")),
        *sorted((ROOT / "figures").glob("*/REPORT.md")),
        ROOT / "figures" / "CROSS_MODEL.md",
        *_code_text(),
    ]


def _code_text() -> list[Path]:
    """The library's, the scripts', the benchmarks' and the tests' sources: their docstrings and
    comments are read too (this file is left out: its examples are the detector's test cases)."""
    files = [*ROOT.glob("arithlib/**/*.py"), *ROOT.glob("scripts/*"), *ROOT.glob("benchmarks/*.py")]
    files += [*ROOT.glob("tests/**/*.py"), *ROOT.glob("*.sh"), ROOT / ".ci" / "run"]
    return sorted(p for p in files if p.is_file() and p.suffix in {".py", ".sh", ""} and p != Path(__file__).resolve())


def _id(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_readme_is_a_short_guide():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


def test_code_sources_are_read():
    read = set(_product_text())
    for f in ("arithlib/core/stats.py", "scripts/run_notebooks.py", "tests/unit/test_stats.py", "run_all.sh"):
        assert ROOT / f in read, f


def test_readme_states_the_committed_default_run_time():
    """The README's time for the default model is its whole-run total from the committed
    timings (``arithlib.report.run_times.total_seconds``: each notebook's wall seconds plus
    the seconds of sections it loaded from the store that a run from an empty cache computes
    in it), so that the number is not edited by hand and a resumed run does not understate
    a run from an empty cache."""
    from arithlib.report.run_times import notebook_times, total_seconds

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"\| `\./run_all\.sh` \| about ([\d.]+) hours \(([\d,]+) s", text)
    assert m, "README.md states no time for `./run_all.sh` on the default model"
    total = total_seconds(notebook_times(ROOT / "figures/qwen2.5-coder-0.5b"))
    assert int(m.group(2).replace(",", "")) == total, f"README says {m.group(2)} s, the timings sum to {total:,}"
    assert float(m.group(1)) == round(total / 3600, 1)
    assert f"The {m.group(1)} hours are the sum" in text


def test_docs_exist():
    assert _docs(), "docs/ has no markdown file"


@pytest.mark.parametrize("path", _product_text(), ids=_id)
def test_no_process_words(path):
    hits = process_words(path.read_text(encoding="utf-8"))
    assert not hits, f"{_id(path)} speaks of the project's making: " + "; ".join(
        f"line {n}: {kind} {text!r}" for n, kind, text in hits
    )


@pytest.mark.parametrize("path", [ROOT / "README.md", *_docs()], ids=_id)
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{_id(path)} links to missing files: {broken_links(path)}"
