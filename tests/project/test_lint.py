"""One lint and format standard for the tree: ``ruff check`` and ``ruff format --check`` pass
(configured in pyproject.toml's ``[tool.ruff]``; .pre-commit-config.yaml runs the same on
commit). A violation fails the suite, so it fails CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401  (the dev extra of the lock installs it)
    except ModuleNotFoundError:
        pytest.fail("ruff is not installed: scripts/setup.sh installs the lock, which holds it")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_passes():
    out = _ruff("check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_check_passes():
    out = _ruff("format", "--check", "--no-cache", ".")
    assert out.returncode == 0, "files ruff would reformat (run `ruff format .`):\n" + out.stdout[-4000:]
