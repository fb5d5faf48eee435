"""Which arithlib modules a piece of code depends on, read from the source text alone
(no import): a module and every arithlib module it imports, transitively. Both the run
keys of ``scripts/run_key.py`` (a notebook reruns when a module it uses changes) and the
stored results of :mod:`arithlib.stored` (a result is reused only while the code that
computed it is unchanged) hash these files."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable

PACKAGE = Path(__file__).resolve().parent
_ABSOLUTE = re.compile(r"arithlib\.(\w+)")
_RELATIVE_IMPORT = re.compile(r"from[ \t]+\.(\w*)[ \t]+import[ \t]+([\w \t,(]+)")


def imported_names(imported: str) -> list[str]:
    """The names of ``from X import a, (b, c)``."""
    return [n.strip() for n in imported.replace("(", "").replace(")", "").split(",")]


def module_closure(names: Iterable[str], package: Path = PACKAGE) -> set[str]:
    """``names`` (arithlib module names, e.g. ``"patching"``) and every arithlib module
    they import, transitively, relative, absolute or lazy (``importlib.import_module(
    "arithlib.toy")``), plus ``__init__``."""
    seen: set[str] = {"__init__"}
    todo = [n for n in names if (package / f"{n}.py").is_file()]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = (package / f"{name}.py").read_text()
        for mod, imported in _RELATIVE_IMPORT.findall(text):
            candidates = [mod] if mod else imported_names(imported)
            todo += [c for c in candidates if (package / f"{c}.py").is_file()]
        todo += [m for m in _ABSOLUTE.findall(text) if (package / f"{m}.py").is_file()]
    return seen


def code_fingerprint(names: Iterable[str], package: Path = PACKAGE) -> str:
    """A 16-hex-digit hash of the source of :func:`module_closure` ``(names)``."""
    h = hashlib.sha256()
    for name in sorted(module_closure(names, package)):
        h.update(name.encode())
        h.update((package / f"{name}.py").read_bytes())
    return h.hexdigest()[:16]
