"""scripts/compare_tables.py: the check that a refactor leaves every committed table as it was."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare_tables", ROOT / "scripts" / "compare_tables.py")
CT = importlib.util.module_from_spec(spec)
spec.loader.exec_module(CT)


def test_identical_rounding_different_and_missing_tables(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    base = pd.DataFrame({"x": [0.1, 0.2], "name": ["p", "q"], "seconds": [1.0, 2.0]})
    for d in (a, b):
        base.to_csv(d / "same.csv", index=False)
    base.to_csv(a / "round.csv", index=False)
    base.assign(x=[0.1 + 1e-9, 0.2], seconds=[5.0, 9.0]).to_csv(b / "round.csv", index=False)  # run time ignored
    base.to_csv(a / "runtime.csv", index=False)
    base.assign(seconds=[3.0, 4.0]).to_csv(b / "runtime.csv", index=False)  # only the run time differs
    base.to_csv(a / "diff.csv", index=False)
    base.assign(x=[0.1, 0.3]).to_csv(b / "diff.csv", index=False)
    base.to_csv(a / "only_a.csv", index=False)
    assert CT.main([str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert "diff.csv: column 'x' row 1" in out and "only_a.csv: missing" in out
    assert "1 identical (" in out and "1 rounding" in out and "2 different" in out
    assert "1 identical but for run-time columns" in out and "round.csv: equal up to float rounding" in out
