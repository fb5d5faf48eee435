"""No import cycle among arithlib's modules: each module's imports (lazy ones in function
bodies included, ``if TYPE_CHECKING:`` blocks left out) form a graph without a cycle, so
every module can be imported first and the layers stay layers. An import of a package
counts as an import of its ``__init__``; ``from pkg import module`` as one of that module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import arithlib

ROOT = Path(arithlib.__file__).parent


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name below the package ("yu.cna", "engine" for engine/__init__.py) -> file."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines |= set(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the arithlib modules it imports (names as in :func:`_modules`; "" is the
    top-level ``__init__``)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = [p for p in package if p]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name[len("arithlib.") :] for a in node.names if a.name.startswith("arithlib.")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                elif node.module and (node.module == "arithlib" or node.module.startswith("arithlib.")):
                    mod = node.module[len("arithlib.") :] if node.module != "arithlib" else ""
                else:
                    continue
                for a in node.names:
                    sub = f"{mod}.{a.name}" if mod else a.name
                    targets.add(sub if sub in modules else mod)
            elif isinstance(node, ast.Constant) and isinstance(
                node.value, str
            ):  # importlib.import_module("arithlib.x")
                m = re.fullmatch(r"arithlib\.([\w.]+)", node.value)
                if m and m[1] in modules:
                    targets.add(m[1])
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_arithlib_modules():
    found = cycles(import_graph())
    assert not found, f"modules that import each other, directly or through others: {found}"


def test_the_check_sees_a_cycle(tmp_path):
    """A lazy import that closes a loop through a package's __init__ is a cycle."""
    (tmp_path / "report").mkdir()
    (tmp_path / "plots").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "plots" / "__init__.py").write_text("")
    (tmp_path / "report" / "__init__.py").write_text("from .cross import f\n")
    (tmp_path / "report" / "cross.py").write_text("def f():\n    from ..plots.fig import g\n    return g\n")
    (tmp_path / "plots" / "fig.py").write_text("from ..report import f\ndef g():\n    return f\n")
    (tmp_path / "ok.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plots.fig import g\n"
    )
    assert cycles(import_graph(tmp_path)) == [["plots.fig", "report", "report.cross"]]
