"""arithlib's command line: ``python -m arithlib run [OPTIONS]`` executes the numbered
notebooks (what ``./run_all.sh`` runs once it has set up the environment; both take the
same options, ``--help`` lists them with the models and notebooks).

Every option is checked here, before anything runs or is written: a missing or bad
value (an unknown model, a GPU that is not there, an unknown notebook or ``-p`` name, a
``-p`` value that is not of its default's type, a model whose installed weight files
changed) stops the command with one line on stderr and exit status 2. Values are never
pasted into code: they reach the notebooks as papermill parameters, typed as each
notebook's default (``scripts/notebook_files.py``: ``typed_value``).

The run itself (scheduling, cache keys, staging, the lock, the scratch folder, the report)
is ``scripts/run_notebooks.py``'s; this module builds its options and calls it.
"""

import argparse
import ast
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from arithlib.core.models import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent  # a checkout: scripts/ and notebooks/ beside arithlib/
SCRIPTS = ROOT / "scripts"
NOTEBOOK_DIR = ROOT / "notebooks"
#: The name in the usage line and in error messages: run_all.sh sets it to its own.
PROG_ENV = "ARITHLIB_PROG"


class Bad(Exception):
    """A missing or bad value: one line, exit status 2."""


def _run_notebooks():
    """``scripts/run_notebooks.py`` as a module (it needs a checkout, not only the package)."""
    from arithlib.run.paths import script_module

    if not (SCRIPTS / "run_notebooks.py").is_file():
        raise Bad(f"the run command needs a checkout of the repository ({SCRIPTS}/run_notebooks.py not found)")
    return script_module("run_notebooks")


# --------------------------------------------------------------------------- what --help lists


def notebook_titles(folder: Path = NOTEBOOK_DIR) -> dict[str, str]:
    """Notebook name -> its title (the first markdown cell's first line, less "# NN · ")."""
    out = {}
    for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
        title = ""
        try:
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            cell = next(c for c in cells if c.get("cell_type") == "markdown")
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            title = src.strip().splitlines()[0].lstrip("# ")
            title = title.split("·", 1)[1].strip() if "·" in title else title
        except (OSError, ValueError, KeyError, IndexError, StopIteration):
            pass
        out[path.stem] = title
    return out


def model_lines() -> list[str]:
    """One line per registry model (``arithlib.core.models.known_models``), with what it is."""
    from arithlib.core import models, packaged_models

    lines = []
    for name in models.known_models():
        packaged = packaged_models.PACKAGED_MODELS.get(name)
        what = (
            packaged.description
            if packaged
            else "the small arithmetic model of arithlib.core.toy (its weights ship in data/toy/)"
        )
        lines.append(f"  {name:<20} {what}{' (default)' if name == DEFAULT_MODEL else ''}")
    return lines


def _epilog() -> str:
    """The end of ``--help``: models, notebooks, how -p values are read, where results go."""
    models = model_lines()
    notebooks = [f"  {name[:2]}  {name:<24} {title}" for name, title in notebook_titles().items()]
    return "\n\n".join(
        [
            "\b\nModels (--model):\n"
            + "\n".join(models)
            + "\n  or a local folder holding an HF model, or a hub id such as EleutherAI/pythia-6.9b",
            "\b\nNotebooks (--only takes their numbers; each runs after the notebooks whose tables it reads):\n"
            + "\n".join(notebooks),
            "\b\n-p NAME VALUE sets a variable of the notebooks' parameters cell (--list-params lists them\n"
            "with their defaults), in the notebooks that declare it, typed as its default there:\n"
            "  True/False default    true or false, in any case\n"
            "  whole-number default  a whole number (e.g. 3)\n"
            "  number default        any number (e.g. -0.1, 1e-3), as a float\n"
            '  list or tuple default a Python literal list (e.g. \'["+", "-"]\'), each item of the type\n'
            "                        of the default's items (read with ast.literal_eval, never run)\n"
            '  text or None default  a number, true/false, None or a [list] as such (the "auto"\n'
            "                        settings take a count), a quoted text ('\"8\"') as text, else the\n"
            '                        text as typed; a text default that reads as a number ("-1")\n'
            "                        takes the text as typed\n"
            "A name no selected notebook declares, one set by an option (model, device, dtype,\n"
            "device_map, quick, seed, out_dir) or a value of the wrong type stops the run before it\n"
            "starts. --quick never overrides a -p value.",
            "\b\nWhere results go: figures and tables to FIG/<model>/ (FIG: figures/, or --figures), the\n"
            "executed notebooks to FIG/<model>/notebooks/ (.ipynb and .html), keys, logs and raw\n"
            "copies to outputs/<model>/. A run with changed settings (--quick, --seed other than 0,\n"
            "any -p) writes to outputs/scratch/figures/<model>/ (first a copy of figures/<model>/),\n"
            "never over the committed figures, unless --figures says where. A notebook writes into\n"
            "its own staging folder; only when it succeeds do its files replace its old ones, whole\n"
            "or not at all. After a failing notebook (named, with its log) no other starts. A\n"
            "notebook whose code, data, parameters and input tables are unchanged since its last\n"
            "successful run is skipped (--force reruns it). One run at a time per outputs and\n"
            "figures folder: a second one stops at once, naming the first. Every minute the console\n"
            "shows each running notebook's cells done and its minutes against its last run's.",
        ]
    )


