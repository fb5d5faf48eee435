"""Print the cache key of one notebook run for run_all.sh.

The key hashes the library modules the notebook imports (directly or through other
arithlib modules), the data files (data/), the notebook itself, the run's parameters,
the last successful keys of the notebooks whose tables it reads (a name such as
"01_path_patching" in its code), and the Python version and the versions of the packages
that compute the tables (``arithlib.run.environment.COMPUTE_PACKAGES``). So editing a
notebook reruns it and the notebooks that read its tables, editing a library module reruns the notebooks that use it, and
upgrading a package such as torch or transformers reruns them all.
Usage: run_key.py NOTEBOOK OUTPUT_DIR PARAM...   (OUTPUT_DIR holds the NN_*.key files)
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "arithlib"
_NOTEBOOK_IMPORT = re.compile(r"(?:from|import)[ \t]+arithlib(?:\.([\w.]+))?(?:[ \t]+import[ \t]+([\w \t,(]+))?")
sys.path.insert(0, str(ROOT))  # this checkout's arithlib (sources only: no torch is imported)
from arithlib.run.sources import imported_names, module_closure  # noqa: E402


def notebook_modules(notebook: Path) -> set[str]:
    """The arithlib modules a notebook uses."""
    code = notebook_code(notebook)
    names: set[str] = set()
    for mod, imported in _NOTEBOOK_IMPORT.findall(code):
        if mod:  # arithlib.x, or from arithlib.pkg import module (that module, not all of pkg)
            base = mod.replace(".", "/")
            subs = [f"{base}/{n}" for n in imported_names(imported)] if imported else []
            found = {m for m in subs if (PACKAGE / f"{m}.py").is_file()}
            names |= found or {base}
        elif imported:
            names |= set(imported_names(imported))
    return module_closure(names, PACKAGE)


def notebook_code(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def upstream(notebook: Path) -> list[Path]:
    """The other notebooks whose tables ``notebook`` reads ("NN_..." names in its code)."""
    own = notebook.name[:2]
    numbers = sorted(set(re.findall(r"[\"'](\d\d)_\w+", notebook_code(notebook))) - {own})
    return [p for n in numbers for p in sorted(notebook.parent.glob(f"{n}_*.ipynb"))]


def run_key(notebook: Path, out_dir: Path, params: list[str]) -> str:
    h = hashlib.sha256()
    code = [PACKAGE / f"{m}.py" for m in sorted(notebook_modules(notebook))]
    for path in code + sorted((ROOT / "data").rglob("*")) + [notebook]:
        if path.is_file():
            h.update(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name).encode())
            h.update(path.read_bytes())
    for dep in upstream(notebook):
        key = out_dir / f"{dep.stem}.key"
        h.update(f"{dep.stem}={key.read_text().strip() if key.is_file() else 'missing'}".encode())
    for p in params:
        h.update(p.encode())
    h.update(environment_key().encode())
    return h.hexdigest()[:16]


def environment_key() -> str:
    """Python's version and the compute packages' versions, as one string."""
    sys.path.insert(0, str(ROOT))
    try:
        from arithlib.run.environment import package_versions
    finally:
        sys.path.pop(0)
    return f"python={platform.python_version()};" + ";".join(f"{k}={v}" for k, v in package_versions().items())


if __name__ == "__main__":
    print(run_key(Path(sys.argv[1]).resolve(), Path(sys.argv[2]), sys.argv[3:]))
