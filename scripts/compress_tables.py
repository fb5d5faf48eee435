#!/usr/bin/env python
"""Store the tables of figures folders as arithlib stores them: row-level tables
gzip-compressed (``<name>.csv.gz``), summary tables plain (``<name>.csv``); the rule is
:func:`arithlib.run.outputs.is_row_level`, the compressed bytes those
:func:`arithlib.run.outputs.save_table` writes (deterministic: the same table gives the same
bytes). For folders written by a run of older code, which wrote every table as plain
CSV, and for the committed figures. Idempotent: a folder that follows the rule is left
as it is.

    python scripts/compress_tables.py figures/qwen2.5-coder-0.5b [FOLDER ...]
    python scripts/compress_tables.py --check figures/*/ figures   # exit 1 if a table would change

Only the tables at the top of each folder are touched (not ``notebooks/`` or ``stored/``).
A table present both plain and compressed is an error (exit 2, nothing done to it) unless
the two hold the same text (the redundant file is removed) or ``--replace`` is given: then
the plain CSV, as written by a run of older code, replaces the compressed one.
Every file written is read back and compared before the other one is removed.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's arithlib
from arithlib.run.atomic import write_bytes  # noqa: E402
from arithlib.run.outputs import gzip_bytes, is_row_level, table_name  # noqa: E402


def _text(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.name.endswith(".gz") else data


def plan(folder: Path, replace: bool = False) -> tuple[list[tuple[Path, Path]], list[Path], list[str]]:
    """What :func:`apply` would do in ``folder``: (source, target) conversions, redundant
    files to remove, and errors (tables in both forms that differ)."""
    convert: list[tuple[Path, Path]] = []
    remove: list[Path] = []
    errors: list[str] = []
    names = sorted({table_name(p) for pattern in ("*.csv", "*.csv.gz") for p in folder.glob(pattern) if p.is_file()})
    for name in names:
        plain, packed = folder / f"{name}.csv", folder / f"{name}.csv.gz"
        want, other = (packed, plain) if is_row_level(name) else (plain, packed)
        if plain.is_file() and packed.is_file():
            if _text(plain) == _text(packed):
                remove.append(other)
            elif replace:
                if want == packed:
                    convert.append((plain, packed))
                else:
                    remove.append(packed)
            else:
                errors.append(
                    f"{folder / name}: both .csv and .csv.gz exist and differ; keep the one the last run "
                    "wrote (--replace keeps the plain .csv)"
                )
        elif other.is_file():
            convert.append((other, want))
    return convert, remove, errors


def apply(folder: Path, replace: bool = False, check: bool = False) -> tuple[int, int]:
    """Convert ``folder``'s tables to the rule (or with ``check`` only report it);
    returns (files changed or to change, errors)."""
    convert, remove, errors = plan(folder, replace)
    for err in errors:
        print(f"error: {err}", file=sys.stderr)
    for src, dst in convert:
        print(f"{'would convert' if check else 'converted'} {src} -> {dst.name}")
        if check:
            continue
        text = _text(src)
        write_bytes(dst, gzip_bytes(text) if dst.name.endswith(".gz") else text)
        if _text(dst) != text:  # pragma: no cover - a disk that does not give back what was written
            raise OSError(f"{dst} does not read back as {src}; {src} kept")
        src.unlink()
    for path in remove:
        print(f"{'would remove' if check else 'removed'} {path} (the same table as its other form)")
        if not check:
            path.unlink()
    return len(convert) + len(remove), len(errors)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="figures folders (e.g. figures/<model>)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table does not follow the rule")
    ap.add_argument(
        "--replace",
        action="store_true",
        help="where a table is both plain and compressed, the plain CSV wins (a run of older code wrote it)",
    )
    args = ap.parse_args(argv)
    changed = errors = 0
    for folder in args.folders:
        if not folder.is_dir():
            print(f"error: {folder} is not a folder", file=sys.stderr)
            return 2
        c, e = apply(folder, args.replace, args.check)
        changed, errors = changed + c, errors + e
    if errors:
        return 2
    if args.check:
        print(f"{changed} table file(s) do not follow the rule" if changed else "every table follows the rule")
        return 1 if changed else 0
    print(f"{changed} table file(s) changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
