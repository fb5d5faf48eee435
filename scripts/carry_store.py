#!/usr/bin/env python3
"""Carry a long run's stored results from one machine to the next, through git.

A notebook stopped part-way resumes from the results it stored under ``$ARITHLIB_CACHE``
(default ``~/.cache/arithlib``): the sections and head-sweep batches of
:mod:`arithlib.run.stored`, and the fine-tuned models of :mod:`arithlib.methods.finetune`. A fresh
machine starts with an empty cache, so a run longer than one working session (Qwen-1.5B's
notebook 01 takes some 7 hours on 2 CPU cores) never finishes there. This script copies a
model's stored results into ``figures/<model>/stored/``, where they can be committed with
the run's other outputs, and back into the cache on the next machine:

    scripts/carry_store.py save MODEL       # cache -> figures/MODEL/stored/ (a mirror)
    scripts/carry_store.py restore MODEL    # figures/MODEL/stored/ -> cache (adds, never deletes)
    scripts/carry_store.py status MODEL     # what each holds, and the compute seconds it saves
    scripts/carry_store.py drop MODEL       # delete figures/MODEL/stored/ once the run is done

Nothing here decides what a result is: every stored file is named by the hash of all it
depends on (model weights, prompts, parameters, device, dtype, thread count and the code
that computed it), so a carried result that no longer matches the code or the run is
never loaded; it only takes room until the next ``save`` (a mirror of the cache) or
``drop``. A resumed run must use the thread count of the run that stored the results.

A notebook that finished on this machine need not run again on the next: its tables,
figures and executed copy are in ``figures/<model>/`` (commit them), and ``save`` also
carries its run record, the ``NN_name.key``, ``.seconds`` and ``.peak_mib`` files that
``run_all.sh`` writes to ``outputs/<model>/`` (``--outputs``: that folder's parent, default
``outputs/``) on success, into ``stored/finished/``; ``restore`` puts them back, and the
next ``run_all.sh`` skips that notebook as up to date when its key is unchanged (same code,
parameters, packages and upstream keys), its committed outputs standing as this run's. A run
whose results are committed only when all of it has finished (a release, from another
checkout) passes ``--figures`` (that checkout's ``figures/``): the finished notebooks' outputs
are then packed beside their records and unpacked there by ``restore``.

Carried: each result of ``sections/<model>/`` and ``head_sweep/<model>/`` (with its
seconds file), and from ``finetune/<model>/`` each finished model's ``result.pt`` and
``key.json`` (not its mid-training checkpoints), when the result is at most ``--max-mib``
MiB (default 8). A larger one is listed as left behind, with the seconds it took, and is
computed again on the next machine: git keeps every committed file in its history for
good, so a few minutes of recomputation (path patching's 150 MB result on Qwen-1.5B: about
9 minutes) cost less than every later clone downloading them.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arithlib.run.atomic import atomic_write  # noqa: E402
from arithlib.run.paths import cache_root  # noqa: E402
from arithlib.run.stored import stored_seconds  # noqa: E402

#: Cache subfolders (each holding one folder per model) whose files are all carried.
STORES = ("sections", "head_sweep")
#: The fine-tuning cache: one folder per trained model, its result in ``result.pt``.
FINETUNE = "finetune"
FINETUNE_FILES = ("result.pt", "result.json", "key.json")
#: Default size limit of one carried result (MiB).
MAX_MIB = 8
#: A finished notebook's run record in ``outputs/<model>/`` (``scripts/run_notebooks.py``).
RECORD_SUFFIXES = (".key", ".seconds", ".peak_mib")
#: Where the run records go in the carried folder.
FINISHED = "finished"


@dataclass(frozen=True)
class Entry:
    """One carried file: its path relative to the model's carried folder, and its size."""

    rel: Path
    size: int


def model_slug(model: str) -> str:
    """The folder name of ``model`` in the cache and in ``figures/`` (hub ids: ``/`` -> ``__``)."""
    return model.replace("/", "__")


def carried_dir(model: str, figures: Path = ROOT / "figures") -> Path:
    """``figures/<model>/stored/``: where the carried results are committed."""
    return figures / model_slug(model) / "stored"


