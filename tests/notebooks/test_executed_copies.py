"""The committed executed notebooks (``figures/<model>/notebooks/``) say which code they ran
and ran it, carry no path of the machine that ran them, stay within their size budget;
the notebooks of ``notebooks/``, run as they are, write to a scratch folder. The rules
are :mod:`executed_copies`' (``scripts/executed_copies.py``)."""

from __future__ import annotations

import ast
import copy
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import executed_copies as ec  # noqa: E402
from notebook_files import notebook_parameters, publish  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
#: The most the executed copies of all models may take together (bytes, as committed).
COPIES_BUDGET = 5 * 2**20
#: Files under figures/ whose text is read for machine paths.
TEXT_SUFFIXES = (".json", ".ipynb", ".md", ".html", ".csv", ".txt", ".csv.gz")


def _tracked(*patterns: str) -> list[Path]:
    """Tracked files matching ``patterns`` (git pathspecs); fails outside a git checkout."""
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *patterns], capture_output=True, text=True)
    assert done.returncode == 0, f"git ls-files failed (the tests need the git checkout): {done.stderr.strip()}"
    return [ROOT / p for p in done.stdout.split("\0") if p]


COPIES = _tracked("figures/*/notebooks/*.ipynb")


# --------------------------------------------------------------------------- the committed copies


def test_there_are_committed_copies():
    assert len(COPIES) >= 9, COPIES


@pytest.mark.parametrize("copy_path", COPIES, ids=[f"{p.parent.parent.name}/{p.stem}" for p in COPIES])
def test_committed_copy_states_its_commit_and_ran_that_commits_source(copy_path: Path):
    """Its first cell names the commit it ran at, and its code cells (papermill's injected
    parameters aside) are ``notebooks/NN_name.py`` at that commit. A clone without that
    commit (a shallow one) fails here, naming it: an unverifiable copy does not pass."""
    problems = ec.check([copy_path])
    assert not problems, (
        f"{copy_path.relative_to(ROOT)}: {problems}; an old run's copy: "
        f"python scripts/executed_copies.py refresh {copy_path.relative_to(ROOT)}"
    )


def _text(path: Path) -> str:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def test_no_machine_paths_in_committed_figures():
    """No tracked text file under figures/ names a folder of the machine that made it
    (a checkout under /work, a home folder, a virtual environment's site-packages)."""
    found = {}
    for path in _tracked("figures"):
        if path.name.endswith(TEXT_SUFFIXES) and path.is_file():
            hits = sorted({m.group(0) for m in ec.MACHINE_PATH.finditer(_text(path))})
            if hits:
                found[str(path.relative_to(ROOT))] = hits
    assert not found, f"machine paths in committed figures: {found}; scripts/executed_copies.py refresh rewrites them"


def test_committed_copies_fit_their_size_budget():
    """The executed copies link the PNGs committed beside them instead of embedding them."""
    files = _tracked("figures/*/notebooks/*")
    total = sum(p.stat().st_size for p in files if p.is_file())
    biggest = sorted(((p.stat().st_size, str(p.relative_to(ROOT))) for p in files if p.is_file()), reverse=True)[:3]
    assert total <= COPIES_BUDGET, f"{total / 2**20:.1f} MiB of executed copies (budget 5 MiB); largest: {biggest}"


def test_figures_linked_from_committed_copies_are_committed():
    """Each figure a copy shows by reference (``../NN_name.png``) is a tracked file."""
    import re

    tracked = {p.resolve() for p in _tracked("figures")}
    missing = []
    for path in COPIES:
        for cell in json.loads(path.read_text())["cells"]:
            for out in cell.get("outputs", []):
                md = "".join((out.get("data") or {}).get("text/markdown", ""))
                for target in re.findall(r"\]\((\.\./[^)]+\.png)\)", md):
                    if (path.parent / target).resolve() not in tracked:
                        missing.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not missing, missing


