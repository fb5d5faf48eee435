"""The notebook files run_all.sh reads and writes: a notebook's parameters (its
``parameters`` cell), the executed copy published beside the figures, and the check
that the notebooks in ``notebooks/`` carry no outputs.

Published copies (``figures/<model>/notebooks/NN_name.ipynb``, committed, and ``.html``,
not committed) are meant to be read on a code host, so :func:`strip_for_publishing` drops
what only a live kernel can show or what repeats a figure:

* widget state (``metadata.widgets``) and widget views (the notebooks' progress bars,
  whose saved text is the bar's first frame, "0/10");
* PDF, SVG and HTML copies of an output that also has a PNG.

and the first cell's "**Results**" line, which in ``notebooks/`` links the default
model's executed copy, links the report section of the copy's own run instead. Then
:func:`executed_copies.finish_copy` (its docstring states the rules) makes the copy open
with the commit it ran at, rewrites the machine's paths, drops noise warnings and replaces
each embedded PNG that is committed beside the copy by a link to that file.

Each notebook of ``notebooks/`` is authored as a percent-format script ``NN_name.py``
paired with ``NN_name.ipynb`` by jupytext (``formats: ipynb,py:percent`` in the notebook's
metadata): edit either, in JupyterLab with jupytext or in an editor, then
``jupytext --sync notebooks/NN_name.ipynb`` writes the other. :func:`pair_drift` names
the cells where the two differ.

Usage: ``notebook_files.py publish EXECUTED.ipynb DEST_DIR`` (writes both files; after the
run's tables are in ``DEST_DIR/..``, whose ``NN_name_params.json`` gives the commit) or
``notebook_files.py check notebooks/NN_*.ipynb`` (exit 1 naming notebooks with outputs, or
whose ``.py`` pair is missing or holds other cells).
"""

from __future__ import annotations

import ast
import copy
import difflib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's arithlib
from arithlib.run.atomic import write_text  # noqa: E402  (the standard library only)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from executed_copies import FIGURES_FROM_NOTEBOOKS, finish_copy  # noqa: E402

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
#: Output types dropped where the same output has a PNG.
PNG_DUPLICATES = ("application/pdf", "image/svg+xml", "text/html")
#: The first markdown cell's line that links results (arithlib.report.notebook_links).
RESULTS_LINE = "**Results**"
#: Parameters run_all.sh sets itself, and the option that sets each.
RUN_PARAMETERS = {
    "model": "--model",
    "device": "--device",
    "quick": "--quick",
    "seed": "--seed",
    "out_dir": "--figures",
    "dtype": "--dtype",
    "device_map": "--device-map",
}


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
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign) and node.value is not None
                    else []
                )
                for t in targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = ast.get_source_segment(source, node.value) or ""
            return out
    return {}


_INT = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)


def parse_value(text: str):
    """A ``-p NAME VALUE`` value for a parameter whose default is text or None: a whole
    number (``3``) or a number (``-0.1``, ``1e-3``) as such, ``true`` / ``false`` in any case
    as a boolean, ``None`` / ``none`` as None, a list, tuple or dict written as a Python
    literal (``[1, 2]``; read by ``ast.literal_eval``, never run) as such, a quoted text
    (``'a b'``, ``"-1"``) as the text inside the quotes, else the text as typed (``-p scale
    cpu`` gives "cpu")."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if t in ("None", "none"):
        return None
    if _INT.fullmatch(t):
        return int(t)
    if _NUMBER.fullmatch(t):
        return float(t)
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t[:1] in "[({":
        try:
            return ast.literal_eval(t)
        except _LITERAL_ERRORS:
            pass
    return text


def _kind(like) -> str:
    """What a value typed as ``like`` (a parameter's default, or an item of one) takes."""
    if isinstance(like, bool):
        return "true or false"
    if isinstance(like, int):
        return "a whole number"
    if isinstance(like, float):
        return "a number"
    if isinstance(like, (list, tuple)):
        return "a list"
    if isinstance(like, dict):
        return "a dict"
    return "text" if isinstance(like, str) else "any value"


def _conform(value, like, where: str = ""):
    """``value`` (a parsed literal) as the type of ``like``: the same type (an integer for a
    float, as a float; a list for a tuple, as a tuple), list items each like the default's
    items (a default of mixed items, like ["+", 4, 3], item by item). ValueError naming the
    first item that is not."""
    if like is None or isinstance(like, str) and isinstance(value, str):
        return value
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        dict: lambda v: isinstance(v, dict),
    }
    if isinstance(like, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where or 'the value'} is not a list")
        kinds = {type(x) for x in like}
        if kinds <= {int, float} and float in kinds:
            kinds = {float}
        if len(kinds) == 1 or not like:  # items of one kind: each like the first
            out = (
                [_conform(v, float(like[0]) if kinds == {float} else like[0], f"item {i}") for i, v in enumerate(value)]
                if like
                else list(value)
            )
        else:  # a record such as ["+", 4, 3]: the same length, item by item
            if len(value) != len(like):
                raise ValueError(f"{where or 'the value'} has {len(value)} items, not {len(like)}")
            out = [_conform(v, x, f"item {i}") for i, (v, x) in enumerate(zip(value, like))]
        return tuple(out) if isinstance(like, tuple) else out
    check = next((f for t, f in ok.items() if type(like) is t), None)
    if check is None:
        return value
    if not check(value):
        raise ValueError(f"{where or 'the value'} is {value!r}, not {_kind(like)}")
    return float(value) if isinstance(like, float) else value


