"""No two arithlib modules define the same public name: a reader who meets
``table11`` or ``SCALES`` knows which module it is without looking at the import.
``main`` (each command-line entry point) is the one name allowed twice."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import arithlib

ALLOWED = {"main"}


def public_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def test_no_public_name_is_defined_in_two_modules():
    where = defaultdict(list)
    root = Path(arithlib.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue  # a package's __init__ re-exports its modules' names
        for name in public_names(path):
            where[name].append(str(path.relative_to(root)))
    clashes = {n: m for n, m in where.items() if len(m) > 1 and n not in ALLOWED}
    assert not clashes, f"public names defined in more than one module: {clashes}"
