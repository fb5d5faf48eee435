"""Saving what a notebook produces: tables as CSV, figures as PNG and PDF, and the
run's parameters, all under one folder per model (:func:`arithlib.run.paths.figure_dir`);
and reading a table back, whichever way it is stored.

Files are written to a temporary name in the same folder, flushed and renamed
(:mod:`arithlib.run.atomic`), so an interrupted run never leaves a half-written table or
figure behind.

**How a table is stored.** A *summary* table (a few rows per operator, layer or
condition: what a reader opens) is plain ``<name>.csv``. A *row-level* table (one row
per prompt, case, neuron, head or match: what a finding's interval or a rule is
recomputed from) is gzip-compressed, ``<name>.csv.gz``: those tables are most of the
committed tree's bytes and compress about five-fold. Which is which depends on the
name only, never on a run's size (:func:`is_row_level`: the suffixes
:data:`ROW_LEVEL_SUFFIXES` and the names :data:`ROW_LEVEL_TABLES`), so a quick run and
a full run store a table the same way. The compressed file is deterministic: the same
table gives the same bytes (gzip with no file name and mtime 0, level 9).

**Reading a table.** Everything that opens a table (the report, the notebooks that read
an earlier notebook's tables, the library functions they pass a path to, the scripts)
goes through :func:`read_table` / :func:`find_table`, which accept ``<name>.csv`` and
``<name>.csv.gz`` alike (a run of older code, or a folder not yet converted by
``scripts/compress_tables.py``, has plain CSV everywhere). A folder that holds both is
an error, not a guess: one of them is stale.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pandas as pd

from .atomic import atomic_write, write_bytes, write_text  # noqa: F401  (write_text: the report writes through here)

#: A table whose name ends with one of these is row-level (stored as ``.csv.gz``).
ROW_LEVEL_SUFFIXES: tuple[str, ...] = ("_per_prompt", "_per_case", "_rows", "_prompts", "_scores")
#: Row-level tables whose names do not say so (one row per neuron, head, match or case).
ROW_LEVEL_TABLES: frozenset[str] = frozenset(
    {
        "01_yu_head_screen",  # every head x operator x digit count
        "03_heuristic_matches",  # every (neuron, heuristic) match
        "03_circuit_neurons",  # every circuit neuron
        "03_gallery_grids",  # every gallery neuron x operand pair
        "03_correct_vs_incorrect",  # every grid prompt
        "04_pe_dag_cases",  # every case x kind x seed
        "06_neuron_ranking",  # every ranked neuron
        "07_top_predictions",  # every prompt's top tokens
        "09_spectra",  # every source x layer x frequency
        "09_bridge_neurons",  # every heuristic neuron x frequency band
        "09_neuron_fits",  # every fitted neuron
    }
)
#: The two ways a table is stored, in the order :func:`find_table` names them.
TABLE_SUFFIXES: tuple[str, str] = (".csv", ".csv.gz")
#: gzip level of the row-level tables (9: the smallest; the output is the same bytes for
#: the same table with a given zlib).
GZIP_LEVEL = 9
#: Resolution of the PNG figures (the PDF beside each is vector). 120 rather than
#: matplotlib's savefig 150 of the committed runs: a third fewer pixels, still sharp at
#: the width a report page shows.
FIGURE_DPI = 120


class TableNotFound(FileNotFoundError):
    """Neither ``<name>.csv`` nor ``<name>.csv.gz`` exists (the message names both)."""


class AmbiguousTable(RuntimeError):
    """Both ``<name>.csv`` and ``<name>.csv.gz`` exist: one of them is stale."""


def table_name(name: str | os.PathLike) -> str:
    """``name`` without a ``.csv`` / ``.csv.gz`` suffix or folder: ``"x/01_a.csv"`` -> ``"01_a"``."""
    base = Path(name).name
    for suffix in (".csv.gz", ".csv"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def is_row_level(name: str | os.PathLike) -> bool:
    """Whether table ``name`` (with or without a folder or suffix) is row-level, i.e.
    stored as ``<name>.csv.gz``: its name ends with one of :data:`ROW_LEVEL_SUFFIXES` or
    is one of :data:`ROW_LEVEL_TABLES`."""
    name = table_name(name)
    return name in ROW_LEVEL_TABLES or name.endswith(ROW_LEVEL_SUFFIXES)


def table_file(name: str | os.PathLike) -> str:
    """The file name table ``name`` is written to: ``<name>.csv.gz`` if row-level, else
    ``<name>.csv``."""
    name = table_name(name)
    return name + (".csv.gz" if is_row_level(name) else ".csv")


def _split(folder: str | os.PathLike, name: str | os.PathLike | None) -> tuple[Path, str]:
    if name is None:  # one path: <folder>/<name>[.csv|.csv.gz]
        path = Path(folder)
        return path.parent, table_name(path)
    return Path(folder), table_name(name)


def find_table(folder: str | os.PathLike, name: str | os.PathLike | None = None) -> Path | None:
    """The file of table ``name`` in ``folder`` (``<name>.csv`` or ``<name>.csv.gz``),
    None when neither exists. ``find_table(path)`` takes one path, with or without the
    suffix (``run.out / "01_path_patching.csv"``). Raises :class:`AmbiguousTable` when
    both exist."""
    folder, name = _split(folder, name)
    found = [folder / f"{name}{s}" for s in TABLE_SUFFIXES if (folder / f"{name}{s}").is_file()]
    if len(found) > 1:
        raise AmbiguousTable(
            f"both {found[0]} and {found[1].name} exist, so one is stale: keep the one the last run "
            "wrote (python scripts/compress_tables.py --replace FOLDER keeps the plain CSV, compressed "
            "if the table is row-level)"
        )
    return found[0] if found else None


def table_path(folder: str | os.PathLike, name: str | os.PathLike | None = None) -> Path:
    """:func:`find_table`, raising :class:`TableNotFound` (naming both files) when
    neither exists."""
    path = find_table(folder, name)
    if path is None:
        folder, name = _split(folder, name)
        raise TableNotFound(f"table {name} not found: neither {folder / name}.csv nor {name}.csv.gz exists")
    return path


def read_table(folder: str | os.PathLike, name: str | os.PathLike | None = None, **read_csv: object) -> pd.DataFrame:
    """Table ``name`` of ``folder`` (``read_table(path)``: one path, with or without the
    suffix), read from ``<name>.csv`` or ``<name>.csv.gz`` with :func:`pandas.read_csv`
    (``read_csv``: its keyword arguments). :class:`TableNotFound` when neither exists,
    :class:`AmbiguousTable` when both do."""
    return pd.read_csv(table_path(folder, name), **read_csv)


def section_timings(folder: str | os.PathLike) -> dict[str, pd.DataFrame]:
    """Notebook number (``"00"``...) -> its ``NN_timings`` table in ``folder`` (plain or
    compressed): each section's seconds and arithmetic, then a ``total`` row
    (:mod:`arithlib.run.floor` writes them; older runs wrote other columns). The one reader
    of these tables for the report's run times and ``benchmarks/floor.py``."""
    out: dict[str, pd.DataFrame] = {}
    for nn in (f"{i:02d}" for i in range(100)):
        path = find_table(folder, f"{nn}_timings")
        if path is not None:
            out[nn] = read_table(path)
    return out


