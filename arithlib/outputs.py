"""Saving what a notebook produces: tables as CSV, figures as PNG and PDF, and the
run's parameters, all under one folder per model (:func:`arithlib.paths.figure_dir`).

Files are written to a temporary name in the same folder, flushed and renamed
(:mod:`arithlib.atomic`), so an interrupted run never leaves a half-written table or
figure behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from .atomic import atomic_write, write_text  # noqa: F401  (write_text: the report writes through here)


def save_table(frame: pd.DataFrame, out: str | os.PathLike, name: str, float_format: str = "%.6g") -> Path:
    """Write ``frame`` to ``<out>/<name>.csv`` (no index) and return the path."""
    return atomic_write(Path(out) / f"{name}.csv",
                         lambda tmp: frame.to_csv(tmp, index=False, float_format=float_format))


def save_figure(fig, out: str | os.PathLike, name: str, dpi: int = 150) -> Path:
    """Write ``fig`` to ``<out>/<name>.png`` and ``.pdf``; return the PNG path."""
    png = atomic_write(Path(out) / f"{name}.png", lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png"))
    atomic_write(Path(out) / f"{name}.pdf", lambda tmp: fig.savefig(tmp, bbox_inches="tight", format="pdf"))
    return png


def save_json(data: dict, out: str | os.PathLike, name: str) -> Path:
    """Write ``data`` to ``<out>/<name>.json`` (sorted keys, indented)."""
    return atomic_write(Path(out) / f"{name}.json",
                         lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, sort_keys=True, default=str)))