RUN_HELP = (
    "Execute the numbered notebooks (papermill), each after the notebooks whose tables it "
    "reads, then (unless --no-report) write REPORT.md / REPORT.html and the findings across models."
)


# --------------------------------------------------------------------------- the command


CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False, context_settings=CONTEXT)


@app.callback()
def _group() -> None:
    """arithlib: reimplementations of three papers on how language models do arithmetic."""


def _options(
    model: str,
    device: str,
    dtype: str,
    device_map: str | None,
    quick: bool,
    seed: int,
    param: list[tuple[str, str]],
    figures: Path | None,
    out: Path | None,
    only: str,
    force: bool,
    jobs: int | None,
    threads: int | None,
    report: bool,
    notebooks: Path,
    progress_every: float,
    print_figures: bool,
    here: bool = True,
) -> argparse.Namespace:
    """The namespace ``run_notebooks.run`` takes, after the checks that need the library:
    the model's name (and its installed weights) and, when the notebooks run ``here`` (not
    in cluster jobs), the device."""
    from arithlib.core.devices import resolve_device
    from arithlib.core.install import check_installed
    from arithlib.core.models import check_model_name
    from arithlib.core.weights import ModelFilesChanged

    try:
        check_model_name(model)
        check_installed(model)  # ModelFilesChanged: its weight files changed after install
    except (ValueError, OSError, ModelFilesChanged) as err:
        raise Bad(str(err)) from None
    try:
        resolved = resolve_device(device) if here else device
    except (ValueError, RuntimeError) as err:
        raise Bad(str(err)) from None
    return argparse.Namespace(
        model=model,
        device=resolved,
        resolved_device=resolved,
        dtype=dtype,
        device_map=device_map,
        quick="True" if quick else "False",
        seed=seed,
        param=[tuple(p) for p in param],
        figures=None if figures is None else str(figures),
        out=None if out is None else str(out),
        only=only,
        force=force,
        jobs=jobs,
        threads=threads,
        notebooks=str(notebooks),
        progress_every=progress_every,
        print_figures=print_figures,
        report=report,
    )


def list_params(paths: list[Path]) -> list[str]:
    """The ``-p`` names of the notebooks ``paths`` with their defaults, a block per notebook."""
    _run_notebooks()  # scripts/ on the path
    from notebook_files import RUN_PARAMETERS, _kind, notebook_parameters, parse_value

    lines = []
    for path in paths:
        lines.append(f"{path.stem}:")
        for name, default in notebook_parameters(path).items():
            if name in RUN_PARAMETERS:
                continue
            try:
                like = ast.literal_eval(default)
                if isinstance(like, str):
                    kind = "text" if not isinstance(parse_value(like), str) else "text (or a number, true/false, None)"
                else:
                    kind = "None (or a number, true/false, text, a [list])" if like is None else _kind(like)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                kind = "an expression: a number, true/false, None, a [list] or text"
            lines.append(f"  {name} = {' '.join(default.split())}    # {kind}")
    return lines


