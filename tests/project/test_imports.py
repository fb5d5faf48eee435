"""Every name the code reaches in arithlib exists: relative imports inside arithlib (lazy
ones in function bodies included), ``from arithlib.x import y`` anywhere, and attributes
of arithlib modules used through an alias (``patching.key_heads``) in notebooks,
benchmarks, scripts and tests. A module split that misses a caller fails
here, not hours into a notebook run."""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _sources() -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "arithlib", "notebooks", "benchmarks", "scripts", "tests"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.split() if f.endswith(".py")]


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def unresolved(files: list[str], root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, what) for each import or module attribute that does not exist."""
    bad = []
    for f in files:
        tree = ast.parse((root / f).read_text())
        package = ".".join(Path(f).with_suffix("").parts[:-1]) if f.startswith("arithlib/") else None
        alias: dict[str, object] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "arithlib":
                        m = _module(a.name)
                        if m is None:
                            bad.append((f, node.lineno, a.name))
                        elif a.asname:
                            alias[a.asname] = m
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    if package is None:
                        continue
                    parts = package.split(".")
                    mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
                if mod.split(".")[0] != "arithlib":
                    continue
                m = _module(mod)
                if m is None:
                    bad.append((f, node.lineno, mod))
                    continue
                for a in node.names:
                    sub = _module(f"{mod}.{a.name}") if not hasattr(m, a.name) else None
                    if not hasattr(m, a.name) and sub is None:
                        bad.append((f, node.lineno, f"{mod}.{a.name}"))
                    elif sub is not None or isinstance(getattr(m, a.name), type(m)):
                        alias[a.asname or a.name] = sub or getattr(m, a.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in alias:
                if not hasattr(alias[node.value.id], node.attr):
                    bad.append((f, node.lineno, f"{node.value.id}.{node.attr}"))
    return bad


def test_every_arithlib_name_the_code_uses_exists():
    assert unresolved(_sources()) == []


def test_the_check_sees_a_missing_name(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "nb.py").write_text(
        "import arithlib.methods.patching as patching\n"
        "patching.run_variants\npatching.no_such_function\n"
        "from arithlib.engine import forward, no_such_name\n"
    )
    assert unresolved(["notebooks/nb.py"], tmp_path) == [
        ("notebooks/nb.py", 4, "arithlib.engine.no_such_name"),
        ("notebooks/nb.py", 3, "patching.no_such_function"),
    ]
