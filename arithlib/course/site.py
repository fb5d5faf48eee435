"""The course site: one static HTML site a class reads while it works, built with Sphinx and
myst-nb from what the repository already holds.

Pages (each at its path in the repository, so that the documents' own relative links hold):

* the course: ``docs/teaching.md`` (syllabus, order, times), the exercise notebooks
  (``notebooks/exercises/NN_*_exercise.ipynb``) and, on a separate page, their solutions;
* the studies: for each model with a committed run (``figures/<model>/REPORT.md``), its executed
  notebooks (``figures/<model>/notebooks/``, shown with the outputs they were committed with:
  nothing is executed while the site builds), its report, fidelity table and details, and the
  cross-model summary;
* the documentation: ``docs/*.md`` and the README.

:func:`stage` copies those files into a source folder and writes the index pages and
Sphinx's ``conf.py``; :func:`build` runs ``sphinx-build`` on it. A link in a staged document
to a file of the repository that is not a page (a table, a script) becomes a download: the
file is staged beside the pages. A link to a folder becomes the folder's name in code, a link
from an executed notebook is read from ``notebooks/`` (where its source lives) when it does not
resolve from the copy's own folder, and a link to a source notebook points at the default
model's executed copy; a link to a page the site leaves out (another model's report, when the
site shows a few) becomes its text and path. A link to nothing stays as written, so that the site's browser test
(``tests/course/test_site.py``) finds it.

Written here because no kept tool stages a repository's scattered Markdown, notebooks and
reports into one Sphinx project with their links intact; the rendering is Sphinx's and
myst-nb's own.

    python -m arithlib site [--out outputs/site] [--models a,b] [--check]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..core.models import DEFAULT_MODEL
from ..run.paths import REPO_ROOT

#: Where ``python -m arithlib.course.site`` writes the built site.
DEFAULT_OUT = REPO_ROOT / "outputs" / "site"
#: Markdown links and images: ``[text](target)`` / ``![alt](target)``; the target without a title.
_LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)(\))")
#: Documents Sphinx renders; any other linked file is staged as a download.
PAGE_SUFFIXES = (".md", ".ipynb")
#: The staged folder Sphinx copies into the site as it is (``html_extra_path``).
EXTRA = "_extra"


def site_models(root: Path = REPO_ROOT) -> list[str]:
    """The models whose committed run the site shows: those with ``figures/<model>/REPORT.md``,
    the default model first."""
    found = sorted(p.parent.name for p in (root / "figures").glob("*/REPORT.md"))
    return sorted(found, key=lambda m: (m != DEFAULT_MODEL, m))


@dataclass
class Staged:
    """A staged source folder: its pages (repository-relative paths), the files staged as
    downloads, and the pages of the repository that a staged page links to but the site leaves
    out (a model not shown), whose links became text."""

    src: Path
    pages: list[str] = field(default_factory=list)
    downloads: list[str] = field(default_factory=list)
    unlinked: list[str] = field(default_factory=list)


def page_list(root: Path, models: list[str]) -> dict[str, list[str]]:
    """The pages of each part of the site, repository-relative, in reading order."""
    ex = root / "notebooks" / "exercises"
    parts: dict[str, list[str]] = {
        "course": ["docs/teaching.md"],
        "exercises": [p.relative_to(root).as_posix() for p in sorted(ex.glob("[0-9][0-9]_*_exercise.ipynb"))],
        "solutions": [p.relative_to(root).as_posix() for p in sorted(ex.glob("[0-9][0-9]_*_solution.ipynb"))],
    }
    for model in models:
        fig = root / "figures" / model
        pages = [p.relative_to(root).as_posix() for p in sorted((fig / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
        pages += [f"figures/{model}/{n}" for n in ("REPORT.md", "FIDELITY.md", "DETAILS.md") if (fig / n).is_file()]
        parts[f"model:{model}"] = pages
    parts["results"] = [p for p in ("figures/CROSS_MODEL.md", "figures/README.md") if (root / p).is_file()]
    docs = sorted(p.relative_to(root).as_posix() for p in (root / "docs").glob("*.md"))
    parts["docs"] = (
        ["README.md"] + [d for d in docs if d != "docs/teaching.md"] + ["benchmarks/RESULTS.md", "CHANGELOG.md"]
    )
    return parts


def _resolve(page: str, target: str, root: Path) -> str | None:
    """The repository-relative path a page's link points at, or None outside the repository."""
    base = Path(page).parent
    candidates = [base]
    if page.startswith("figures/") and "/notebooks/" in page:  # an executed copy: its source's folder
        candidates.append(Path("notebooks"))
    for where in candidates:
        path = os.path.normpath((where / target).as_posix())
        if not path.startswith(".."):
            if (root / path).exists() or where == candidates[-1]:
                return path
    return None


