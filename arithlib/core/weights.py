"""A model's identity is its weights: the weight files of every model arithlib installs
(the packaged models, the toy model and its checkpoints, the random test models) are
hashed once, when they are written, into ``weights.json`` beside them (each file's
size, modification time and sha256), and checked whenever the model is loaded: cheaply
(size and time), and by a full hash when those changed. A file whose contents changed
after install is refused with the command that reinstalls the model
(:class:`ModelFilesChanged`), so no result is computed from, or reused for, weights
other than the ones installed.

What keys stored results is :func:`arithlib.run.fingerprints.model_fingerprint`, a hash of
every weight of the model as loaded (so in-memory edits count too).

Reinstalling a model whose files changed: :mod:`arithlib.core.install`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..run.atomic import sha256_file, write_text

_log = logging.getLogger(__name__)

#: The record of a folder's weight files, written at install.
MANIFEST = "weights.json"
#: The files that hold a model's weights (training state and tokenizer files are not).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


class ModelFilesChanged(RuntimeError):
    """An installed model's weight files are not those it was installed with; the
    message (one line) names the file and the command that reinstalls the model."""


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files directly in ``folder``, sorted."""
    folder = Path(folder)
    return sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})


def _entry(path: Path, sha256: str | None = None) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256 or sha256_file(path)}


def record_weights(folder: str | Path) -> dict[str, dict]:
    """Hash the weight files of ``folder`` and write them to its ``weights.json``
    (call when the model is installed); returns the record."""
    folder = Path(folder)
    record = {p.name: _entry(p) for p in weight_files(folder)}
    write_text(folder / MANIFEST, json.dumps(record, indent=1, sort_keys=True))
    return record


def reinstall_command(name: str) -> str:
    """The command that reinstalls model ``name`` (a registry name)."""
    return f"python -m arithlib.core.install reinstall {name}"


def verify_weights(folder: str | Path, reinstall: str) -> None:
    """Check that the weight files of ``folder`` are those of its ``weights.json``: a
    file whose size or time differs is hashed again, and :class:`ModelFilesChanged`
    (naming it and ``reinstall``, the command that reinstalls the model) is raised when
    its contents differ, when a file is missing or when one was added. A folder
    installed before weights were recorded gets its record now."""
    folder = Path(folder)
    try:
        record = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        _log.info("recording the weight files of %s (installed before they were recorded)", folder)
        record_weights(folder)
        return
    except ValueError:
        raise ModelFilesChanged(
            f"the weight record {folder / MANIFEST} is damaged; reinstall the model: {reinstall}"
        ) from None
    present = {p.name for p in weight_files(folder)}
    if present != set(record):
        changes = sorted(present ^ set(record))
        raise ModelFilesChanged(
            f"the weight files of {folder} are not those installed ({', '.join(changes)} "
            "added or missing); reinstall the model: {reinstall}"
        )
    updated = False
    for name, was in record.items():
        path = folder / name
        st = path.stat()
        if (st.st_size, st.st_mtime_ns) == (was.get("size"), was.get("mtime_ns")):
            continue
        now = sha256_file(path)
        if now != was.get("sha256"):
            raise ModelFilesChanged(
                f"{path} changed after the model was installed (sha256 {now[:16]}, installed "
                f"{str(was.get('sha256'))[:16]}); reinstall the model: {reinstall}"
            )
        record[name] = _entry(path, now)  # the same contents, touched: note the new time
        updated = True
    if updated:
        write_text(folder / MANIFEST, json.dumps(record, indent=1, sort_keys=True))
