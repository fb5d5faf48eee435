"""Hashes that key cached results, so that a long run interrupted part-way resumes from
what it already computed and never reuses a result computed from something else: a
JSON-able key, a prompt set's token ids, a model's config and every weight."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from ..engine import clean_param_name, hf_module


def fingerprint(obj) -> str:
    """A 16-hex-digit hash of ``obj`` as sorted JSON (``str`` for anything else)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_fingerprint(prompts) -> str:
    """A hash of a prompt set's token ids and answer ids (``"none"`` for None)."""
    if prompts is None:
        return "none"
    h = hashlib.sha256()
    for ids, ans in zip(prompts.input_ids, prompts.answer_ids):
        h.update(np.asarray(ids + [-1] + ans + [-2], dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def tensor_fingerprint(*tensors: torch.Tensor) -> str:
    """A hash of the shapes and values of ``tensors``."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def _fast_hasher():
    """A hash object for bulk weights and its name: xxh3-128 (the xxhash package, about
    ten times sha256's speed) where installed, else sha256."""
    try:
        import xxhash

        return xxhash.xxh3_128(), "xxh3_128"
    except ImportError:
        return hashlib.sha256(), "sha256"


def model_fingerprint(model) -> str:
    """A hash of an HF model's (or a bridge's) config and every one of its weights: each
    parameter's clean name, shape, dtype and all of its values, as they are in memory
    now (so a weight changed in place, by training or by hand, changes it; a 0.5 B-parameter
    model takes a fraction of a second). The weight files a model is loaded from are
    checked against their install record separately (:mod:`arithlib.core.weights`)."""
    hf = hf_module(model)
    h, algorithm = _fast_hasher()
    h.update(algorithm.encode())
    h.update(hf.config.to_json_string().encode())
    for name, p in sorted({clean_param_name(n): p for n, p in hf.named_parameters()}.items()):
        t = p.detach()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return hashlib.sha256(h.digest()).hexdigest()[:16]