def rewrite_links(text: str, page: str, root: Path, staged: set[str], default_model: str, found: Staged) -> str:
    """``text`` (Markdown of ``page``) with its links made to work inside the site (module doc)."""

    def one(m: re.Match) -> str:
        opening, target, closing = m.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path_part, _, anchor = target.partition("#")
        if not path_part:
            return m.group(0)
        resolved = _resolve(page, path_part, root)
        if resolved is None:
            return m.group(0)
        new = resolved
        if resolved.startswith("notebooks/") and resolved.endswith(".ipynb") and resolved not in staged:
            copy = f"figures/{default_model}/notebooks/{Path(resolved).name}"
            new = copy if copy in staged else resolved
        elif (root / resolved).is_dir() or (
            resolved.endswith(PAGE_SUFFIXES) and resolved not in staged and (root / resolved).is_file()
        ):
            shown = f"{resolved}/" if (root / resolved).is_dir() else resolved
            if not (root / resolved).is_dir():
                found.unlinked.append(resolved)
            label = opening[opening.index("[") + 1 : -2]
            return label if opening.startswith("!") else f"{label} (`{shown}`)"
        elif (root / resolved).is_file() and resolved not in staged and not resolved.endswith(PAGE_SUFFIXES):
            if resolved not in found.downloads:
                found.downloads.append(resolved)
        out = os.path.relpath(new, Path(page).parent.as_posix() or ".") + (f"#{anchor}" if anchor else "")
        return f"{opening}{out}{closing}"

    return _LINK.sub(one, text)


def _rewrite_notebook(text: str, fix) -> str:
    """A notebook's JSON with ``fix`` applied to its markdown cells and markdown outputs."""
    import json

    nb = json.loads(text)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = fix(src)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/markdown" in data:
                md = data["text/markdown"]
                data["text/markdown"] = fix("".join(md) if isinstance(md, list) else md)
    return json.dumps(nb, ensure_ascii=False, indent=1)


def _index(parts: dict[str, list[str]]) -> dict[str, str]:
    """The generated pages: the front page and the exercise / solution / model index pages."""

    def tree(caption: str | None, pages: list[str]) -> str:
        opts = (f":caption: {caption}\n" if caption else "") + ":maxdepth: 1\n"
        return "```{toctree}\n" + opts + "\n" + "\n".join(pages) + "\n```\n"

    out = {}
    out["exercises.md"] = (
        "# Exercises\n\nEach notebook asks you to write the key functions of one study yourself; a check "
        "after each function compares yours with arithlib's on the toy model and says what differs. "
        "Open them in JupyterLab (`scripts/lab.sh`) to run them; the solutions are on "
        "[their own page](solutions.md).\n\n" + tree(None, parts["exercises"])
    )
    out["solutions.md"] = (
        "# Solutions\n\nThe exercise notebooks with their functions written and the answers to the questions.\n\n"
        + tree(None, parts["solutions"])
    )
    models = [k.split(":", 1)[1] for k in parts if k.startswith("model:")]
    for model in models:
        out[f"studies/{model}.md"] = (
            f"# The studies on {model}\n\nThe notebooks as the committed run executed them (each opens with the "
            "commit it ran at), then the report that sets each finding of the papers beside this model's.\n\n"
            + tree(None, [os.path.relpath(p, "studies") for p in parts[f"model:{model}"]])
        )
    first = [
        "# How language models do arithmetic: the course\n",
        "Three papers on how language models add and subtract, reproduced on small open models: Zhang et al. "
        "2024 (key attention heads, path patching, precise fine-tuning), Yu & Ananiadou 2024 (Comparative Neuron "
        "Analysis, LoRA, pruning, bias editing) and Nikankin et al. 2025 (the bag of heuristic neurons), and, "
        "beyond them, how the numbers themselves are represented (Fourier features and the helix).\n",
        "Start with [the course](docs/teaching.md): the order of the studies, a syllabus, and what each "
        "exercise teaches. The [exercises](exercises.md) run on a toy model in seconds; the studies show "
        "the same analyses on real models, as the committed runs executed them.\n",
        tree("Course", ["docs/teaching.md", "exercises.md", "solutions.md"]),
        tree("Studies", [f"studies/{m}.md" for m in models]),
    ]
    if parts["results"]:
        first.append(tree("Results across models", parts["results"]))
    first.append(tree("Documentation", parts["docs"]))
    out["index.md"] = "\n".join(first)
    return out


