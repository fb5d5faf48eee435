"""arithlib's folders show its architecture: one package per paper, the methods they share,
the core, the run machinery, the engine, the report and the plots; every module is drawn in
docs/architecture.md; every module imports without the notebook stack (``pip install
arithlib`` without the ``notebooks`` extra); no module is longer than about 700 lines."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import arithlib

PACKAGE = Path(arithlib.__file__).parent
ROOT = PACKAGE.parent
LAYERS = {"core", "methods", "run", "zhang", "yu", "nikankin", "representations", "engine", "report", "plots", "course"}
PAPERS = {"zhang", "yu", "nikankin"}
MAX_LINES = 720
#: Modules still over MAX_LINES, each to be split along a seam of its own (none may be added).
OVER_LIMIT: set[str] = set()


def modules() -> list[str]:
    """Every module of arithlib, dotted ("arithlib.yu.cna"), packages' __init__ included."""
    return ["arithlib"] + sorted(m.name for m in pkgutil.walk_packages(arithlib.__path__, "arithlib."))


def test_the_top_level_shows_the_papers_and_the_layers():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    files = {p.name for p in PACKAGE.glob("*.py")}
    assert folders == LAYERS
    assert files == {"__init__.py", "__main__.py", "cli.py"}


def _imports(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    found = set(re.findall(r"^\s*from \.\.(\w+)", text, re.M))
    found |= set(re.findall(r"arithlib\.(\w+)", "\n".join(l for l in text.splitlines() if "import" in l)))
    return found


def test_no_paper_imports_another_paper_and_no_shared_layer_a_paper():
    """A method two papers use lives in methods/ (or core/), never under one paper."""
    bad = []
    for path in PACKAGE.rglob("*.py"):
        layer = path.relative_to(PACKAGE).parts[0]
        for other in _imports(path) & PAPERS:
            if layer in PAPERS and other != layer:
                bad.append(f"{path.relative_to(PACKAGE)} imports {other}")
            if layer in {"core", "methods", "engine"}:
                bad.append(f"{path.relative_to(PACKAGE)} ({layer}) imports the paper {other}")
    assert not bad, bad


def test_every_module_is_in_the_architecture_document():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [
        m
        for m in modules()
        if m.rsplit(".", 1)[-1] not in ("__init__", "__main__")
        and "." in m
        and f"{m.split('.', 1)[1].replace('.', '/')}.py" not in doc
        and (PACKAGE / m.split(".", 1)[1].replace(".", "/")).with_suffix(".py").is_file()
    ]
    assert not missing, f"modules docs/architecture.md does not draw (as path/module.py): {missing}"


BLOCK_NOTEBOOK_STACK = r"""
import importlib, importlib.abc, pkgutil, sys
STACK = {"papermill", "jupyterlab", "ipywidgets", "ipykernel", "nbformat", "jupyter_server", "notebook"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STACK:
            raise ModuleNotFoundError(f"{name} (the notebooks extra) is not installed")
sys.meta_path.insert(0, Block())
import arithlib
bad = []
for m in pkgutil.walk_packages(arithlib.__path__, "arithlib."):
    if m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as exc:
        bad.append(f"{m.name}: {type(exc).__name__}: {exc}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
"""


def test_every_module_imports_without_the_notebook_stack():
    out = subprocess.run([sys.executable, "-c", BLOCK_NOTEBOOK_STACK], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_the_notebook_stack_is_an_extra_not_a_dependency():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ ;\[]", d)[0] for d in project["dependencies"]}
    extra = {re.split(r"[<>=!~ ;\[]", d)[0] for d in project["optional-dependencies"]["notebooks"]}
    assert {"papermill", "jupyterlab", "ipywidgets"} <= extra and not names & extra
    assert project["scripts"]["arithlib"] == "arithlib.cli:main"


def test_no_module_is_over_the_line_budget():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert set(long) <= OVER_LIMIT, f"modules over {MAX_LINES} lines (split them along a seam): {long}"
