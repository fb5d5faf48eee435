"""Run a command and record the peak resident memory of its process tree, for run_all.sh.

    peak_memory.py OUT_FILE COMMAND [ARG...]

Runs COMMAND, writes the largest resident set size (MiB) reached by any process it
started (papermill and the notebook's kernel: ``getrusage(RUSAGE_CHILDREN).ru_maxrss``,
which counts every descendant that was waited for) to OUT_FILE, and exits with
COMMAND's exit status. This is the number to compare with a machine's RAM: one
notebook's kernel holds the model, its caches and its tables at once.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path


def peak_child_mib() -> float:
    """Largest resident set of a terminated, waited-for descendant, in MiB (Linux: KiB units)."""
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20  # macOS reports bytes


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, cmd = Path(argv[0]), argv[1:]
    status = subprocess.call(cmd)
    out.write_text(f"{peak_child_mib():.0f}\n")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
