"""The cluster executor (arithlib.run.slurm; ``run_all.sh --executor slurm``).

Without Slurm (the default suite): the job graph and which notebooks it queues (the local
executor's keys), each job's resources from the last run's timings.csv, the sbatch
options, and the one-line errors for bad input. Marked ``slurm`` (``-m slurm``, against a
running Slurm such as ``scripts/slurm_local.sh start``; ``.ci/run`` starts one): the toy
model's quick run through Slurm gives the local executor's tables, a failing notebook's job
shows as failed with its log and its dependants do not run, a resubmission runs only what
is left, and Slurm's refusals are one line before anything is queued."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arithlib import cli
from arithlib.run import slurm

ROOT = Path(__file__).resolve().parents[2]
rn = cli._run_notebooks()


def _notebook(path: Path, code: str) -> None:
    """A small notebook with the run's parameters cell, then ``code``."""
    cells = [
        {
            "cell_type": "code",
            "metadata": {"tags": ["parameters"]},
            "execution_count": None,
            "outputs": [],
            "source": 'model = "x"\ndevice = "cpu"\nquick = False\nseed = 0\nout_dir = "."\n',
        },
        {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": code},
    ]
    nb = {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb))


def _table(name: str, reads: str = "") -> str:
    """Notebook code that writes ``NN_name.csv`` (after checking the table it ``reads``)."""
    check = f"assert (d / '{reads}.csv').is_file()\n" if reads else ""
    return (
        f"from pathlib import Path\nd = Path(out_dir) / model\nd.mkdir(parents=True, exist_ok=True)\n{check}"
        f"(d / '{name}.csv').write_text('x\\n1\\n')\n"
    )


def _chain(folder: Path) -> Path:
    """Three notebooks, 00 <- 01 <- 02 (each reads the one before), and 03 on its own."""
    folder.mkdir(parents=True, exist_ok=True)
    _notebook(folder / "00_a.ipynb", _table("00_a"))
    _notebook(folder / "01_b.ipynb", _table("01_b", reads="00_a"))
    _notebook(folder / "02_c.ipynb", _table("02_c", reads="01_b"))
    _notebook(folder / "03_d.ipynb", _table("03_d"))
    return folder


def _args(tmp_path: Path, notebooks: Path, force: bool = False) -> tuple[argparse.Namespace, rn.Plan]:
    args = argparse.Namespace(
        model="toy-arith",
        device="cpu",
        resolved_device="cpu",
        dtype="auto",
        device_map=None,
        quick="True",
        seed=0,
        param=[],
        figures=str(tmp_path / "fig"),
        out=str(tmp_path / "out"),
        only="",
        force=force,
        jobs=1,
        threads=1,
        notebooks=str(notebooks),
        progress_every=60.0,
        print_figures=False,
        report=False,
    )
    plan = rn.check(args)
    return args, plan


# --------------------------------------------------------------------------- without Slurm


def test_the_job_graph_follows_the_tables_each_notebook_reads(tmp_path):
    args, plan = _args(tmp_path, _chain(tmp_path / "nb"))
    stale, deps = slurm.to_run(rn, args, plan)
    assert deps == {"00_a": [], "01_b": ["00_a"], "02_c": ["01_b"], "03_d": []}
    assert stale == ["00_a", "01_b", "02_c", "03_d"]  # nothing ran yet; upstream first
    assert slurm.order({"b": ["a"], "a": [], "c": ["b", "a"]}) == ["a", "b", "c"]
    with pytest.raises(slurm.SlurmError, match="in a circle"):
        slurm.order({"a": ["b"], "b": ["a"]})


