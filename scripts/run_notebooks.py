"""Execute the numbered notebooks with papermill, several at once, for run_all.sh
(``python -m arithlib run``: arithlib/cli.py checks the options and calls :func:`check`
and :func:`run`; ``main`` below is this script's own argparse front end).

    run_notebooks.py --model M --device D [--dtype T] [--device-map MAP]
                     [--quick Q] [--seed S] [--param NAME VALUE ...]
                     [--figures FIG] [--out OUT] [--only NN,NN] [--force] [--jobs N]
                     [--threads T] [--notebooks DIR] [--progress-every S] [--print-figures]
                     [--report]

Why several at once: on a CPU a notebook's kernel keeps its cores busy only while it
runs large matrix products; tokenising, Python loops, small passes and each kernel's
start (about 15 s of imports and model loading) leave one core of two idle. Two
notebooks of one thread each fill both cores (measured on the 2-core build machine:
notebooks 03 and 07 take 248 s one after the other with two threads each and 202 s
side by side with one thread each). ``--jobs 1`` runs them one after the other.

Determinism: every notebook runs with the same number of torch threads (``--threads``,
default: the cores divided by ``--jobs``, or every core when one notebook runs at a time:
``--jobs 1`` or a single notebook selected), whatever runs beside it, and that number is
part of the notebook's cache key, since the rounding of float sums depends on it. So
the same command on the same machine gives the same tables, and ``--only 03`` with the
full run's ``--threads`` (1 on two cores) gives the tables that notebook gets in the
full run.

Order: a notebook starts once the notebooks whose tables it reads (``run_key.upstream``)
have finished; among those ready, the one heading the longest remaining chain of
expected times goes first (the times and peak memory of the last run, from
``FIG/<model>/timings.csv``), and a notebook starts beside others only if the sum of
their peak memories fits in 90 % of RAM (one whose peak is unknown runs alone). The
order changes when notebooks finish, never what they compute.

A notebook whose cache key (``run_key.py``) is unchanged since its last successful run
is skipped (``--force`` reruns it).

Placement and precision: ``--dtype`` (auto: bfloat16 on a GPU, float32 on a
CPU) and ``--device-map`` (auto, balanced, or a JSON object ``{module: device}``) become the notebooks' ``dtype`` and
``device_map`` parameters (``arithlib.core.models.load_model`` splits the model through
TransformerLens/accelerate). A bad value stops the run before any notebook starts. They
enter the cache key only when they differ from float32 on one device, the setting of every
run before them. After a failure no new notebook starts; the ones
running finish, and the script exits 1 naming the failed notebook and its log.

Parameters: ``--param NAME VALUE`` (run_all.sh's ``-p``) sets a variable of the notebooks'
``parameters`` cells, only in the notebooks that declare it, typed as its default there
(a boolean takes only true or false, in any case); a name that no selected notebook
declares is an error naming the closest one (papermill would only warn); a list's
items are each checked against the default's (``notebook_files.typed_value``). ``--quick``
says which values it sets in each notebook and never replaces a ``-p`` value: the
notebook runs with that value restated after its ``if quick:`` block.

Where results go: figures and tables to ``FIG/<model>/``, each executed notebook, without
widget state, to ``FIG/<model>/notebooks/NN_name.ipynb`` and ``.html``
(``notebook_files.py``), keys, logs and papermill's raw copies to ``OUT``. A run that
differs from the configuration of the committed figures (``--quick``, a ``--seed`` other
than 0, any ``--param``) writes, unless ``--figures`` is given, to
``outputs/scratch/figures`` and ``outputs/scratch/<model>`` instead of ``figures`` and
``outputs/<model>``, so the committed figures are never overwritten by accident; a new
scratch folder starts as a copy of the committed one, so a notebook run alone there
finds the tables of the notebooks before it.

One run at a time: a run holds an exclusive lock on ``OUT`` and on ``FIG/<model>/``
(``run_lock.py``) from its start to its end (the report included); a second run on
either stops at once, naming the first (pid and command); the lock of a run that was
killed is taken over.

Staging: a notebook writes into ``OUT/staging/run-<time>-<pid>/<notebook>/<model>/``
(this run's own folder), a copy of ``FIG/<model>/`` without that notebook's own files
(``NN_*``) and without the executed copies. Only when it succeeds do its files replace
its old ones in ``FIG/<model>/``, whole or not at all (``staging.py``: copied next to the
figures, renamed into place, and only then is every ``NN_*`` file of its last run that it
did not write again removed, so no stale table of an earlier configuration stays beside
the new ones). A notebook that fails or is interrupted, or whose files cannot be moved
in (a full disk: one line saying so), leaves the figures as they were; what it wrote
stays in its staging folder until the next run.

Stopping: SIGINT, SIGTERM and SIGHUP (a closed terminal) stop the running notebooks'
process groups and wait for them; each notebook runs under ``peak_memory.py``, which
also stops papermill and the kernel when this process ends in any other way (SIGKILL),
so no notebook outlives its run.

Progress: every ``--progress-every`` seconds (default 60) a line per running notebook
gives its cells done (from papermill's progress bar) and its minutes so far against its
last run's (``FIG/<model>/timings.csv``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
from notebook_files import (  # noqa: E402
    RUN_PARAMETERS,  # noqa: F401
    keep_over_quick,
    params_by_notebook,
    publish,
    quick_report,
    quick_settings,
    yaml_parameters,
)
from run_key import run_key, upstream  # noqa: E402
from run_lock import Locked, lock_all  # noqa: E402
from staging import CARRIED, PromoteError, promote, remove_leftovers, seed_scratch, stage  # noqa: E402,F401

from arithlib.run.atomic import write_text  # noqa: E402  (the standard library only)

ROOT = SCRIPTS.parent
MEMORY_SHARE = 0.9  # of physical RAM that notebooks running side by side may take together
#: papermill's progress bar ("Executing:  40%|####      | 12/30 [...]"): cells done, cells.
_PROGRESS = re.compile(rb"Executing[^|\r\n]*\|[^|\r\n]*\|\s*(\d+)/(\d+)")


@dataclass
class Notebook:
    """One notebook to run: its upstream notebooks (names) and its last run's cost."""

    path: Path
    deps: list[str] = field(default_factory=list)
    expected_s: float = 1.0
    expected_mib: float | None = None
    measured: bool = False  # expected_s is a previous run's time (else a placeholder)
    params: dict = field(default_factory=dict)  # --param values this notebook declares

    @property
    def name(self) -> str:
        return self.path.stem


