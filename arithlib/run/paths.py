"""Where arithlib reads and writes: its data files, the cache root and the figure folders.

Nothing else in arithlib picks file locations; data files are found by
:func:`data_path`, notebooks get their output folder from :func:`figure_dir` and every
cached artefact lives under :func:`cache_root`.

The data files (prompt templates, word lists: the repository's top-level ``data/``)
ship inside the wheel as ``arithlib/data/`` (``pyproject.toml``: ``package-dir`` maps
the package ``arithlib.data`` to ``data/``), so a non-editable ``pip install`` finds
them through :mod:`importlib.resources`; a source checkout or an editable install reads
``data/`` beside the package.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # arithlib/run/paths.py: the checkout holding arithlib/
#: ``data/`` of a source checkout; an installed wheel has its copy in the package.
SOURCE_DATA_DIR = REPO_ROOT / "data"


def script_module(name: str):
    """``scripts/NAME.py`` of this checkout as a module (the run machinery lives there, beside
    the package); FileNotFoundError when the package is installed without a checkout."""
    scripts = REPO_ROOT / "scripts"
    if not (scripts / f"{name}.py").is_file():
        raise FileNotFoundError(f"{scripts / name}.py not found: this needs a checkout of the repository")
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    return importlib.import_module(name)


def data_dir() -> Path:
    """The folder holding arithlib's data files: ``arithlib/data`` of an installed wheel
    (found with :mod:`importlib.resources`), else the checkout's top-level ``data/``."""
    packaged = resources.files("arithlib").joinpath("data")
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    if SOURCE_DATA_DIR.is_dir():
        return SOURCE_DATA_DIR
    raise FileNotFoundError(
        f"arithlib's data files are missing: neither {packaged} (an installed wheel) nor {SOURCE_DATA_DIR} "
        "(a source checkout) is a folder; reinstall arithlib (pip install the repository, not a copy of the "
        "arithlib folder alone)"
    )


def data_path(name: str) -> Path:
    """The data file ``name`` (e.g. ``"templates.json"``); FileNotFoundError naming the
    files there if it does not exist. Every data file arithlib reads goes through here."""
    folder = data_dir()
    path = folder / name
    if not path.is_file():
        have = ", ".join(sorted(p.name for p in folder.iterdir() if p.is_file()))
        raise FileNotFoundError(f"no data file {name!r} in {folder} (it has: {have})")
    return path


def __getattr__(name: str) -> Path:
    """``DATA_DIR``: :func:`data_dir`, resolved when first read (so importing arithlib
    never fails over a missing data folder)."""
    if name == "DATA_DIR":
        return data_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