def test_only_what_is_not_up_to_date_is_queued_with_the_local_keys(tmp_path):
    """After a local run nothing is stale; an edit of 01 makes 01 and 02 (which reads it)
    stale, not 00 or 03; --force queues all; a notebook selected alone waits for nothing."""
    nb = _chain(tmp_path / "nb")
    args, plan = _args(tmp_path, nb)
    assert rn.run(args, plan) == 0  # the local executor writes its keys
    args, plan = _args(tmp_path, nb)
    assert slurm.to_run(rn, args, plan)[0] == []
    _notebook(nb / "01_b.ipynb", _table("01_b", reads="00_a") + "# edited\n")
    assert slurm.to_run(rn, args, plan)[0] == ["01_b", "02_c"]
    args, plan = _args(tmp_path, nb, force=True)
    assert slurm.to_run(rn, args, plan)[0] == ["00_a", "01_b", "02_c", "03_d"]
    args.only = "02"
    plan = rn.check(args)
    assert slurm.to_run(rn, args, plan) == (["02_c"], {"02_c": []})


def test_resources_come_from_the_last_runs_timings_with_a_margin(tmp_path):
    (tmp_path / "timings.csv").write_text(
        "notebook,seconds,this_run,peak_rss_mib\n00_a,600,ran,4000\n01_b,30,ran,NA\n02_c,bad,ran,100\n"
    )
    costs = rn.last_costs(rn.read_timings(tmp_path / "timings.csv"))
    assert slurm.resources(costs, "00_a") == slurm.Resources(6144, 20)  # 1.5 x 4000 MiB (to 256 MiB), 2 x 10 min
    assert slurm.resources(costs, "01_b") == slurm.Resources(6144, 10)  # no peak: the largest of the others
    assert slurm.resources(costs, "09_z") == slurm.Resources(6144, slurm.DEFAULT_MINUTES)  # never ran
    assert slurm.resources({}, "00_a") == slurm.Resources(slurm.DEFAULT_MEM_MIB, slurm.DEFAULT_MINUTES)
    small = {"00_a": (5.0, 100.0)}
    assert slurm.resources(small, "00_a") == slurm.Resources(slurm.MIN_MEM_MIB, slurm.MIN_MINUTES)


def test_sbatch_options_take_the_overrides():
    opts = argparse.Namespace(
        partition="gpu",
        account="lab",
        gpus_per_job=2,
        time="12:00:00",
        threads=8,
        slurm_args={"qos": "high", "mem": "64G"},
        report=True,
    )
    params = slurm.sbatch_options(slurm.Resources(4096, 30), opts)
    assert params["partition"] == "gpu" and params["account"] == "lab" and params["gpus_per_node"] == 2
    assert params["cpus_per_task"] == 8 and params["mem"] == "4096M" and params["time"] == 30
    extra = params["additional_parameters"]  # sbatch reads these after submitit's own: they win
    assert extra == {"kill-on-invalid-dep": "yes", "time": "12:00:00", "qos": "high", "mem": "64G"}
    report = slurm.sbatch_options(slurm.REPORT_JOB, opts, ["11", "12"], gpus=False)
    assert "gpus_per_node" not in report and report["additional_parameters"]["dependency"] == "afterok:11:12"


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--slurm-arg", "qos"], "--slurm-arg takes KEY=VALUE"),
        (["--slurm-arg", "=x"], "--slurm-arg takes KEY=VALUE"),
        (["--models", ","], "--models takes model names"),
        (["--models", "toy-arith,no-such-model"], "unknown model 'no-such-model'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--executor", "pbs"], "--executor takes local or slurm"),
        (["--models", "toy-arith,smollm2-135m", "--out", "o"], "--out names one model's folder"),
    ],
)
def test_bad_cluster_options_are_one_line(bad, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm: these fail before asking it
    argv = ["run", "--model", "toy-arith", "--quick", "--executor", "slurm", *bad]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "option",
    [
        ["--partition", "gpu"],
        ["--gpus-per-job", "1"],
        ["--status"],
        ["--slurm-arg", "qos=high"],
        ["--models", "toy-arith"],
        ["--wait"],
    ],
)
def test_cluster_options_need_the_slurm_executor(option, capsys):
    assert cli.main(["run", "--model", "toy-arith", *option]) == 2
    err = capsys.readouterr().err
    assert f"{option[0]} works with --executor slurm only" in err and len(err.strip().splitlines()) == 1


