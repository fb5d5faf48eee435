"""Hashes that key cached results, so that a long run interrupted part-way resumes from
what it already computed and never reuses a result computed from something else: a
JSON-able key, a prompt set's token ids, a model's config and weights."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from .engine import clean_param_name, hf_module


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


def model_fingerprint(model) -> str:
    """A hash of an HF model's (or a bridge's) config and a sample of its weights: the
    first 256 values of every k-th parameter by clean name (about 16 tensors)."""
    hf = hf_module(model)
    h = hashlib.sha256(hf.config.to_json_string().encode())
    params = {clean_param_name(n): p for n, p in hf.named_parameters()}
    for name, p in sorted(params.items())[:: max(1, len(list(hf.parameters())) // 16)]:
        h.update(name.encode())
        h.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
