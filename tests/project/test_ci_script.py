"""``.ci/run`` builds a fresh venv (about 2 GB) in a temporary folder for every run; it
must remove it on exit, whether the tests pass or fail, and pass the tests' exit status
on (repeated runs filled a developer's disk before)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fake_repo(tmp_path: Path, tests_status: int) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "scripts").mkdir()
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    record = tmp_path / "venv_path"
    (repo / "scripts" / "setup.sh").write_text(
        f'#!/usr/bin/env bash\nmkdir -p "$ARITHLIB_VENV/bin"\necho "$ARITHLIB_VENV" > {record}\n'
    )
    (repo / "run_tests.sh").write_text(f"#!/usr/bin/env bash\nexit {tests_status}\n")
    for f in (repo / ".ci" / "run", repo / "scripts" / "setup.sh", repo / "run_tests.sh"):
        f.chmod(0o755)
    return repo, record


@pytest.mark.parametrize("tests_status", [0, 3])
def test_ci_run_removes_its_venv_and_keeps_the_tests_status(tmp_path: Path, tests_status: int):
    repo, record = _fake_repo(tmp_path, tests_status)
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([str(repo / ".ci" / "run")], env=env, capture_output=True, text=True)
    assert done.returncode == tests_status, done.stderr
    venv = Path(record.read_text().strip())
    assert venv.is_relative_to(tmp_path)
    assert not venv.exists() and not venv.parent.exists(), "the fresh venv's folder was left behind"
