"""One run at a time per folder, for run_all.sh: an exclusive lock on a run's outputs
folder and on its figures folder, held for the whole run.

Each folder gets a file ``.run.lock`` holding the running run's pid, command line and
start time, locked with ``flock`` (the operating system's advisory lock; the standard
library's :mod:`fcntl`). The kernel releases it when the process ends, however it ends,
so a lock file left by a run that was killed is simply taken over (and said so); a
second run while the first is alive stops at once with one line naming it. A run
removes its lock file when it ends. run_notebooks.py hands the lock to each notebook's
``peak_memory.py`` as well, so the lock of a killed run lasts until its notebooks have
stopped. The lock is advisory: it keeps run_all.sh runs
apart, not other programs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

LOCK_NAME = ".run.lock"


class Locked(RuntimeError):
    """Another live run holds the lock; the message names it in one line."""


def _describe(info: dict) -> str:
    """The holder recorded in a lock file, for a message: its pid, start time and command."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if "started" in info else "?"
    return f"pid {info.get('pid', '?')}, started {started}: {info.get('command', '?')}"


def _read(fd: int) -> dict:
    """The holder recorded in the open lock file ``fd`` (empty if none or unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 65536)
        return json.loads(data.decode()) if data.strip() else {}
    except (OSError, ValueError):
        return {}


def _holder(fd: int, wait: float = 2.0) -> dict:
    """The holder recorded in the open lock file ``fd``, which another process has
    locked: a holder writes its record just after taking the lock, so an empty record is
    read again for up to ``wait`` seconds before it is taken as none."""
    end = time.monotonic() + wait
    while True:
        holder = _read(fd)
        if holder or time.monotonic() >= end:
            return holder
        time.sleep(0.02)


def _alive(pid: object) -> bool:
    """Whether process ``pid`` exists (a zombie counts as gone)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class RunLock:
    """The exclusive lock of one folder (``folder/.run.lock``), as a context manager or
    with :meth:`acquire` / :meth:`release`."""

    def __init__(self, folder: str | os.PathLike, command: str | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.command = command or os.environ.get("ARITHLIB_RUN_COMMAND") or " ".join(sys.argv)
        self.fd: int | None = None
        #: the holder of a lock file this run took over from a process that had ended
        self.took_over: dict | None = None

    def acquire(self) -> RunLock:
        """Take the lock without waiting; :class:`Locked` naming the holder if a live run
        has it."""
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                if holder and not _alive(holder.get("pid")):  # its notebooks hold the lock while they stop
                    raise Locked(
                        f"a run that was stopped is still ending its notebooks in {self.folder} "
                        f"({_describe(holder)}); try again in a minute"
                    ) from None
                raise Locked(
                    f"another run is using {self.folder} ({_describe(holder)}); wait for it to end "
                    f"or stop it (kill {holder.get('pid', '<pid>')})"
                ) from None
            try:  # the file may have been removed by its last holder while we waited: lock the one in place
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read(fd)
        if previous and previous.get("pid") != os.getpid() and not _alive(previous.get("pid")):
            self.took_over = previous
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"pid": os.getpid(), "command": self.command, "started": time.time()}).encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (a no-op when not held)."""
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)  # closing the file drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lock_all(folders: list[Path], command: str | None = None) -> list[RunLock]:
    """Locks of every folder of ``folders`` (the same folder once), taken in order;
    :class:`Locked` (releasing those taken) if any is held by a live run."""
    held: list[RunLock] = []
    seen: set[Path] = set()
    try:
        for folder in folders:
            real = Path(folder).resolve()
            if real in seen:
                continue
            seen.add(real)
            held.append(RunLock(folder, command).acquire())
    except BaseException:
        for lock in reversed(held):
            lock.release()
        raise
    return held
