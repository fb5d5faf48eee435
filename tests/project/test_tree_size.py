"""The repository travels: its tracked files stay under a size budget, and the committed
tables are stored as arithlib stores them (row-level tables gzip-compressed)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The budget for every tracked file together (bytes in the working tree): the tree travels
#: to a device machine with at most 64 MiB, and this leaves about 17 MB for the build
#: outputs a run carries with it. Four committed runs (three models and the toy model)
#: fit; the PNGs of runs made before figures were saved at 120 dpi are a third larger than
#: a rerun writes.
TREE_BUDGET = 50_000_000


def tracked_sizes(root: Path = ROOT) -> dict[str, int]:
    """Tracked path -> its size in the working tree (tracked files deleted there: left out)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"not a git checkout ({err})")
    sizes = {}
    for name in out.decode().split("\0"):
        path = root / name
        if name and path.is_file() and not path.is_symlink():
            sizes[name] = path.stat().st_size
    return sizes


def _kind(name: str) -> str:
    if "/notebooks/" in name and name.endswith(".ipynb") and name.startswith("figures/"):
        return "executed notebooks"
    return name.rsplit(".", 2)[-2] + ".gz" if name.endswith(".gz") else name.rsplit(".", 1)[-1]


def test_the_tracked_tree_is_under_its_budget():
    sizes = tracked_sizes()
    total = sum(sizes.values())
    by_kind = Counter()
    for name, size in sizes.items():
        by_kind[_kind(name)] += size
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    assert total < TREE_BUDGET, (
        f"the tracked tree holds {total / 1e6:.1f} MB, over its {TREE_BUDGET / 1e6:.0f} MB budget; by kind: "
        + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in by_kind.most_common(6))
        + "; largest: "
        + ", ".join(f"{n} {s / 1e3:.0f} KB" for n, s in largest)
    )


def test_committed_tables_follow_the_storage_rule():
    """Row-level tables are .csv.gz, summary tables .csv (arithlib.run.outputs.is_row_level);
    scripts/compress_tables.py converts a folder that does not follow the rule."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compress_tables
    finally:
        sys.path.pop(0)
    folders = [ROOT / "figures", *sorted(p for p in (ROOT / "figures").iterdir() if p.is_dir())]
    wrong = []
    for folder in folders:
        convert, remove, errors = compress_tables.plan(folder)
        wrong += [f"{src.relative_to(ROOT)} -> {dst.name}" for src, dst in convert]
        wrong += [f"{p.relative_to(ROOT)} (redundant)" for p in remove] + errors
    assert not wrong, (
        "tables not stored by the rule (python scripts/compress_tables.py figures/*/ figures): " + "; ".join(wrong)
    )
