"""A stored notebook step is keyed by the code that computes it: every arithlib module its
compute function calls into is named in its ``code=`` (or imported by one that is), so an
edit to that module computes the step anew instead of loading a result of the old code
(:class:`arithlib.run.stored.Store`). Read from the notebooks' source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from arithlib.run.sources import module_closure

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _aliases(tree: ast.Module) -> tuple[dict[str, str], dict[str, str]]:
    """(module alias -> arithlib module name, imported function name -> its module name)."""
    modules, functions = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("arithlib."):
                    modules[a.asname or a.name] = a.name.removeprefix("arithlib.")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("arithlib"):
            base = node.module.removeprefix("arithlib").lstrip(".")
            for a in node.names:
                name = f"{base}.{a.name}" if base else a.name
                if (ROOT / "arithlib" / (name.replace(".", "/") + ".py")).is_file():
                    modules[a.asname or a.name] = name
                elif base:
                    functions[a.asname or a.name] = base
    return modules, functions


def _assigned(tree: ast.Module) -> dict[str, ast.expr]:
    return {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def _code_names(expr: ast.expr, modules: dict[str, str], assigned: dict[str, ast.expr]) -> list[str]:
    """The module names a ``code=`` expression lists."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        return [n for e in expr.elts for n in _code_names(e, modules, assigned)]
    if isinstance(expr, ast.Starred):
        return _code_names(expr.value, modules, assigned)
    if isinstance(expr, ast.Constant):
        return [expr.value]
    if isinstance(expr, ast.Name) and expr.id in modules:
        return [modules[expr.id]]
    if isinstance(expr, ast.Name) and expr.id in assigned:
        return _code_names(assigned[expr.id], modules, assigned)
    raise AssertionError(f"cannot read code={ast.unparse(expr)}")


def _store_calls(tree: ast.Module):
    """(call, code expression) of every ``store(...)`` with a ``code`` keyword, directly
    or through ``**name`` of a ``dict(code=...)``."""
    assigned = _assigned(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "store"):
            continue
        for kw in node.keywords:
            if kw.arg == "code":
                yield node, kw.value
            elif kw.arg is None and isinstance(kw.value, ast.Name):
                d = assigned.get(kw.value.id)
                if isinstance(d, ast.Call):
                    yield from ((node, k.value) for k in d.keywords if k.arg == "code")


def _called_modules(fn: ast.AST, modules: dict[str, str], functions: dict[str, str], defs: dict) -> set[str]:
    """The arithlib modules ``fn`` (a lambda, or a name of a function defined in the
    notebook) calls into."""
    if isinstance(fn, ast.Name) and fn.id in defs:
        fn = defs[fn.id]
    used = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.add(modules[node.value.id])
        elif isinstance(node, ast.Name) and node.id in functions:
            used.add(functions[node.id])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defs:
            if defs[node.func.id] is not fn:
                used |= _called_modules(defs[node.func.id], modules, functions, defs)
    return used


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_stored_step_names_the_code_it_calls(notebook):
    tree = ast.parse(notebook.read_text())
    modules, functions = _aliases(tree)
    assigned = _assigned(tree)
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    missing = []
    for call, code in _store_calls(tree):
        named = module_closure(_code_names(code, modules, assigned))
        compute = call.args[1] if len(call.args) > 1 else None
        if compute is None:
            continue
        for mod in sorted(_called_modules(compute, modules, functions, defs)):
            if mod.split(".")[0] in ("run",):  # the run machinery computes nothing a result holds
                continue
            if mod.replace(".", "/") not in named:
                missing.append(f"{ast.unparse(call.args[0])}: {mod}")
    assert not missing, f"stored steps whose key leaves out code they call: {missing}"
