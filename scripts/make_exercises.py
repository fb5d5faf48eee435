#!/usr/bin/env python
"""Write the exercise and solution notebooks of ``notebooks/exercises/`` from one source each.

A source ``notebooks/exercises/NN_name.py`` is a percent-format script (jupytext's
``py:percent``, the format of the notebooks' own ``.py`` sources). From it come

* ``NN_name_solution.ipynb``: the source with the markers below removed;
* ``NN_name_exercise.ipynb``: every block between ``# BEGIN SOLUTION`` and
  ``# END SOLUTION`` replaced by ``raise NotImplementedError(...)`` at the marker's
  indentation; the block's ``# HINT:`` lines become a markdown cell before the code, one
  collapsed ``<details>`` per hint, which a student opens when stuck.

Each exercise (a code cell with a solution block) follows a markdown cell with its ``##``
heading and a line ``**Objective** ... · **Difficulty** ●●○○○ · **Importance** ●●●○○ ·
**Time** N min`` (:data:`META`); both notebooks open with the table of them
(:func:`exercise_table`), and a source without them is an error.

A cell whose header carries ``tags=["solution"]`` (or ``["exercise"]``) appears only in
that version (e.g. the answer to a question). Both notebooks start with a note naming
the source, so they are never edited by hand; ``tests/notebooks/test_exercises.py`` fails when
they differ from what this script writes.

    python scripts/make_exercises.py           # write every exercise and solution notebook
    python scripts/make_exercises.py --check   # exit 1 (naming them) if any is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = ROOT / "notebooks" / "exercises"
VARIANTS = ("exercise", "solution")
BEGIN, END, HINT = "# BEGIN SOLUTION", "# END SOLUTION", "# HINT:"
_CELL = re.compile(r"^# %%", flags=re.M)
_DEF = re.compile(r"^\s*def (\w+)\(")
#: An exercise's learning objective, difficulty and importance (of 5) and time budget.
META = re.compile(
    r"\*\*Objective\*\*\s*(?P<objective>.+?)\s*·\s*\*\*Difficulty\*\*\s*(?P<difficulty>[●○]{5})\s*·\s*"
    r"\*\*Importance\*\*\s*(?P<importance>[●○]{5})\s*·\s*\*\*Time\*\*\s*(?P<minutes>\d+)\s*min",
    flags=re.S,
)


def sources(folder: Path = EXERCISES) -> list[Path]:
    """The exercise sources: ``NN_*.py`` in ``folder``."""
    return sorted(folder.glob("[0-9][0-9]_*.py"))


def _cells(text: str) -> list[tuple[str, str]]:
    """(header, body) of each ``# %%`` cell; the header is the rest of the marker line."""
    parts = _CELL.split(text)
    if parts[0].strip():
        raise ValueError("an exercise source must start with a '# %%' cell marker")
    return [tuple(p.partition("\n")[::2]) for p in parts[1:]]  # type: ignore[misc]


def _tags(header: str) -> list[str]:
    m = re.search(r"tags=(\[.*?\])", header)
    return json.loads(m.group(1)) if m else []


def strip_solutions(body: str, where: str = "") -> str:
    """``body`` with each solution block replaced by a NotImplementedError (its hints go to
    :func:`hints`)."""
    out: list[str] = []
    inside, function, indent = False, None, ""
    for n, line in enumerate(body.splitlines(), 1):
        stripped = line.strip()
        if not inside:
            m = _DEF.match(line)
            if m:
                function = m.group(1)
            if stripped == BEGIN:
                inside, indent = True, line[: len(line) - len(line.lstrip())]
            elif stripped == END:
                raise ValueError(f"{where}: line {n}: {END} without {BEGIN}")
            else:
                out.append(line)
            continue
        if stripped == BEGIN:
            raise ValueError(f"{where}: line {n}: nested {BEGIN}")
        if stripped == END:
            what = f"the body of {function}()" if function else "this part"
            out.append(f'{indent}raise NotImplementedError("exercise: write {what}")')
            inside = False
    if inside:
        raise ValueError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out) + ("\n" if body.endswith("\n") else "")


def hints(body: str) -> list[str]:
    """The ``# HINT:`` lines of a cell's solution blocks, in order."""
    out, inside = [], False
    for line in body.splitlines():
        stripped = line.strip()
        if stripped in (BEGIN, END):
            inside = stripped == BEGIN
        elif inside and stripped.startswith(HINT):
            out.append(stripped[len(HINT) :].strip())
    return out


def hint_cell(found: list[str]) -> str:
    """A percent-format markdown cell with one collapsed ``<details>`` per hint."""
    lines = []
    for i, h in enumerate(found, 1):
        lines += [f"<details><summary>Hint {i}</summary>", "", h, "", "</details>", ""]
    return "# %% [markdown]\n" + "\n".join(f"# {line}".rstrip() for line in lines[:-1]) + "\n\n"


def _markdown_text(body: str) -> str:
    """A percent-format markdown cell's text, without the comment marks."""
    return "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())


