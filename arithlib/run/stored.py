"""Results stored on disk under a key, so that a long run that is stopped (a working
session ends, a machine goes away) resumes from what it already computed, and never
reuses a result computed from something else.

A key holds everything a result depends on, hashed (:mod:`arithlib.run.fingerprints`): the
model's config and weights, the prompts' token ids and records (counterfactuals
included), tensors and tables by value, plain parameters as JSON, the device, dtype and
thread count the model runs with, and the code: the source of the arithlib modules
named, with every arithlib module they import (:func:`arithlib.run.sources.code_fingerprint`).
Editing any of that code computes the result anew. Files are written atomically (a
temporary file of its own, flushed and renamed: :mod:`arithlib.run.atomic`), so a run stopped
mid-write leaves no half result, and each is verified when loaded: its sidecar records
the pickle's sha256 (and the arithlib version that wrote it), and a file that does not
match it, or that cannot be unpickled, is named in a warning, deleted and computed again.

Notebooks 01, 03, 04 and 05 store their long sections this way (``use_cache``); the head
sweep stores each batch (:func:`arithlib.yu.head_sweep.exact_head_sweep`). Beside each
result a small JSON file keeps its checksum and the seconds it took to compute, so that
a run resumed over several sessions can still report what its sections cost
(:attr:`Store.reused_seconds`), and the GFLOP it did when counted (:attr:`Store.reused_gflop`,
:mod:`arithlib.run.floor`). Fine-tuning keeps its own folder per trained model, with
mid-training checkpoints (:func:`arithlib.methods.finetune.train_parameters`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import torch

from .. import __version__
from ..core.prompt_sets import PromptSet
from ..engine import counted_flops
from .atomic import write_bytes, write_text
from .fingerprints import data_fingerprint, fingerprint, model_fingerprint, tensor_fingerprint
from .sources import code_fingerprint

T = TypeVar("T")
_log = logging.getLogger(__name__)


def key_value(obj: Any) -> Any:
    """``obj`` as a JSON-able value that changes whenever ``obj`` does: a model by its
    weights (:func:`model_fingerprint`) with the device, dtype and threads it runs with,
    a prompt set by its token ids and records, a tensor, array or table by its values,
    an arithlib module by its code; containers element by element; anything else as is
    (JSON, else ``str``)."""
    if isinstance(obj, torch.nn.Module):
        p = next(iter(obj.parameters()))
        return {
            "model": model_fingerprint(obj),
            "device": str(p.device),
            "dtype": str(p.dtype),
            "threads": torch.get_num_threads(),
        }
    if isinstance(obj, PromptSet):
        return {
            "tokens": data_fingerprint(obj),
            "records": fingerprint([repr(r) for r in obj.records]),
            "counterfactuals": fingerprint(obj.cf_input_ids),
        }
    if isinstance(obj, torch.Tensor):
        return tensor_fingerprint(obj)
    if isinstance(obj, np.ndarray):
        return tensor_fingerprint(torch.from_numpy(np.ascontiguousarray(obj)))
    if isinstance(obj, (pd.DataFrame, pd.Series)):
        return fingerprint(
            [
                list(map(str, obj.columns if isinstance(obj, pd.DataFrame) else [obj.name])),
                pd.util.hash_pandas_object(obj, index=True).tolist(),
            ]
        )
    if isinstance(obj, ModuleType):
        return code_fingerprint([obj.__name__.split(".", 1)[-1].replace(".", "/")])
    if isinstance(obj, dict):
        return {str(k): key_value(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [key_value(v) for v in obj]
    return obj


class Store:
    """``store(what, compute, code=[...], **parts)``: ``compute()`` once per key (``what``,
    the code of the arithlib modules ``code`` with those they import, and
    :func:`key_value` of ``parts``), stored in ``directory`` and loaded on later calls.
    ``directory`` None: always computed, nothing stored. Pass in ``parts`` every input of
    ``compute``."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory is not None else None
        #: seconds that the results loaded from disk took when they were computed (0 for a
        #: result stored before its time was recorded): add it to a section's wall time
        #: for that section's cost over every session it ran in.
        self.reused_seconds = 0.0
        #: the same for the GFLOP they took (:mod:`arithlib.engine.flops`; 0 when not counted)
        self.reused_gflop = 0.0

    def path(self, what: str, *, code: Iterable[str | ModuleType], **parts: Any) -> Path | None:
        """The file of ``what`` computed by ``code`` (arithlib module names or modules)
        from ``parts`` (None without a directory)."""
        if self.directory is None:
            return None
        # a module by its name below arithlib ("yu.cna"), so a module in a subpackage resolves
        names = [c.__name__.split(".", 1)[-1] if isinstance(c, ModuleType) else str(c) for c in code]
        key = {"what": what, "code": code_fingerprint(names), **key_value(parts)}
        slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")
        return self.directory / f"{slug}-{fingerprint(key)}.pkl"

    def __call__(self, what: str, compute: Callable[[], T], *, code: Iterable[str | ModuleType], **parts: Any) -> T:
        return self.at(self.path(what, code=code, **parts), compute)

    def credit(self, path: Path) -> None:
        """Add what the stored file ``path`` took when it was computed (its sidecar's
        ``seconds`` and ``gflop``) to :attr:`reused_seconds` and :attr:`reused_gflop`: a
        result loaded from a cache this store does not write itself (trained weights,
        :func:`arithlib.methods.finetune.cached_training`) counts as reused like its own."""
        self.reused_seconds += stored_seconds(path)
        self.reused_gflop += stored_meta(path, "gflop")

    def at(self, path: Path | None, compute: Callable[[], T]) -> T:
        """``compute()`` once for a file ``path`` whose name the caller keyed itself (e.g.
        the head sweep's batches), with the same bookkeeping; None: always computed. A
        stored file that fails its checksum or cannot be unpickled is reported (one
        warning naming it), deleted and computed again."""
        data = read_verified(path) if path is not None else None
        if data is not None:
            try:
                result = pickle.loads(data)
            except Exception as exc:  # a file that passed its checksum but not pickle: written by other code
                discard(path, f"cannot be unpickled ({type(exc).__name__}: {exc})")
            else:
                self.credit(path)
                return result
        result, seconds, gflop = measured(compute)
        if path is not None:
            save_atomic(path, result, seconds=seconds, gflop=gflop)
        return result


