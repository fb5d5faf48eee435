"""The executed copies of the notebooks (``figures/<model>/notebooks/NN_name.ipynb``): what
makes them say which code they ran, carry no path of the machine that ran them, and stay
small. :func:`notebook_files.publish` applies :func:`finish_copy` to each notebook a run
executes; ``refresh`` applies the same code to copies already committed.

Rules, in the order applied:

1. **Provenance.** The copy opens with a markdown cell (tagged ``provenance``) naming the
   model and the commit the notebook ran at, and how to rerun it; the commit is also
   stored as ``metadata.arithlib.git_commit``. The commit is the run's own record: its
   ``NN_name_params.json`` (``environment.git_commit``, written by
   :func:`arithlib.run.runs.start_run` from the checkout the notebook ran in), found beside
   the copy's folder. ``+dirty`` (tracked files other than ``figures/`` were edited) is
   kept and said. Where the notebook's source in this checkout (``notebooks/NN_name.py``)
   differs from its source at that commit, the cell says so, and in which sections; such
   a copy shows an older version of the notebook until the next run replaces it.
   ``tests/notebooks/test_executed_copies.py`` checks that every committed copy's code
   cells are its source at the recorded commit (papermill's injected parameters aside).
   It needs that commit in the clone's history and in HEAD's: a shallow clone, or a run
   at a commit that was never merged, fails the check, naming the cause; it is not
   skipped, since a copy whose code cannot be checked is what the check exists to catch.
   (A ``--quick`` run with ``-p`` values runs a source with those values restated, so
   its copy would not pass; such runs write to ``outputs/scratch/``, not committed.)
2. **No machine paths.** Every path of the machine that ran the notebook is rewritten
   (:func:`scrub_text`), in the outputs' text, the injected parameters cell and
   papermill's metadata: the checkout's own prefix is dropped (paths become relative to
   the repository), the run's staging folder (``out_dir`` as the run passed it) becomes
   the figures root relative to ``notebooks/`` (``../figures``, where the files were
   moved), an installed package's path starts at the package
   (``transformers/modeling_utils.py``), a kernel's cell file is ``<cell>`` and a home
   folder is ``~``.
3. **No noise warnings.** Warnings that say nothing about the results
   (:data:`NOISE_WARNINGS`: a font's missing glyph, a deprecation inside a dependency)
   are dropped from stderr; each is also silenced, or its cause fixed, where it is raised.
4. **Figures by reference.** A figure a cell saves with
   ``save_figure(fig, out, "NN_name")`` is committed as ``figures/<model>/NN_name.png``;
   the copy does not embed it again. A cell's ``image/png`` outputs are replaced by one
   markdown output that shows and links those files (``../NN_name.png``, relative to the
   copy), when the files the cell saves (its ``save_figure`` calls read with Python's
   parser; an f-string's field matches a name part without `_`) exist beside the copy and are at
   least as many as its images. A JupyterLab or Jupyter viewer opened on the copy shows
   the same PNG inline; a code host shows the link. Images of a cell that does not save
   them all stay embedded.

Usage: ``executed_copies.py refresh figures/*/notebooks/*.ipynb`` rewrites committed
copies in place by these rules (idempotent); ``executed_copies.py check FILE...`` exits 1
naming copies whose code cells are not their source at the recorded commit.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE_TAG = "provenance"
INJECTED_TAG = "injected-parameters"
#: The figures root as a notebook in ``notebooks/`` names it (run_all.sh's default).
FIGURES_FROM_NOTEBOOKS = "../figures"
#: Patterns of warnings dropped from an executed copy's stderr (rule 3). Each one is also
#: handled where it is raised: glyphs by :func:`arithlib.plots.font_safe` (token labels
#: outside the font are written as ``\\uXXXX``), the deprecation by
#: :func:`arithlib.yu.lora.train_lora` silencing it around its call into peft.
NOISE_WARNINGS = (
    re.compile(r"UserWarning: Glyph \d+ .* missing from font"),
    re.compile(r"FutureWarning: `is_gradient_checkpointing` is deprecated"),
)
#: What machine paths look like (the published copies must have none).
MACHINE_PATH = re.compile(r"(?:/work/|/root/|/home/|/Users/|/tmp/|site-packages)")
_WARNING_HEAD = re.compile(r"^\S.*:\d+: \w*(?:Warning|Deprecation)\w*: ")


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


# --------------------------------------------------------------------------- rule 2: paths


def run_roots(nb: dict) -> list[str]:
    """The checkout folders the notebook ran in, as absolute paths: the parent of
    ``notebooks/`` in papermill's ``input_path``, and this checkout."""
    roots = []
    path = nb.get("metadata", {}).get("papermill", {}).get("input_path") or ""
    parts = Path(path).parts
    if path.startswith("/") and "notebooks" in parts:
        roots.append(str(Path(*parts[: len(parts) - 1 - parts[::-1].index("notebooks")])))
    roots.append(str(ROOT))
    return sorted(set(roots), key=len, reverse=True)