def exercise_table(text: str, where: str = "") -> list[dict]:
    """Per exercise of a source: its heading, function, objective, difficulty, importance
    and minutes (:data:`META`); a ValueError names an exercise without them."""
    rows, last_md = [], None
    for header, body in _cells(text):
        if "[markdown]" in header:
            last_md = _markdown_text(body)
            continue
        if BEGIN not in body:
            continue
        function = next((m.group(1) for m in map(_DEF.match, body.splitlines()) if m), None)
        heading = re.search(r"^##\s+(.+)$", last_md or "", re.M)
        meta = META.search(last_md or "")
        if not heading or not meta:
            raise ValueError(
                f"{where}: the exercise {function or '(no function)'} needs a markdown cell before it with a '## ' heading "
                "and '**Objective** ... · **Difficulty** ●●○○○ · **Importance** ●●●○○ · **Time** N min'"
            )
        rows.append({"title": heading.group(1).strip(), "function": function, **meta.groupdict()})
        rows[-1]["objective"] = " ".join(rows[-1]["objective"].split())
        rows[-1]["minutes"] = int(rows[-1]["minutes"])
        last_md = None
    return rows


def _contents(rows: list[dict]) -> str:
    """The markdown table of a notebook's exercises (objective, difficulty, time)."""
    lines = [
        f"**The exercises** ({sum(r['minutes'] for r in rows)} minutes in all; difficulty and importance of 5):",
        "",
        "| exercise | learning objective | difficulty | importance | time |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['title']} | {r['objective']} | {r['difficulty']} | {r['importance']} | {r['minutes']} min |"
        for r in rows
    ]
    return "\n".join(lines)


def keep_solutions(body: str) -> str:
    """``body`` without the markers and the hint lines of its solution blocks."""
    out, inside = [], False
    for line in body.splitlines():
        stripped = line.strip()
        if stripped in (BEGIN, END):
            inside = stripped == BEGIN
        elif not (inside and stripped.startswith(HINT)):
            out.append(line)
    return "\n".join(out) + ("\n" if body.endswith("\n") else "")


def render(text: str, variant: str, where: str = "") -> str:
    """The percent-format text of one variant of an exercise source."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    other = VARIANTS[1 - VARIANTS.index(variant)]
    pieces = []
    for header, body in _cells(text):
        if other in _tags(header):
            continue
        if variant == "exercise":
            found = hints(body)
            if found:
                pieces.append(hint_cell(found))
            body = strip_solutions(body, where)
        else:
            body = keep_solutions(body)
        pieces.append(f"# %%{header}\n{body}")
    return "".join(pieces)


def _banner(source: Path, variant: str) -> str:
    rel = source.relative_to(ROOT).as_posix() if source.is_relative_to(ROOT) else source.name
    if variant == "exercise":
        what = (
            "**Exercise version.** Fill in each function that raises `NotImplementedError`, then run the "
            "cell after it: the check compares your function with arithlib's own implementation on the toy "
            f"model. The answers are in `{source.stem}_solution.ipynb`."
        )
    else:
        what = f"**Solution version** of `{source.stem}_exercise.ipynb`."
    return (
        f"{what}\n\n*Generated from `{rel}` by `scripts/make_exercises.py`; edit the source and rerun the "
        "script, not this notebook.*"
    )


def build(source: Path, variant: str) -> nbformat.NotebookNode:
    """The notebook of one variant, with fixed cell ids (so the output is reproducible)."""
    text = source.read_text(encoding="utf-8")
    table = exercise_table(text, str(source))
    nb = jupytext.reads(render(text, variant, str(source)), fmt="py:percent")
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(_banner(source, variant)))
    nb.cells.insert(2, nbformat.v4.new_markdown_cell(_contents(table)))  # after the title cell
    for i, cell in enumerate(nb.cells):
        cell.id = f"{variant}-{i:02d}"
        cell.metadata.pop("lines_to_next_cell", None)  # jupytext's spacing, for a round trip to .py
    nb.metadata["arithlib_exercise"] = {"source": source.name, "variant": variant}
    return nb


def outputs(source: Path) -> dict[Path, str]:
    """Each generated notebook's path and its exact text."""
    return {source.with_name(f"{source.stem}_{v}.ipynb"): nbformat.writes(build(source, v)) + "\n" for v in VARIANTS}


def stale(folder: Path = EXERCISES) -> list[Path]:
    """Generated notebooks that are missing or differ from what their source gives."""
    return [
        path
        for src in sources(folder)
        for path, text in outputs(src).items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report notebooks that are out of date")
    ap.add_argument("--folder", type=Path, default=EXERCISES, help="folder of the NN_*.py sources")
    args = ap.parse_args(argv)
    if not sources(args.folder):
        ap.error(f"no NN_*.py exercise sources in {args.folder}")
    if args.check:
        bad = stale(args.folder)
        for path in bad:
            print(f"out of date: {path} (run python scripts/make_exercises.py)")
        return 1 if bad else 0
    for src in sources(args.folder):
        for path, text in outputs(src).items():
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