def remaining_chain(notebooks: dict[str, Notebook]) -> dict[str, float]:
    """Expected seconds from each notebook's start to the end of the longest chain of
    notebooks that wait on it (its own time included): the scheduling priority."""
    downstream: dict[str, list[str]] = {n: [] for n in notebooks}
    for nb in notebooks.values():
        for d in nb.deps:
            if d in downstream:
                downstream[d].append(nb.name)
    memo: dict[str, float] = {}

    def chain(name: str) -> float:
        if name not in memo:
            memo[name] = notebooks[name].expected_s + max((chain(c) for c in downstream[name]), default=0.0)
        return memo[name]

    return {n: chain(n) for n in notebooks}


def pick(
    ready: list[str], running: list[str], notebooks: dict[str, Notebook], jobs: int, budget_mib: float | None
) -> str | None:
    """The ready notebook to start now, or None: the one with the longest remaining
    chain (ties: the lower number) if fewer than ``jobs`` run and its expected peak
    memory fits beside theirs in ``budget_mib`` (None: no limit)."""
    if not ready or len(running) >= jobs:
        return None
    priority = remaining_chain(notebooks)
    for name in sorted(ready, key=lambda n: (-priority[n], n)):
        if not running or budget_mib is None:
            return name
        if sum(notebooks[n].expected_mib or 0.0 for n in running + [name]) <= budget_mib:
            return name
    return None


def read_timings(timings_csv: Path) -> dict[str, dict[str, str]]:
    """The rows of a previous run's ``timings.csv`` by notebook (empty if there is none)."""
    if not timings_csv.is_file():
        return {}
    with timings_csv.open() as f:
        return {row["notebook"]: row for row in csv.DictReader(f)}


def notebook_floor(fig: Path, name: str, seconds: str | float) -> tuple[str, str]:
    """(GFLOP, ratio to floor) of notebook ``name`` as cells of ``timings.csv``, from the
    ``total`` row of its ``NN_timings.csv`` in ``fig`` (:mod:`arithlib.run.floor`): the
    arithmetic its sections counted, and ``seconds`` (the notebook's whole wall time, kernel
    start and loading included) over that arithmetic's time at the peak it measured. Empty
    cells when the table predates the count or has no arithmetic."""
    import gzip

    for path in (fig / f"{name[:2]}_timings.csv", fig / f"{name[:2]}_timings.csv.gz"):
        if path.is_file():
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt") as f:
                total = next((r for r in csv.DictReader(f) if r.get("section") == "total"), None)
            break
    else:
        return "", ""
    try:
        gflop, peak = float(total["gflop"]), float(total["peak_gflop_s"])
        ratio = float(seconds) / (gflop / peak)
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        return "", ""
    if not (gflop > 0 and peak > 0):
        return "", ""
    return f"{gflop:.1f}", f"{ratio:.2f}"