# --------------------------------------------------------------------------- notebooks run as they are


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_run_as_it_is_writes_to_the_scratch_folder(notebook: Path):
    """A notebook opened in JupyterLab and run as it is never writes the committed
    figures: its default out_dir is under outputs/scratch (run_all.sh passes its own)."""
    out_dir = ast.literal_eval(notebook_parameters(notebook)["out_dir"])
    target = (notebook.parent / out_dir).resolve()
    assert target.is_relative_to((ROOT / "outputs" / "scratch").resolve()), f"{notebook.name}: out_dir = {out_dir!r}"
    assert not target.is_relative_to((ROOT / "figures").resolve())


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_opens_with_its_run_time_and_the_toy_model(notebook: Path):
    """The first cell says, near the top, how long a run as it is takes on the default
    model and how to make it a short one on the toy model."""
    from arithlib.core.models import DEFAULT_MODEL, TOY_MODEL

    first = "".join(json.loads(notebook.read_text())["cells"][0]["source"])
    paragraphs = first.split("\n\n")
    at = next((i for i, p in enumerate(paragraphs) if p.startswith("**Running it.**")), None)
    assert at is not None and at <= 2, f"{notebook.name}: no **Running it.** paragraph after its title and links"
    running = paragraphs[at]
    assert "takes about" in running and DEFAULT_MODEL in running, running
    assert f'model = "{TOY_MODEL}"' in running and "quick = True" in running, running
    assert "outputs/scratch/figures" in running, running


def test_start_run_defaults_to_the_scratch_folder():
    import inspect

    from arithlib.run.runs import SCRATCH_FIGURES, start_run

    default = inspect.signature(start_run).parameters["out_dir"].default
    assert (ROOT / "notebooks" / default).resolve() == SCRATCH_FIGURES.resolve()


def test_scratch_folder_starts_as_a_copy_of_the_committed_run(tmp_path, monkeypatch):
    import arithlib.run.runs as runs

    committed = tmp_path / "figures" / "m"
    (committed / "notebooks").mkdir(parents=True)
    (committed / "01_a.csv").write_text("x\n")
    (committed / "notebooks" / "01_a.ipynb").write_text("{}")
    scratch = tmp_path / "outputs" / "scratch" / "figures"
    monkeypatch.setattr(runs, "SCRATCH_FIGURES", scratch)
    assert not runs.seed_scratch(tmp_path / "elsewhere", "m", tmp_path / "figures")  # not the scratch folder
    assert runs.seed_scratch(scratch, "m", tmp_path / "figures")
    assert (scratch / "m" / "01_a.csv").read_text() == "x\n" and not (scratch / "m" / "notebooks").exists()
    (scratch / "m" / "01_a.csv").write_text("mine\n")
    assert not runs.seed_scratch(scratch, "m", tmp_path / "figures")  # an existing scratch run is kept
    assert (scratch / "m" / "01_a.csv").read_text() == "mine\n"


# --------------------------------------------------------------------------- the rules


def test_scrub_text_rewrites_every_kind_of_machine_path():
    roots = ["/work/rerun"]
    out = "/work/rerun/outputs/qwen/staging/07_gender_bias_editing"
    cases = {
        f"outputs in {out}/qwen": "outputs in ../figures/qwen",
        "/work/rerun/.venv/lib/python3.11/site-packages/transformers/modeling_utils.py:12: FutureWarning: x": "transformers/modeling_utils.py:12: FutureWarning: x",
        "/work/rerun/arithlib/run/outputs.py:3: UserWarning": "arithlib/run/outputs.py:3: UserWarning",
        "/tmp/ipykernel_15607/3053041968.py:5: UserWarning: dropped": "<cell>:5: UserWarning: dropped",
        "/work/wt15/outputs/m/staging/run-20261127-1-2/05_lora_mechanism/m": "../figures/m",
        "/work/other/arithlib/yu/bias.py:1": "arithlib/yu/bias.py:1",
        "/root/.cache/arithlib/core/models/x": "~/.cache/arithlib/core/models/x",
        "/usr/lib/python3.11/warnings.py:1": "warnings.py:1",
        "no path here: 3/4 = 0.75": "no path here: 3/4 = 0.75",
    }
    for text, want in cases.items():
        got = ec.scrub_text(text, roots)
        assert got == want, (text, got)
        assert not ec.MACHINE_PATH.search(got)
    assert (
        ec.scrub_text(
            "out_dir = '../outputs/m/staging/run-1/01_a'",
            [],
            "../outputs/scratch/figures",
            "../outputs/m/staging/run-1/01_a",
        )
        == "out_dir = '../outputs/scratch/figures'"
    )