_STAGING = re.compile(
    r"(?:/[^\s\"':]*?/|(?:\.\./)+)?outputs/(?:scratch/)?[^/\s\"']+/staging/(?:run-[^/\s\"']+/)?\d\d_[A-Za-z0-9_]+"
)
_SITE = re.compile(r"[^\s\"':]*/(?:site|dist)-packages/")
_STDLIB = re.compile(r"[^\s\"':]*/lib/python3\.\d+/")
_KERNEL_CELL = re.compile(r"/tmp/ipykernel_\d+/\d+\.py")
_HOME = re.compile(r"(?:/root|/home/[^/\s\"']+|/Users/[^/\s\"']+)(?=/)")
_REPO_PARTS = ("arithlib", "notebooks", "outputs", "figures", "scripts", "tests", "data")
_ANY_ABS = re.compile(r"/(?:work|tmp|mnt|opt|srv|var)/[^\s\"':,)]*")


def _relative_rest(match: re.Match) -> str:
    """An absolute path no rule above knew: from its first repository folder on
    (``arithlib/…``), else its last component."""
    parts = match.group(0).split("/")
    for i, part in enumerate(parts):
        if part in _REPO_PARTS:
            return "/".join(parts[i:])
    return parts[-1] or "<path>"


def scrub_text(text: str, roots: list[str], figures: str = FIGURES_FROM_NOTEBOOKS, out_dir: str | None = None) -> str:
    """``text`` with the machine's paths rewritten by rule 2 (module docstring);
    ``out_dir``: the value the run passed (its staging folder), written as ``figures``."""
    if out_dir and out_dir != figures:
        text = text.replace(out_dir.rstrip("/"), figures)
    for root in roots:
        text = text.replace(root.rstrip("/") + "/", "")
    text = _STAGING.sub(figures, text)
    text = _SITE.sub("", text)
    text = _STDLIB.sub("", text)
    text = _KERNEL_CELL.sub("<cell>", text)
    text = _HOME.sub("~", text)
    return _ANY_ABS.sub(_relative_rest, text)


def _scrub_value(value, roots: list[str], figures: str, out_dir: str | None = None):
    if isinstance(value, str):
        return scrub_text(value, roots, figures, out_dir)
    if isinstance(value, list):
        return [_scrub_value(v, roots, figures, out_dir) for v in value]
    if isinstance(value, dict):
        return {k: _scrub_value(v, roots, figures, out_dir) for k, v in value.items()}
    return value


def scrub_paths(nb: dict, figures: str = FIGURES_FROM_NOTEBOOKS) -> None:
    """Rule 2 on ``nb`` in place: outputs (all but images), the injected parameters cell,
    papermill's metadata (input and output paths, parameters)."""
    roots = run_roots(nb)
    meta = nb.get("metadata", {})
    out_dir = meta.get("papermill", {}).get("parameters", {}).get("out_dir")
    out_dir = out_dir if isinstance(out_dir, str) else None
    if "papermill" in meta:
        meta["papermill"] = _scrub_value(meta["papermill"], roots, figures, out_dir)
    for cell in nb.get("cells", []):
        if INJECTED_TAG in cell.get("metadata", {}).get("tags", []):
            cell["source"] = scrub_text(_source(cell), roots, figures, out_dir)
        for out in cell.get("outputs", []):
            for key in ("text", "traceback", "evalue"):
                if key in out:
                    out[key] = _scrub_value(out[key], roots, figures, out_dir)
            data = out.get("data")
            if isinstance(data, dict):
                for mime, value in data.items():
                    if not mime.startswith("image/") or mime == "image/svg+xml":
                        data[mime] = _scrub_value(value, roots, figures, out_dir)


# --------------------------------------------------------------------------- rule 3: noise warnings


