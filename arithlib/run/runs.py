"""The start of every notebook: seed everything, load the model, pick the output
folder and record the run's parameters next to its tables."""

from __future__ import annotations

import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..core.models import LoadedModel, load_model
from .environment import environment
from .outputs import save_json
from .paths import REPO_ROOT, figure_dir

#: Where a notebook run as it is (JupyterLab's Run All) writes: its ``out_dir`` default,
#: ``../outputs/scratch/figures`` from ``notebooks/``. Only run_all.sh writes ``figures/``.
SCRATCH_FIGURES = REPO_ROOT / "outputs" / "scratch" / "figures"


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Run:
    """A notebook run: the loaded model, its output folder and its parameters."""

    notebook: str
    model: LoadedModel
    out: Path
    params: dict = field(default_factory=dict)

    @property
    def bridge(self):
        return self.model.bridge

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def record(self, **params) -> None:
        """Add ``params`` known only once the model is loaded (e.g. the resolved scale) to
        the run's parameters and rewrite ``<notebook>_params.json``."""
        self.params.update(params)
        save_json(self.params, self.out, f"{self.notebook}_params")


def seed_scratch(out_dir: str | Path, model_dir: str, committed_root: Path = REPO_ROOT / "figures") -> bool:
    """When ``out_dir`` is the scratch folder (:data:`SCRATCH_FIGURES`) and its
    ``model_dir`` folder is new (or empty), start that folder as a copy of the committed
    ``figures/<model_dir>/`` (its tables and figures; not the executed copies, the carried
    store or hidden files), so a notebook run alone there finds the tables of the
    notebooks before it, as under run_all.sh. Whether it copied."""
    target = Path(out_dir).absolute() / model_dir
    committed = committed_root / model_dir
    if Path(out_dir).resolve() != SCRATCH_FIGURES.resolve() or not committed.is_dir():
        return False
    if target.is_dir() and any(target.iterdir()):
        return False
    shutil.copytree(
        committed,
        target,
        dirs_exist_ok=True,
        ignore=lambda d, names: [
            n for n in names if Path(d) == committed and (n in ("notebooks", "stored") or n.startswith("."))
        ],
    )
    return True


def start_run(
    notebook: str,
    model: str,
    device: str = "cpu",
    seed: int = 0,
    out_dir: str = "../outputs/scratch/figures",
    quick: bool = False,
    dtype: str | torch.dtype = "auto",
    device_map: str | dict | None = None,
    **params,
) -> Run:
    """Seed, load ``model`` on ``device`` and write ``<out_dir>/<model>/<notebook>_params.json``
    with every parameter (few-shot prefix, sizes, seed, library version) and the
    software environment (Python, package versions, git commit: :mod:`arithlib.run.environment`).

    ``dtype`` ("auto": bfloat16 on a GPU, float32 on a CPU) and ``device_map`` go to
    :func:`arithlib.core.models.load_model`; with a device map the model is split by it and
    ``device`` only tells the notebook which scale to pick (e.g. "cuda")."""
    seed_everything(seed)
    t0 = time.time()
    if device_map is not None:
        loaded = load_model(model, dtype=dtype, device_map=device_map)
    else:
        loaded = load_model(model, device=device, dtype=dtype)
    model_dir = (model if not Path(model).exists() else Path(model).name).replace("/", "__")
    seeded = seed_scratch(out_dir, model_dir)
    out = figure_dir(out_dir, model_dir)
    placement = {"device_map": loaded.device_map} if loaded.device_map else {}
    record = {
        "notebook": notebook,
        "model": model,
        "device": loaded.device,
        "seed": seed,
        "quick": quick,
        "dtype": str(loaded.dtype),
        **placement,
        "arithlib_version": __version__,
        "model_info": loaded.info.__dict__,
        **params,
        "environment": environment(),
    }
    print(
        f"loaded {model} on {loaded.device} in {time.time() - t0:.1f}s; outputs in {out}"
        + (f" (started as a copy of figures/{model_dir})" if seeded else "")
    )
    run = Run(notebook, loaded, out, record)
    run.record()  # the params JSON, rewritten by later calls with what loading decides
    return run
