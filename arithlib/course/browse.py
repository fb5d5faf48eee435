"""Reading a built course site in a real browser, as a student would: every page reachable from
the front page renders, every figure loads and no link is dead.

The site is served over HTTP on localhost and crawled from ``index.html`` in headless
Chromium, driven by Playwright. Per page: the HTTP status is 200, the page has a heading and no
script error, every ``<img>`` has loaded (a decoded image with a width), and every link inside
the site names a file that is there and, where it has a ``#fragment``, an element of the target
page with that id. Links out of the site (``https:``, ``mailto:``) are listed, not followed:
the site is read offline.

Chromium is the system's (Debian's ``chromium``; ``$ARITHLIB_CHROMIUM`` names another
binary): Playwright's own browser download is not needed.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

#: Flags for Chromium on a machine with no screen, no sandbox (root) and no network.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: Sphinx's own generated pages, reached from every page but not the course's content.
GENERATED = ("genindex.html", "search.html", "py-modindex.html")

_PAGE_STATE = """() => ({
  title: document.title,
  headings: document.querySelectorAll('h1').length,
  text: document.body ? document.body.innerText.length : 0,
  broken_images: Array.from(document.images)
      .filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.getAttribute('src')),
  images: document.images.length,
  links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
  ids: Array.from(document.querySelectorAll('[id], a[name]')).map(e => e.id || e.getAttribute('name')),
})"""


def chromium_path() -> str | None:
    """The Chromium binary to drive: ``$ARITHLIB_CHROMIUM``, else ``chromium`` on the PATH."""
    return os.environ.get("ARITHLIB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class SiteReport:
    """What the crawl found: pages read, images loaded, and every problem as one line."""

    pages: list[str] = field(default_factory=list)
    images: int = 0
    internal_links: int = 0
    external_links: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the crawl's requests are not news
        pass


@contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve ``folder`` on a free localhost port for the duration; yields its base URL."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def check_site(folder: Path, chromium: str | None = None, timeout_ms: int = 30_000) -> SiteReport:
    """Crawl the built site in ``folder`` from ``index.html`` in headless Chromium (module doc)."""
    from playwright.sync_api import sync_playwright

    folder = Path(folder)
    if not (folder / "index.html").is_file():
        raise FileNotFoundError(f"{folder}/index.html not found: build the site first (python -m arithlib.course.site)")
    chromium = chromium or chromium_path()
    if not chromium:
        raise FileNotFoundError(
            "no Chromium found: install Debian's chromium (apt-get install chromium) or set ARITHLIB_CHROMIUM"
        )
    report = SiteReport()
    ids: dict[str, set[str]] = {}
    fragments: list[tuple[str, str, str]] = []  # (page, target page, fragment)
    with serve(folder) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        todo, seen = ["index.html"], {"index.html"}
        while todo:
            rel = todo.pop(0)
            errors.clear()
            response = page.goto(base + rel, wait_until="load", timeout=timeout_ms)
            if response is None or response.status != 200:
                report.problems.append(f"{rel}: HTTP {None if response is None else response.status}")
                continue
            state = page.evaluate(_PAGE_STATE)
            report.pages.append(rel)
            report.images += state["images"]
            ids[rel] = set(state["ids"])
            if not state["headings"] or state["text"] < 20:
                report.problems.append(f"{rel}: no heading or no text (title {state['title']!r})")
            report.problems += [f"{rel}: script error: {e}" for e in errors]
            report.problems += [f"{rel}: image does not load: {src}" for src in state["broken_images"]]
            for href in state["links"]:
                url, frag = urldefrag(href)
                if not url.startswith(base):
                    if urlsplit(href).scheme in ("http", "https", "mailto"):
                        report.external_links.add(href)
                    continue
                report.internal_links += 1
                target = unquote(url[len(base) :]) or "index.html"
                if target.endswith("/"):
                    target += "index.html"
                if not (folder / target).is_file():
                    report.problems.append(f"{rel}: dead link to {target}")
                    continue
                if target.endswith(".html"):
                    if frag:
                        fragments.append((rel, target, unquote(frag)))
                    if target not in seen and target.rsplit("/", 1)[-1] not in GENERATED:
                        seen.add(target)
                        todo.append(target)
        browser.close()
    for rel, target, frag in fragments:
        if target in ids and frag not in ids[target]:
            report.problems.append(f"{rel}: link to {target}#{frag}, which has no element with that id")
    return report
