"""Where arithlib reads and writes: the cache root and the figure folders.

Nothing else in arithlib picks file locations; notebooks get their output folder
from :func:`figure_dir` and every cached artefact lives under :func:`cache_root`.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


def cache_root() -> Path:
    """The cache folder: ``$ARITHLIB_CACHE`` if set, else ``~/.cache/arithlib``.

    It holds dequantized models, the trained toy model and its checkpoints, and
    cached results; deleting it only costs recomputation.
    """
    root = Path(os.environ.get("ARITHLIB_CACHE", Path.home() / ".cache" / "arithlib")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def figure_dir(out_dir: str | os.PathLike, model: str) -> Path:
    """``<out_dir>/<model>/``, created; the folder a notebook's figures and tables go to."""
    path = Path(out_dir) / model.replace("/", "__")
    path.mkdir(parents=True, exist_ok=True)
    return path