def drop_noise(text: str) -> str:
    """``text`` (a stderr stream) without the warnings of :data:`NOISE_WARNINGS`: each
    warning's head line and the indented source lines that follow it."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if _WARNING_HEAD.match(line):
            skipping = any(p.search(line) for p in NOISE_WARNINGS)
        elif not line.startswith((" ", "\t")):
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out)


def drop_noise_warnings(nb: dict) -> None:
    """Rule 3 on ``nb`` in place (a stderr output left empty is removed)."""
    for cell in nb.get("cells", []):
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                out["text"] = drop_noise(_source({"source": out.get("text", "")}))
                if not out["text"]:
                    continue
            kept.append(out)
        if "outputs" in cell:
            cell["outputs"] = kept


# --------------------------------------------------------------------------- rule 4: figures


def saved_figures(source: str) -> list[str]:
    """Patterns (regular expressions) of the names a cell saves with
    ``save_figure(fig, out, name)`` (or ``name=``), in the order written; an f-string's
    field matches a run of letters, digits, dots and dashes (no ``_``, so
    ``f"02_case{i}"`` does not take ``02_case1_mlp_out``, another cell's figure)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "save_figure"
        ):
            continue
        arg = node.args[2] if len(node.args) >= 3 else next((k.value for k in node.keywords if k.arg == "name"), None)
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            names.append((getattr(arg, "lineno", 0), getattr(arg, "col_offset", 0), re.escape(arg.value)))
        elif isinstance(arg, ast.JoinedStr):
            pattern = "".join(
                re.escape(v.value) if isinstance(v, ast.Constant) else r"[A-Za-z0-9.\-]+" for v in arg.values
            )
            names.append((arg.lineno, arg.col_offset, pattern))
    return [n for _, _, n in sorted(names)]


def figure_output(files: list[str]) -> dict:
    """The output that stands for a cell's figures: each PNG shown and linked, relative
    to the copy (``../NN_name.png``)."""
    md = "\n\n".join(f"[![{f}](../{f})](../{f})" for f in files)
    plain = "\n".join(f"<figure: ../{f}>" for f in files)
    return {"output_type": "display_data", "metadata": {}, "data": {"text/markdown": md, "text/plain": plain}}


def link_figures(nb: dict, model_dir: Path) -> int:
    """Rule 4 on ``nb`` in place, ``model_dir`` being the folder of the committed PNGs
    (the copy's folder's parent); returns the number of images replaced."""
    pngs = sorted(p.name for p in model_dir.glob("*.png")) if model_dir.is_dir() else []
    replaced = 0
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        images = [o for o in cell.get("outputs", []) if "image/png" in (o.get("data") or {})]
        if not images:
            continue
        files = []
        for pattern in saved_figures(_source(cell)):
            files += [f for f in pngs if re.fullmatch(rf"{pattern}\.png", f) and f not in files]
        if not files or len(files) < len(images):
            continue
        outputs, placed = [], False
        for out in cell["outputs"]:
            if "image/png" in (out.get("data") or {}):
                if not placed:
                    outputs.append(figure_output(files))
                    placed = True
                replaced += 1
                continue
            outputs.append(out)
        cell["outputs"] = outputs
    return replaced


# --------------------------------------------------------------------------- rule 1: provenance


