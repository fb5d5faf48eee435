"""A class set-up in one command: ``./run_all.sh --teach`` (or ``python -m arithlib teach``).

After ``run_all.sh`` has installed the environment from the lock, the set-up

1. checks the shipped toy model against its checksums (``data/toy/``: nothing is trained);
2. runs every notebook on it in quick mode (``arithlib run --model toy-arith --quick``), so each
   notebook's figures exist when students open it; a quick run writes to
   ``outputs/scratch/``, never into ``figures/``;
3. checks that the exercise notebooks are those their sources give (``scripts/make_exercises.py``);
4. builds the course site into ``outputs/site/`` (:mod:`arithlib.course.site`);

and prints how to open JupyterLab and the site. Each step says what it does and how long it
took; a failing step stops the set-up with its reason.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..run.paths import REPO_ROOT
from .site import DEFAULT_OUT, make_site

TOY = "toy-arith"


class SetupFailed(RuntimeError):
    """A step of the class set-up failed; the message says which and why."""


@dataclass(frozen=True)
class SetupStep:
    """One step of the set-up: a name for the log and what it runs."""

    name: str
    run: Callable[[], str]


def _command(cmd: Sequence[str], what: str) -> str:
    """Run ``cmd`` in the repository, its output passing through; SetupFailed when it fails."""
    proc = subprocess.run(list(cmd), cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise SetupFailed(f"{what} failed (exit status {proc.returncode}): {' '.join(cmd)}")
    return ""


def check_toy() -> str:
    """The shipped toy model's files against their checksums."""
    from ..core.toy import ToyConfig, shipped_dir, verify_shipped

    folder = shipped_dir(ToyConfig())
    if folder is None:
        raise SetupFailed("the toy model's weights are not in data/toy/: use a full clone of the repository")
    sums = verify_shipped(folder)
    return f"{len(sums)} files match their SHA-256 ({folder.relative_to(REPO_ROOT) if folder.is_relative_to(REPO_ROOT) else folder})"


def run_toy(jobs: int, threads: int) -> str:
    """Every notebook on the toy model, quick mode (into outputs/scratch/)."""
    cmd = [
        sys.executable,
        "-m",
        "arithlib",
        "run",
        "--model",
        TOY,
        "--quick",
        "--jobs",
        str(jobs),
        "--threads",
        str(threads),
    ]
    return _command(cmd, "the toy model's quick run")


def check_exercises() -> str:
    """The exercise notebooks equal what their sources give."""
    _command(
        [sys.executable, str(REPO_ROOT / "scripts" / "make_exercises.py"), "--check"], "the exercise notebooks' check"
    )
    return "the exercise notebooks are up to date"


def build_site(out: Path) -> str:
    """The course site."""
    index, warnings = make_site(out)
    for w in warnings:
        print(f"  sphinx: {w}")
    return f"{index} ({len(warnings)} warnings)"


def plan(out: Path = DEFAULT_OUT, jobs: int = 2, threads: int = 1, skip_run: bool = False) -> list[SetupStep]:
    """The set-up's steps, in order."""
    steps = [SetupStep("check the shipped toy model", check_toy)]
    if not skip_run:
        steps.append(SetupStep("run every notebook on the toy model (quick mode)", lambda: run_toy(jobs, threads)))
    steps += [
        SetupStep("check the exercise notebooks", check_exercises),
        SetupStep("build the course site", lambda: build_site(out)),
    ]
    return steps


def run_setup(steps: Sequence[SetupStep], say: Callable[[str], None] = print) -> float:
    """Run ``steps`` in order, saying each and its time; the total seconds. SetupFailed
    (or a step's own error) stops at the first that fails."""
    t0 = time.perf_counter()
    for i, step in enumerate(steps, 1):
        say(f"[teach] {i}/{len(steps)} {step.name}")
        t = time.perf_counter()
        note = step.run()
        say(f"[teach]     done in {time.perf_counter() - t:.0f} s{': ' + note if note else ''}")
    return time.perf_counter() - t0


def closing(out: Path = DEFAULT_OUT) -> str:
    """What to open once the set-up is done."""
    site = out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out
    return "\n".join(
        [
            "[teach] ready.",
            "  JupyterLab (exercises in notebooks/exercises/, the studies in notebooks/):  scripts/lab.sh",
            f"  the course site:  {site}/index.html  (or serve it: .venv/bin/python -m http.server -d {site} 8000)",
            "  the toy model's figures of this set-up:  outputs/scratch/figures/toy-arith/",
            "  for teachers:  docs/teaching.md",
        ]
    )