def test_no_sbatch_is_one_line_before_anything_is_written(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    argv = [
        "run",
        "--model",
        "toy-arith",
        "--quick",
        "--executor",
        "slurm",
        "--out",
        str(tmp_path / "out"),
        "--figures",
        str(tmp_path / "fig"),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "needs Slurm's sbatch on the PATH" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "fig").exists()


def test_status_without_slurm_reads_the_jobs_results(tmp_path, monkeypatch):
    """A job Slurm no longer knows is judged by submitit's result file."""
    monkeypatch.setenv("PATH", str(tmp_path))
    args, plan = _args(tmp_path, _chain(tmp_path / "nb"))
    logs = tmp_path / "out" / "slurm" / "logs"
    logs.mkdir(parents=True)
    import pickle

    (logs / "7_0_result.pkl").write_bytes(pickle.dumps(("success", None)))
    (logs / "8_0_result.pkl").write_bytes(pickle.dumps(("error", "Traceback ...")))
    (tmp_path / "out" / "00_a.log").write_text("the notebook's log\n")
    jobs = [
        slurm.JobRecord("toy-arith", "03_d", "7", str(logs / "7_0_log.out")),
        slurm.JobRecord("toy-arith", "00_a", "8", str(logs / "8_0_log.out"), str(tmp_path / "out" / "00_a.log")),
        slurm.JobRecord("toy-arith", "01_b", "9", str(logs / "9_0_log.out"), "", ["8"]),
    ]
    (tmp_path / "out" / "slurm" / "jobs.json").write_text(
        json.dumps({"up_to_date": ["02_c"], "jobs": [j.__dict__ for j in jobs]})
    )
    lines, active, failed = slurm.status_lines([(args, plan)])
    text = "\n".join(lines)
    assert not active and failed
    assert "02_c" in lines[0] and "up to date" in lines[0]
    assert "03_d" in lines[1] and "COMPLETED" in lines[1]
    assert "FAILED" in lines[2] and f"notebook log {tmp_path / 'out' / '00_a.log'}" in lines[2]
    assert "unknown to Slurm" in lines[3], text


# --------------------------------------------------------------------------- against a running Slurm


def _slurm_running() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def cluster():
    """A running Slurm (``.ci/run`` starts one and sets ARITHLIB_REQUIRE_SLURM: then none is an error)."""
    if not _slurm_running():
        if os.environ.get("ARITHLIB_REQUIRE_SLURM"):
            pytest.fail("no Slurm answers (sinfo failed): start one with scripts/slurm_local.sh start")
        pytest.skip("no Slurm answers (sinfo); start one with scripts/slurm_local.sh start")


def _run(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m arithlib run ARGV`` in a process of its own, as run_all.sh runs it."""
    return subprocess.run(
        [sys.executable, "-m", "arithlib", "run", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slurm
@pytest.mark.toy_model
def test_the_toy_models_quick_run_through_slurm_gives_the_local_tables(cluster, tmp_path):
    """Notebooks 05 and 06 (06 reads 05's tables) on the toy model in quick mode: the
    Slurm jobs (06 after 05, then the report) write the tables the local executor writes.
    The local run goes beside the Slurm jobs (one core each), to keep the test short."""
    common = ["--model", "toy-arith", "--quick", "--only", "05,06", "--threads", "1"]
    local = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arithlib",
            "run",
            *common,
            "--figures",
            str(tmp_path / "local"),
            "--out",
            str(tmp_path / "local_out"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    t0 = time.time()
    queued = _run(
        *common,
        "--executor",
        "slurm",
        "--wait",
        "--figures",
        str(tmp_path / "slurm"),
        "--out",
        str(tmp_path / "slurm_out"),
    )
    print(f"through Slurm in {time.time() - t0:.0f} s:\n{queued.stdout}")
    local_log = local.communicate(timeout=900)[0]
    assert local.returncode == 0, local_log[-3000:]
    assert queued.returncode == 0, queued.stdout[-3000:] + queued.stderr[-3000:]
    assert "06_pruning: Slurm job" in queued.stdout and " after " in queued.stdout
    compared = subprocess.run(
        [
            sys.executable,
            "scripts/compare_tables.py",
            str(tmp_path / "local" / "toy-arith"),
            str(tmp_path / "slurm" / "toy-arith"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert compared.returncode == 0, compared.stdout[-3000:]
    tables = sorted(p.name for p in (tmp_path / "local" / "toy-arith").glob("0[56]_*.csv*"))
    assert any(n.startswith("05_") for n in tables) and any(n.startswith("06_") for n in tables)
    assert "different" not in compared.stdout and compared.stdout.strip().endswith("tables)"), compared.stdout
    fig = tmp_path / "slurm" / "toy-arith"
    assert (fig / "REPORT.md").is_file()
    ended = [line.split() for line in queued.stdout.splitlines() if line.startswith(("toy-arith ", "(all) "))]
    assert [(e[1], e[4]) for e in ended] == [
        ("05_lora_mechanism", "COMPLETED"),
        ("06_pruning", "COMPLETED"),
        ("report", "COMPLETED"),
        ("cross-model", "COMPLETED"),
    ]
    rows = {r.split(",")[0]: r.split(",") for r in (fig / "timings.csv").read_text().splitlines()[1:]}
    assert rows["05_lora_mechanism"][2] == "ran" and rows["06_pruning"][2] == "ran"
    keys = [(tmp_path / out / "06_pruning.key").read_text() for out in ("local_out", "slurm_out")]
    assert keys[0] != keys[1]  # the figures folder is part of the key; each is the local executor's


@pytest.mark.slurm
def test_a_failing_job_stops_its_dependants_and_a_resubmission_runs_what_is_left(cluster, tmp_path):
    nb = _chain(tmp_path / "nb")
    _notebook(nb / "01_b.ipynb", "raise RuntimeError('a bug in 01')\n")
    common = [
        "--model",
        "toy-arith",
        "--notebooks",
        str(nb),
        "--no-report",
        "--figures",
        str(tmp_path / "fig"),
        "--out",
        str(tmp_path / "out"),
        "--executor",
        "slurm",
    ]
    first = _run(*common, "--wait")
    assert first.returncode == 1, first.stdout + first.stderr
    state = {line.split()[1]: line for line in first.stdout.splitlines() if line.startswith("toy-arith ")}
    assert "COMPLETED" in state["00_a"] and "COMPLETED" in state["03_d"]
    assert "FAILED" in state["01_b"] and f"notebook log {tmp_path / 'out' / '01_b.log'}" in state["01_b"]
    assert "RuntimeError: a bug in 01" in (tmp_path / "out" / "01_b.log").read_text()
    assert "CANCELLED" in state["02_c"] and "did not run" in state["02_c"]
    assert not (tmp_path / "fig" / "toy-arith" / "02_c.csv").exists()
    status = _run(*common, "--status")
    assert status.returncode == 0 and status.stdout and first.stdout.endswith(status.stdout)

    _notebook(nb / "01_b.ipynb", _table("01_b", reads="00_a"))  # the fix
    second = _run(*common, "--wait")
    assert second.returncode == 0, second.stdout + second.stderr
    queued = [line.split()[2].rstrip(":") for line in second.stdout.splitlines() if ": Slurm job " in line]
    assert queued == ["01_b", "02_c"]
    assert "00_a" in second.stdout and "up to date (not submitted)" in second.stdout
    assert all((tmp_path / "fig" / "toy-arith" / f"{n}.csv").is_file() for n in ("00_a", "01_b", "02_c", "03_d"))


@pytest.mark.slurm
@pytest.mark.parametrize(
    "bad,message",
    [
        (["--partition", "no-such-partition"], "unknown Slurm partition 'no-such-partition' (this cluster has: "),
        (["--slurm-arg", "mem=100000G"], "Slurm refuses the jobs: "),
        (["--slurm-arg", "nodelist=no-such-node"], "Slurm refuses the jobs: "),
    ],
)
def test_slurm_refusing_is_one_line_before_anything_is_queued(cluster, tmp_path, bad, message, capsys):
    nb = _chain(tmp_path / "nb")
    status = cli.main(
        [
            "run",
            "--model",
            "toy-arith",
            "--notebooks",
            str(nb),
            "--figures",
            str(tmp_path / "fig"),
            "--out",
            str(tmp_path / "out"),
            "--executor",
            "slurm",
            *bad,
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "slurm").exists()
