"""Print the cache key of one notebook run for run_all.sh.

The key hashes the library code (arithlib/), the data files (data/), the notebook
itself, the run's parameters and the key of the notebook before it, so editing a
notebook reruns it and the notebooks after it (which may read its tables), and editing
the library reruns everything. Usage: run_key.py NOTEBOOK PREVIOUS_KEY PARAM=VALUE...
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Library modules no notebook imports (the report runs after the notebooks).
NOT_USED_BY_NOTEBOOKS = {"report.py"}


def run_key(notebook: Path, previous: str, params: list[str]) -> str:
    h = hashlib.sha256()
    code = [p for p in sorted((ROOT / "arithlib").rglob("*.py")) if p.name not in NOT_USED_BY_NOTEBOOKS]
    files = code + sorted((ROOT / "data").rglob("*")) + [notebook]
    for path in files:
        if path.is_file():
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    h.update(previous.encode())
    for p in params:
        h.update(p.encode())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    print(run_key(Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3:]))
