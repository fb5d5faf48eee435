"""run_all.sh's scheduler: order by dependencies and remaining chain, memory limit, keys,
threads, and a failing notebook stopping the run; its parameters (-p), the scratch folder
of runs with changed settings, progress lines, and the executed copies it publishes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fake_runs import ROOT, nf, rn, run_args, write_notebook


def _nbs(**spec) -> dict:
    return {name: rn.Notebook(Path(f"{name}.ipynb"), deps, s, mib) for name, (deps, s, mib) in spec.items()}


def test_remaining_chain_and_pick_follow_the_longest_chain():
    nbs = _nbs(
        **{
            "00_a": ([], 300, 3000),
            "01_b": ([], 500, 5000),
            "02_c": (["01_b"], 100, 3000),
            "05_e": (["01_b"], 400, 15000),
            "06_f": (["05_e"], 350, 4000),
        }
    )
    chain = rn.remaining_chain(nbs)
    assert chain["01_b"] == 500 + 400 + 350 and chain["05_e"] == 750 and chain["00_a"] == 300
    assert rn.pick(["00_a", "01_b"], [], nbs, 2, None) == "01_b"  # heads the longest chain
    assert rn.pick(["00_a"], ["01_b"], nbs, 2, None) == "00_a"
    assert rn.pick(["00_a"], ["01_b", "02_c"], nbs, 2, None) is None  # both lanes busy
    # memory: 05 (15 GB) fits beside 00 (3 GB) in 20 GB, not beside 01 (5 GB) in 19 GB
    assert rn.pick(["05_e"], ["00_a"], nbs, 2, 20000) == "05_e"
    assert rn.pick(["05_e"], ["01_b"], nbs, 2, 19000) is None
    assert rn.pick(["05_e", "02_c"], ["01_b"], nbs, 2, 19000) == "02_c"  # the next one that fits
    assert rn.pick(["05_e"], [], nbs, 2, 1000) == "05_e"  # alone it always starts


def test_last_costs_reads_timings(tmp_path):
    (tmp_path / "timings.csv").write_text(
        "notebook,seconds,this_run,peak_rss_mib\n00_a,280,ran,3604\n01_b,535,cached,NA\n"
    )
    rows = rn.read_timings(tmp_path / "timings.csv")
    assert rn.last_costs(rows) == {"00_a": (280.0, 3604.0), "01_b": (535.0, None)}
    assert rn.read_timings(tmp_path / "missing.csv") == {}


def test_only_that_matches_nothing_is_an_error(tmp_path):
    args = [
        "--out",
        str(tmp_path / "o"),
        "--figures",
        str(tmp_path / "f"),
        "--model",
        "m",
        "--device",
        "cpu",
        "--only",
        "99",
    ]
    try:
        rn.main(args)
    except SystemExit as err:
        assert "--only 99 matches no notebook" in str(err)
    else:
        raise AssertionError("no error for --only 99")


def test_default_jobs():
    assert rn.default_jobs("cpu", 2) == 2 and rn.default_jobs("cpu", 1) == 1
    assert rn.default_jobs("cuda", 16) == 1 and rn.default_jobs("cuda:1", 16) == 1


def test_runs_notebooks_two_at_a_time_with_fixed_threads(tmp_path, capsys):
    nb_dir, out, fig = tmp_path / "nb", tmp_path / "out", tmp_path / "fig"
    nb_dir.mkdir()
    record = (
        "import os, time, torch\nfrom pathlib import Path\n"
        "d = Path(out_dir) / model\nd.mkdir(parents=True, exist_ok=True)\n"
        "(d / (NAME + '.txt')).write_text(f\"{os.environ.get('OMP_NUM_THREADS')} {torch.get_num_threads()} "
        '{time.time()}")\n'
    )
    write_notebook(nb_dir / "01_a.ipynb", "NAME = '01_a'\n" + record + "time.sleep(2)\n")
    write_notebook(
        nb_dir / "02_b.ipynb",
        "NAME = '02_b'\n" + record + "assert (Path(out_dir) / model / '01_a.txt').exists()  # reads 01_a's table\n",
    )
    write_notebook(nb_dir / "03_c.ipynb", "NAME = '03_c'\n" + record)
    args = run_args(nb_dir, out, fig, jobs=2)
    assert rn.main(args) == 0
    got = {p.stem: p.read_text().split() for p in (fig / "m").glob("*.txt")}
    assert set(got) == {"01_a", "02_b", "03_c"}
    assert all(v[:2] == ["1", "1"] for v in got.values())  # every notebook ran with one torch thread
    assert float(got["02_b"][2]) > float(got["01_a"][2])  # after the notebook whose tables it reads
    rows = (fig / "m" / "timings.csv").read_text().splitlines()
    assert rows[0].startswith("notebook,seconds,this_run,peak_rss_mib,threads") and len(rows) == 4
    starts = {r.split(",")[0]: int(r.split(",")[5]) for r in rows[1:]}
    ends = {r.split(",")[0]: int(r.split(",")[6]) for r in rows[1:]}
    assert starts["03_c"] < ends["01_a"]  # side by side
    assert all((out / f"{n}.key").is_file() for n in got)

    # a fresh clone has the committed figures but no outputs: a run of one notebook keeps the others' rows
    shutil.copytree(out, tmp_path / "out_kept")
    shutil.rmtree(out)
    assert rn.main(args + ["--only", "03"]) == 0
    kept = {r.split(",")[0]: r.split(",") for r in (fig / "m" / "timings.csv").read_text().splitlines()[1:]}
    assert set(kept) == {"01_a", "02_b", "03_c"} and kept["03_c"][2] == "ran"
    assert kept["01_a"][1:5] == [rows[1].split(",")[1], "cached", rows[1].split(",")[3], "1"]
    shutil.rmtree(out)
    shutil.copytree(tmp_path / "out_kept", out)

    capsys.readouterr()
    timings = fig / "m" / "timings.csv"  # a row left by an older run of another thread count
    timings.write_text(timings.read_text().replace("01_a," + ",".join(kept["01_a"][1:5]), "01_a,999,cached,1,2"))
    assert "01_a,999,cached,1,2" in timings.read_text()
    assert rn.main(args) == 0  # nothing changed: every notebook is skipped
    assert capsys.readouterr().out.count("is up to date") == 3
    again = {r.split(",")[0]: r.split(",") for r in timings.read_text().splitlines()[1:]}
    assert again["01_a"][2:5] == ["cached", rows[1].split(",")[3], "1"]  # its key holds this run's threads
    assert rn.main(args[:-1] + ["2"]) == 0  # another thread count is another key: all rerun
    assert capsys.readouterr().out.count("started") == 3

    write_notebook(nb_dir / "01_a.ipynb", "raise RuntimeError('boom')\n")
    assert rn.main(args) == 1
    err = capsys.readouterr().err
    assert "01_a FAILED" in err and "01_a.log" in err
    assert not (out / "01_a.key").exists()


def test_outputs_reach_the_figures_only_when_the_notebook_succeeds(tmp_path, capsys):
    """A failing or stopped notebook leaves the figures folder as it was (no half-written
    tables beside old ones); a successful one replaces all of its own files, so a table
    its last run wrote and this one does not is gone."""
    nb_dir, out, fig = tmp_path / "nb", tmp_path / "out", tmp_path / "fig"
    nb_dir.mkdir()
    model = fig / "m"
    model.mkdir(parents=True)
    (model / "00_up.csv").write_text("upstream\n")
    (model / "01_a_table.csv").write_text("old\n")
    (model / "01_a_stale.csv").write_text("from an older configuration\n")
    body = (
        "from pathlib import Path\nd = Path(out_dir) / model\n"
        "assert (d / '00_up.csv').read_text() == 'upstream\\n'  # the tables before it are there\n"
        "assert not (d / '01_a_table.csv').exists()  # its own old outputs are not\n"
        "(d / '01_a_table.csv').write_text('new\\n')\n"
    )
    write_notebook(nb_dir / "01_a.ipynb", body + "raise RuntimeError('stopped half-way')\n")
    args = run_args(nb_dir, out, fig, threads=False)
    assert rn.main(args) == 1
    assert "keeps its last successful outputs" in capsys.readouterr().err
    assert (model / "01_a_table.csv").read_text() == "old\n"  # untouched by the failed run
    assert (model / "01_a_stale.csv").exists()
    staged = list((out / "staging").glob("run-*/01_a/m/01_a_table.csv"))  # kept for a look, in this run's folder
    assert len(staged) == 1 and staged[0].read_text() == "new\n"

    write_notebook(nb_dir / "01_a.ipynb", body)
    assert rn.main(args) == 0
    assert (model / "01_a_table.csv").read_text() == "new\n"
    assert not (model / "01_a_stale.csv").exists()  # not written by this run: removed
    assert (model / "00_up.csv").read_text() == "upstream\n"
    assert not list((out / "staging").glob("*/01_a"))  # promoted: its staging folder is gone


def test_an_interrupted_run_keeps_the_timings_of_the_notebooks_that_finished(tmp_path, monkeypatch, capsys):
    """A run stopped (the end of a working session) after one notebook finished records
    that notebook's row in the figures' timings.csv, as a complete run would."""
    nb_dir, out, fig = tmp_path / "nb", tmp_path / "out", tmp_path / "fig"
    nb_dir.mkdir()
    write_notebook(nb_dir / "01_a.ipynb", "x = 1\n")
    write_notebook(nb_dir / "02_b.ipynb", "import time\ntime.sleep(60)\n")
    args = run_args(nb_dir, out, fig)
    real_sleep = rn.time.sleep

    stopped = []

    def sleep(seconds):  # stop the run (once) when 01_a has finished and 02_b is running
        if not stopped and (out / "01_a.key").is_file() and (out / "02_b.log").is_file():
            stopped.append(True)
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(rn.time, "sleep", sleep)
    assert rn.main(args) == 130
    assert "keep their outputs, keys and timings" in capsys.readouterr().err
    rows = {r.split(",")[0]: r.split(",") for r in (fig / "m" / "timings.csv").read_text().splitlines()[1:]}
    assert rows["01_a"][2] == "ran" and rows["01_a"][4] == "1" and "02_b" not in rows


# --------------------------------------------------------------------------- parameters (-p)


def test_parameters_are_read_from_the_parameters_cell_as_python_reads_them(tmp_path):
    write_notebook(
        tmp_path / "01_a.ipynb",
        "pass\n",
        params='n_side = 2         # random controls (K = edit_k)\nops = ["+",\n       "-"]\nx: float = 0.5\n',
    )
    assert nf.notebook_parameters(tmp_path / "01_a.ipynb") == {
        "model": '"x"',
        "device": '"cpu"',
        "quick": "False",
        "seed": "0",
        "out_dir": '"."',
        "n_side": "2",
        "ops": '["+",\n       "-"]',
        "x": "0.5",
    }  # papermill's inspect_notebook skips n_side (the bracket)
    assert "n_side_seeds" in nf.notebook_parameters(ROOT / "notebooks" / "07_gender_bias_editing.ipynb")
    assert [nf.parse_value(v) for v in ("3", "-0.1", "True", "None", "[1, 2]", "cpu", "1e-3", "'a b'")] == [
        3,
        -0.1,
        True,
        None,
        [1, 2],
        "cpu",
        1e-3,
        "a b",
    ]


def test_unknown_parameter_is_an_error_listing_the_valid_names(tmp_path):
    nb_dir = tmp_path / "nb"
    nb_dir.mkdir()
    write_notebook(nb_dir / "01_a.ipynb", "pass\n", params="n_items = 4\nlrs = [1e-3]\n")
    write_notebook(nb_dir / "02_b.ipynb", "pass\n", params="scale = 'auto'\n")
    base = ["--model", "m", "--device", "cpu", "--notebooks", str(nb_dir), "--print-figures"]
    with pytest.raises(SystemExit, match="unknown parameter nope") as err:
        rn.main(base + ["--only", "01", "--param", "nope", "1"])
    assert "01_a: n_items, lrs" in str(err.value) and "02_b" not in str(err.value)  # --only 01: 01's names
    with pytest.raises(SystemExit, match="set it with --seed"):
        rn.main(base + ["--param", "seed", "1"])
    # a name is passed to the notebooks that declare it (02_b has no n_items), with its type
    paths = rn.select_notebooks(nb_dir)
    assert rn.params_by_notebook({"n_items": "8", "scale": "cpu"}, paths) == {
        "01_a": {"n_items": 8},
        "02_b": {"scale": "cpu"},
    }
    assert (
        rn.yaml_parameters({"lrs": (1e-05, 0.5), "scale": "cpu", "k": None})
        == "{k: null, lrs: [1.0e-05, 0.5], scale: cpu}"
    )


# --------------------------------------------------------------------------- the scratch folder


def test_runs_with_changed_settings_go_to_the_scratch_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rn, "ROOT", tmp_path)
    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    base = ["--model", "org/m", "--device", "cpu", "--notebooks", str(nb_dir), "--jobs", "1"]

    def figures(*extra: str) -> str:
        assert rn.main(base + list(extra) + ["--print-figures"]) == 0
        return capsys.readouterr().out.strip()

    write_notebook(nb_dir / "00_a.ipynb", "pass\n")
    write_notebook(
        nb_dir / "01_b.ipynb",
        "from pathlib import Path\nfrom tqdm.auto import tqdm\nfor _ in tqdm(range(3)): pass\n"
        "d = Path(out_dir) / model.replace('/', '__')\n"
        "prev = (d / '00_a.csv').read_text()  # reads notebook 00's table\n"
        "(d / '01_b.csv').write_text(f'{prev}{n}\\n')\n",
        params="n = 1\n",
    )
    scratch = tmp_path / "outputs" / "scratch" / "figures"
    assert figures() == str(tmp_path / "figures")  # the committed configuration
    for changed in (["--quick", "True"], ["--seed", "1"], ["--param", "n", "2"]):
        assert figures(*changed) == str(scratch)
    assert figures("--seed", "1", "--figures", str(tmp_path / "mine")) == str(tmp_path / "mine")  # asked for

    committed = tmp_path / "figures" / "org__m"
    committed.mkdir(parents=True)
    (committed / "00_a.csv").write_text("committed\n")
    (committed / "01_b.csv").write_text("committed\n1\n")
    before = {p.name: p.read_text() for p in committed.iterdir()}
    assert rn.main(base + ["--only", "01", "--param", "n", "3"]) == 0
    assert "changed settings (-p n)" in capsys.readouterr().out
    assert {p.name: p.read_text() for p in committed.iterdir()} == before  # untouched
    run = scratch / "org__m"
    assert (run / "01_b.csv").read_text() == "committed\n3\n"  # read the copy of the committed table
    assert (tmp_path / "outputs" / "scratch" / "org__m" / "01_b.key").is_file()
    assert not (tmp_path / "outputs" / "org__m").exists()
    # the executed copy beside the figures: outputs kept, progress-bar widgets dropped
    copy = json.loads((run / "notebooks" / "01_b.ipynb").read_text())
    assert (run / "notebooks" / "01_b.html").is_file()
    assert "widgets" not in copy["metadata"]
    assert not [o for c in copy["cells"] for o in c.get("outputs", []) if nf.WIDGET_VIEW in o.get("data", {})]
    assert copy["metadata"]["papermill"]["parameters"]["n"] == 3
    # recorded as the figures root it went to, relative to notebooks/; no path of this machine
    assert copy["metadata"]["papermill"]["parameters"]["out_dir"] == "../outputs/scratch/figures"
    assert str(tmp_path) not in json.dumps(copy) and copy["cells"][0]["metadata"]["tags"] == ["provenance"]


# --------------------------------------------------------------------------- executed copies


def _executed() -> dict:
    widget = {
        "output_type": "display_data",
        "metadata": {},
        "data": {
            nf.WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0},
            "text/plain": "loss:   0%|          | 0/10 [00:00<?, ?it/s]",
        },
    }
    figure = {
        "output_type": "display_data",
        "metadata": {},
        "data": {
            "image/png": "iVBORw0KGgo=",
            "application/pdf": "JVBERi0=",
            "image/svg+xml": "<svg/>",
            "text/html": "<img>",
            "text/plain": "<Figure size 640x480 with 1 Axes>",
        },
    }
    table = {
        "output_type": "display_data",
        "metadata": {},
        "data": {"text/html": "<table></table>", "text/plain": "   a\n0  1"},
    }
    svg_only = {"output_type": "display_data", "metadata": {}, "data": {"image/svg+xml": "<svg/>"}}
    stream = {"output_type": "stream", "name": "stdout", "text": "done\n"}
    first = {
        "cell_type": "markdown",
        "id": "m0",
        "metadata": {},
        "source": "# 01 · Title\n\n**Results** (m): [x](../figures/m/notebooks/01_a.ipynb)\n\nText.",
    }
    code = {
        "cell_type": "code",
        "id": "c1",
        "metadata": {},
        "execution_count": 1,
        "source": "plot()",
        "outputs": [widget, figure, table, svg_only, stream],
    }
    return {
        "cells": [first, code],
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "widgets": {nf.WIDGET_STATE: {"state": {"abc": {}}, "version_major": 2, "version_minor": 0}},
        },
    }


def test_published_copy_drops_widgets_and_the_duplicates_of_a_png(tmp_path):
    nb = _executed()
    stripped = nf.strip_for_publishing(nb, "01_a")
    outs = stripped["cells"][1]["outputs"]
    assert "widgets" not in stripped["metadata"] and len(outs) == 4  # the progress bar is gone
    assert set(outs[0]["data"]) == {"image/png", "text/plain"}  # PDF, SVG, HTML copies of the PNG dropped
    assert set(outs[1]["data"]) == {"text/html", "text/plain"}  # a table's HTML stays (no PNG)
    assert set(outs[2]["data"]) == {"image/svg+xml"} and outs[3]["text"] == "done\n"  # no PNG to prefer
    assert stripped["cells"][1]["execution_count"] == 1
    assert "(../REPORT.md#notebook-01)" in stripped["cells"][0]["source"]  # relinked for figures/<model>/notebooks
    assert "widgets" in nb["metadata"] and len(nb["cells"][1]["outputs"]) == 5  # the input is left as it was

    src = tmp_path / "01_a.ipynb"
    src.write_text(json.dumps(nb))
    ipynb, page = nf.publish(src, tmp_path / "pub")
    import nbformat

    nbformat.validate(nbformat.read(ipynb, as_version=4))
    assert "widget" not in ipynb.read_text() and "JVBERi0=" not in ipynb.read_text()
    assert page.suffix == ".html" and "iVBORw0KGgo=" in page.read_text()
    assert nf.outputs_in(ipynb) and nf.outputs_in(src)  # executed copies do have outputs


# --------------------------------------------------------------------------- progress


def test_progress_is_read_from_papermill_bar_and_compared_with_the_last_run():
    chunk = (
        b"Executing:   0%|          | 0/40 [00:00<?, ?cell/s]\rExecuting:  30%|###       | 12/40 "
        b"[03:12<07:00, 15.0s/cell]\r"
    )
    assert [tuple(map(int, m)) for m in rn._PROGRESS.findall(chunk)][-1] == (12, 40)
    assert rn.progress_line("01_a", (12, 40), 192, 840) == "01_a: 12/40 cells, 3.2 of ~14.0 min"
    assert rn.progress_line("01_a", (39, 40), 900, 840) == "01_a: 39/40 cells, 15.0 min (the last run took 14.0)"
    assert rn.progress_line("01_a", None, 30, None) == "01_a: starting, 0.5 min (no earlier run to compare)"


def test_dtype_and_device_map_reach_the_notebooks_and_the_key_only_when_not_default():
    """--dtype / --device-map: checked with arithlib's parsers, passed as the
    notebooks' parameters, and part of the cache key only when they differ from what
    every earlier run did (float32 on one device)."""
    assert rn.check_placement("auto", None) == ("auto", None)
    assert rn.check_placement("bfloat16", '{"model.layers.0": 0}') == ("bfloat16", {"model.layers.0": 0})
    for dtype, dmap in (("float8", None), ("auto", "everywhere"), ("auto", "{broken")):
        with pytest.raises(SystemExit, match="run_all.sh: "):
            rn.check_placement(dtype, dmap)
    assert rn.placement_parameters("auto", None) == {}
    assert rn.placement_parameters("bfloat16", "balanced") == {"dtype": "bfloat16", "device_map": "balanced"}
    assert rn.placement_key("cpu", "auto", None) == [] == rn.placement_key("cuda", "float32", None)
    assert rn.placement_key("cuda", "auto", None) == ["dtype=bfloat16"]
    assert rn.placement_key("cpu", "bfloat16", {"b": 1, "a": 0}) == ["dtype=bfloat16", 'device_map={"a": 0, "b": 1}']
    with pytest.raises(SystemExit, match="set it with --dtype"):
        rn.params_by_notebook({"dtype": "bfloat16"}, [])


def test_the_carried_store_is_not_copied_into_staging_or_scratch(tmp_path):
    fig = tmp_path / "figures" / "m"
    (fig / "stored" / "sections").mkdir(parents=True)
    (fig / "stored" / "sections" / "x.pkl").write_bytes(b"x")
    (fig / "00_table.csv").write_text("a\n1\n")
    staged = rn.stage(fig, tmp_path / "staging", "m", "01_next")
    assert (staged / "00_table.csv").is_file() and not (staged / "stored").exists()
    scratch = tmp_path / "scratch" / "m"
    assert rn.seed_scratch(scratch, fig)
    assert (scratch / "00_table.csv").is_file() and not (scratch / "stored").exists()


def test_the_run_timings_read_each_notebooks_arithmetic_and_its_ratio_to_the_floor(tmp_path):
    from arithlib.run.floor import Sections

    s = Sections(peak_gflop_s=50.0)
    s.add("1 sweep", wall_s=80.0, gflop=2000.0)
    s.table(total_wall_s=90.0).to_csv(tmp_path / "01_timings.csv", index=False)
    # the notebook's whole wall time (kernel start, loading) against its sections' 40 s floor
    assert rn.notebook_floor(tmp_path, "01_identify_heads", "100") == ("2000.0", "2.50")
    (tmp_path / "02_timings.csv").write_text("step,seconds\ntotal,3\n")  # before the count
    assert rn.notebook_floor(tmp_path, "02_mlp_probing", 3) == ("", "")
    assert rn.notebook_floor(tmp_path, "03_neuron_heuristics", 3) == ("", "")  # no table
