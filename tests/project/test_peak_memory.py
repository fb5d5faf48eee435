"""run_all.sh's peak-memory record: the largest resident set of a command's process tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "peak_memory.py"

# A child that starts a grandchild holding about 200 MiB (as papermill starts the kernel).
_GRANDCHILD = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.2)"
_CHILD = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {_GRANDCHILD!r}]))"


def test_records_the_grandchild_peak_and_passes_the_exit_status(tmp_path):
    out = tmp_path / "peak"
    status = subprocess.call([sys.executable, str(SCRIPT), str(out), sys.executable, "-c", _CHILD])
    assert status == 0
    assert 200 <= float(out.read_text()) < 2000
    failing = subprocess.call([sys.executable, str(SCRIPT), str(out), sys.executable, "-c", "raise SystemExit(3)"])
    assert failing == 3 and float(out.read_text()) > 0


def test_usage_without_a_command(tmp_path):
    assert subprocess.call([sys.executable, str(SCRIPT), str(tmp_path / "peak")], stderr=subprocess.DEVNULL) == 2