def cache_entries(model: str, cache: Path, max_bytes: int) -> tuple[list[Entry], list[Path]]:
    """The files of ``model``'s stores in ``cache`` to carry, and the results left behind
    for their size (paths relative to ``cache``)."""
    slug = model_slug(model)
    out: list[Entry] = []
    left: list[Path] = []
    for store in STORES:
        base = cache / store / slug
        if not base.is_dir():
            continue
        files = [p for p in sorted(base.rglob("*")) if p.is_file() and not p.name.endswith(".tmp")]
        big = {p.with_suffix("") for p in files if p.suffix != ".json" and p.stat().st_size > max_bytes}
        left += [p.relative_to(cache) for p in files if p.suffix != ".json" and p.with_suffix("") in big]
        out += [
            Entry(Path(store) / p.relative_to(base), p.stat().st_size) for p in files if p.with_suffix("") not in big
        ]
    base = cache / FINETUNE / slug
    if base.is_dir():
        for folder in sorted(p for p in base.iterdir() if p.is_dir()):
            result = folder / "result.pt"
            if not result.is_file():
                continue  # training not finished: its checkpoints stay on this machine
            if result.stat().st_size > max_bytes:
                left.append(folder.relative_to(cache))
                continue
            out += [
                Entry(Path(FINETUNE) / folder.name / f, (folder / f).stat().st_size)
                for f in FINETUNE_FILES
                if (folder / f).is_file()
            ]
    return out, left


def finished_records(run_out: Path) -> list[Path]:
    """The run-record files of the notebooks that finished in ``run_out``
    (``outputs/<model>/``): each ``NN_name`` with a ``.key``, its record files."""
    if not run_out.is_dir():
        return []
    names = sorted(p.stem for p in run_out.glob("[0-9][0-9]_*.key"))
    return [run_out / f"{n}{s}" for n in names for s in RECORD_SUFFIXES if (run_out / f"{n}{s}").is_file()]


def notebook_outputs(fig: Path, name: str) -> list[Path]:
    """What notebook ``name`` (``NN_title``) wrote to ``fig`` (``figures/<model>/``): its
    ``NN_*`` tables, figures and params, and its executed copy in ``notebooks/``."""
    return sorted(fig.glob(f"{name[:2]}_*")) + sorted((fig / "notebooks").glob(f"{name}.ipynb"))


def save_finished(run_out: Path, dest: Path, fig: Path | None = None) -> int:
    """Make ``dest/finished/`` a mirror of the run records in ``run_out``; return how many
    files. With ``fig`` (the run's ``figures/<model>/``), each finished notebook's outputs
    too, as ``NN_title.tar.gz``: for a run whose results are committed only once all
    notebooks have finished (a release), so that ``figures/`` keeps one run's results."""
    folder = dest / FINISHED
    records = finished_records(run_out)
    if folder.is_dir():
        shutil.rmtree(folder)
    for src in records:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, folder / src.name)
    names = sorted({p.stem for p in records})
    for name in names if fig is not None else []:
        with tarfile.open(folder / f"{name}.tar.gz", "w:gz") as tar:
            for path in notebook_outputs(fig, name):
                tar.add(path, arcname=str(path.relative_to(fig)))
    return len(records) + (len(names) if fig is not None else 0)


def restore_finished(dest: Path, run_out: Path, fig: Path | None = None) -> int:
    """Copy the carried run records into ``run_out`` where they are missing, and with
    ``fig`` unpack the carried outputs there (replacing what is there: the outputs belong
    to the records); return how many files."""
    folder = dest / FINISHED
    n = 0
    for src in sorted(folder.glob("*")) if folder.is_dir() else []:
        if src.name.endswith(".tar.gz"):
            if fig is not None:
                with tarfile.open(src) as tar:
                    tar.extractall(fig, filter="data")
                n += 1
            continue
        target = run_out / src.name
        if target.is_file():
            continue
        atomic_write(target, lambda tmp, src_file=src: shutil.copyfile(src_file, tmp))
        n += 1
    return n


def carried_entries(dest: Path) -> list[Entry]:
    """The files under a carried folder (its README aside)."""
    if not dest.is_dir():
        return []
    return [
        Entry(p.relative_to(dest), p.stat().st_size)
        for p in sorted(dest.rglob("*"))
        if p.is_file() and p.relative_to(dest) != Path("README.md") and p.relative_to(dest).parts[0] != FINISHED
    ]


def _cache_path(cache: Path, model: str, rel: Path) -> Path:
    """Where carried file ``rel`` (``<store>/<...>``) lives in the cache."""
    store, *rest = rel.parts
    return cache / store / model_slug(model) / Path(*rest)


def save(model: str, cache: Path, dest: Path, max_bytes: int) -> dict:
    """Make ``dest`` a mirror of ``model``'s carried files in ``cache``; return counts."""
    entries, left = cache_entries(model, cache, max_bytes)
    wanted = {e.rel for e in entries}
    removed = 0
    for old in carried_entries(dest):
        if old.rel not in wanted:
            (dest / old.rel).unlink()
            removed += 1
    copied = 0
    for e in entries:
        src, dst = _cache_path(cache, model, e.rel), dest / e.rel
        if dst.is_file() and dst.stat().st_size == e.size and dst.read_bytes() == src.read_bytes():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        copied += 1
    for d in sorted((p for p in dest.rglob("*") if p.is_dir()), reverse=True) if dest.is_dir() else []:
        if not any(d.iterdir()):
            d.rmdir()
    if entries:
        (dest / "README.md").write_text(readme(model))
    elif dest.is_dir():
        shutil.rmtree(dest)
    return {"files": len(entries), "copied": copied, "removed": removed, "left_behind": [str(p) for p in left]}


