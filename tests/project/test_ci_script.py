"""``.ci/run`` builds a fresh venv (about 2 GB) in a temporary folder for every run; it
must remove it on exit, whether the tests pass or fail, and pass the tests' exit status
on (repeated runs filled a developer's disk before). It starts a local Slurm for the
``slurm`` tests and must stop it on exit too, whichever tests fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fake_repo(tmp_path: Path, tests_status: int, slurm_status: int) -> tuple[Path, Path, Path]:
    """A repository whose setup, tests and Slurm script only record what they were asked:
    the default suite exits ``tests_status``, the slurm tests ``slurm_status``."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "scripts").mkdir()
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    record, slurm = tmp_path / "venv_path", tmp_path / "slurm_calls"
    (repo / "scripts" / "setup.sh").write_text(
        f'#!/usr/bin/env bash\nmkdir -p "$ARITHLIB_VENV/bin"\necho "$ARITHLIB_VENV" > {record}\n'
    )
    (repo / "scripts" / "slurm_local.sh").write_text(
        f'#!/usr/bin/env bash\necho "$1" >> {slurm}\n[ "$1" = start ] && mkdir -p "$ARITHLIB_SLURM_DIR"\n'
        f'[ "$1" = stop ] && rm -rf "$ARITHLIB_SLURM_DIR"\nexit 0\n'
    )
    (repo / "scripts" / "chromium.sh").write_text("#!/usr/bin/env bash\necho /usr/bin/chromium\n")
    (repo / "run_tests.sh").write_text(
        f'#!/usr/bin/env bash\nif [ "$*" = "-m slurm" ]; then exit {slurm_status}; fi\nexit {tests_status}\n'
    )
    for f in (
        repo / ".ci" / "run",
        repo / "scripts" / "setup.sh",
        repo / "scripts" / "slurm_local.sh",
        repo / "scripts" / "chromium.sh",
        repo / "run_tests.sh",
    ):
        f.chmod(0o755)
    return repo, record, slurm


@pytest.mark.parametrize("tests_status,slurm_status", [(0, 0), (3, 0), (0, 4)])
def test_ci_run_removes_its_venv_stops_slurm_and_keeps_the_tests_status(
    tmp_path: Path, tests_status: int, slurm_status: int
):
    repo, record, slurm = _fake_repo(tmp_path, tests_status, slurm_status)
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([str(repo / ".ci" / "run")], env=env, capture_output=True, text=True)
    assert done.returncode == (tests_status or slurm_status), done.stderr
    venv = Path(record.read_text().strip())
    assert venv.is_relative_to(tmp_path)
    assert not venv.exists() and not venv.parent.exists(), "the fresh venv's folder was left behind"
    calls = slurm.read_text().split() if slurm.exists() else []
    assert calls == ([] if tests_status else ["start", "stop"]), "a Slurm started for the tests was left running"