def typed_value(name: str, text: str, default: str):
    """``-p name text`` typed as the notebook's default ``default`` (its source) is: a
    boolean default takes only true or false (any case), an integer one a whole number,
    a float one any number (as a float), a list or tuple (dict) one a Python literal of
    that kind whose items are each of the type of the default's items (read with
    ``ast.literal_eval``, never run); a text or None default takes :func:`parse_value`'s
    reading, a text default that reads as a number (``"-1"``) the text as typed. ValueError
    with a one-line message otherwise."""
    try:
        like = ast.literal_eval(default)
    except _LITERAL_ERRORS:
        return parse_value(text)
    t = text.strip()
    if isinstance(like, str) and not isinstance(parse_value(like), str):
        return text  # a text default that reads as a number ("-1"): text, as typed
    if like is None or isinstance(like, str):
        return parse_value(text)
    if isinstance(like, bool):
        if t.lower() not in ("true", "false"):
            raise ValueError(f"-p {name} takes true or false (default {default}), not {text!r}")
        return t.lower() == "true"
    if isinstance(like, int):
        if not _INT.fullmatch(t):
            raise ValueError(f"-p {name} takes a whole number (default {default}), not {text!r}")
        return int(t)
    if isinstance(like, float):
        if not _NUMBER.fullmatch(t):
            raise ValueError(f"-p {name} takes a number (default {default}), not {text!r}")
        return float(t)
    try:
        value = ast.literal_eval(t)
    except _LITERAL_ERRORS:
        value = text
    try:
        return _conform(value, like)
    except ValueError as err:
        raise ValueError(
            f"-p {name} takes {_kind(like)} like its default {default}, written as a Python "
            f"literal ({err}), not {text!r}"
        ) from None


def _quick_blocks(source: str) -> list[tuple[int, int, dict[str, str]]]:
    """``(last line, indent, {name: value source})`` of each ``if quick:`` statement in a
    cell's ``source``: the variables quick mode sets there (plain and tuple assignments
    in its body). A cell Python cannot parse (an IPython magic) has none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    blocks = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "quick"):
            continue
        sets: dict[str, str] = {}
        for stmt in node.body:
            if not isinstance(stmt, ast.Assign):
                continue
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    sets[target.id] = ast.get_source_segment(source, stmt.value) or ""
                elif (
                    isinstance(target, ast.Tuple)
                    and isinstance(stmt.value, ast.Tuple)
                    and len(target.elts) == len(stmt.value.elts)
                ):
                    for t, v in zip(target.elts, stmt.value.elts):
                        if isinstance(t, ast.Name):
                            sets[t.id] = ast.get_source_segment(source, v) or ""
        blocks.append((node.end_lineno or node.lineno, node.col_offset, sets))
    return blocks


def quick_settings(path: str | Path) -> dict[str, str]:
    """Name -> value (source) of every variable the notebook's ``if quick:`` blocks set."""
    out: dict[str, str] = {}
    for cell in _read(Path(path))["cells"]:
        if cell.get("cell_type") == "code":
            for _, _, sets in _quick_blocks(_source(cell)):
                out.update(sets)
    return out


def keep_over_quick(nb: dict, params: dict[str, object]) -> dict:
    """A copy of notebook ``nb`` in which each ``if quick:`` block that sets one of
    ``params`` (the run's ``-p`` values) is followed by that value again, so quick mode
    never replaces a value the user gave."""
    nb = copy.deepcopy(nb)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        lines = _source(cell).split("\n")
        for end, indent, sets in sorted(_quick_blocks(_source(cell)), reverse=True):
            kept = [
                f"{' ' * indent}{n} = {params[n]!r}  # -p {n}: kept over quick mode's {v}"
                for n, v in sets.items()
                if n in params
            ]
            lines[end:end] = kept
        cell["source"] = "\n".join(lines)
    return nb


