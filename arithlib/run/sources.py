"""Which arithlib modules a piece of code depends on, read from the source text alone
(no import): a module and every arithlib module it imports, transitively. Both the run
keys of ``scripts/run_key.py`` (a notebook reruns when a module it uses changes) and the
stored results of :mod:`arithlib.run.stored` (a result is reused only while the code that
computed it is unchanged) hash these files."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # arithlib/ (this module is arithlib/run/sources.py)
# ``import arithlib.x``, ``from arithlib.x import``, ``import_module("arithlib.x")``: not a
# mention in a docstring, which would make every module depend on most others
_ABSOLUTE = re.compile(r"(?:(?:import|from)[ \t]+|[\"'])arithlib\.(\w+(?:\.\w+)*)")
_RELATIVE_IMPORT = re.compile(r"from[ \t]+(\.+)([\w.]*)[ \t]+import[ \t]+([\w \t,(]+)")


def imported_names(imported: str) -> list[str]:
    """The names of ``from X import a, (b, c)`` (``a as b`` gives ``a``)."""
    return [n.split()[0] for n in (p.strip() for p in imported.replace("(", "").replace(")", "").split(",")) if n]


def _files(name: str, package: Path) -> list[str]:
    """The module names that ``name`` (``"methods.patching"``, ``"engine/passes"``, ``"engine"``)
    stands for: a module is itself; a subpackage is every module in it (what it imports
    from its own modules is then covered whatever the import's form)."""
    if (package / f"{name}.py").is_file():  # a module, with the __init__ of each package above it
        parents = name.split("/")[:-1]
        return [name] + ["/".join(parents[:k] + ["__init__"]) for k in range(1, len(parents) + 1)]
    folder = package / name
    if (folder / "__init__.py").is_file():
        return sorted(str(p.relative_to(package).with_suffix("")) for p in folder.rglob("*.py"))
    return []


def module_closure(names: Iterable[str], package: Path = PACKAGE) -> set[str]:
    """``names`` (arithlib module names relative to the package, e.g. ``"methods.patching"``,
    ``"engine/passes"``, or a subpackage, ``"engine"``) and every arithlib module they
    import, transitively, relative, absolute or lazy (``importlib.import_module(
    "arithlib.core.toy")``), plus ``__init__``. A subpackage counts as all its modules. A
    name that is neither a module nor a subpackage raises ValueError."""
    seen: set[str] = {"__init__"}
    todo = []
    for n in names:
        found = _files(n.replace(".", "/"), package)
        if not found:  # a name that resolves to nothing would drop its code from every key
            raise ValueError(
                f"no arithlib module or subpackage {n!r} (names are relative to the package: "
                f"'yu.cna', 'methods.ablation', 'engine')"
            )
        todo += found
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = (package / f"{name}.py").read_text()
        here = name.split("/")[:-1]  # the (sub)package the module sits in
        for dots, mod, imported in _RELATIVE_IMPORT.findall(text):
            base = here[: len(here) - (len(dots) - 1)] if len(dots) - 1 <= len(here) else []
            candidates = [mod] if mod else imported_names(imported)
            for c in candidates:
                todo += _files("/".join(base + c.split(".")), package)
        for m in _ABSOLUTE.findall(text):
            parts = m.split(".")
            # the longest prefix that names a module or subpackage (arithlib.engine.passes.forward)
            for k in range(len(parts), 0, -1):
                found = _files("/".join(parts[:k]), package)
                if found:
                    todo += found
                    break
    return seen


def code_fingerprint(names: Iterable[str], package: Path = PACKAGE) -> str:
    """A 16-hex-digit hash of the source of :func:`module_closure` ``(names)``."""
    h = hashlib.sha256()
    for name in sorted(module_closure(names, package)):
        h.update(name.encode())
        h.update((package / f"{name}.py").read_bytes())
    return h.hexdigest()[:16]
