"""Links of the generated pages: which files they point to, whether git tracks those files and
whether each link's target (and anchor) exists, so that a page never links what a clean clone
of the repository lacks (an executed notebook's ignored HTML rendering, a file a run wrote
but nobody committed)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
_HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")  # <a href="..."> and <img src="...">
_ANCHOR = re.compile(r"""\bid\s*=\s*["']([^"']+)["']""")  # <a id="..."> and <h2 id="...">
_EXTERNAL = ("http://", "https://", "mailto:", "data:")


def links(text: str) -> list[str]:
    """Every link target in ``text``, Markdown or HTML (a Markdown page may hold HTML tags),
    in order of appearance; external ones (http, https, mailto, data) left out."""
    found = sorted([(m.start(), m.group(1)) for rx in (_MD_LINK, _HTML_LINK) for m in rx.finditer(text)])
    return [t for _, t in found if not t.startswith(_EXTERNAL)]


def anchors(text: str) -> set[str]:
    """The explicit anchors (``id`` attributes) of a page."""
    return set(_ANCHOR.findall(text))


def tracked_files(root: str | os.PathLike) -> set[Path] | None:
    """The files git tracks under ``root`` (absolute, resolved paths), or None when ``root``
    is not in a git work tree (or git is missing)."""
    root = Path(root).resolve()
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {(root / p).resolve() for p in out.decode().split("\0") if p}


def is_tracked(path: str | os.PathLike) -> bool:
    """Whether git tracks ``path`` (False outside a git work tree)."""
    path = Path(path)
    try:
        subprocess.run(
            ["git", "ls-files", "--error-unmatch", path.name], cwd=path.parent, capture_output=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


def broken_links(page: str | os.PathLike, exists: Callable[[Path], bool] | None = None) -> list[str]:
    """The links of ``page`` (a Markdown or HTML file) that lead nowhere: a file that
    ``exists`` denies (default: not on disk), or an anchor (``#name``) its target page does
    not define. Each as "target (why)"."""
    page = Path(page)
    exists = exists or (lambda p: p.is_file())
    text = page.read_text(encoding="utf-8")
    bad = []
    for target in links(text):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page.resolve()
        if file_part and not exists(dest):
            bad.append(f"{target} (no such committed file)")
        elif anchor and anchor not in anchors(dest.read_text(encoding="utf-8") if dest.is_file() else ""):
            bad.append(f"{target} (no anchor {anchor!r} in {dest.name})")
    return bad


def committed_pages(root: str | os.PathLike, names: Iterable[str] = ("REPORT.md", "REPORT.html")) -> list[Path]:
    """The tracked pages called ``names`` in the model folders under ``root``/figures."""
    tracked = tracked_files(root) or set()
    figures = (Path(root) / "figures").resolve()
    return sorted(p for p in tracked if p.name in set(names) and p.parent.parent == figures)