def restore(model: str, cache: Path, src: Path) -> int:
    """Copy the carried files of ``src`` into ``cache`` where they are missing; return how many."""
    n = 0
    for e in carried_entries(src):
        dst = _cache_path(cache, model, e.rel)
        if dst.is_file():
            continue
        atomic_write(dst, lambda tmp, src_file=src / e.rel: shutil.copyfile(src_file, tmp))
        n += 1
    return n


def folder_seconds(folder: Path) -> float:
    """Compute seconds recorded beside the stored results in ``folder`` (the ``*.json``
    sidecars that :func:`arithlib.run.stored.stored_seconds` reads)."""
    return sum(stored_seconds(p.with_suffix(".pkl")) for p in folder.rglob("*.json"))


def readme(model: str) -> str:
    return (
        f"# Stored results of a run of `{model}` in progress\n\n"
        "Written by `scripts/carry_store.py save`: the results a stopped notebook resumes from\n"
        "(sections and head-sweep batches of `arithlib/run/stored.py`, finished fine-tuned models of\n"
        "`arithlib/methods/finetune.py`), committed so that the next working session, on a fresh machine,\n"
        "resumes the run instead of starting it over. Each file is named by the hash of all it\n"
        "depends on; one that the code or the run no longer matches is never loaded. They are\n"
        "pickles written by this repository's own code: load them only from a checkout you trust.\n"
        "`finished/` holds the run records (key, seconds, peak memory) of the notebooks that finished:\n"
        "with their committed outputs in `figures/`, the next run skips them while their key holds.\n\n"
        f"    scripts/carry_store.py restore {model}   # before the run, on a new machine\n"
        f"    scripts/carry_store.py save {model}      # after it, then commit this folder\n"
        f"    scripts/carry_store.py drop {model}      # once every notebook of the run has finished\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["save", "restore", "status", "drop"])
    ap.add_argument("model")
    ap.add_argument("--dir", type=Path, default=None, help="carried folder (default figures/<model>/stored)")
    ap.add_argument("--max-mib", type=float, default=MAX_MIB, help=f"largest result carried, MiB (default {MAX_MIB})")
    ap.add_argument(
        "--outputs",
        type=Path,
        default=ROOT / "outputs",
        help="the run's outputs folder, whose <model>/ holds finished notebooks' run records (default outputs/)",
    )
    ap.add_argument(
        "--figures",
        type=Path,
        default=None,
        help="the run's figures root: also carry finished notebooks' outputs (figures/<model>/NN_*), packed",
    )
    a = ap.parse_args(argv)
    dest = a.dir or carried_dir(a.model)
    cache = cache_root()
    run_out = a.outputs / model_slug(a.model)
    fig = None if a.figures is None else a.figures / model_slug(a.model)
    if a.action == "save":
        r = save(a.model, cache, dest, int(a.max_mib * 2**20))
        n_finished = save_finished(run_out, dest, fig)
        if n_finished and not (dest / "README.md").is_file():
            (dest / "README.md").write_text(readme(a.model))
        mib = sum(e.size for e in carried_entries(dest)) / 2**20
        print(f"[carry] {dest}: {r['files']} files ({mib:.1f} MiB), {r['copied']} copied, {r['removed']} removed")
        finished = sorted({p.stem for p in finished_records(run_out)})
        print(f"[carry] run records of finished notebooks ({len(finished)}): {', '.join(finished) or 'none'}")
        for p in r["left_behind"]:
            path = cache / p
            took = stored_seconds(path)
            print(
                f"[carry] left behind (over {a.max_mib:g} MiB; recomputed on the next machine"
                f"{f', {took:,.0f} s' if took else ''}): {path}"
            )
    elif a.action == "restore":
        if not dest.is_dir():
            print(f"[carry] nothing to restore: {dest} does not exist")
            return 0
        n = restore(a.model, cache, dest)
        print(f"[carry] {n} files restored from {dest} into {cache}")
        n = restore_finished(dest, run_out, fig)
        print(f"[carry] {n} run records of finished notebooks restored into {run_out}")
    elif a.action == "status":
        for label, folder in (("carried", dest), ("cache", cache)):
            parts = [folder] if label == "carried" else [cache / s / model_slug(a.model) for s in STORES]
            files = sum(len(carried_entries(p)) for p in parts)
            secs = sum(folder_seconds(p) for p in parts if p.is_dir())
            print(f"[carry] {label}: {files} files, {secs:,.0f} s of recorded compute")
    elif a.action == "drop":
        if dest.is_dir():
            shutil.rmtree(dest)
            print(f"[carry] removed {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
