"""Run a command and record the peak resident memory of its process tree, for run_all.sh.

    peak_memory.py OUT_FILE COMMAND [ARG...]

Runs COMMAND, writes the largest resident set size (MiB) reached by any process it
started (papermill and the notebook's kernel: ``getrusage(RUSAGE_CHILDREN).ru_maxrss``,
which counts every descendant that was waited for) to OUT_FILE, and exits with
COMMAND's exit status. This is the number to compare with a machine's RAM: one
notebook's kernel holds the model, its caches and its tables at once.

It never outlives the run that started it, nor lets COMMAND's processes do so: on
SIGTERM, SIGHUP or SIGINT, and when its parent ends however it ends (a SIGKILL, a closed
terminal: the kernel's parent-death signal on Linux, else a check every second), it
stops COMMAND and every process COMMAND started (the notebook's kernel runs in a session
of its own), first with SIGTERM, then SIGKILL, and exits with 128 + the signal.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

#: Seconds the processes get to end after SIGTERM before SIGKILL.
GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def peak_child_mib() -> float:
    """Largest resident set of a terminated, waited-for descendant, in MiB (Linux: KiB units)."""
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20  # macOS reports bytes


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent ends (Linux's
    ``PR_SET_PDEATHSIG``); whether it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children, ...)."""
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:  # psutil missing, or pid gone: nothing left to find
        return []


def stop_tree(pid: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM ``pid`` and all its descendants, then SIGKILL those still there after
    ``grace_s`` seconds."""
    procs = [pid] + descendants(pid)
    for p in procs:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        import psutil

        handles = []
        for p in procs:
            try:
                handles.append(psutil.Process(p))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(handles, timeout=grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    except ImportError:
        time.sleep(min(grace_s, 2.0))
        for p in procs:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out, cmd = Path(argv[0]), argv[1:]
    parent = int(os.environ.pop("ARITHLIB_RUNNER_PID", "") or os.getppid())
    pdeathsig = die_with_parent()
    if os.getppid() != parent:  # the run ended before this could take note
        return 128 + signal.SIGTERM
    stopped: list[int] = []
    running: list[subprocess.Popen] = []

    def stop(signum, frame) -> None:
        if not stopped:
            stopped.append(signum)
            for proc in running:
                stop_tree(proc.pid)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
    if stopped:  # stopped before the command started
        return 128 + stopped[0]
    child = subprocess.Popen(cmd)
    running.append(child)
    if stopped:  # a signal between the check and the start
        stop_tree(child.pid)
    if not pdeathsig:  # no parent-death signal here: look for a new parent every second

        def watch() -> None:
            while child.poll() is None:
                if os.getppid() != parent:
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                time.sleep(1.0)

        threading.Thread(target=watch, daemon=True).start()
    status = child.wait()
    try:
        out.write_text(f"{peak_child_mib():.0f}\n")
    except OSError:
        pass
    return 128 + stopped[0] if stopped else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
