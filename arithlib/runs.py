"""The start of every notebook: seed everything, load the model, pick the output
folder and record the run's parameters next to its tables."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import __version__
from .environment import environment
from .models import LoadedModel, load_model
from .outputs import save_json
from .paths import figure_dir


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


def start_run(notebook: str, model: str, device: str = "cpu", seed: int = 0, out_dir: str = "../figures",
              quick: bool = False, dtype: str | torch.dtype = "auto", device_map: str | dict | None = None,
              **params) -> Run:
    """Seed, load ``model`` on ``device`` and write ``<out_dir>/<model>/<notebook>_params.json``
    with every parameter (few-shot prefix, sizes, seed, library version) and the
    software environment (Python, package versions, git commit: :mod:`arithlib.environment`).

    ``dtype`` ("auto": bfloat16 on a GPU, float32 on a CPU) and ``device_map`` go to
    :func:`arithlib.models.load_model`; with a device map the model is split by it and
    ``device`` only tells the notebook which scale to pick (e.g. "cuda")."""
    seed_everything(seed)
    t0 = time.time()
    if device_map is not None:
        loaded = load_model(model, dtype=dtype, device_map=device_map)
    else:
        loaded = load_model(model, device=device, dtype=dtype)
    out = figure_dir(out_dir, model if not Path(model).exists() else Path(model).name)
    placement = {"device_map": loaded.device_map} if loaded.device_map else {}
    record = {"notebook": notebook, "model": model, "device": loaded.device, "seed": seed, "quick": quick,
              "dtype": str(loaded.dtype), **placement, "arithlib_version": __version__,
              "model_info": loaded.info.__dict__, **params, "environment": environment()}
    print(f"loaded {model} on {loaded.device} in {time.time() - t0:.1f}s; outputs in {out}")
    run = Run(notebook, loaded, out, record)
    run.record()  # the params JSON, rewritten by later calls with what loading decides
    return run
