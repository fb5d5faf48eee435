"""The cluster executor: ``run_all.sh --executor slurm`` submits the notebooks to Slurm
through submitit, each as a job of its own, and exits (``--wait`` stays until they end).

One job per (model, notebook) that is not up to date: the cache keys are the local
executor's (``scripts/run_key.py``), computed at submission in the notebooks' order, each
with the keys its upstream notebooks will have once they ran. A notebook's job starts
after the jobs of the notebooks whose tables it reads (``afterok``; Slurm cancels it when
one of them fails), so the whole graph is queued at once. Inside a job the local
executor runs that notebook alone (``run_notebooks.Runner``: staging, the key, the
executed copy). Then one job per model writes its report and timings, and a last job the
findings across models. Each job asks for the memory and time of its notebook's last run
(``timings.csv``) with a margin; ``--time`` and ``--slurm-arg`` override them.

The record of a submission is ``OUT/slurm/jobs.json`` (per model); ``--status`` reads it
and asks Slurm for each job's state. Submitit's logs are in ``OUT/slurm/logs/``, each
notebook's own log at ``OUT/NN_name.log``, as in a local run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from arithlib.run.atomic import write_text
from arithlib.run.paths import script_module

#: Memory and time of a job whose notebook has no earlier run (MiB, minutes).
DEFAULT_MEM_MIB = 8192
DEFAULT_MINUTES = 240
#: A job asks for its notebook's last peak memory and time times these, at least the floors below.
MEM_MARGIN, TIME_MARGIN = 1.5, 2.0
MIN_MEM_MIB, MIN_MINUTES = 2048, 10
#: Slurm states of a job that has not ended.
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "STAGE_OUT"}


class SlurmError(Exception):
    """A bad option, or Slurm refusing the jobs: one line, before any job is queued."""


@dataclass
class Resources:
    """What one job asks Slurm for."""

    mem_mib: int
    minutes: int


#: What a report job and the cross-model job ask for.
REPORT_JOB = Resources(MIN_MEM_MIB, 30)


@dataclass
class JobRecord:
    """One submitted job as ``--status`` shows it."""

    model: str
    name: str  # a notebook, "report" or "cross-model"
    job_id: str
    log: str  # submitit's log of the job
    notebook_log: str = ""  # the notebook's own log (OUT/NN_name.log)
    after: list[str] = field(default_factory=list)  # job ids it waits for


# --------------------------------------------------------------------------- pieces without Slurm


def parse_slurm_args(items: list[str]) -> dict[str, str]:
    """``--slurm-arg KEY=VALUE`` items as sbatch options (``mem=16G`` -> ``--mem=16G``)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("--")
        if not eq or not key or not value:
            raise SlurmError(
                f"--slurm-arg takes KEY=VALUE (an sbatch option without its --, e.g. qos=high), not {item!r}"
            )
        out[key] = value
    return out


def parse_models(models: str) -> list[str]:
    """The model names of ``--models a,b,c`` (each once, in order)."""
    names = list(dict.fromkeys(m.strip() for m in models.split(",") if m.strip()))
    if not names:
        raise SlurmError(f"--models takes model names separated by commas, not {models!r}")
    return names


def job_device(device: str, gpus_per_job: int) -> str:
    """The notebooks' device in a job: the one given, or for auto, cuda when the job gets
    GPUs, else cpu (the submitting machine's own GPUs do not matter)."""
    if device == "auto":
        return "cuda" if gpus_per_job > 0 else "cpu"
    if device != "cpu" and not device.startswith(("cuda", "mps")):
        raise SlurmError(f"unknown device {device!r} (cpu, cuda, cuda:N or auto)")
    return device