@app.command("run", help=RUN_HELP, context_settings=CONTEXT)
def run(
    model: Annotated[str, typer.Option(metavar="NAME", help="the model (see Models below)")] = DEFAULT_MODEL,
    device: Annotated[
        str,
        typer.Option(
            metavar="auto|cpu|cuda|cuda:N|mps",
            help="auto takes the GPU when torch sees one, else the CPU; a device torch does not see stops the run",
        ),
    ] = "auto",
    dtype: Annotated[
        str, typer.Option(metavar="auto|float32|bfloat16|float16", help="auto is bfloat16 on a GPU, float32 on a CPU")
    ] = "auto",
    device_map: Annotated[
        str | None,
        typer.Option(
            metavar="auto|balanced|balanced_low_0|sequential|JSON",
            show_default="none: the whole model on --device",
            help="split the model across devices (TransformerLens/accelerate); JSON: '{\"model.layers.0\": 0, ...}' "
            "names HF modules",
        ),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            show_default="off",
            help="the notebooks' quick sizes, for a smoke test (writes to the scratch folder)",
        ),
    ] = False,
    seed: Annotated[
        int, typer.Option(min=0, metavar="N", help="random seed; other than 0 writes to the scratch folder")
    ] = 0,
    param: Annotated[
        list[tuple] | None,
        typer.Option(  # NAME VALUE: two values each (_command)
            "--param",
            "-p",
            metavar="NAME VALUE",
            show_default="none",
            help="set a notebook parameter, typed as its default (see below); repeatable",
        ),
    ] = None,
    only: Annotated[
        str,
        typer.Option(
            metavar="NN[,NN...]",
            show_default="every notebook",
            help="run these notebooks only (two-digit numbers, see Notebooks below)",
        ),
    ] = "",
    force: Annotated[
        bool, typer.Option("--force", show_default="off", help="rerun notebooks whose inputs are unchanged")
    ] = False,
    jobs: Annotated[
        int | None,
        typer.Option(min=1, metavar="N", show_default="2 on a CPU with 2+ cores, else 1", help="notebooks run at once"),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            min=0,
            metavar="N",
            show_default="every core when one notebook runs at a time (--jobs 1 or one notebook selected), "
            "else cores // jobs",
            help="torch threads per notebook (part of the cache key); 0: torch's default",
        ),
    ] = None,
    figures: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            show_default="figures, or outputs/scratch/figures for a run with changed settings",
            help="the figures root (results go to DIR/<model>/)",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            show_default="outputs/<model>, or outputs/scratch/<model>",
            help="keys, logs and raw executed notebooks",
        ),
    ] = None,
    report: Annotated[
        bool,
        typer.Option(
            help="after the notebooks, write the model's report and the cross-model findings, still holding the lock"
        ),
    ] = True,
    list_params_: Annotated[
        bool,
        typer.Option(
            "--list-params",
            show_default="off",
            help="print the selected notebooks' parameters (-p names) with their defaults, and exit",
        ),
    ] = False,
    print_figures: Annotated[
        bool,
        typer.Option(
            "--print-figures",
            show_default="off",
            help="check the options, print the figures root this run would use, and exit",
        ),
    ] = False,
    notebooks: Annotated[
        Path, typer.Option(metavar="DIR", show_default="notebooks", help="where the numbered notebooks are")
    ] = NOTEBOOK_DIR,
    progress_every: Annotated[
        float, typer.Option(min=1.0, metavar="SECONDS", help="seconds between progress lines")
    ] = 60.0,
    executor: Annotated[
        str,
        typer.Option(
            metavar="local|slurm",
            help="local: run the notebooks here; slurm: submit one Slurm job per notebook "
            "(and the reports) and exit (docs/cluster.md)",
        ),
    ] = "local",
    models: Annotated[
        str | None,
        typer.Option(metavar="A,B,...", show_default="--model", help="[slurm] the jobs of several models at once"),
    ] = None,
    partition: Annotated[
        str | None,
        typer.Option(metavar="NAME", show_default="the cluster's default", help="[slurm] the partition of the jobs"),
    ] = None,
    account: Annotated[
        str | None,
        typer.Option(metavar="NAME", show_default="yours", help="[slurm] the account the jobs are charged to"),
    ] = None,
    gpus_per_job: Annotated[int, typer.Option(min=0, metavar="N", help="[slurm] GPUs per notebook job")] = 0,
    time_limit: Annotated[
        str | None,
        typer.Option(
            "--time",
            metavar="TIME",
            show_default="twice the notebook's last run, at least 10 min; 4 h when unknown",
            help="[slurm] each job's time limit, in sbatch's format (minutes, or HH:MM:SS)",
        ),
    ] = None,
    slurm_arg: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY=VALUE",
            show_default="none",
            help="[slurm] an sbatch option for every job (qos=high, mem=32G, constraint=a100, ...); repeatable",
        ),
    ] = None,
    status: Annotated[
        bool,
        typer.Option(
            "--status", show_default="off", help="[slurm] show each job of the last submission: its state and log"
        ),
    ] = False,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            show_default="off",
            help="[slurm] stay until the jobs end, then show their states; exit status 1 when one failed",
        ),
    ] = False,
) -> int:
    rn = _run_notebooks()
    cluster = {
        "--models": models,
        "--partition": partition,
        "--account": account,
        "--gpus-per-job": gpus_per_job,
        "--time": time_limit,
        "--slurm-arg": slurm_arg,
        "--status": status,
        "--wait": wait,
    }
    if executor not in ("local", "slurm"):
        raise Bad(f"--executor takes local or slurm, not {executor!r}")
    if executor == "local" and any(cluster.values()):
        raise Bad(f"{next(k for k, v in cluster.items() if v)} works with --executor slurm only")
    if list_params_:  # needs no model: the notebooks' own cells
        try:
            paths = rn.select_notebooks(notebooks, only)
        except SystemExit as err:
            raise Bad(str(err)) from None
        print("\n".join(list_params(paths)))
        return 0
    if executor == "slurm":
        from arithlib.run import slurm

        try:
            names = slurm.parse_models(models) if models else [model]
            if len(names) > 1 and out is not None:
                raise Bad("--out names one model's folder: leave it out with --models")
            device = slurm.job_device(device, gpus_per_job)
            opts = argparse.Namespace(
                partition=partition,
                account=account,
                gpus_per_job=gpus_per_job,
                time=time_limit,
                slurm_args=slurm.parse_slurm_args(slurm_arg or []),
                threads=threads if threads is not None else (1 if device == "cpu" else 4),
                report=report,
            )
            runs = []
            for name in names:
                args = _options(
                    name,
                    device,
                    dtype,
                    device_map,
                    quick,
                    seed,
                    param or [],
                    figures,
                    out,
                    only,
                    force,
                    1,
                    opts.threads,
                    report,
                    notebooks,
                    progress_every,
                    print_figures,
                    here=False,
                )
                try:
                    plan = rn.check(args)
                except SystemExit as err:
                    raise Bad(str(err)) from None
                args.figures, args.out = str(plan.figures), str(plan.out)
                runs.append((args, plan))
            if not status:
                slurm.check_slurm(partition)
            if print_figures:
                print(runs[0][1].figures)
                return 0
            if status:
                print("\n".join(slurm.status_lines(runs)[0]))
                return 0
            records = slurm.submit(runs, opts)
        except slurm.SlurmError as err:
            raise Bad(str(err)) from None
        for r in records:
            print(
                f"=== {r.model} {r.name}: Slurm job {r.job_id}"
                + (f" after {', '.join(r.after)}" if r.after else "")
                + f"; log {r.log}"
            )
        print(
            f"=== {len(records)} Slurm jobs queued; --status shows their states and logs"
            if records
            else "=== nothing to run: every notebook is up to date"
        )
        return slurm.wait(runs) if wait else 0
    args = _options(
        model,
        device,
        dtype,
        device_map,
        quick,
        seed,
        param or [],
        figures,
        out,
        only,
        force,
        jobs,
        threads,
        report,
        notebooks,
        progress_every,
        print_figures,
    )
    try:
        plan = rn.check(args)
    except SystemExit as err:
        raise Bad(str(err)) from None
    return rn.run(args, plan)


