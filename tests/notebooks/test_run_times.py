"""The README's "how long it takes" table: each model's committed notebook times (wall seconds
plus the seconds of sections loaded from the store) and peak memory, rewritten from the
committed figures by the same command as the verdict table."""

from __future__ import annotations

from pathlib import Path

import pytest

import arithlib.report as R
from arithlib.report.run_times import (
    FROM_ANOTHER_NOTEBOOK,
    TIMES_END,
    TIMES_START,
    notebook_times,
    run_time_markdown,
    run_time_table,
    total_seconds,
)

ROOT = Path(__file__).resolve().parents[2]

TIMINGS = "notebook,seconds,this_run,peak_rss_mib,threads\n"


def _folder(d: Path, rows: str, sections: dict[str, str] | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "timings.csv").write_text(TIMINGS + rows)
    for nb, text in (sections or {}).items():
        (d / f"{nb}_timings.csv").write_text(text)
    return d


def test_a_notebooks_time_adds_the_seconds_it_loaded_from_the_store(tmp_path: Path):
    d = _folder(
        tmp_path / "m",
        "00_a,100.9,ran,2048,1\n01_b,50,cached,,1\n",
        {
            "00": "section,wall_s,reused_s\nload,10,0\ntotal,100.9,30.4\n",
            "01": "step,seconds\nload,3\n",  # an older format without sections: nothing reused
        },
    )
    t = notebook_times(d).set_index("notebook")
    assert t.at["00_a", "seconds"] == pytest.approx(130.4)  # int(100.9) + 30.4
    assert t.at["01_b", "seconds"] == 50 and t.at["01_b", "reused_s"] == 0
    assert t.at["00_a", "peak_gib"] == 2.0 and t["peak_gib"].isna().tolist() == [False, True]
    assert total_seconds(t.reset_index()) == 180  # 100 + 50 + round(30.4)


def test_another_notebooks_product_is_counted_in_that_notebook_only(tmp_path: Path):
    """Notebook 06 loads notebook 05's reference LoRA: in a run of every notebook 05 trained
    it, so its seconds are not added to 06's (they would be counted twice); 06's own stored
    sections still are."""
    section = next(iter(FROM_ANOTHER_NOTEBOOK["06"]))
    d = _folder(
        tmp_path / "m",
        "05_lora,500,ran,1024,1\n06_pruning,100,ran,1024,1\n",
        {"06": f"section,wall_s,reused_s\n{section},1,60\nsweep,99,7\ntotal,100,67\n"},
    )
    t = notebook_times(d).set_index("notebook")
    assert t.at["06_pruning", "seconds"] == 107 and total_seconds(t.reset_index()) == 607


def test_the_table_has_a_column_per_model_and_a_total(tmp_path: Path):
    a = _folder(tmp_path / "a", "00_a,3600,ran,1024,1\n01_b,3600,ran,3072,1\n")
    b = _folder(tmp_path / "b", "00_a,10,ran,,1\n")
    table = run_time_table([a, b]).set_index("notebook")
    assert list(table.columns) == ["a", "b"]
    assert table.at["`00_a`", "a"] == "3,600 s, 1.0 GiB"
    assert table.at["`00_a`", "b"] == "10 s, peak not recorded"
    assert table.at["`01_b`", "b"] == "not run"
    assert table.at["**all notebooks**", "a"] == "**7,200 s (2.0 h)**, largest peak 3.0 GiB"
    assert table.at["**all notebooks**", "b"] == "**10 s (0.0 h)**, largest peak not recorded"


def test_a_folder_without_timings_is_a_clear_error(tmp_path: Path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="run the model's notebooks"):
        notebook_times(tmp_path / "m")


def test_the_readme_block_is_written_only_where_it_has_markers(tmp_path: Path):
    a = _folder(tmp_path / "a", "00_a,60,ran,1024,1\n")
    text = f"intro\n{TIMES_START}\nold\n{TIMES_END}\nafter\n"
    new = R.replace_readme_block(text, run_time_markdown([a]), TIMES_START, TIMES_END, "run-time")
    assert "old" not in new and "| `00_a` | 60 s, 1.0 GiB |" in new and new.endswith(f"{TIMES_END}\nafter\n")
    with pytest.raises(ValueError, match="no run-time block"):
        R.replace_readme_block("intro\n", "x", TIMES_START, TIMES_END, "run-time")


def test_readme_run_times_match_the_committed_figures():
    """The README's run-time table is the one the committed figures give (the same command
    rewrites it with the verdict table; after committing new figures without it, this fails)."""
    folders = R.model_folders(ROOT / "figures")
    if len(folders) < 2:
        pytest.skip("fewer than two committed model folders")
    from arithlib.report.cross_model import models_by_size

    folders = models_by_size(folders)
    text = (ROOT / "README.md").read_text()
    assert TIMES_START in text, "README.md has no run-time block"
    expected = R.replace_readme_block(text, run_time_markdown(folders), TIMES_START, TIMES_END, "run-time")
    assert expected == text, (
        "README.md's run-time table differs from figures/: run python -m arithlib.report --cross-in figures "
        "--readme README.md"
    )


def test_compressed_section_timings_are_read_too(tmp_path: Path):
    """A notebook's ``NN_timings`` table may be committed compressed; its reused seconds
    count as the plain table's would (the same reader as ``benchmarks/floor.py``)."""
    import gzip

    d = _folder(tmp_path / "m", "00_a,100,ran,1024,1\n")
    (d / "00_timings.csv.gz").write_bytes(gzip.compress(b"section,wall_s,reused_s\nload,10,0\ntotal,100,25\n"))
    t = notebook_times(d).set_index("notebook")
    assert t.at["00_a", "reused_s"] == 25 and t.at["00_a", "seconds"] == 125 and t.at["00_a", "wall_s"] == 100