def resources(costs: dict[str, tuple[float, float | None]], name: str) -> Resources:
    """The memory and time of ``name``'s job from the last run's (seconds, peak MiB) per
    notebook (``run_notebooks.last_costs``): the measured values with a margin; a
    notebook not measured gets the largest peak of the others and the default time."""
    peaks = [p for _, p in costs.values() if p is not None]
    seconds, peak = costs.get(name, (None, None))
    if peak is None:
        peak = max(peaks, default=None)
    mem = DEFAULT_MEM_MIB if peak is None else max(MIN_MEM_MIB, math.ceil(peak * MEM_MARGIN / 256) * 256)
    minutes = DEFAULT_MINUTES if seconds is None else max(MIN_MINUTES, math.ceil(seconds * TIME_MARGIN / 60))
    return Resources(mem, minutes)


def order(deps: dict[str, list[str]]) -> list[str]:
    """The notebooks of ``deps`` (name -> the selected names it reads) upstream first."""
    done: list[str] = []

    def visit(name: str, seen: tuple[str, ...]) -> None:
        if name in done:
            return
        if name in seen:
            raise SlurmError(f"the notebooks read each other's tables in a circle: {' -> '.join(seen + (name,))}")
        for dep in deps[name]:
            visit(dep, seen + (name,))
        done.append(name)

    for name in sorted(deps):
        visit(name, ())
    return done


def to_run(rn: Any, args: argparse.Namespace, plan: Any) -> tuple[list[str], dict[str, list[str]]]:
    """(the notebooks of ``plan`` that are not up to date, upstream first; each selected
    notebook's selected upstream notebooks). A notebook is up to date when its stored key
    equals the key it will get, computed with the keys its upstream notebooks will have."""
    selected = {p.stem: p for p in plan.paths}
    deps = {n: [d.stem for d in rn.upstream(p) if d.stem in selected] for n, p in selected.items()}
    run_params = rn.key_parameters(args)
    stale = []
    with tempfile.TemporaryDirectory() as tmp:
        for key_file in Path(args.out).glob("*.key"):
            shutil.copy(key_file, tmp)
        for name in order(deps):
            params = rn.notebook_key_parameters(run_params, plan.by_notebook.get(name, {}))
            key = rn.run_key(selected[name], Path(tmp), params)
            if not rn.up_to_date(Path(args.out), name, key, args.force):
                stale.append(name)
            (Path(tmp) / f"{name}.key").write_text(key + "\n")
    return stale, deps


# --------------------------------------------------------------------------- Slurm itself


def _slurm(*cmd: str) -> subprocess.CompletedProcess:
    """A Slurm command's result (exit status 127 when the command is not installed)."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True)
    except FileNotFoundError:
        return subprocess.CompletedProcess(list(cmd), 127, "", f"error: {cmd[0]} not found")


def _message(text: str) -> str:
    """Slurm's reason in one line (its last "error:" line, else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln.split("error:", 1)[1].strip() for ln in lines if "error:" in ln]
    return (errors or lines or ["no message"])[-1]


def check_slurm(partition: str | None) -> None:
    """sbatch on the PATH and, when given, the partition known to Slurm."""
    if shutil.which("sbatch") is None:
        raise SlurmError(
            "--executor slurm needs Slurm's sbatch on the PATH, and there is none "
            "(run on the cluster's login node, or start a local one: scripts/slurm_local.sh start)"
        )
    if partition:
        found = _slurm("scontrol", "show", "partition", partition)
        if found.returncode != 0:
            names = _slurm("sinfo", "-h", "-o", "%P").stdout.split()
            raise SlurmError(
                f"unknown Slurm partition {partition!r} (this cluster has: "
                f"{', '.join(n.rstrip('*') for n in names) or 'none listed'})"
            )


def sbatch_options(
    res: Resources, opts: argparse.Namespace, after: list[str] | None = None, gpus: bool = True
) -> dict[str, Any]:
    """The sbatch options of a job asking for ``res`` (overridden by ``--time`` and
    ``--slurm-arg``), starting once the jobs ``after`` succeeded, with ``--gpus-per-job``
    GPUs unless not ``gpus``: submitit's SlurmExecutor parameters."""
    extra = {
        "kill-on-invalid-dep": "yes",
        **({"dependency": "afterok:" + ":".join(after)} if after else {}),
        **({"time": opts.time} if opts.time else {}),
        **opts.slurm_args,
    }
    params: dict[str, Any] = dict(
        mem=f"{res.mem_mib}M",
        time=res.minutes,
        cpus_per_task=max(1, opts.threads),
        additional_parameters=extra,
        use_srun=False,
    )
    for key in ("partition", "account"):
        if getattr(opts, key):
            params[key] = getattr(opts, key)
    if opts.gpus_per_job and gpus:
        params["gpus_per_node"] = opts.gpus_per_job
    return params


