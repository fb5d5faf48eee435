#!/usr/bin/env python
"""Write a notebook from a percent-format Python script (the authoring format of
this repo's notebooks; the .ipynb is what is committed and run).

Cells start with ``# %%`` (code) or ``# %% [markdown]`` (markdown: each line's
leading ``# `` is stripped). ``# %% tags=["parameters"]`` marks papermill's
parameters cell.

    python scripts/py_to_notebook.py source.py notebooks/NN_name.ipynb
"""

from __future__ import annotations

import json
import re
import sys

import nbformat


def convert(source: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    blocks = re.split(r"^# %%", source, flags=re.M)
    for block in blocks[1:]:
        header, _, body = block.partition("\n")
        body = body.strip("\n")
        if "[markdown]" in header:
            text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
            nb.cells.append(nbformat.v4.new_markdown_cell(text))
        else:
            cell = nbformat.v4.new_code_cell(body)
            m = re.search(r"tags=(\[.*\])", header)
            if m:
                cell.metadata["tags"] = json.loads(m.group(1))
            nb.cells.append(cell)
    return nb


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    with open(src, encoding="utf-8") as f:
        nb = convert(f.read())
    nbformat.write(nb, dst)
    print(f"wrote {dst} ({len(nb.cells)} cells)")
