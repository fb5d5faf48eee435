"""A release's record: CITATION.cff declares the release commit; a model's committed results
are its record only when every params JSON and executed copy names that commit, clean,
and the report's header says so. Checked on made-up folders (each way it can fail), and
on every committed model whose report names a release."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arithlib.report.release import CITATION, Release, read_release, record_problems, release_sentence

ROOT = Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
DATE = "release-day"  # recorded in CITATION.cff, never shown in a report
REL = Release(version="1.0.0", date=DATE, commit=SHA)


def _model(tmp_path: Path, commits: dict[str, str | None], copies: dict[str, str | None] | None = None) -> Path:
    """A model folder whose notebooks ran at ``commits`` (name -> recorded commit) and whose
    executed copies record ``copies`` (default: the same), with a report naming REL."""
    d = tmp_path / "model"
    (d / "notebooks").mkdir(parents=True)
    for nb, c in commits.items():
        (d / f"{nb}_params.json").write_text(json.dumps({"environment": {"git_commit": c}}))
    for nb, c in (commits if copies is None else copies).items():
        (d / "notebooks" / f"{nb}.ipynb").write_text(json.dumps({"metadata": {"arithlib": {"git_commit": c}}}))
    params = {nb[:2]: {"environment": {"git_commit": c}} for nb, c in commits.items()}
    (d / "REPORT.md").write_text("# Reproduction report\n\n" + (release_sentence(params, REL) or "") + "\n")
    return d


def test_a_model_run_at_the_release_commit_is_its_record(tmp_path):
    d = _model(tmp_path, {"00_model_accuracy": SHA, "01_identify_heads": SHA})
    assert record_problems(d, REL) == []
    assert record_problems(d, Release("1.0.0", DATE, SHA[:7])) == []  # an abbreviated commit


@pytest.mark.parametrize(
    "commits, copies, expected",
    [
        ({"00_a": SHA, "01_b": "f" * 40}, None, "01_b_params.json: ran at ffff"),
        ({"00_a": SHA, "01_b": SHA + "+dirty"}, None, "01_b_params.json: ran at " + SHA + "+dirty"),
        ({"00_a": SHA, "01_b": None}, None, "01_b_params.json: ran at no recorded commit"),
        ({"00_a": SHA}, {"00_a": "e" * 40}, "notebooks/00_a.ipynb: executed at eeee"),
        ({"00_a": SHA, "01_b": SHA}, {"00_a": SHA}, "01_b: params but no executed copy"),
        ({"00_a": SHA}, {"00_a": SHA, "02_c": SHA}, "notebooks/02_c.ipynb: executed copy but no params"),
    ],
)
def test_each_break_of_the_record_is_named(tmp_path, commits, copies, expected):
    d = _model(tmp_path, commits, copies)
    problems = record_problems(d, REL)
    assert any(p.startswith(expected) for p in problems), problems


def test_a_report_that_does_not_name_the_release_fails_the_record(tmp_path):
    d = _model(tmp_path, {"00_a": SHA})
    (d / "REPORT.md").write_text("# Reproduction report\n\n**Code:** results from commit 0123456.\n")
    assert record_problems(d, REL) == ["REPORT.md: its header does not name release 1.0.0 (regenerate the report)"]


def test_the_release_sentence_only_when_every_notebook_ran_clean_at_the_commit():
    ok = {"00": {"environment": {"git_commit": SHA}}, "01": {"environment": {"git_commit": SHA}}}
    assert release_sentence(ok, REL).startswith("**Release 1.0.0** (commit 0123456)")
    assert DATE not in release_sentence(ok, REL)
    assert release_sentence(ok, None) is None
    dirty = {**ok, "02": {"environment": {"git_commit": SHA + "+dirty"}}}
    assert release_sentence(dirty, REL) is None
    other = {**ok, "02": {"environment": {"git_commit": "f" * 40}}}
    assert release_sentence(other, REL) is None
    assert release_sentence({**ok, "03": {}}, REL) is None  # a run that recorded no commit


def test_citation_declares_a_release_only_with_a_commit(tmp_path):
    cff = tmp_path / "CITATION.cff"
    cff.write_text(f'cff-version: 1.2.0\nversion: 1.0.0\ndate-released: "{DATE}"\n')
    assert read_release(cff) is None
    cff.write_text(cff.read_text() + f"commit: {SHA}\n")
    assert read_release(cff) == REL
    cff.write_text(cff.read_text().replace(SHA, "HEAD"))
    with pytest.raises(ValueError, match="not a git commit hash"):
        read_release(cff)
    assert read_release(tmp_path / "missing.cff") is None


def test_every_committed_model_that_names_the_release_is_its_record():
    """The committed record itself: a model whose report names the release declared in
    CITATION.cff has every result from that commit (none names it before the release)."""
    release = read_release(CITATION)
    for report in sorted((ROOT / "figures").glob("*/REPORT.md")):
        if release is None:
            assert "**Release " not in report.read_text(), f"{report} names a release CITATION.cff does not declare"
            continue
        if f"**Release {release.version}**" in report.read_text():
            assert record_problems(report.parent, release) == [], report.parent.name


def test_the_report_header_names_the_release_its_results_come_from(tmp_path, monkeypatch):
    import arithlib.report.render as render

    for nb in ("00_model_accuracy", "01_identify_heads"):
        (tmp_path / f"{nb}_params.json").write_text(json.dumps({"model": "m", "environment": {"git_commit": SHA}}))
    monkeypatch.setattr(render, "read_release", lambda: REL)
    assert "**Release 1.0.0** (commit 0123456)" in render.report_markdown(tmp_path)
    assert "<b>Release 1.0.0</b>" in render.report_html(tmp_path)
    monkeypatch.setattr(render, "read_release", lambda: Release("1.0.0", DATE, "f" * 40))
    assert "**Release" not in render.report_markdown(tmp_path)


def test_the_readme_names_the_release_only_when_every_model_is_its_record():
    """The README's "Results of release V (commit ...)" is a claim about every committed
    model (the toy model's quick runs aside): it stands exactly when each model's report
    names the release CITATION.cff declares."""
    from arithlib.report import model_folders

    release = read_release(CITATION)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    if release is None:
        assert "Results of release" not in readme
        return
    version = release.version.removesuffix(".0") if release.version.count(".") == 2 else release.version  # 1.0.0 -> 1.0
    sentence = f"Results of release {version} (commit {release.commit[:7]})"
    named = [f"**Release {release.version}**" in (d / "REPORT.md").read_text() for d in model_folders(ROOT / "figures")]
    if all(named):
        assert sentence in readme, f"every model's results are release {release.version}'s: say {sentence!r}"
    else:
        assert "Results of release" not in readme, "the README names a release not every model's results come from"