def test_noise_warnings_are_dropped_and_others_kept():
    text = (
        "/x/arithlib/run/outputs.py:42: UserWarning: Glyph 20013 (\\N{CJK UNIFIED IDEOGRAPH-4E2D}) missing from "
        "font(s) DejaVu Sans.\n  png = _atomic_write(...)\n"
        "<cell>:5: UserWarning: PromptSet.build dropped 2 of 10 prompts\n  return build()\n"
        "transformers/modeling_utils.py:1: FutureWarning: `is_gradient_checkpointing` is deprecated\n"
        "  warnings.warn(\n"
    )
    assert ec.drop_noise(text) == "<cell>:5: UserWarning: PromptSet.build dropped 2 of 10 prompts\n  return build()\n"


def _cell(source: str, outputs: list | None = None, tags: list | None = None) -> dict:
    return {
        "cell_type": "code",
        "metadata": {"tags": tags or []},
        "source": source,
        "execution_count": 1,
        "outputs": outputs or [],
    }


def _png(n: int) -> dict:
    return {"output_type": "display_data", "metadata": {}, "data": {"image/png": f"iVBOR{n}", "text/plain": "<Figure>"}}


def test_figures_committed_beside_the_copy_are_linked_not_embedded(tmp_path):
    (tmp_path / "notebooks").mkdir()
    for name in ("01_a", "01_case1", "01_case2"):
        (tmp_path / f"{name}.png").write_bytes(b"png")
    nb = {
        "cells": [
            _cell('save_figure(plot(t), run.out, "01_a")', [_png(1)]),
            _cell('for i in (1, 2):\n    save_figure(f(i),\n                out, f"01_case{i}")', [_png(2), _png(3)]),
            _cell("plot(t)  # shown, not saved", [_png(4)]),
            _cell('save_figure(a, out, "01_missing")', [_png(5)]),
        ]
    }
    assert ec.link_figures(nb, tmp_path) == 3
    outs = [c["outputs"] for c in nb["cells"]]
    assert outs[0][0]["data"]["text/markdown"] == "[![01_a.png](../01_a.png)](../01_a.png)"
    assert "../01_case1.png" in outs[1][0]["data"]["text/markdown"] and len(outs[1]) == 1
    assert "image/png" in outs[2][0]["data"] and "image/png" in outs[3][0]["data"]  # kept: no committed file


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def _as_executed(stem: str, commit: str) -> dict:
    """The notebook ``stem`` at ``commit`` as papermill would write it (injected cell added)."""
    cells = ec.source_at(stem, commit)
    assert cells is not None
    nb_cells = []
    for c in cells:
        nb_cells.append({**c, "outputs": [], "execution_count": 1} if c["cell_type"] == "code" else c)
        if "parameters" in c["metadata"].get("tags", []):
            nb_cells.append(
                _cell('# Parameters\nout_dir = "/work/x/outputs/m/staging/01_a"\n', tags=["injected-parameters"])
            )
    return {
        "cells": nb_cells,
        "metadata": {
            "papermill": {
                "input_path": f"/work/x/notebooks/{stem}.ipynb",
                "parameters": {"out_dir": "/work/x/outputs/m/staging/01_a"},
            }
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def test_check_accepts_the_source_at_the_commit_and_catches_a_change(tmp_path):
    head = _git("rev-parse", "HEAD")
    stem = NOTEBOOKS[0].stem
    model_dir = tmp_path / "m"
    (model_dir / "notebooks").mkdir(parents=True)
    (model_dir / f"{stem}_params.json").write_text(json.dumps({"environment": {"git_commit": head}}))
    nb = _as_executed(stem, head)
    path = model_dir / "notebooks" / f"{stem}.ipynb"
    path.write_text(json.dumps(nb))
    assert "does not state the commit" in ec.check([path])[str(path)][0]  # no first cell yet
    ec.finish_copy(nb, path)
    first = nb["cells"][0]
    assert ec.PROVENANCE_TAG in first["metadata"]["tags"] and head[:12] in first["source"]
    assert nb["metadata"]["arithlib"]["git_commit"] == head
    assert "/work/" not in json.dumps(nb)
    path.write_text(json.dumps(nb))
    assert ec.check([path]) == {}
    changed = copy.deepcopy(nb)
    code = next(c for c in changed["cells"] if c["cell_type"] == "code" and not c["metadata"].get("tags"))
    code["source"] += "\nprint('not in the source')"
    path.write_text(json.dumps(changed))
    assert "differs" in ec.check([path])[str(path)][0]
    (model_dir / f"{stem}_params.json").write_text(json.dumps({"environment": {"git_commit": "0" * 40}}))
    missing = copy.deepcopy(nb)
    missing["metadata"].pop("arithlib")
    missing["cells"][0]["source"] = "0" * 12
    path.write_text(json.dumps(missing))
    assert "not in this clone's history" in ec.check([path])[str(path)][0]


def test_provenance_names_what_changed_since_the_commit():
    then = [
        {"cell_type": "markdown", "source": "# 01 · T", "metadata": {}},
        {"cell_type": "code", "source": "a = 1", "metadata": {}},
        {"cell_type": "markdown", "source": "## 2 · Knockout", "metadata": {}},
        {"cell_type": "code", "source": "b = 2", "metadata": {}},
    ]
    now = copy.deepcopy(then)
    now[3]["source"] = "b = 3"
    text = ec.provenance_text("01_a", "m", "abc123", then, now)
    assert "run at commit `abc123`" in text and "1 code cell differ" in text and "2 · Knockout" in text
    assert "changed" not in ec.provenance_text("01_a", "m", "abc123", then, then)
    assert "--model m --only 01" in text


def test_publish_writes_a_copy_with_provenance_and_no_machine_path(tmp_path):
    head = _git("rev-parse", "HEAD")
    stem = NOTEBOOKS[0].stem
    src = tmp_path / "raw" / f"{stem}.ipynb"
    src.parent.mkdir()
    src.write_text(json.dumps(_as_executed(stem, head)))
    fig = tmp_path / "fig" / "m"
    fig.mkdir(parents=True)
    (fig / f"{stem}_params.json").write_text(json.dumps({"environment": {"git_commit": head}}))
    ipynb = publish(src, fig / "notebooks", html=False)[0]
    nb = json.loads(ipynb.read_text())
    assert nb["cells"][0]["metadata"]["tags"] == [ec.PROVENANCE_TAG] and head[:12] in "".join(nb["cells"][0]["source"])
    assert nb["metadata"]["papermill"]["parameters"]["out_dir"] == "../figures"
    assert not ec.MACHINE_PATH.search(ipynb.read_text())
    assert ec.check([ipynb]) == {}


def test_token_labels_outside_the_font_are_escaped_not_drawn_as_boxes():
    """Notebook 07's edit-set figure (and 04's neuron figures) label neurons with tokens of
    any script: those the font lacks are written as \\uXXXX, with no "Glyph missing" warning."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from arithlib.plots import bias, cna, font_safe

    assert font_safe("she, она, 她的\n") == "she, она, \\u5979\\u7684\\n"
    table = pd.DataFrame(
        {
            "name": ["22_2592", "20_848"],
            "mean_change": [0.02, 0.01],
            "top_tokens": ["herself, 她, 她的, she", "computer, 计算机, software"],
        }
    )
    frame = pd.DataFrame(
        {
            "name": ["20_2448"],
            "top_tokens": ["three, 三个方面, drei"],
            "imp_a": [3.0],
            "imp_b": [0.5],
            "coef_a": [1.0],
            "coef_b": [2.0],
        }
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"Glyph .* missing from font")
        for fig in (bias.edit_set(table, "t"), cna.case_neurons(frame, "t")):
            fig.canvas.draw()
            labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels() + ax.get_xticklabels()]
            assert any("\\u" in s for s in labels), labels
            plt.close(fig)