CONF = """# Written by arithlib.course.site: the Sphinx configuration of the course site.
project = "How language models do arithmetic"
author = "The arithlib authors"
extensions = ["myst_nb"]
nb_execution_mode = "off"  # the notebooks are shown as committed, with their outputs
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
html_theme = "sphinx_book_theme"  # Jupyter Book's theme
html_theme_options = {"show_toc_level": 2, "navigation_with_keys": False, "use_download_button": True}
html_title = project
html_show_sourcelink = False
exclude_patterns = ["_build", "_extra"]
html_extra_path = ["_extra"]  # linked files at their own paths (a notebook output's link to a figure)
# the reports link to raw HTML anchors (<a id="...">), which MyST cannot see but the browser does:
# the site's browser test (arithlib.course.browse) checks every such link instead
suppress_warnings = ["myst.header", "myst.xref_missing", "misc.highlighting_failure"]
"""


def stage(src: Path, models: list[str] | None = None, root: Path = REPO_ROOT) -> Staged:
    """Copy the site's pages into ``src`` (emptied first), rewrite their links, stage the
    downloads they link to and write the index pages and ``conf.py``."""
    if not (root / "docs" / "teaching.md").is_file():
        raise FileNotFoundError(
            f"the course site is built from a checkout of the repository; {root} has no docs/teaching.md"
        )
    models = site_models(root) if models is None else list(models)
    for model in models:
        if not (root / "figures" / model / "REPORT.md").is_file():
            raise FileNotFoundError(
                f"no committed run of {model!r} (figures/{model}/REPORT.md); choose from {site_models(root)}"
            )
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    parts = page_list(root, models)
    pages = [p for ps in parts.values() for p in ps]
    found = Staged(src=src, pages=pages)
    staged = set(pages)
    for page in pages:
        text = (root / page).read_text(encoding="utf-8")

        def fix(t: str, page: str = page) -> str:
            return rewrite_links(t, page, root, staged, models[0] if models else DEFAULT_MODEL, found)

        text = _rewrite_notebook(text, fix) if page.endswith(".ipynb") else fix(text)
        (src / page).parent.mkdir(parents=True, exist_ok=True)
        (src / page).write_text(text, encoding="utf-8")
    images = {Path(p).parent for p in pages if p.startswith("figures/")}
    for folder in images:  # the figures the pages show (by reference, as the executed copies do)
        here = folder.parent if folder.name == "notebooks" else folder
        for png in (root / here).glob("*.png"):
            dest = src / here / png.name
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(png, dest)
    for rel in found.downloads:  # in the sources (a Markdown page's download) and as an extra file at
        for dest in (src / rel, src / EXTRA / rel):  # its own path (a notebook output's plain link)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, dest)
    for name, text in _index(parts).items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text, encoding="utf-8")
    (src / "conf.py").write_text(CONF, encoding="utf-8")
    return found


def build(src: Path, out: Path, jobs: int = 1) -> list[str]:
    """Run ``sphinx-build -b html`` from ``src`` into ``out``; its warnings, one per line.
    Raises RuntimeError when Sphinx fails."""
    out.mkdir(parents=True, exist_ok=True)
    warnings = out.parent / f"{out.name}-warnings.txt"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", str(jobs), "-w", str(warnings), str(src), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sphinx-build failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return (
        [line for line in warnings.read_text(encoding="utf-8").splitlines() if line.strip()]
        if warnings.exists()
        else []
    )


def make_site(
    out: Path = DEFAULT_OUT, models: list[str] | None = None, jobs: int = 1, root: Path = REPO_ROOT
) -> tuple[Path, list[str]]:
    """Stage and build the site into ``out`` (its sources in ``out``'s sibling ``<name>-src``);
    the path of its front page and the warnings: Sphinx's, and one per page left out that a
    shown page links to."""
    src = out.parent / f"{out.name}-src"
    found = stage(src, models, root)
    warnings = build(src, out, jobs)
    left = [f"{p}: a linked page the site leaves out (its links are text)" for p in sorted(set(found.unlinked))]
    return out / "index.html", warnings + left
