"""Where a notebook run by run_all.sh writes, and how its outputs replace the old ones.

A notebook writes into a staging folder of its own (:func:`stage`: a copy of the
figures folder without that notebook's own files), never into the figures folder. When
it succeeds, :func:`promote` replaces its outputs whole or not at all: every new file is
first copied into a temporary folder inside the figures folder (so on its filesystem:
the step that needs disk space, and the only one that can run out of it), then each is
moved into place with :func:`os.replace` (a rename, atomic), the file it replaces kept
as a hard link until every new file is in place; only then are the old files that the
run did not write again removed. Any ``OSError`` on the way puts every replaced file
back and raises :class:`PromoteError`, whose message says in one line what failed,
where, and what is kept: the figures folder as it was, the new files in the staging
folder.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's arithlib
from arithlib.run.atomic import fsync_dir  # noqa: E402  (the standard library only)

#: ``figures/<model>/stored/``: a run in progress's stored results (scripts/carry_store.py),
#: which no notebook reads from there; never copied into a scratch or staging folder.
CARRIED = "stored"
#: Prefix of promote's temporary folders inside the figures folder.
PROMOTING = ".promote-"


class PromoteError(OSError):
    """Outputs that could not be moved into the figures folder, which keeps its previous
    ones; the message is one line."""


def _hidden(name: str) -> bool:
    """Run bookkeeping inside a figures folder (its lock, promote's temporary folders)."""
    return name.startswith(".")


def seed_scratch(fig_model: Path, committed: Path) -> bool:
    """Start a new scratch folder ``fig_model`` as a copy of the committed ``committed``
    (the tables of notebooks not rerun; not the carried store); whether it copied (not if
    it exists, its run's lock aside, or there is nothing to copy)."""
    if not committed.is_dir() or (fig_model.is_dir() and any(not _hidden(p.name) for p in fig_model.iterdir())):
        return False
    shutil.copytree(
        committed,
        fig_model,
        dirs_exist_ok=True,
        ignore=lambda d, names: [n for n in names if Path(d) == committed and (n == CARRIED or _hidden(n))],
    )
    return True


def own_files(folder: Path, name: str) -> list[Path]:
    """The files of notebook ``name`` (stem ``NN_...``) in ``folder``: those named ``NN_*``."""
    prefix = name[:3]
    return sorted(p for p in folder.glob(f"{prefix}*") if p.is_file()) if folder.is_dir() else []


def stage(fig_model: Path, staging_root: Path, model_dir: str, name: str) -> Path:
    """A fresh staging folder ``staging_root/model_dir`` for notebook ``name``: a copy of
    ``fig_model`` (the tables of the notebooks before it) without ``name``'s own files,
    the executed copies (``notebooks/``), the carried store (``stored/``) and the run's
    bookkeeping (hidden files). Returns the folder."""
    if staging_root.exists():
        shutil.rmtree(staging_root)
    staged = staging_root / model_dir
    if fig_model.is_dir():
        prefix = name[:3]
        shutil.copytree(
            fig_model,
            staged,
            ignore=lambda d, names: [
                n
                for n in names
                if Path(d) == fig_model and (n in ("notebooks", CARRIED) or n.startswith(prefix) or _hidden(n))
            ],
        )
    else:
        staged.mkdir(parents=True)
    return staged


def to_promote(staged: Path, name: str, since: float) -> list[Path]:
    """The files of ``staged`` that notebook ``name`` produced (paths relative to it):
    every ``NN_*`` file at its top, and every other file created or changed after
    ``since`` (seconds since the epoch)."""
    out = []
    for src in sorted(p for p in staged.rglob("*") if p.is_file()):
        rel = src.relative_to(staged)
        own = len(rel.parts) == 1 and rel.name.startswith(name[:3])
        if own or src.stat().st_mtime >= since:
            out.append(rel)
    return out


def _copy_synced(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` (contents and times) and flush it to the disk."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def remove_leftovers(fig_model: Path) -> None:
    """Remove promote's temporary folders left in ``fig_model`` by a run that was killed
    (call only while holding the folder's run lock)."""
    for p in fig_model.glob(f"{PROMOTING}*") if fig_model.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)


def promote(staged: Path, fig_model: Path, name: str, since: float) -> list[str]:
    """Replace notebook ``name``'s outputs in ``fig_model`` by those in ``staged`` (see
    :func:`to_promote`), whole or not at all (the module's docstring); its old ``NN_*``
    files that this run did not write are removed last. Returns the names moved in;
    :class:`PromoteError` leaves ``fig_model`` as it was."""
    fig_model.mkdir(parents=True, exist_ok=True)
    new = to_promote(staged, name, since)
    old = {p.relative_to(fig_model) for p in own_files(fig_model, name)}
    incoming = Path(tempfile.mkdtemp(prefix=f"{PROMOTING}{name[:2]}-new-", dir=fig_model))
    previous = Path(tempfile.mkdtemp(prefix=f"{PROMOTING}{name[:2]}-old-", dir=fig_model))
    replaced: list[Path] = []
    step = "copying"
    rel = Path(".")
    try:
        try:
            for rel in new:  # 1. onto the figures' filesystem: what needs space
                _copy_synced(staged / rel, incoming / rel)
            step = "replacing"
            for rel in new:  # 2. renames: the old file kept (a hard link) until all are in
                dst = fig_model / rel
                if dst.exists():
                    (previous / rel).parent.mkdir(parents=True, exist_ok=True)
                    os.link(dst, previous / rel)
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(incoming / rel, dst)
                replaced.append(rel)
        except OSError as err:
            restored = _roll_back(fig_model, previous, replaced)
            raise PromoteError(
                err.errno,
                f"could not move {name}'s outputs into {fig_model}: {step} {rel} failed "
                f"({err.strerror or err}); {fig_model} {'keeps its previous outputs' if restored else 'may hold a mix of old and new outputs'}; "
                f"this run's are in {staged}",
            ) from err
        for rel in sorted(old - set(new)):  # 3. only now: the old files not written again
            (fig_model / rel).unlink(missing_ok=True)
        fsync_dir(fig_model)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
        shutil.rmtree(previous, ignore_errors=True)
    return [str(r) for r in new]


def _roll_back(fig_model: Path, previous: Path, replaced: list[Path]) -> bool:
    """Put back the files of ``fig_model`` that ``replaced`` had replaced (from their
    links in ``previous``) and remove the new ones that replaced nothing; whether all
    went back."""
    ok = True
    for rel in reversed(replaced):
        try:
            if (previous / rel).exists():
                os.replace(previous / rel, fig_model / rel)
            else:
                (fig_model / rel).unlink(missing_ok=True)
        except OSError:
            ok = False
    return ok