# --------------------------------------------------------------------------- the course


@app.command("teach", context_settings=CONTEXT)
def teach(
    jobs: Annotated[int, typer.Option(min=1, help="notebooks of the toy run at once")] = 2,
    threads: Annotated[int, typer.Option(min=1, help="torch threads per notebook")] = 1,
    skip_run: Annotated[
        bool, typer.Option("--skip-run", help="do not run the toy notebooks (the site and checks only)")
    ] = False,
    out: Annotated[
        Path | None, typer.Option(metavar="DIR", help="where the course site goes (default outputs/site)")
    ] = None,
) -> int:
    """Set up a class: check the shipped toy model, run every notebook on it (quick mode, into
    outputs/scratch/), check the exercise notebooks and build the course site (docs/teaching.md)."""
    from arithlib.course import classroom

    out = classroom.DEFAULT_OUT if out is None else out.resolve()
    try:
        classroom.run_setup(classroom.plan(out=out, jobs=jobs, threads=threads, skip_run=skip_run))
    except classroom.SetupFailed as err:
        raise Bad(str(err)) from None
    print(classroom.closing(out))
    return 0


@app.command("site", context_settings=CONTEXT)
def site(
    out: Annotated[Path | None, typer.Option(metavar="DIR", help="where the site goes (default outputs/site)")] = None,
    show: Annotated[
        str, typer.Option("--models", metavar="A,B", help="the models' studies to show (default: every committed run)")
    ] = "",
    check: Annotated[bool, typer.Option("--check", help="then read every page in headless Chromium")] = False,
) -> int:
    """Build the course site (the exercises, executed notebooks, reports and docs) into DIR."""
    from arithlib.course import browse
    from arithlib.course import site as S

    out = S.DEFAULT_OUT if out is None else out.resolve()
    if check and not browse.chromium_path():
        raise Bad("--check needs Chromium: apt-get install chromium (or set ARITHLIB_CHROMIUM)")
    try:
        index, warnings = S.make_site(out, [m for m in show.split(",") if m] or None)
    except (FileNotFoundError, RuntimeError) as err:
        raise Bad(str(err)) from None
    for w in warnings:
        print(w, file=sys.stderr)
    print(f"site: {index} ({len(warnings)} warnings)")
    if check:
        found = browse.check_site(out)
        print(f"site: {len(found.pages)} pages, {found.images} figures, {found.internal_links} links read in Chromium")
        for problem in found.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1 if found.problems else 0
    return 0


