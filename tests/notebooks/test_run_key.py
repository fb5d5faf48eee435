"""run_all.sh's rerun cache: which library modules and upstream tables a notebook's key covers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("run_key", ROOT / "scripts" / "run_key.py")
run_key = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_key)
NB = ROOT / "notebooks"


def test_notebook_modules_follow_imports():
    mods = run_key.notebook_modules(NB / "00_model_accuracy.ipynb")
    assert {
        "core/datasets",
        "core/evaluate",
        "run/runs",
        "core/models",
        "core/toy",
    } <= mods  # toy: imported lazily by models
    assert "yu/cna" not in mods and "report/__init__" not in mods
    # subpackages count (the old closure skipped them: plots and engine edits kept old keys)
    assert {"plots/accuracy", "plots/__init__", "engine/passes"} <= mods and "plots/cna" not in mods
    assert "yu/cna" in run_key.notebook_modules(NB / "04_cna.ipynb")


def test_upstream_tables_and_key_changes(tmp_path):
    assert [p.name for p in run_key.upstream(NB / "06_pruning.ipynb")] == ["05_lora_mechanism.ipynb"]
    assert run_key.upstream(NB / "00_model_accuracy.ipynb") == []
    assert [p.name for p in run_key.upstream(NB / "08_precise_sft.ipynb")] == ["01_identify_heads.ipynb"]
    nb = NB / "08_precise_sft.ipynb"
    k1 = run_key.run_key(nb, tmp_path, ["qwen", "cpu"])
    assert k1 == run_key.run_key(nb, tmp_path, ["qwen", "cpu"])
    assert k1 != run_key.run_key(nb, tmp_path, ["qwen", "cuda"])
    (tmp_path / "01_identify_heads.key").write_text("abc\n")  # the upstream notebook ran again
    assert k1 != run_key.run_key(nb, tmp_path, ["qwen", "cpu"])


def test_key_changes_with_package_versions(tmp_path, monkeypatch):
    """An upgrade of a package that computes the tables reruns the notebook."""
    import arithlib.run.environment as env

    nb = NB / "00_model_accuracy.ipynb"
    k1 = run_key.run_key(nb, tmp_path, ["qwen"])
    real = env.package_versions

    def upgraded(packages=env.COMPUTE_PACKAGES):
        return {**real(packages), "transformers": "99.0"}

    monkeypatch.setattr(env, "package_versions", upgraded)
    assert run_key.run_key(nb, tmp_path, ["qwen"]) != k1


def test_the_readme_and_the_teachers_guide_state_the_notebooks_real_order():
    """The README and docs/teaching.md say which notebooks read 01's key heads and which stand
    alone; those sentences match what the notebooks' code reads (the run order follows it)."""
    import re

    reads = {p.name[:2]: {d.name[:2] for d in run_key.upstream(p)} for p in sorted(NB.glob("[0-9][0-9]_*.ipynb"))}
    readers_of_01 = sorted(n for n, ups in reads.items() if "01" in ups)
    alone = sorted(n for n, ups in reads.items() if not ups and n != "01")  # read no other notebook's tables

    def listed(text: str) -> list[str]:
        return sorted(re.findall(r"\d\d", text))

    readme = (ROOT / "README.md").read_text()
    m = re.search(r"01 finds the heads that ([\d, and]+) read", readme)
    assert m and listed(m.group(1)) == readers_of_01, (m and m.group(0), readers_of_01)
    m = re.search(r"; ([\d, and]+) stand alone", readme)
    assert m and listed(m.group(1)) == alone, (m and m.group(0), alone)
    teaching = (ROOT / "docs" / "teaching.md").read_text()
    m = re.search(r"run 01 before ([\d, and]+),", teaching)
    assert m and listed(m.group(1)) == readers_of_01, (m and m.group(0), readers_of_01)
