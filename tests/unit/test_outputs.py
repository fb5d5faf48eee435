"""arithlib.run.outputs: which tables are stored compressed, the one reader that finds a table
in either form, the deterministic writer, and scripts/compress_tables.py."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import pandas as pd
import pytest

from arithlib.run import outputs
from arithlib.run.outputs import (
    AmbiguousTable,
    TableNotFound,
    find_table,
    is_row_level,
    read_table,
    save_table,
    table_file,
)

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FRAME = pd.DataFrame({"prompt_id": [0, 1, 2], "x": [0.1, 1 / 3, float("nan")], "token": ["a", "b,c", "é"]})


def test_the_rule_is_by_name_only():
    for name in (
        "01_path_patching_per_prompt",
        "05_cna_coef_per_case",
        "01_yu_head_sweep_rows",
        "07_bias_scores",
        "03_heuristic_ablation_prompts",
        "03_heuristic_matches",
        "06_neuron_ranking",
    ):
        assert is_row_level(name) and table_file(name) == f"{name}.csv.gz"
    for name in ("01_path_patching", "01_yu_head_sweep", "03_matched_share", "timings", "CROSS_MODEL", "07_table13"):
        assert not is_row_level(name) and table_file(name) == f"{name}.csv"
    assert is_row_level("figures/m/07_bias_scores.csv") and is_row_level("07_bias_scores.csv.gz")


def test_a_row_level_table_is_written_compressed_with_the_same_bytes_every_time(tmp_path):
    first = save_table(FRAME, tmp_path / "a", "01_x_per_prompt")
    second = save_table(FRAME, tmp_path / "b", "01_x_per_prompt")
    assert first.name == "01_x_per_prompt.csv.gz"
    assert first.read_bytes() == second.read_bytes()  # no file name or time in the gzip header
    plain = save_table(FRAME, tmp_path / "a", "01_x")
    assert plain.name == "01_x.csv"
    assert gzip.decompress(first.read_bytes()) == plain.read_bytes()  # the same text, compressed
    assert first.read_bytes() == outputs.gzip_bytes(plain.read_bytes())  # what compress_tables.py writes
    pd.testing.assert_frame_equal(read_table(tmp_path / "a", "01_x_per_prompt"), read_table(plain))


def test_the_reader_finds_either_form_and_names_both_when_neither_exists(tmp_path):
    FRAME.to_csv(tmp_path / "01_a_per_prompt.csv", index=False)  # written by older code: plain
    (tmp_path / "01_b.csv.gz").write_bytes(gzip.compress(FRAME.to_csv(index=False).encode()))
    for name in ("01_a_per_prompt", "01_b"):
        pd.testing.assert_frame_equal(read_table(tmp_path, name), read_table(tmp_path / f"{name}.csv"))
    assert find_table(tmp_path / "01_b.csv") == tmp_path / "01_b.csv.gz"
    assert find_table(tmp_path, "01_c") is None
    with pytest.raises(TableNotFound) as err:
        read_table(tmp_path, "01_c")
    assert isinstance(err.value, FileNotFoundError)
    assert "01_c.csv" in str(err.value) and "01_c.csv.gz" in str(err.value)


def test_both_forms_of_one_table_are_an_error_and_the_writer_leaves_one(tmp_path):
    FRAME.to_csv(tmp_path / "01_a_per_prompt.csv", index=False)
    (tmp_path / "01_a_per_prompt.csv.gz").write_bytes(gzip.compress(b"prompt_id\n9\n"))
    with pytest.raises(AmbiguousTable, match="stale"):
        read_table(tmp_path, "01_a_per_prompt")
    save_table(FRAME, tmp_path, "01_a_per_prompt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_a_per_prompt.csv.gz"]


def test_compress_tables_converts_a_folder_once(tmp_path, capsys):
    ct = _script("compress_tables")
    FRAME.to_csv(tmp_path / "01_a_per_prompt.csv", index=False, float_format="%.6g")  # as save_table formats it
    FRAME.to_csv(tmp_path / "01_a.csv", index=False)
    (tmp_path / "01_b.csv.gz").write_bytes(gzip.compress(b"x\n1\n"))  # a summary table compressed: made plain
    text = (tmp_path / "01_a_per_prompt.csv").read_bytes()
    assert ct.main(["--check", str(tmp_path)]) == 1
    assert ct.main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_a.csv", "01_a_per_prompt.csv.gz", "01_b.csv"]
    assert (tmp_path / "01_a_per_prompt.csv.gz").read_bytes() == outputs.gzip_bytes(text)
    assert (tmp_path / "01_a_per_prompt.csv.gz").read_bytes() == save_table(
        read_table(tmp_path, "01_a_per_prompt"), tmp_path / "again", "01_a_per_prompt"
    ).read_bytes()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert ct.main([str(tmp_path)]) == 0 and ct.main(["--check", str(tmp_path)]) == 0  # idempotent
    assert before == {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    # a plain table from a run of older code beside a different compressed one: an error unless --replace
    FRAME.head(1).to_csv(tmp_path / "01_a_per_prompt.csv", index=False)
    assert ct.main([str(tmp_path)]) == 2
    assert ct.main(["--replace", str(tmp_path)]) == 0
    assert len(read_table(tmp_path, "01_a_per_prompt")) == 1 and not (tmp_path / "01_a_per_prompt.csv").exists()
    capsys.readouterr()


def test_compare_tables_compares_a_plain_and_a_compressed_table_by_contents(tmp_path, capsys):
    ct = _script("compare_tables")
    a, b = tmp_path / "a", tmp_path / "b"
    save_table(FRAME, a, "01_x")
    (a / "01_x.csv").rename(a / "01_x_per_prompt.csv")  # plain, as a run of older code wrote it
    save_table(FRAME, b, "01_x_per_prompt")
    assert ct.main([str(a), str(b)]) == 0
    assert "1 identical" in capsys.readouterr().out
