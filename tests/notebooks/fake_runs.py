"""What the tests of run_all.sh's scheduler share: the scheduler script loaded as a module,
a two-cell notebook with its papermill parameters, and the command line of a run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run_notebooks.py"
sys.path.insert(0, str(ROOT / "scripts"))
if "run_notebooks" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("run_notebooks", SCRIPT)
    _rn = importlib.util.module_from_spec(_spec)
    sys.modules["run_notebooks"] = _rn  # its dataclass looks its module up
    _spec.loader.exec_module(_rn)
rn = sys.modules["run_notebooks"]
import notebook_files as nf  # noqa: E402  (scripts/, on the path above)

__all__ = ["PARAMS", "ROOT", "SCRIPT", "nf", "rn", "run_args", "write_notebook"]

PARAMS = 'model = "x"\ndevice = "cpu"\nquick = False\nseed = 0\nout_dir = "."\n'


def write_notebook(path: Path, code: str, params: str = "") -> None:
    """A notebook of a parameters cell (``PARAMS`` + ``params``) and one cell of ``code``."""
    cells = [
        {
            "cell_type": "code",
            "metadata": {"tags": ["parameters"]},
            "execution_count": None,
            "outputs": [],
            "source": PARAMS + params,
        },
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": code},
    ]
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def run_args(nb_dir: Path, out: Path, fig: Path, *extra: str, jobs: int = 1, threads: bool = True) -> list[str]:
    """run_notebooks.py's arguments for model "m" on the CPU, ``jobs`` jobs (and one thread each)."""
    return [
        "--out",
        str(out),
        "--figures",
        str(fig),
        "--model",
        "m",
        "--device",
        "cpu",
        "--notebooks",
        str(nb_dir),
        "--jobs",
        str(jobs),
        *(["--threads", "1"] if threads else []),
        *extra,
    ]