def test_submission(res: Resources, opts: argparse.Namespace) -> None:
    """Ask Slurm whether it would take a job with these options (``sbatch --test-only``),
    so that a refused job stops the command before anything is queued."""
    p = sbatch_options(res, opts)
    cmd = [
        "sbatch",
        "--test-only",
        f"--mem={p['mem']}",
        f"--time={p['time']}",
        f"--cpus-per-task={p['cpus_per_task']}",
        "--output=/dev/null",
    ]
    cmd += [f"--{k}={p[k]}" for k in ("partition", "account") if k in p]
    cmd += [f"--gpus-per-node={p['gpus_per_node']}"] if "gpus_per_node" in p else []
    cmd += [
        f"--{k}={v}" for k, v in p["additional_parameters"].items() if k not in ("kill-on-invalid-dep", "dependency")
    ]
    done = subprocess.run(cmd, input="#!/bin/sh\ntrue\n", capture_output=True, text=True)
    if done.returncode != 0:
        raise SlurmError(f"Slurm refuses the jobs: {_message(done.stderr + done.stdout)}")


def states(job_ids: list[str]) -> dict[str, str]:
    """Each job's state: from sacct where the cluster keeps accounting, else squeue
    (which knows finished jobs for a while: MinJobAge); ids Slurm no longer knows are left out."""
    if not job_ids:
        return {}
    out: dict[str, str] = {}
    acct = _slurm("sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(job_ids))
    if acct.returncode == 0:
        for line in acct.stdout.splitlines():
            jid, _, state = line.partition("|")
            out[jid.strip()] = state.split()[0] if state.split() else "UNKNOWN"
    queue = _slurm("squeue", "-h", "-t", "all", "-o", "%i|%T|%r")
    for line in queue.stdout.splitlines():
        jid, state, reason = (line.split("|") + ["", ""])[:3]
        if jid in job_ids and jid not in out:
            out[jid] = state + (f" ({reason})" if reason not in ("", "None") else "")
    return out


# --------------------------------------------------------------------------- inside the jobs


def notebook_job(args: argparse.Namespace, path: str, params: dict[str, object]) -> None:
    """A job: run one notebook as the local executor does; raises when it fails (the job
    then ends FAILED and Slurm cancels its dependants)."""
    rn = script_module("run_notebooks")
    name, out = Path(path).stem, Path(args.out)
    staging = out / "staging" / f"slurm-{os.environ.get('SLURM_JOB_ID', os.getpid())}"
    runner = rn.Runner(args, [Path(path)], {name: params}, staging=staging, timings=False)
    status = runner.run()
    for row in runner.rows:  # for the model's timings.csv, written by its report job
        write_text(out / "slurm" / "rows" / f"{name}.json", json.dumps({**row, "t0": runner.t0}) + "\n")
    if status == 0:
        shutil.rmtree(staging, ignore_errors=True)
    else:
        raise RuntimeError(f"notebook {name} failed (exit status {status}); its log: {out / name}.log")


def report_job(args: argparse.Namespace, paths: list[str], ran: list[str]) -> None:
    """A job: the model's timings.csv (the notebooks of ``ran`` as run now) and its report."""
    rn = script_module("run_notebooks")
    out = Path(args.out)
    runner = rn.Runner(args, [Path(p) for p in paths], {}, staging=out / "staging" / "report", timings=False)
    rows = [
        json.loads((out / "slurm" / "rows" / f"{n}.json").read_text())
        for n in ran
        if (out / "slurm" / "rows" / f"{n}.json").is_file()
    ]
    t0 = min((r["t0"] + r.get("start_s", 0) for r in rows), default=0.0)
    for r in rows:  # times from the first job's start
        shift = r.pop("t0") - t0
        r.update({k: round(r[k] + shift) for k in ("start_s", "end_s") if k in r})
    runner.rows = rows
    runner.write_timings()
    fig_model = Path(args.figures) / args.model.replace("/", "__")
    if subprocess.call([sys.executable, "-m", "arithlib.report", str(fig_model)], cwd=rn.ROOT):
        raise RuntimeError(f"the report of {fig_model} failed")


def cross_job(figures: str) -> None:
    """A job: the findings across the models of ``figures`` (and the README's table when
    ``figures`` is the repository's own)."""
    rn = script_module("run_notebooks")
    readme = (
        ["--readme", str(rn.ROOT / "README.md")] if Path(figures).resolve() == (rn.ROOT / "figures").resolve() else []
    )
    if subprocess.call([sys.executable, "-m", "arithlib.report", "--cross-in", figures, *readme], cwd=rn.ROOT):
        raise RuntimeError(f"the findings across the models of {figures} failed")


# --------------------------------------------------------------------------- submission and status


def _record_file(args: argparse.Namespace) -> Path:
    return Path(args.out) / "slurm" / "jobs.json"


def _records(args: argparse.Namespace) -> list[JobRecord]:
    path = _record_file(args)
    return [JobRecord(**r) for r in json.loads(path.read_text())["jobs"]] if path.is_file() else []


def check_idle(runs: list[tuple[argparse.Namespace, Any]]) -> None:
    """No local run holds a model's folders and no job of the last submission is still queued."""
    rn = script_module("run_notebooks")
    for args, plan in runs:
        try:
            for lock in rn.lock_all([plan.out, plan.figures / args.model.replace("/", "__")]):
                lock.release()
        except rn.Locked as err:
            raise SlurmError(str(err)) from None
        jobs = {r.job_id: r for r in _records(args)}
        active = [f"{jobs[j].name} (job {j})" for j, s in states(list(jobs)).items() if s.split()[0] in ACTIVE]
        if active:
            raise SlurmError(
                f"the last submission for {args.model} still has jobs queued or running: "
                f"{', '.join(active)}; wait for them (--status) or scancel them"
            )


def submit(runs: list[tuple[argparse.Namespace, Any]], opts: argparse.Namespace) -> list[JobRecord]:
    """Queue every model's stale notebooks, then its report job and the cross-model job;
    :class:`SlurmError` (and nothing queued) when Slurm refuses a job."""
    import submitit

    rn = script_module("run_notebooks")
    check_slurm(opts.partition)
    plans = []
    for args, plan in runs:
        stale, deps = to_run(rn, args, plan)
        costs = rn.last_costs(rn.read_timings(plan.figures / args.model.replace("/", "__") / "timings.csv"))
        plans.append((args, plan, stale, deps, {n: resources(costs, n) for n in stale}))
    biggest = [r for *_, res in plans for r in res.values()] or [Resources(MIN_MEM_MIB, MIN_MINUTES)]
    test_submission(Resources(max(r.mem_mib for r in biggest), max(r.minutes for r in biggest)), opts)
    check_idle(runs)
    records: list[JobRecord] = []
    try:
        reports: list[str] = []
        for args, plan, stale, deps, res in plans:
            safe = args.model.replace("/", "__")
            if plan.changes and not plan.explicit:  # as a local run: a new scratch folder starts as the committed one
                rn.seed_scratch(plan.figures / safe, rn.ROOT / "figures" / safe)
            logs = Path(args.out) / "slurm" / "logs"
            ex = submitit.SlurmExecutor(folder=logs, max_num_timeout=0)
            ids: dict[str, str] = {}
            mine: list[JobRecord] = []
            for name in stale:
                after = [ids[d] for d in deps[name] if d in ids]
                ex.update_parameters(
                    job_name=f"{Path(args.model).name}:{name[:2]}", **sbatch_options(res[name], opts, after)
                )
                path = next(p for p in plan.paths if p.stem == name)
                job = ex.submit(notebook_job, args, str(path), plan.by_notebook.get(name, {}))
                ids[name] = job.job_id
                mine.append(
                    JobRecord(
                        args.model, name, job.job_id, str(job.paths.stdout), str(Path(args.out) / f"{name}.log"), after
                    )
                )
            if opts.report:
                ex.update_parameters(
                    job_name=f"{Path(args.model).name}:report",
                    **sbatch_options(REPORT_JOB, opts, list(ids.values()), gpus=False),
                )
                job = ex.submit(report_job, args, [str(p) for p in plan.paths], stale)
                reports.append(job.job_id)
                mine.append(JobRecord(args.model, "report", job.job_id, str(job.paths.stdout), "", list(ids.values())))
            records += mine
        if opts.report:
            args = runs[0][0]
            ex.update_parameters(job_name="cross-model", **sbatch_options(REPORT_JOB, opts, reports, gpus=False))
            job = ex.submit(cross_job, args.figures)
            records.append(JobRecord("(all)", "cross-model", job.job_id, str(job.paths.stdout), "", reports))
    except Exception as err:  # Slurm refused a job: take back those queued
        if records:
            subprocess.run(["scancel", *[r.job_id for r in records]], capture_output=True)
        raise SlurmError(
            f"Slurm refused a job ({_message(str(err))}); the {len(records)} jobs queued before it were cancelled"
        ) from None
    for args, plan, stale, *_ in plans:
        mine = [r for r in records if r.model in (args.model, "(all)")]
        write_text(
            _record_file(args),
            json.dumps(
                {
                    "submitted": time.time(),
                    "up_to_date": [p.stem for p in plan.paths if p.stem not in stale],
                    "jobs": [asdict(r) for r in mine],
                },
                indent=1,
            )
            + "\n",
        )
    return records


def status_lines(runs: list[tuple[argparse.Namespace, Any]]) -> tuple[list[str], bool, bool]:
    """(a line per job of each model's last submission: its state and log; whether any
    is still queued or running; whether any failed or was cancelled)."""
    lines, active, failed = [], False, False
    seen: set[str] = set()
    for args, _plan in runs:
        path = _record_file(args)
        if not path.is_file():
            lines.append(f"{args.model}: nothing submitted to Slurm yet for these settings ({path} not found)")
            continue
        record = json.loads(path.read_text())
        jobs = [r for r in _records(args) if r.job_id not in seen]
        seen |= {r.job_id for r in jobs}
        known = states([r.job_id for r in jobs])
        lines += [f"{args.model:<12} {n:<28} up to date (not submitted)" for n in record.get("up_to_date", [])]
        for r in jobs:
            state = known.get(r.job_id) or _ended(r)
            base = state.split()[0]
            active |= base in ACTIVE
            bad = base not in ACTIVE and base != "COMPLETED"
            failed |= bad
            if base == "FAILED" and r.notebook_log and Path(r.notebook_log).is_file():
                where = f"notebook log {r.notebook_log} (job log {r.log})"
            elif base == "CANCELLED" and "Dependency" in state:
                where = "did not run: a job it waits for failed"
            else:
                where = f"log {r.log}"
            lines.append(f"{r.model:<12} {r.name:<28} job {r.job_id:<8} {state:<12} {where}")
    return lines, active, failed


def _ended(r: JobRecord) -> str:
    """The state of a job Slurm forgot: from submitit's result file."""
    result = Path(r.log).parent / f"{r.job_id}_0_result.pkl"
    if not result.is_file():
        return "ENDED (unknown to Slurm now, no result)"
    import pickle

    with result.open("rb") as f:
        outcome = pickle.load(f)[0]
    return "COMPLETED" if outcome == "success" else "FAILED"


def wait(runs: list[tuple[argparse.Namespace, Any]], every_s: float = 5.0) -> int:
    """Wait until no job of the submission is queued or running; print the status; 0 when
    every job completed, else 1."""
    while True:
        lines, active, failed = status_lines(runs)
        if not active:
            print("\n".join(lines), flush=True)
            return 1 if failed else 0
        time.sleep(every_s)
