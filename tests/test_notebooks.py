"""Every notebook runs headless (papermill) on the toy model in quick mode, so no
notebook can rot. Notebooks run in order, as run_all.sh runs them, because later
notebooks read tables that earlier ones wrote to the same figures folder."""

from __future__ import annotations

import sys
from pathlib import Path

import papermill as pm
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
sys.path.insert(0, str(ROOT / "scripts"))
from notebook_files import outputs_in  # noqa: E402


def test_notebooks_in_the_repository_carry_no_outputs():
    """notebooks/ holds the notebooks as written: no outputs, execution counts or widget
    state (a run's executed copies go to figures/<model>/notebooks/)."""
    dirty = {p.name: found for p in NOTEBOOKS if (found := outputs_in(p))}
    assert not dirty, (f"notebooks with outputs: {dirty}; clear them (JupyterLab: Edit > Clear Outputs of All "
                       "Cells, then save; or jupyter nbconvert --clear-output --inplace notebooks/NN_name.ipynb)")


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("figures")


@pytest.mark.toy_model
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_toy_model(notebook: Path, figures: Path, tmp_path: Path):
    out = tmp_path / notebook.name
    pm.execute_notebook(str(notebook), str(out), cwd=str(notebook.parent), kernel_name="python3", progress_bar=False,
                        parameters={"model": "toy-arith", "device": "cpu", "quick": True, "seed": 0,
                                    "out_dir": str(figures)})
    produced = list((figures / "toy-arith").glob(f"{notebook.stem[:2]}_*"))
    assert any(p.suffix == ".csv" for p in produced), f"{notebook.name} wrote no table"
    assert any(p.suffix == ".png" for p in produced), f"{notebook.name} wrote no figure"