def last_costs(rows: dict[str, dict[str, str]]) -> dict[str, tuple[float, float | None]]:
    """(seconds, peak MiB) of each notebook in :func:`read_timings`'s rows."""
    costs: dict[str, tuple[float, float | None]] = {}
    for name, row in rows.items():
        try:
            seconds = float(row["seconds"])
        except (KeyError, ValueError):
            continue
        try:
            peak = float(row.get("peak_rss_mib") or "")
        except ValueError:
            peak = None
        costs[name] = (seconds, peak)
    return costs


def physical_memory_mib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        return None


def select_notebooks(notebooks: str | Path, only: str = "") -> list[Path]:
    """The numbered notebooks of the folder ``notebooks``, those of ``only`` ("00,03")
    alone if given; an ``only`` that matches none is an error."""
    paths = sorted(Path(notebooks).glob("[0-9][0-9]_*.ipynb"))
    wanted = {s.strip() for s in only.split(",") if s.strip()}
    if not wanted:
        return paths
    chosen = [p for p in paths if p.name[:2] in wanted]
    if not chosen:
        raise SystemExit(
            f"run_all.sh: --only {only} matches no notebook in {notebooks} (give two-digit numbers, e.g. --only 00,03)"
        )
    return chosen


def changed_settings(quick: str, seed: int, params: dict[str, object]) -> list[str]:
    """How a run differs from the configuration of the committed figures (not quick,
    seed 0, every notebook's default parameters): the options that make it so."""
    changes = ["--quick"] if str(quick).strip().lower() in ("true", "1") else []
    if int(seed) != 0:
        changes.append(f"--seed {seed}")
    return changes + [f"-p {name}" for name in params]


def output_folders(
    root: Path, model: str, figures: str | None, out: str | None, changes: list[str]
) -> tuple[Path, Path]:
    """(figures root, outputs folder) of a run: those given, else ``root/figures`` and
    ``root/outputs/<model>``, or, for a run with ``changes``, their scratch twins
    ``root/outputs/scratch/figures`` and ``root/outputs/scratch/<model>``."""
    scratch = root / "outputs" / "scratch"
    fig = Path(figures).absolute() if figures else (scratch / "figures" if changes else root / "figures")
    out_dir = Path(out).absolute() if out else (scratch if changes else root / "outputs") / model.replace("/", "__")
    return fig, out_dir


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def progress_line(name: str, cells: tuple[int, int] | None, elapsed_s: float, expected_s: float | None) -> str:
    """One notebook's progress for the console: cells done (papermill's count), time so
    far and the last run's time (``expected_s``; None: no earlier run)."""
    done = f"{cells[0]}/{cells[1]} cells" if cells else "starting"
    if expected_s is None:
        return f"{name}: {done}, {_minutes(elapsed_s)} min (no earlier run to compare)"
    if elapsed_s <= expected_s:
        return f"{name}: {done}, {_minutes(elapsed_s)} of ~{_minutes(expected_s)} min"
    return f"{name}: {done}, {_minutes(elapsed_s)} min (the last run took {_minutes(expected_s)})"