def measured(compute: Callable[[], T]) -> tuple[T, float, float | None]:
    """``(compute(), its wall seconds, the GFLOP it dispatched)``: the cost a stored result
    records beside it (GFLOP None outside a counting block, :mod:`arithlib.engine.flops`)."""
    t0, flops0 = time.perf_counter(), counted_flops()
    result = compute()
    flops = counted_flops()
    gflop = (flops - flops0) / 1e9 if flops is not None and flops0 is not None else None
    return result, time.perf_counter() - t0, gflop


def sidecar(path: Path) -> Path:
    """The JSON file beside a stored result: its checksum, the library version that wrote
    it and the seconds it took to compute."""
    return Path(path).with_suffix(".json")


def stored_meta(path: Path, name: str) -> float:
    """A number the sidecar of ``path`` records (``seconds``, ``gflop``; 0 when not recorded)."""
    try:
        return float(json.loads(sidecar(path).read_text())[name])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def stored_seconds(path: Path) -> float:
    """Seconds the result stored at ``path`` took to compute (0 when not recorded)."""
    return stored_meta(path, "seconds")


def discard(path: Path, reason: str) -> None:
    """Delete the stored file ``path`` and its sidecar, with a one-line warning naming it."""
    _log.warning("stored result %s %s: deleted, computing it again", path, reason)
    Path(path).unlink(missing_ok=True)
    sidecar(path).unlink(missing_ok=True)


def write_verified(path: Path, data: bytes, **meta: Any) -> None:
    """Write ``data`` to ``path`` and then its sidecar (``meta``, the sha256 of ``data``
    and the arithlib version), each atomically: a file without a matching sidecar is
    never read back (:func:`read_verified`)."""
    write_bytes(path, data)
    record = {**meta, "sha256": hashlib.sha256(data).hexdigest(), "arithlib": __version__}
    write_text(sidecar(path), json.dumps(record, sort_keys=True))


def read_verified(path: Path) -> bytes | None:
    """The bytes stored at ``path`` if they match the sha256 of its sidecar; None when
    there is no file, or when the checksum is missing (a file written before checksums
    were recorded, or its sidecar lost) or wrong: then the file is discarded
    (:func:`discard`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        recorded = json.loads(sidecar(path).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        discard(path, "has no recorded checksum (written by an older version, or its .json is missing)")
        return None
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded:
        discard(
            path,
            f"does not match its checksum (sha256 {actual[:16]}, recorded {str(recorded)[:16]}): "
            "the file was changed or damaged",
        )
        return None
    return data


class _CompactPickler(pickle.Pickler):
    """A pickler that writes a tensor viewing part of a larger storage as a copy of its
    own elements. Pickle writes a tensor's whole storage, once per tensor: results that
    hold one row each of a shared [models, ...] tensor would otherwise store the whole
    tensor once per row (notebook 05's CNA details: 7 GB instead of about 1). Tensors
    that cover their storage, and those that need grad, are pickled as they are."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            isinstance(obj, torch.Tensor)
            and obj.layout == torch.strided
            and not obj.requires_grad
            and obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()
        ):
            return obj.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """``pickle.dumps(obj)`` with every tensor view stored as its own elements (:class:`_CompactPickler`)."""
    buf = io.BytesIO()
    _CompactPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def save_atomic(path: Path, obj: Any, seconds: float | None = None, gflop: float | None = None) -> None:
    """Pickle ``obj`` to ``path`` (:func:`dumps`) with its checksum (:func:`write_verified`),
    and the ``seconds`` and ``gflop`` it took to compute when given."""
    meta = {k: v for k, v in {"seconds": seconds, "gflop": gflop}.items() if v is not None}
    write_verified(Path(path), dumps(obj), **meta)