# --------------------------------------------------------------------------- entry point


def _line(message: object) -> str:
    """A message as one line, without the "run_all.sh: " the scripts put first."""
    text = " ".join(str(message).split())
    return text.removeprefix("run_all.sh: ")


def _command(with_epilog: bool = False):
    """The click group of :data:`app`, its ``run`` command's ``-p`` taking two values (NAME
    VALUE: typer declares one a time) and, ``with_epilog``, the lists --help shows."""
    group = typer.main.get_command(app)
    run_command = group.commands["run"]
    (param,) = [p for p in run_command.params if p.name == "param"]
    param.nargs = 2
    run_command.epilog = _epilog() if with_epilog else None
    return group


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); the exit status. With
    ``$ARITHLIB_PROG`` set (run_all.sh sets it), ``run`` is the whole command and its usage
    line and messages carry that name."""
    argv = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    command = _command(with_epilog=any(a in ("-h", "--help") for a in argv))
    prog = os.environ.get(PROG_ENV) or ("arithlib" if Path(sys.argv[0]).name == "arithlib" else "python -m arithlib")
    if os.environ.get(PROG_ENV) and argv[:1] == ["run"]:
        command, argv = command.commands["run"], argv[1:]
        who = prog
    else:
        who = f"{prog} {argv[0]}" if argv[:1] and argv[0] in command.commands else prog
    try:
        status = command.main(argv, prog_name=prog, standalone_mode=False)
    except typer.TyperException as err:  # click's usage errors: a missing value, a bad number, an unknown option
        print(f"{who}: error: {_line(err.format_message())}", file=sys.stderr)
        return err.exit_code
    except Bad as err:
        print(f"{who}: error: {_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as err:  # the run's own stops (another run holds the lock, ...): their one line, status 1
        if isinstance(err.code, str):
            print(f"{who}: {_line(err.code)}", file=sys.stderr)
            return 1
        return err.code or 0
    except typer.Abort:
        return 130
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
