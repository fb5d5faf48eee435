"""Every notebook runs headless (papermill) on the toy model in quick mode, so no
notebook can rot. Notebooks run in order, as run_all.sh runs them, because later
notebooks read tables that earlier ones wrote to the same figures folder."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import papermill as pm
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
sys.path.insert(0, str(ROOT / "scripts"))
from notebook_files import outputs_in, pair_drift  # noqa: E402


def test_notebooks_in_the_repository_carry_no_outputs():
    """notebooks/ holds the notebooks as written: no outputs, execution counts or widget
    state (a run's executed copies go to figures/<model>/notebooks/)."""
    dirty = {p.name: found for p in NOTEBOOKS if (found := outputs_in(p))}
    assert not dirty, (
        f"notebooks with outputs: {dirty}; clear them (JupyterLab: Edit > Clear Outputs of All "
        "Cells, then save; or jupyter nbconvert --clear-output --inplace notebooks/NN_name.ipynb)"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_and_its_py_source_hold_the_same_cells(notebook: Path):
    """Each notebook is committed twice: as the .ipynb that papermill runs and as the
    percent-format .py that jupytext pairs with it (readable diffs). They must not drift."""
    meta = json.loads(notebook.read_text())["metadata"]
    assert meta.get("jupytext", {}).get("formats") == "ipynb,py:percent", (
        f"pair it: jupytext --set-formats ipynb,py:percent {notebook.relative_to(ROOT)}"
    )
    assert pair_drift(notebook) == [], f"run: jupytext --sync {notebook.relative_to(ROOT)}"


def test_a_drifted_pair_is_caught(tmp_path):
    nb = tmp_path / NOTEBOOKS[0].name
    shutil.copy(NOTEBOOKS[0], nb)
    shutil.copy(NOTEBOOKS[0].with_suffix(".py"), nb.with_suffix(".py"))
    assert pair_drift(nb) == []
    py = nb.with_suffix(".py")
    py.write_text(py.read_text().replace("quick = False", "quick = True", 1))
    assert any("source differs" in d for d in pair_drift(nb))
    py.unlink()
    assert "no " in pair_drift(nb)[0]


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("figures")


@pytest.mark.toy_model
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_toy_model(notebook: Path, figures: Path, tmp_path: Path):
    out = tmp_path / notebook.name
    pm.execute_notebook(
        str(notebook),
        str(out),
        cwd=str(notebook.parent),
        kernel_name="python3",
        progress_bar=False,
        parameters={"model": "toy-arith", "device": "cpu", "quick": True, "seed": 0, "out_dir": str(figures)},
    )
    produced = list((figures / "toy-arith").glob(f"{notebook.stem[:2]}_*"))
    assert any(p.name.endswith((".csv", ".csv.gz")) for p in produced), f"{notebook.name} wrote no table"
    assert any(p.suffix == ".png" for p in produced), f"{notebook.name} wrote no figure"