class Interrupted(Exception):
    """The run received a signal that stops it (SIGINT, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def say(msg: str, err: bool = False) -> None:
    """Print ``msg`` to the console (stderr with ``err``); a closed terminal is no error."""
    try:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)
    except OSError:
        pass


class Runner:
    """Starts notebooks in the order above and records their keys, times and peaks."""

    def __init__(
        self,
        args: argparse.Namespace,
        paths: list[Path],
        params: dict[str, dict[str, object]],
        staging: Path | None = None,
        timings: bool = True,
    ):
        """Run ``paths`` (selected notebooks), each with its ``params`` (--param values).
        ``staging``: this run's own staging folder, for a run beside others on the same
        folders (a cluster job, ``arithlib.run.slurm``): the other runs' staging folders and
        leftovers are then left alone. ``timings``: write the timings tables at the end."""
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.fig = Path(args.figures) / args.model.replace("/", "__")
        self.fig.mkdir(parents=True, exist_ok=True)
        self.params = key_parameters(args)
        self.timings = timings
        self.previous = read_timings(self.fig / "timings.csv")
        costs = last_costs(self.previous)
        known = [peak for _, peak in costs.values() if peak is not None]
        unknown_peak = max(known, default=None)  # a notebook not measured yet: the model's largest peak
        self.notebooks: dict[str, Notebook] = {}
        for p in paths:
            seconds, peak = costs.get(p.stem, (1.0, None))
            self.notebooks[p.stem] = Notebook(
                p,
                [d.stem for d in upstream(p)],
                seconds,
                peak if peak is not None else unknown_peak,
                measured=p.stem in costs,
                params=params.get(p.stem, {}),
            )
        self.pending = list(self.notebooks)
        self.keys: dict[str, str] = {}  # computed once a notebook is ready: its inputs are final then
        self.running: dict[str, tuple[subprocess.Popen, float, threading.Thread]] = {}
        self.cells: dict[str, tuple[int, int]] = {}  # cells done, cells: from papermill's progress bar
        self.publishing: list[threading.Thread] = []
        self.staged: dict[str, tuple[Path, float]] = {}  # notebook: its staging folder, when it was made
        self.last_progress = time.time()
        self.rows: list[dict] = []
        self.failed: str | None = None
        self.t0 = time.time()
        self.budget = physical_memory_mib()
        self.budget = self.budget * MEMORY_SHARE if self.budget else None
        if staging is not None:
            self.staging = staging
            return
        # this run's own staging folder; earlier runs' (kept for a look after a failure) go now
        self.staging = self.out / "staging" / time.strftime(f"run-%Y%m%d-%H%M%S-{os.getpid()}")
        for old in (self.out / "staging").glob("*") if (self.out / "staging").is_dir() else []:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
        remove_leftovers(self.fig)

    def log(self, msg: str) -> None:
        say(f"=== [{time.time() - self.t0:5.0f}s] {msg}")

    def _ready(self) -> list[str]:
        """Pending notebooks whose selected upstream notebooks have all finished."""
        waiting = set(self.pending) | set(self.running)
        return [n for n in self.pending if not any(d in waiting for d in self.notebooks[n].deps)]

    def _start(self, name: str) -> None:
        a, nb = self.args, self.notebooks[name]
        (self.out / f"{name}.key").unlink(missing_ok=True)
        model_dir = self.fig.name
        staged = stage(self.fig, self.staging / name, model_dir, name)
        self.staged[name] = (staged, time.time())
        source = nb.path
        if is_quick(a.quick) and nb.params and quick_settings(nb.path):  # quick mode keeps the -p values
            source = self.staging / name / nb.path.name
            source.write_text(json.dumps(keep_over_quick(json.loads(nb.path.read_text()), nb.params), indent=1))
        cmd = [
            sys.executable,
            str(SCRIPTS / "peak_memory.py"),
            str(self.out / f"{name}.peak_mib.tmp"),
            sys.executable,
            "-m",
            "papermill",
            str(source),
            str(self.out / f"{name}.ipynb"),
            "--cwd",
            str(nb.path.parent),
            "-k",
            "python3",
            "-p",
            "model",
            a.model,
            "-p",
            "device",
            a.device,
            "-p",
            "quick",
            a.quick,
            "-p",
            "seed",
            str(a.seed),
            "-p",
            "out_dir",
            os.path.relpath(staged.parent, nb.path.parent),
        ]  # relative: no machine path recorded
        placement = placement_parameters(a.dtype, a.device_map_value)
        if nb.params or placement:  # YAML keeps their types (papermill's -p would make a list a string)
            cmd += ["-y", yaml_parameters({**placement, **nb.params})]
        env = dict(os.environ, ARITHLIB_RUNNER_PID=str(os.getpid()))  # peak_memory.py ends with this run
        if a.threads:
            env.update(OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
        # peak_memory.py holds this run's locks too: they outlast a killed run until its notebooks are stopped
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=getattr(a, "lock_fds", ()),
        )
        echo = a.jobs == 1
        log_path = self.out / f"{name}.log"

        def copy() -> None:  # the notebook's output to its log (and the console when alone)
            tail = b""
            with log_path.open("wb") as log:
                for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                    log.write(chunk)
                    log.flush()
                    bars = _PROGRESS.findall(tail + chunk)  # the bar redraws with "\r": read chunks, not lines
                    if bars:
                        self.cells[name] = (int(bars[-1][0]), int(bars[-1][1]))
                    tail = (tail + chunk)[-200:]
                    if echo:
                        sys.stdout.buffer.write(chunk)
                        sys.stdout.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        self.running[name] = (proc, time.time(), reader)
        extra = "".join(f" {k}={v!r}" for k, v in nb.params.items())
        self.log(
            f"{name} started (model={a.model} device={a.device} quick={a.quick} seed={a.seed}{extra} "
            f"threads={a.threads or 'default'}; log {log_path})"
        )

    def _publish(self, name: str) -> None:
        """Write ``name``'s executed notebook, stripped, and its HTML beside the figures
        (``FIG/<model>/notebooks/``), in the background; a failure is reported, not fatal."""

        def work() -> None:
            try:
                publish(
                    self.out / f"{name}.ipynb",
                    self.fig / "notebooks",
                    figures=os.path.relpath(self.args.figures, self.args.notebooks),
                )
            except Exception as err:  # the tables are written: say what is missing, go on
                print(
                    f"run_all.sh: could not write {name}'s executed copy to {self.fig / 'notebooks'} "
                    f"({type(err).__name__}: {err}); rerun scripts/notebook_files.py publish "
                    f"{self.out / name}.ipynb {self.fig / 'notebooks'}",
                    file=sys.stderr,
                    flush=True,
                )

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        self.publishing.append(thread)

    def _report_progress(self) -> None:
        """Every ``--progress-every`` seconds, a line per running notebook."""
        now = time.time()
        if not self.running or now - self.last_progress < self.args.progress_every:
            return
        self.last_progress = now
        for name, (_, start, _) in self.running.items():
            nb = self.notebooks[name]
            self.log(progress_line(name, self.cells.get(name), now - start, nb.expected_s if nb.measured else None))

    def _finish(self, name: str, status: int) -> None:
        proc, start, reader = self.running.pop(name)
        reader.join()
        end = time.time()
        secs = round(end - start)
        tmp_peak = self.out / f"{name}.peak_mib.tmp"
        peak = tmp_peak.read_text().strip() if tmp_peak.is_file() else "NA"
        row = {"notebook": name, "seconds": secs, "start_s": round(start - self.t0), "end_s": round(end - self.t0)}
        staged, since = self.staged.pop(name)
        if status == 0:
            try:
                promote(staged, self.fig, name, since)
            except PromoteError as err:
                self.rows.append({**row, "status": "failed", "peak_rss_mib": peak})
                self.failed = self.failed or name
                say(f"run_all.sh: notebook {name} ran, but {err.strerror}", err=True)
                return
            shutil.rmtree(staged.parent, ignore_errors=True)
            write_text(self.out / f"{name}.key", self.keys[name] + "\n")
            write_text(self.out / f"{name}.seconds", f"{secs}\n")
            write_text(self.out / f"{name}.peak_mib", peak + "\n")
            tmp_peak.unlink(missing_ok=True)
            self.rows.append({**row, "status": "ok", "peak_rss_mib": peak})
            self.log(f"{name} done in {secs}s")
            self._publish(name)
        else:
            self.rows.append({**row, "status": "failed", "peak_rss_mib": peak})
            self.failed = self.failed or name
            say(
                f"run_all.sh: notebook {name} FAILED (exit {status}) after {secs}s; see {self.out / name}.ipynb and "
                f"{self.out / name}.log. {self.fig} keeps its last successful outputs; what this run wrote "
                f"is in {staged}.",
                err=True,
            )

    def _skip_unchanged(self) -> bool:
        """Compute the cache key of each newly ready notebook and mark it done if the key
        is unchanged since its last successful run (not with ``--force``); whether any was."""
        skipped = False
        for name in self._ready():
            if name in self.keys:
                continue
            nb = self.notebooks[name]
            params = notebook_key_parameters(self.params, nb.params)
            key = self.keys[name] = run_key(nb.path, self.out, params)
            sfile = self.out / f"{name}.seconds"
            if up_to_date(self.out, name, key, self.args.force):
                self.pending.remove(name)
                self.rows.append(
                    {
                        "notebook": name,
                        "status": "cached",
                        "seconds": sfile.read_text().strip() if sfile.is_file() else "NA",
                    }
                )
                self.log(f"{name} is up to date (key {key}); skipped (--force reruns it)")
                if not (self.fig / "notebooks" / f"{name}.ipynb").is_file() and (self.out / f"{name}.ipynb").is_file():
                    self._publish(name)  # a run from before executed copies were published
                skipped = True
        return skipped

    def run(self) -> int:
        """Run the notebooks; 0 when all succeeded, 1 after a failure, 128 + the signal
        when stopped by SIGINT, SIGHUP or SIGTERM."""

        def stop(signum, frame):  # a kill of run_all.sh, or its terminal closing, stops the notebooks too
            raise Interrupted(signum)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        """:meth:`run` under its signal handlers."""
        try:
            while self.pending or self.running:
                for name in list(self.running):
                    status = self.running[name][0].poll()
                    if status is not None:
                        self._finish(name, status)
                if self.failed:
                    self.pending = []
                while self._skip_unchanged():
                    pass
                name = pick(self._ready(), list(self.running), self.notebooks, self.args.jobs, self.budget)
                if name is not None:
                    self.pending.remove(name)
                    self._start(name)
                    continue
                self._report_progress()
                time.sleep(0.5)
        except (Interrupted, KeyboardInterrupt) as exc:
            signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal: stop as well, once
                signal.signal(sig, signal.SIG_IGN)
            self._stop_running()
        except OSError as err:  # a full disk while staging, say: stop what runs, keep what finished
            signum = None
            self._stop_running()
            self.failed = self.failed or "(the run)"
            say(
                f"run_all.sh: {err.strerror or err}{f' ({err.filename})' if err.filename else ''}; the run stopped; "
                f"{self.fig} keeps the outputs of the notebooks that finished",
                err=True,
            )
        else:
            signum = None
        for thread in self.publishing:  # the notebooks that finished keep their outputs and timings
            thread.join()
        try:
            if self.timings:
                self.write_timings()
        except OSError as err:
            say(f"run_all.sh: could not write the timings ({err.strerror or err}: {err.filename})", err=True)
        if signum is not None:
            say(
                f"run_all.sh: stopped ({signal.Signals(signum).name}); the running notebooks were stopped and keep "
                f"no key; their figures folder keeps its last successful outputs (what they wrote is in "
                f"{self.staging}); the notebooks that finished keep their outputs, keys and timings",
                err=True,
            )
            return 128 + signum
        if self.failed:
            say(f"run_all.sh: what the other notebooks produced is kept in {self.fig}/.", err=True)
            return 1
        self.log(
            f"all notebooks done in {time.time() - self.t0:.0f}s (jobs={self.args.jobs}, "
            f"threads={self.args.threads or 'default'}); timings in {self.out / 'timings.csv'}"
        )
        return 0

    def _stop_running(self, grace_s: float = 30.0) -> None:
        """Stop every running notebook: SIGTERM to its process group (peak_memory.py, which
        stops papermill and the kernel), SIGKILL to what is left after ``grace_s`` seconds."""
        for proc, *_ in self.running.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        for proc, *_ in self.running.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def write_timings(self) -> None:
        """This run's rows (``OUT/timings.csv``) and, beside the figures, every notebook's
        last successful run (wall seconds, whether it ran now, peak MiB, start and end
        seconds from the start of this run, and the GFLOP its sections did with the ratio of
        its seconds to their floor: :func:`notebook_floor`). A notebook skipped as up to date
        ran with this run's threads, which its key holds; one not selected keeps its old row's."""
        cols = ["notebook", "seconds", "status", "peak_rss_mib", "start_s", "end_s"]
        lines = [",".join(cols)] + [",".join(str(r.get(c, "")) for c in cols) for r in self.rows]
        write_text(self.out / "timings.csv", "\n".join(lines) + "\n")
        ran = {r["notebook"]: r for r in self.rows if r["status"] == "ok"}
        # skipped now as up to date: its key, which holds the thread count, is this run's
        matched = {r["notebook"] for r in self.rows if r["status"] == "cached"}
        out = ["notebook,seconds,this_run,peak_rss_mib,threads,start_s,end_s,gflop,ratio_to_floor"]
        for p in sorted(Path(self.args.notebooks).glob("[0-9][0-9]_*.ipynb")):
            name = p.stem
            if name in ran:
                r = ran[name]
                floor = notebook_floor(self.fig, name, r["seconds"])
                out.append(
                    f"{name},{r['seconds']},ran,{r['peak_rss_mib']},{self.args.threads or 'default'},"
                    f"{r['start_s']},{r['end_s']},{floor[0]},{floor[1]}"
                )
            elif (self.out / f"{name}.seconds").is_file() or self.previous.get(name, {}).get("seconds"):
                # not run now: its last run's row, from this machine's outputs or else (a fresh
                # clone with committed figures) from the timings.csv this run replaces
                old = self.previous.get(name, {})
                sfile, pfile = self.out / f"{name}.seconds", self.out / f"{name}.peak_mib"
                seconds = sfile.read_text().strip() if sfile.is_file() else old["seconds"]
                peak = pfile.read_text().strip() if pfile.is_file() else old.get("peak_rss_mib") or "NA"
                threads = (self.args.threads or "default") if name in matched else (old.get("threads") or "NA")
                floor = notebook_floor(self.fig, name, seconds)
                out.append(f"{name},{seconds},cached,{peak},{threads},,,{floor[0]},{floor[1]}")
        write_text(self.fig / "timings.csv", "\n".join(out) + "\n")


def key_parameters(args: argparse.Namespace) -> list[str]:
    """The run's settings that enter every notebook's cache key (``run_key.run_key``'s
    ``params``, before the notebook's own ``--param`` values)."""
    params = [args.model, args.device, args.quick, str(args.seed), str(args.figures)]
    if args.threads != 0:  # keys of runs before threads were recorded stay valid for torch's default
        params.append(f"threads={args.threads}")
    return params + placement_key(args.device, args.dtype, args.device_map_value)


def notebook_key_parameters(run_params: list[str], notebook_params: dict[str, object]) -> list[str]:
    """:func:`key_parameters` with one notebook's ``--param`` values added."""
    return run_params + [f"{k}={v!r}" for k, v in sorted(notebook_params.items())]


def up_to_date(out: Path, name: str, key: str, force: bool) -> bool:
    """Whether notebook ``name``'s last successful run (its key in ``out``) has ``key``;
    never with ``force`` (--force)."""
    kfile = out / f"{name}.key"
    return not force and kfile.is_file() and kfile.read_text().strip() == key


def placement_parameters(dtype: str, device_map) -> dict[str, object]:
    """The notebooks' ``dtype`` / ``device_map`` parameters a run sets (none at their
    defaults, "auto" and None: the notebooks keep their own)."""
    out: dict[str, object] = {}
    if dtype != "auto":
        out["dtype"] = dtype
    if device_map is not None:
        out["device_map"] = device_map
    return out


def placement_key(device: str, dtype: str, device_map) -> list[str]:
    """What ``--dtype`` / ``--device-map`` add to the cache key: nothing for float32 on
    one device (every run before placement was recorded), else the resolved dtype and the map."""
    sys.path.insert(0, str(ROOT))
    try:
        from arithlib.core.devices import resolve_dtype
    finally:
        sys.path.pop(0)
    key = []
    resolved = str(resolve_dtype(dtype, device)).removeprefix("torch.")  # the library's reading of "auto", aliases
    if resolved != "float32":
        key.append(f"dtype={resolved}")
    if device_map is not None:
        import json

        key.append(f"device_map={json.dumps(device_map, sort_keys=True)}")
    return key


def check_placement(dtype: str, device_map: str | None) -> tuple[str, str | dict | None]:
    """``(dtype, device map as the notebooks get it)`` after checking them with
    :mod:`arithlib.core.models`' own parsers: SystemExit with its message for a bad value."""
    sys.path.insert(0, str(ROOT))
    try:
        from arithlib.core.devices import parse_device_map, resolve_dtype
    finally:
        sys.path.pop(0)
    try:
        if dtype != "auto":
            resolve_dtype(dtype)
        return dtype, parse_device_map(device_map)
    except ValueError as exc:
        raise SystemExit(f"run_all.sh: {exc}") from None


def default_jobs(device: str, cores: int) -> int:
    """Two notebooks at once on a CPU with at least two cores; one at a time on a GPU
    (two models in one GPU's memory would cap the model size)."""
    return 2 if device == "cpu" and cores >= 2 else 1


def default_threads(jobs: int, cores: int, n_notebooks: int) -> int:
    """Torch threads per notebook when ``--threads`` is not given: every core when one
    notebook runs at a time (``--jobs 1``, or a single notebook selected), else the cores
    divided by ``jobs``."""
    if min(jobs, n_notebooks) <= 1:
        return max(1, cores)
    return max(1, cores // jobs)


def parser() -> argparse.ArgumentParser:
    """This script's own arguments (``arithlib.cli`` builds the same namespace itself)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        default=None,
        help="keys, logs, raw executed notebooks (default: outputs/<model>, or outputs/scratch/<model>)",
    )
    ap.add_argument(
        "--figures",
        default=None,
        help="figures root (default: figures, or outputs/scratch/figures for a run with changed settings)",
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", required=True, help="the notebooks' device parameter (cpu, cuda, auto, ...)")
    ap.add_argument("--resolved-device", default=None, help="what --device resolves to here (picks the default --jobs)")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16")
    ap.add_argument("--device-map", default=None, help="split the model: auto, balanced or a JSON {module: device}")
    ap.add_argument("--quick", default="False")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--param",
        "-p",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="set a notebook parameter, typed as its default there; repeatable",
    )
    ap.add_argument("--only", default="")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--jobs", type=int, default=None, help="notebooks at once (default: 2 on a CPU, 1 on a GPU)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per notebook (default: every core for one notebook at a time, else "
        "cores // jobs; 0: torch's default)",
    )
    ap.add_argument("--notebooks", default=str(ROOT / "notebooks"))
    ap.add_argument("--progress-every", type=float, default=60.0, help="seconds between progress lines")
    ap.add_argument(
        "--print-figures",
        action="store_true",
        help="check the options, print the figures root this run would use, and exit",
    )
    ap.add_argument(
        "--report",
        action="store_true",
        help="after the notebooks, write the report (and the cross-model one), still holding the lock",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run(args, check(args))


@dataclass
class Plan:
    """What :func:`check` makes of a run's options."""

    paths: list[Path]  # the selected notebooks
    by_notebook: dict[str, dict[str, object]]  # each notebook's --param values, typed
    changes: list[str]  # how the run differs from the committed configuration
    explicit: bool  # --figures was given
    figures: Path
    out: Path


def check(args: argparse.Namespace) -> Plan:
    """Check every option before anything runs or is written, and fill in the defaults
    of ``args`` (``jobs``, ``threads``, ``device_map_value``): SystemExit with a one-line
    message for a bad value."""
    params = dict(args.param)
    args.dtype, args.device_map_value = check_placement(args.dtype, args.device_map)
    paths = select_notebooks(args.notebooks, args.only)
    by_notebook = params_by_notebook(params, paths)
    changes = changed_settings(args.quick, args.seed, params)
    explicit = args.figures is not None
    figures, out = output_folders(ROOT, args.model, args.figures, args.out, changes)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if args.jobs is None:
        args.jobs = default_jobs(args.resolved_device or args.device, cores)
    if args.jobs < 1:
        raise SystemExit(f"run_all.sh: --jobs must be at least 1, not {args.jobs}")
    if args.threads is None:
        args.threads = default_threads(args.jobs, cores, len(paths))
    if args.threads < 0:
        raise SystemExit(f"run_all.sh: --threads must be 0 (torch's default) or more, not {args.threads}")
    return Plan(paths, by_notebook, changes, explicit, figures, out)


def run(args: argparse.Namespace, plan: Plan) -> int:
    """Run the notebooks of ``plan`` (:func:`check`'s) under the lock, then the report
    (``--report``); the exit status."""
    paths, by_notebook, changes, figures, out = plan.paths, plan.by_notebook, plan.changes, plan.figures, plan.out
    if args.print_figures:
        print(figures)
        return 0
    args.figures, args.out = str(figures), str(out)
    safe = args.model.replace("/", "__")
    try:
        locks = lock_all([out, figures / safe])
    except Locked as err:
        raise SystemExit(f"run_all.sh: {err}") from None
    except OSError as err:
        raise SystemExit(f"run_all.sh: cannot lock {err.filename or out} ({err.strerror or err})") from None
    try:
        for lock in locks:
            if lock.took_over:
                say(
                    f"=== {lock.folder}: taking over the lock of a run that ended without releasing it "
                    f"(pid {lock.took_over.get('pid')}: {lock.took_over.get('command')})"
                )
        if changes and not plan.explicit:
            seeded = seed_scratch(figures / safe, ROOT / "figures" / safe)
            say(
                f"=== changed settings ({', '.join(changes)}): results go to {figures / safe}, not the committed "
                f"figures/{safe}"
                + (" (started as a copy of it)" if seeded else "")
                + "; --figures DIR chooses the folder"
            )
        if is_quick(args.quick):
            for line in quick_report(paths, by_notebook):
                say(f"=== {line}")
        args.lock_fds = [lock.fd for lock in locks]
        status = Runner(args, paths, by_notebook).run()
        if status == 0 and args.report:
            status = write_reports(figures, figures / safe)
        return status
    except OSError as err:  # a full disk, a folder that cannot be written: one line, the figures as they were
        raise SystemExit(
            f"run_all.sh: {err.strerror or err}{f' ({err.filename})' if err.filename else ''}; "
            "stopped; the figures folder keeps what the notebooks that finished wrote"
        ) from None
    finally:
        for lock in reversed(locks):
            lock.release()


def is_quick(quick: str) -> bool:
    """Whether ``--quick``'s value turns quick mode on."""
    return str(quick).strip().lower() in ("true", "1")


def write_reports(figures: Path, fig_model: Path) -> int:
    """``REPORT.md`` / ``.html`` of ``fig_model``, then the findings across every model in
    ``figures`` (the README's verdict table too when ``figures`` is the repository's own);
    the first non-zero exit status, else 0."""
    status = subprocess.call([sys.executable, "-m", "arithlib.report", str(fig_model)], cwd=ROOT)
    if status:
        return status
    readme = ["--readme", str(ROOT / "README.md")] if figures.resolve() == (ROOT / "figures").resolve() else []
    return subprocess.call([sys.executable, "-m", "arithlib.report", "--cross-in", str(figures), *readme], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