def params_by_notebook(params: dict[str, str], paths: list[Path]) -> dict[str, dict[str, object]]:
    """Notebook name -> the ``params`` (name -> the text given with ``-p``) its
    ``parameters`` cell declares, each typed as the notebook's default
    (:func:`notebook_files.typed_value`: a boolean takes only true or false). A name
    run_all.sh sets itself, one that none of ``paths`` declares, or a value of the wrong
    type is an error, in one line (an unknown name: the closest valid one, and the valid
    names of a single notebook; papermill would only warn and inject it anyway)."""
    for name in params:
        if name in RUN_PARAMETERS:
            raise SystemExit(f"run_all.sh: -p {name}: set it with {RUN_PARAMETERS[name]}, not -p")
    declared = {p.stem: notebook_parameters(p) for p in paths}
    unknown = [n for n in params if not any(n in d for d in declared.values())]
    if unknown:  # one line: the names of one notebook, else where to find them
        valid = sorted({n for d in declared.values() for n in d if n not in RUN_PARAMETERS})
        near = difflib.get_close_matches(unknown[0], valid, n=1)
        if len(declared) == 1:
            ((nb, d),) = declared.items()
            names = f"valid names for {nb}: {', '.join(n for n in d if n not in RUN_PARAMETERS) or '(none)'}"
        else:
            names = "--list-params lists each notebook's parameters and defaults"
        raise SystemExit(
            f"run_all.sh: unknown parameter{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)} for notebook{'s' if len(paths) > 1 else ''} "
            f"{', '.join(declared)}{f' (did you mean {near[0]}?)' if near else ''}; {names}"
        )
    try:
        return {nb: {n: typed_value(n, v, d[n]) for n, v in params.items() if n in d} for nb, d in declared.items()}
    except ValueError as err:
        raise SystemExit(f"run_all.sh: {err}") from None


def quick_report(paths: list[Path], params: dict[str, dict[str, object]]) -> list[str]:
    """One line per notebook saying which values ``--quick`` sets in it, and which of
    them the run's ``-p`` values keep instead."""
    lines = []
    for p in paths:
        sets = quick_settings(p)
        if not sets:
            continue
        given = params.get(p.stem, {})
        kept = [n for n in sets if n in given]
        line = f"--quick sets in {p.stem}: " + ", ".join(f"{n}={v}" for n, v in sets.items() if n not in given)
        if kept:
            line += "; kept from -p: " + ", ".join(f"{n}={given[n]!r}" for n in kept)
        lines.append(line)
    return lines


def _plain(value):
    """``value`` with tuples as lists (YAML's safe dumper takes no tuple)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def yaml_parameters(params: dict[str, object]) -> str:
    """``params`` as the YAML papermill's ``-y`` reads (floats such as 1e-05 stay floats)."""
    import yaml

    return yaml.safe_dump(_plain(params), default_flow_style=True).strip()


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
    out = [
        f"cell {i}: {what} differs"
        for i, (x, y) in enumerate(zip(a, b))
        for what, u, v in zip(("type", "source", "tags"), x, y)
        if u != v
    ]
    if len(a) != len(b):
        out.append(f"{len(a)} cells in {ipynb.name}, {len(b)} in {py.name}")
    return out


def copy_links(stem: str) -> str:
    """The "**Results**" line of the executed copy of notebook ``stem``, relative to
    ``figures/<model>/notebooks/`` (anchor as ``arithlib.report.notebook_anchor``)."""
    return (
        f"{RESULTS_LINE}: [this run's section of the report](../REPORT.md#notebook-{stem[:2]}). This is "
        f"`notebooks/{stem}.ipynb` as run for these figures, with its outputs."
    )


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


def publish(
    executed: str | Path,
    dest_dir: str | Path,
    html: bool = True,
    figures: str = FIGURES_FROM_NOTEBOOKS,
    commit: str | None = None,
) -> list[Path]:
    """Write the stripped copy of ``executed`` to ``dest_dir/<its name>.ipynb`` and, with
    ``html``, its rendering to ``.html``; return the paths written. ``figures``: the
    figures root as seen from ``notebooks/`` (what the run's staging ``out_dir`` is
    recorded as); ``commit``: the commit it ran at (default: its run's params JSON in
    ``dest_dir/..``). See :func:`executed_copies.finish_copy`."""
    executed, dest_dir = Path(executed), Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    import nbformat

    ipynb = dest_dir / f"{executed.stem}.ipynb"
    nb = finish_copy(strip_for_publishing(_read(executed), executed.stem), ipynb, commit=commit, figures=figures)
    write_text(ipynb, nbformat.writes(nbformat.from_dict(nb)) + "\n")
    written = [ipynb]
    if html:
        page = dest_dir / f"{executed.stem}.html"
        write_text(page, to_html(nb))
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
            print(
                f"{p}: {'; '.join(found)} (clear them: Edit > Clear Outputs of All Cells in "
                f"JupyterLab, or jupyter nbconvert --clear-output --inplace {p})",
                file=sys.stderr,
            )
        drift = {p: d for p in argv[1:] if (d := pair_drift(p))}
        for p, d in drift.items():
            print(f"{p}: its .py pair differs ({'; '.join(d[:3])}); run jupytext --sync {p}", file=sys.stderr)
        return 1 if bad or drift else 0
    print(__doc__.split("\n\n")[-1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
