"""The notebook files run_all.sh reads and writes: a notebook's parameters (its
``parameters`` cell), the executed copy published beside the figures, and the check
that the notebooks in ``notebooks/`` carry no outputs.

Published copies (``figures/<model>/notebooks/NN_name.ipynb`` and ``.html``) are meant to
be read on a code host, so :func:`strip_for_publishing` drops what only a live kernel
can show or what repeats a figure:

* widget state (``metadata.widgets``) and widget views (the notebooks' progress bars,
  whose saved text is the bar's first frame, "0/10");
* PDF, SVG and HTML copies of an output that also has a PNG.

and the first cell's "**Results**" line, which in ``notebooks/`` links the default
model's executed copy, links the report section of the copy's own run instead.

Each notebook of ``notebooks/`` is authored as a percent-format script ``NN_name.py``
paired with ``NN_name.ipynb`` by jupytext (``formats: ipynb,py:percent`` in the notebook's
metadata): edit either, in JupyterLab with jupytext or in an editor, then
``jupytext --sync notebooks/NN_name.ipynb`` writes the other. :func:`pair_drift` names
the cells where the two differ.

Usage: ``notebook_files.py publish EXECUTED.ipynb DEST_DIR`` (writes both files) or
``notebook_files.py check notebooks/NN_*.ipynb`` (exit 1 naming notebooks with outputs, or
whose ``.py`` pair is missing or holds other cells).
"""

from __future__ import annotations

import ast
import copy
import json
import sys
from pathlib import Path

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
#: Output types dropped where the same output has a PNG.
PNG_DUPLICATES = ("application/pdf", "image/svg+xml", "text/html")
#: The first markdown cell's line that links results (arithlib.report.notebook_links).
RESULTS_LINE = "**Results**"


def _read(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def notebook_parameters(path: str | Path) -> dict[str, str]:
    """Name -> default (as written) of each variable set in the notebook's cell tagged
    ``parameters`` (empty if it has none). Read with Python's parser, which takes every
    line papermill's own inspection skips (a comment with brackets, for one)."""
    for cell in _read(Path(path))["cells"]:
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            source = _source(cell)
            out: dict[str, str] = {}
            for node in ast.parse(source).body:
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
                for t in targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = ast.get_source_segment(source, node.value) or ""
            return out
    return {}


def parse_value(text: str):
    """A ``-p NAME VALUE`` value as the notebook gets it: a Python literal (``3``, ``0.5``,
    ``True``, ``None``, ``[1, 2]``, ``"a b"``) when it parses as one, else the text itself
    (``-p scale cpu`` gives the string "cpu")."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def outputs_in(path: str | Path) -> list[str]:
    """What makes a notebook in ``notebooks/`` not clean: code cells with outputs or an
    execution count, and saved widget state (empty: clean)."""
    nb = _read(Path(path))
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            found.append(f"cell {i}: {len(cell['outputs'])} output(s)")
        if cell.get("execution_count") is not None:
            found.append(f"cell {i}: execution count {cell['execution_count']}")
    if "widgets" in nb.get("metadata", {}):
        found.append("metadata.widgets (saved widget state)")
    return found


def _cells(nb) -> list[tuple[str, str, list]]:
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def pair_drift(ipynb: str | Path) -> list[str]:
    """Where ``ipynb`` and its jupytext pair ``.py`` differ: cell type, source or tags,
    or a missing pair (empty when they hold the same cells)."""
    import jupytext

    ipynb = Path(ipynb)
    py = ipynb.with_suffix(".py")
    if not py.is_file():
        return [f"no {py.name} (jupytext --set-formats ipynb,py:percent {ipynb})"]
    a, b = _cells(jupytext.read(ipynb)), _cells(jupytext.read(py))
    out = [f"cell {i}: {what} differs" for i, (x, y) in enumerate(zip(a, b))
           for what, u, v in zip(("type", "source", "tags"), x, y) if u != v]
    if len(a) != len(b):
        out.append(f"{len(a)} cells in {ipynb.name}, {len(b)} in {py.name}")
    return out


def copy_links(stem: str) -> str:
    """The "**Results**" line of the executed copy of notebook ``stem``, relative to
    ``figures/<model>/notebooks/`` (anchor as ``arithlib.report.notebook_anchor``)."""
    return (f"{RESULTS_LINE}: [this run's section of the report](../REPORT.md#notebook-{stem[:2]}). This is "
            f"`notebooks/{stem}.ipynb` as run for these figures, with its outputs.")


def _relink(nb: dict, stem: str) -> None:
    """Replace the first markdown cell's "**Results**" line by :func:`copy_links`."""
    cell = next((c for c in nb.get("cells", []) if c.get("cell_type") == "markdown"), None)
    if cell is None:
        return
    lines = _source(cell).split("\n")
    lines = [copy_links(stem) if line.startswith(RESULTS_LINE) else line for line in lines]
    cell["source"] = "\n".join(lines)


def strip_for_publishing(nb: dict, stem: str | None = None) -> dict:
    """A copy of an executed notebook without widget state or views and without PDF,
    SVG or HTML outputs that repeat a PNG (see the module's docstring); with ``stem``
    (the notebook's name), its "**Results**" line relinked for ``figures/<model>/notebooks/``."""
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    if stem is not None:
        _relink(nb, stem)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data")
            if isinstance(data, dict):
                if WIDGET_VIEW in data or WIDGET_STATE in data:
                    continue  # a progress bar: nothing to see without the live kernel
                if "image/png" in data:
                    for mime in PNG_DUPLICATES:
                        data.pop(mime, None)
            kept.append(out)
        cell["outputs"] = kept
    return nb


def to_html(nb: dict) -> str:
    """The notebook rendered as one HTML page (nbconvert's lab template; images inline)."""
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nbformat.reads(json.dumps(nb), as_version=4))
    return body


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def publish(executed: str | Path, dest_dir: str | Path, html: bool = True) -> list[Path]:
    """Write the stripped copy of ``executed`` to ``dest_dir/<its name>.ipynb`` and, with
    ``html``, its rendering to ``.html``; return the paths written."""
    executed, dest_dir = Path(executed), Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    import nbformat

    nb = strip_for_publishing(_read(executed), executed.stem)
    ipynb = dest_dir / f"{executed.stem}.ipynb"
    _write_atomic(ipynb, nbformat.writes(nbformat.from_dict(nb)) + "\n")
    written = [ipynb]
    if html:
        page = dest_dir / f"{executed.stem}.html"
        _write_atomic(page, to_html(nb))
        written.append(page)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "publish":
        for p in publish(argv[1], argv[2]):
            print(p)
        return 0
    if len(argv) >= 2 and argv[0] == "check":
        bad = {p: outputs_in(p) for p in argv[1:]}
        bad = {p: f for p, f in bad.items() if f}
        for p, found in bad.items():
            print(f"{p}: {'; '.join(found)} (clear them: Edit > Clear Outputs of All Cells in "
                  f"JupyterLab, or jupyter nbconvert --clear-output --inplace {p})", file=sys.stderr)
        drift = {p: d for p in argv[1:] if (d := pair_drift(p))}
        for p, d in drift.items():
            print(f"{p}: its .py pair differs ({'; '.join(d[:3])}); run jupytext --sync {p}", file=sys.stderr)
        return 1 if bad or drift else 0
    print(__doc__.split("\n\n")[-1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