def git(*args: str, root: Path = ROOT) -> str | None:
    """``git args`` in ``root``: its stdout, None when git fails (an unknown commit)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def recorded_commit(copy: Path, nb: dict | None = None) -> str | None:
    """The commit the copy's notebook ran at: ``metadata.arithlib.git_commit``, else its
    run's ``NN_name_params.json`` beside the copy's folder (``environment.git_commit``)."""
    nb = nb if nb is not None else json.loads(copy.read_text(encoding="utf-8"))
    commit = nb.get("metadata", {}).get("arithlib", {}).get("git_commit")
    if commit:
        return commit
    params = copy.parent.parent / f"{copy.stem}_params.json"
    if params.is_file():
        return (json.loads(params.read_text(encoding="utf-8")).get("environment") or {}).get("git_commit")
    return None


def _code_cells(nb_cells: list) -> list[str]:
    return [
        _source(c).strip()
        for c in nb_cells
        if c.get("cell_type") == "code" and INJECTED_TAG not in c.get("metadata", {}).get("tags", [])
    ]


def source_at(stem: str, commit: str, root: Path = ROOT) -> list[dict] | None:
    """The cells of ``notebooks/<stem>`` at ``commit`` (the ``.py`` read by jupytext, else
    the ``.ipynb``), as plain dicts; None when the commit or the file is not there."""
    import jupytext

    base = commit.removesuffix("+dirty")
    for suffix, fmt in ((".py", "py:percent"), (".ipynb", "ipynb")):
        text = git("show", f"{base}:notebooks/{stem}{suffix}", root=root)
        if text is not None:
            with warnings.catch_warnings():  # an old notebook's cells without ids: nbformat's warning, not ours
                warnings.simplefilter("ignore")
                nb = jupytext.reads(text, fmt=fmt)
            return [{"cell_type": c.cell_type, "source": c.source, "metadata": dict(c.metadata)} for c in nb.cells]
    return None


def code_drift(copy_nb: dict, source_cells: list[dict]) -> list[str]:
    """Where the copy's code cells (injected parameters aside) differ from
    ``source_cells``' (empty: the same code)."""
    a, b = _code_cells(copy_nb.get("cells", [])), _code_cells(source_cells)
    out = [f"code cell {i + 1} differs" for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != len(b):
        out.append(f"{len(a)} code cells in the copy, {len(b)} in the source")
    return out


def _sections(cells: list[dict]) -> list[str]:
    """Each cell's section: the last markdown heading at or before it ("" before any)."""
    current, out = "", []
    for c in cells:
        if c.get("cell_type") == "markdown":
            heads = [line.lstrip("#").strip() for line in _source(c).split("\n") if line.startswith("#")]
            current = heads[-1] if heads else current
        out.append(current)
    return out


def changes_since(then: list[dict], now: list[dict]) -> tuple[int, int, list[str]]:
    """(code cells changed, markdown cells changed, sections with changes) from the cells
    ``then`` to ``now`` (matched with difflib on their text)."""
    import difflib

    key = [(c["cell_type"], _source(c).strip()) for c in then]
    key_now = [(c["cell_type"], _source(c).strip()) for c in now]
    sections, code, text, where = _sections(now), 0, 0, []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, key, key_now, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        old, new = key[i1:i2], key_now[j1:j2]
        code += max(sum(t == "code" for t, _ in old), sum(t == "code" for t, _ in new))
        text += max(sum(t == "markdown" for t, _ in old), sum(t == "markdown" for t, _ in new))
        for j in range(j1, max(j2, j1 + 1)):
            s = sections[min(j, len(sections) - 1)] if sections else ""
            if s and s not in where:
                where.append(s)
    return code, text, where


def current_source(stem: str, root: Path = ROOT) -> list[dict] | None:
    """The cells of ``notebooks/<stem>.py`` in this checkout's working tree."""
    import jupytext

    py = root / "notebooks" / f"{stem}.py"
    if not py.is_file():
        return None
    return [
        {"cell_type": c.cell_type, "source": c.source, "metadata": dict(c.metadata)} for c in jupytext.read(py).cells
    ]


def provenance_text(stem: str, model: str, commit: str | None, then: list[dict] | None, now: list[dict] | None) -> str:
    """The markdown of the copy's first cell (rule 1)."""
    dirty = (
        " (`+dirty`: the checkout also had uncommitted edits to tracked files)"
        if commit and commit.endswith("+dirty")
        else ""
    )
    lines = [
        f"**Executed copy** of `notebooks/{stem}.ipynb` on **{model}**, "
        + (f"run at commit `{commit[:12]}`{dirty}." if commit else "run at an unrecorded commit.")
    ]
    if commit and then is not None and now is not None:
        code, text, where = changes_since(then, now)
        if code or text:
            parts = [f"{n} {kind} cell{'s' if n != 1 else ''}" for n, kind in ((code, "code"), (text, "text")) if n]
            lines.append(
                f"The notebook's source has changed since that commit ({' and '.join(parts)} differ from "
                f"the current `notebooks/{stem}.py`"
                + (f"; in: {'; '.join(where[:6])}{'; ...' if len(where) > 6 else ''}" if where else "")
                + "): the code and outputs below are that commit's, not the current notebook's."
            )
    elif commit and then is None:
        lines.append("(The source at that commit is not in this clone's history: `git fetch --unshallow`.)")
    lines.append(
        f"Rerun: `./run_all.sh --model {model} --only {stem[:2]}` (writes `figures/{model}/`); "
        f"`git show {(commit or 'COMMIT').removesuffix('+dirty')[:12]}:notebooks/{stem}.py` shows the code that ran."
    )
    return "\n\n".join(lines)


def add_provenance(
    nb: dict, stem: str, model: str, commit: str | None, root: Path = ROOT, compare: bool = True
) -> None:
    """Rule 1 on ``nb`` in place: the first cell (replaced if already there) and
    ``metadata.arithlib``. With ``compare``, the source at ``commit`` is compared with
    this checkout's ``notebooks/<stem>.py``."""
    then = source_at(stem, commit, root) if commit and compare else None
    now = current_source(stem, root) if compare else None
    cell = {
        "cell_type": "markdown",
        "id": "provenance",
        "metadata": {"tags": [PROVENANCE_TAG]},
        "source": provenance_text(stem, model, commit, then, now),
    }
    cells = [c for c in nb.get("cells", []) if PROVENANCE_TAG not in c.get("metadata", {}).get("tags", [])]
    nb["cells"] = [cell] + cells
    meta = nb.setdefault("metadata", {}).setdefault("arithlib", {})
    meta.update({"git_commit": commit, "model": model, "notebook": stem})


def _model_of(nb: dict, copy: Path) -> str:
    params = nb.get("metadata", {}).get("papermill", {}).get("parameters", {})
    return str(params.get("model") or copy.parent.parent.name)


def finish_copy(
    nb: dict, copy: Path, commit: str | None = None, figures: str = FIGURES_FROM_NOTEBOOKS, root: Path = ROOT
) -> dict:
    """Rules 1-4 on ``nb``, the executed copy to be written at ``copy``
    (``<figures>/<model>/notebooks/NN_name.ipynb``); ``commit`` defaults to the recorded
    one (:func:`recorded_commit`). Returns ``nb`` (changed in place)."""
    commit = commit or recorded_commit(copy, nb)
    scrub_paths(nb, figures)
    drop_noise_warnings(nb)
    link_figures(nb, copy.parent.parent)
    add_provenance(nb, copy.stem, _model_of(nb, copy), commit, root)
    return nb


def refresh(paths: list[Path]) -> list[Path]:
    """Rewrite each committed copy in ``paths`` by the rules above (in place)."""
    import nbformat

    sys.path.insert(0, str(ROOT))
    from arithlib.run.atomic import write_text

    done = []
    for path in paths:
        path = Path(path)
        nb = json.loads(path.read_text(encoding="utf-8"))
        finish_copy(nb, path)
        write_text(path, nbformat.writes(nbformat.from_dict(nb)) + "\n")
        done.append(path)
    return done


def check(paths: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """Copy -> what is wrong with its provenance: no recorded commit, a commit missing
    from this clone's history, or code cells other than its source's at that commit."""
    bad: dict[str, list[str]] = {}
    for path in paths:
        path = Path(path)
        nb = json.loads(path.read_text(encoding="utf-8"))
        commit = recorded_commit(path, nb)
        if not commit:
            bad[str(path)] = ["no recorded commit (metadata.arithlib.git_commit or its _params.json)"]
            continue
        first = nb.get("cells", [{}])[0]
        if PROVENANCE_TAG not in first.get("metadata", {}).get("tags", []) or commit[:12] not in _source(first):
            bad[str(path)] = [f"its first cell does not state the commit {commit[:12]}"]
            continue
        cells = source_at(path.stem, commit, root)
        if cells is None:
            shallow = (git("rev-parse", "--is-shallow-repository", root=root) or "").strip() == "true"
            bad[str(path)] = [
                f"commit {commit} (or notebooks/{path.stem}.py in it) is not in this clone's history"
                + (
                    "; this is a shallow clone: git fetch --unshallow"
                    if shallow
                    else "; was the run's commit never pushed or merged?"
                )
            ]
            continue
        if git("merge-base", "--is-ancestor", commit.removesuffix("+dirty"), "HEAD", root=root) is None:
            bad[str(path)] = [f"commit {commit} is not in HEAD's history: a fresh clone would not have it"]
            continue
        drift = code_drift(nb, cells)
        if drift:
            bad[str(path)] = drift
    return bad


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) >= 2 and argv[0] == "refresh":
        for p in refresh([Path(a) for a in argv[1:]]):
            print(p)
        return 0
    if len(argv) >= 2 and argv[0] == "check":
        bad = check([Path(a) for a in argv[1:]])
        for p, problems in bad.items():
            print(f"{p}: {'; '.join(problems[:4])}", file=sys.stderr)
        return 1 if bad else 0
    print(__doc__.split("\n\n")[-1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