def gzip_bytes(data: bytes) -> bytes:
    """``data`` gzip-compressed deterministically: no file name, mtime 0, level
    :data:`GZIP_LEVEL`, so the same bytes in give the same bytes out."""
    return gzip.compress(data, compresslevel=GZIP_LEVEL, mtime=0)


def save_table(frame: pd.DataFrame, out: str | os.PathLike, name: str, float_format: str = "%.6g") -> Path:
    """Write ``frame`` (no index) to ``<out>/<name>.csv``, or to ``<out>/<name>.csv.gz``
    when the table is row-level (:func:`is_row_level`; deterministic bytes:
    :func:`gzip_bytes`), and return the path. A file of the same table in the other
    form is removed, so a folder never holds both."""
    text = frame.to_csv(index=False, float_format=float_format, lineterminator="\n")
    path = Path(out) / table_file(name)
    if path.name.endswith(".gz"):
        write_bytes(path, gzip_bytes(text.encode("utf-8")))
    else:
        write_bytes(path, text.encode("utf-8"))
    for suffix in TABLE_SUFFIXES:
        other = Path(out) / f"{table_name(name)}{suffix}"
        if other != path:
            other.unlink(missing_ok=True)
    return path


def save_figure(fig, out: str | os.PathLike, name: str, dpi: int = FIGURE_DPI) -> Path:
    """Write ``fig`` to ``<out>/<name>.png`` (``dpi``) and ``.pdf``; return the PNG path."""
    png = atomic_write(
        Path(out) / f"{name}.png", lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
    )
    atomic_write(Path(out) / f"{name}.pdf", lambda tmp: fig.savefig(tmp, bbox_inches="tight", format="pdf"))
    return png


def save_json(data: dict, out: str | os.PathLike, name: str) -> Path:
    """Write ``data`` to ``<out>/<name>.json`` (sorted keys, indented)."""
    return atomic_write(
        Path(out) / f"{name}.json",
        lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, sort_keys=True, default=str)),
    )
