"""The course site (arithlib.course.site) and its reading in a real browser
(arithlib.course.browse): the links of the staged pages, a broken site that the browser check
must fail, and the whole site built from this checkout, read page by page in headless
Chromium. Without Chromium the browser tests skip, unless ``ARITHLIB_REQUIRE_BROWSER`` is set
(``.ci/run`` installs Chromium and sets it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from arithlib.course import browse, classroom
from arithlib.course import site as S

ROOT = Path(__file__).resolve().parents[2]


def _browser() -> str:
    path = browse.chromium_path()
    if not path:
        if os.environ.get("ARITHLIB_REQUIRE_BROWSER"):
            pytest.fail("ARITHLIB_REQUIRE_BROWSER is set but no Chromium was found (scripts/chromium.sh installs it)")
        pytest.skip("no Chromium (apt-get install chromium, or scripts/chromium.sh)")
    return path


def _repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for rel, text in {
        "docs/teaching.md": "# Teaching\n",
        "docs/a.md": "# A\n",
        "figures/m/REPORT.md": "# Report\n",
        "figures/m/01_table.csv": "x\n1\n",
        "figures/m/notebooks/01_x.ipynb": "{}",
        "notebooks/01_x.ipynb": "{}",
        "scripts/tool.sh": "echo\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_links_are_made_to_work_inside_the_site(tmp_path: Path):
    root = _repo(tmp_path)
    staged = {"docs/teaching.md", "docs/a.md", "figures/m/REPORT.md", "figures/m/notebooks/01_x.ipynb"}
    found = S.Staged(src=tmp_path / "src")

    def fix(text: str, page: str) -> str:
        return S.rewrite_links(text, page, root, staged, "m", found)

    assert fix("[a](a.md#part)", "docs/teaching.md") == "[a](a.md#part)"  # a page: kept
    assert fix("[t](../figures/m/01_table.csv)", "docs/a.md") == "[t](../figures/m/01_table.csv)"
    assert fix("[s](../scripts/tool.sh)", "docs/a.md") == "[s](../scripts/tool.sh)"
    assert found.downloads == ["figures/m/01_table.csv", "scripts/tool.sh"]  # staged as downloads
    assert fix("see [the folder](../scripts/)", "docs/a.md") == "see the folder (`scripts/`)"
    # a source notebook: the default model's executed copy
    assert fix("[nb](../notebooks/01_x.ipynb)", "docs/a.md") == "[nb](../figures/m/notebooks/01_x.ipynb)"
    # an executed copy's link written for notebooks/ resolves from there
    assert fix("[d](../docs/a.md)", "figures/m/notebooks/01_x.ipynb") == "[d](../../../docs/a.md)"
    assert fix("![f](../01_table.csv)", "figures/m/notebooks/01_x.ipynb") == "![f](../01_table.csv)"
    # outside links, anchors and links to nothing are left as written (the browser check finds the last)
    for text in ("[w](https://example.org/a.md)", "[h](#here)", "[gone](missing.md)"):
        assert fix(text, "docs/a.md") == text
    # a page the site leaves out: its text and path
    assert fix("[r](../figures/other/REPORT.md)", "docs/a.md") == "[r](../figures/other/REPORT.md)"  # not in the repo
    (root / "figures/other").mkdir()
    (root / "figures/other/REPORT.md").write_text("# Other\n")
    assert fix("[r](../figures/other/REPORT.md)", "docs/a.md") == "r (`figures/other/REPORT.md`)"
    assert found.unlinked == ["figures/other/REPORT.md"]


def test_stage_writes_the_pages_the_index_and_the_configuration(tmp_path: Path):
    found = S.stage(tmp_path / "src", ["toy-arith"], ROOT)
    src = tmp_path / "src"
    assert (src / "conf.py").is_file() and "myst_nb" in (src / "conf.py").read_text()
    index = (src / "index.md").read_text()
    assert "docs/teaching.md" in index and "studies/toy-arith.md" in index and "qwen" not in index
    exercises = sorted(p.name for p in (src / "notebooks" / "exercises").glob("*.ipynb"))
    assert exercises == sorted(p.name for p in (ROOT / "notebooks" / "exercises").glob("*.ipynb"))
    study = (src / "studies" / "toy-arith.md").read_text()
    for nb in sorted((ROOT / "figures" / "toy-arith" / "notebooks").glob("*.ipynb")):
        assert f"../figures/toy-arith/notebooks/{nb.name}" in study
        assert json.loads((src / "figures" / "toy-arith" / "notebooks" / nb.name).read_text())["cells"]
    assert all((src / d).is_file() and (src / S.EXTRA / d).is_file() for d in found.downloads)
    with pytest.raises(FileNotFoundError, match="no committed run"):
        S.stage(tmp_path / "src2", ["no-such-model"], ROOT)
    with pytest.raises(FileNotFoundError, match="checkout of the repository"):
        S.stage(tmp_path / "src3", None, tmp_path)


def _broken_site(folder: Path) -> None:
    folder.mkdir(parents=True)
    png = bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
    (folder / "ok.png").write_bytes(png)
    (folder / "index.html").write_text(
        "<html><head><title>i</title></head><body><h1>Index</h1><p>Some text for the page.</p>"
        '<img src="ok.png"><a href="page.html#here">p</a> <a href="page.html#nowhere">q</a> '
        '<a href="gone.html">dead</a> <a href="https://example.org/">out</a></body></html>'
    )
    (folder / "page.html").write_text(
        '<html><body><h1 id="here">Page</h1><p>Text text text text.</p><img src="missing.png"></body></html>'
    )


def test_the_browser_check_finds_dead_links_missing_anchors_and_broken_figures(tmp_path: Path):
    chromium = _browser()
    _broken_site(tmp_path / "site")
    found = browse.check_site(tmp_path / "site", chromium)
    assert sorted(found.pages) == ["index.html", "page.html"]
    assert found.external_links == {"https://example.org/"}
    assert sorted(found.problems) == [
        "index.html: dead link to gone.html",
        "index.html: link to page.html#nowhere, which has no element with that id",
        "page.html: image does not load: missing.png",
    ]


def test_the_course_site_builds_and_every_page_reads_in_a_browser(tmp_path: Path):
    """The whole site of this checkout: no Sphinx warning, every page reached from the front
    page renders, every figure loads, no link is dead."""
    chromium = _browser()
    index, warnings = S.make_site(tmp_path / "site", jobs=2)
    assert warnings == []
    found = browse.check_site(tmp_path / "site", chromium)
    assert found.problems == []
    pages = set(found.pages)
    expected = {"index.html", "docs/teaching.html", "exercises.html", "solutions.html", "README.html"}
    expected |= {f"notebooks/exercises/{p.stem}.html" for p in (ROOT / "notebooks" / "exercises").glob("*.ipynb")}
    for model in S.site_models(ROOT):
        expected |= {f"figures/{model}/REPORT.html"}
        expected |= {
            f"figures/{model}/notebooks/{p.stem}.html" for p in (ROOT / "figures" / model / "notebooks").glob("*.ipynb")
        }
    assert expected <= pages, sorted(expected - pages)
    assert found.images >= 100  # the reports' and notebooks' figures
    hint = (tmp_path / "site" / "notebooks" / "exercises" / "01_identify_heads_exercise.html").read_text()
    assert "<details>" in hint and "Hint 1" in hint  # hints open on demand


def test_teach_runs_its_steps_in_order_and_stops_at_a_failure():
    said: list[str] = []
    calls: list[str] = []

    def step(name: str, fail: bool = False) -> classroom.SetupStep:
        def run() -> str:
            calls.append(name)
            if fail:
                raise classroom.SetupFailed(f"{name} broke")
            return "ok"

        return classroom.SetupStep(name, run)

    classroom.run_setup([step("a"), step("b")], say=said.append)
    assert calls == ["a", "b"] and said[0] == "[teach] 1/2 a" and said[1].endswith(": ok")
    with pytest.raises(classroom.SetupFailed, match="b broke"):
        classroom.run_setup([step("a"), step("b", fail=True), step("c")], say=said.append)
    assert calls[-2:] == ["a", "b"]
    names = [s.name for s in classroom.plan(skip_run=False)]
    assert (
        names[0].startswith("check the shipped toy model")
        and "quick" in names[1]
        and names[-1] == "build the course site"
    )
    assert len(classroom.plan(skip_run=True)) == len(names) - 1
    assert classroom.check_toy().endswith(")")  # the shipped weights match their checksums
