"""The one way arithlib and run_all.sh write a file: whole or not at all.

:func:`atomic_write` writes to a temporary file with a name of its own in the same folder
(so two processes writing the same path never share one), flushes it to the disk
(``fsync``), renames it into place with :func:`os.replace` and syncs the folder, so a
run stopped at any point (a crash, a power cut, a full disk) leaves either the old file
or the new one, never half of one. Tables and figures (:mod:`arithlib.run.outputs`), stored
results (:mod:`arithlib.run.stored`), fine-tuned weights (:mod:`arithlib.methods.finetune`) and the
run's keys and timings (``scripts/run_notebooks.py``) all go through it.

Only the standard library is imported here: the run scripts import this module without
loading torch.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

#: Suffix of every temporary file :func:`atomic_write` makes (``.<name>.<random>.tmp``).
TMP_SUFFIX = ".tmp"


def _umask() -> int:
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush ``folder``'s entries (a rename into it) to the disk; a no-op where folders
    cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp)`` on a fresh temporary file beside ``path``, flush it to the
    disk, give it the permissions a plain ``open`` would (mkstemp's are 0600) and rename
    it to ``path``. On any error the temporary file is removed and ``path`` is as it was.
    Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(path.parent)
    return path


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; return the path."""
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; return the path."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def sha256_file(path: str | os.PathLike, block: int = 1 << 22) -> str:
    """The sha256 of the file at ``path`` (hex), read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
