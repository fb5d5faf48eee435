"""Checks for the exercise notebooks (``notebooks/exercises/``, written by
``scripts/make_exercises.py``): each ``check_*`` runs a student's function on the toy
model and compares it with arithlib's own implementation, in a few seconds.

A check prints one line when the function agrees, and raises :class:`CheckFailed` (an
AssertionError) saying what differs when it does not; an error inside the student's
function (the exercise stub's NotImplementedError) propagates unchanged.

Notebook 01 (heads): :func:`check_relative_logit_change` (Zhang's metric),
:func:`check_zero_head_logits` (Yu's head ablation), :func:`check_patch_head_logits`
(activation patching), :func:`check_path_patch_logit` (Zhang's path patching) and
:func:`check_head_effects` (the path-patching heatmap).
Notebook 02 (MLPs): :func:`check_logit_lens`, :func:`check_delta_cosine` (Zhang Fig. 6b)
and :func:`check_probe_r2` (a linear probe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import pandas as pd
import torch

from ..core import datasets as ds
from ..core.metrics import relative_logit_change
from ..core.models import LoadedModel, load_model
from ..core.prompt_sets import PromptSet, single_token_numbers
from ..methods import patching as P
from ..zhang import answer_cache as AC
from ..zhang import lens as L
from ..zhang import mlp_curves as MC
from ..zhang import path_patching as PP
from ..zhang import probing as PR

#: The model every check runs on.
CHECK_MODEL = "toy-arith"
#: Largest absolute difference allowed between a student's tensor and the reference (fp32).
TOL = 1e-4
#: Largest difference allowed between a student's probe score and the reference's.
PROBE_TOL = 0.05


class CheckFailed(AssertionError):
    """A student's function disagrees with arithlib's reference."""


@lru_cache(maxsize=1)
def check_model() -> LoadedModel:
    """The toy model (trained into the cache the first time, about 4 minutes), loaded once."""
    return load_model(CHECK_MODEL, device="cpu")


@dataclass(frozen=True)
class PatchingBatch:
    """One same-length batch of Zhang prompts (+ and -, template ``A + B =``, 2-shot) with
    their counterfactuals (operator swapped): ``tokens``, ``cf_tokens`` [B, T] and the
    answer's first token ``answer_ids`` [B]; only prompts the model answers with a
    positive answer logit (Zhang's X_r). ``prompts`` is the PromptSet they come from."""

    prompts: PromptSet
    tokens: torch.Tensor
    cf_tokens: torch.Tensor
    answer_ids: torch.Tensor


@lru_cache(maxsize=1)
def patching_batch() -> PatchingBatch:
    """The prompts every notebook-01 check patches (:class:`PatchingBatch`)."""
    model = check_model()
    recs = ds.zhang_prompts(ops=["+", "-"], n_per_template=8, seed=0, fewshot=2, templates=[0])
    ps = PromptSet.build(recs, model.tokenizer)
    batch = next(ps.batches(len(ps)))
    with torch.no_grad():
        logits = model.bridge(batch.tokens)[:, -1]
    answer = logits.gather(1, batch.answer_ids[:, None]).squeeze(1)
    keep = [
        int(i)
        for i, (pred, a, logit) in enumerate(zip(logits.argmax(-1), batch.answer_ids, answer))
        if pred == a and logit > 0
    ]
    ps = ps.subset([int(batch.index[i]) for i in keep])
    batch = next(ps.batches(len(ps)))
    return PatchingBatch(ps, batch.tokens, batch.cf_tokens, batch.answer_ids)


def _heads(bridge) -> list[tuple[int, int]]:
    return [(layer, head) for layer in range(bridge.cfg.n_layers) for head in range(bridge.cfg.n_heads)]


def _as_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckFailed(f"{name} should return a torch.Tensor, got {type(value).__name__}")
    return value.detach().float().cpu()


def _compare(mine: torch.Tensor, ref: torch.Tensor, what: str, tol: float = TOL) -> float:
    """Raise CheckFailed unless ``mine`` has ``ref``'s shape and is within ``tol``; the max difference."""
    if tuple(mine.shape) != tuple(ref.shape):
        raise CheckFailed(f"{what}: shape {tuple(mine.shape)}, expected {tuple(ref.shape)}")
    if torch.isnan(mine).any() and not torch.isnan(ref).any():
        raise CheckFailed(f"{what}: has NaN values")
    diff = float((mine - ref).abs().nan_to_num(0.0).max()) if mine.numel() else 0.0
    if diff > tol:
        raise CheckFailed(f"{what}: differs from the reference by up to {diff:.3g} (allowed {tol:g})")
    return diff


def passed(message: str) -> None:
    """Say that a check passed."""
    print(f"✓ {message}")


# --------------------------------------------------------------------------- notebook 01


def check_relative_logit_change(fn: Callable) -> None:
    """``fn(patched_logit, clean_logit)``: Zhang's (patched - clean) / clean, elementwise
    and broadcasting (``[variants, prompts]`` against ``[prompts]``)."""
    g = torch.Generator().manual_seed(0)
    clean = 1 + 10 * torch.rand(7, generator=g)
    patched = clean + torch.randn(3, 7, generator=g)
    mine = _as_tensor(fn(patched, clean), "relative_logit_change")
    _compare(mine, relative_logit_change(patched, clean), "relative_logit_change([3, 7], [7])", 1e-6)
    passed("relative_logit_change matches arithlib.core.metrics.relative_logit_change")


def check_zero_head_logits(fn: Callable) -> None:
    """``fn(bridge, tokens, layer, head)``: last-position logits [B, vocab] with the head's
    output z zeroed at every position (Yu & Ananiadou's W_O-slice ablation), for every
    head of the toy model; reference :func:`arithlib.methods.patching.run_edits_full` with
    :func:`arithlib.methods.patching.ablation_edits`."""
    bridge, batch = check_model().bridge, patching_batch()
    for layer, head in _heads(bridge):
        ref = P.run_edits_full(bridge, batch.tokens, P.ablation_edits([(layer, head)], 0.0, position=None)).cpu()
        with torch.no_grad():
            mine = _as_tensor(fn(bridge, batch.tokens.clone(), layer, head), "zero_head_logits")
        _compare(mine, ref, f"zero_head_logits(layer={layer}, head={head})")
    passed(f"zero_head_logits matches arithlib on all {len(_heads(bridge))} heads of the toy model")


def check_patch_head_logits(fn: Callable) -> None:
    """``fn(bridge, tokens, cf_tokens, layer, head)``: last-position logits [B, vocab] with
    the head's z at the last position set to its value on ``cf_tokens`` (activation
    patching); reference :func:`arithlib.methods.patching.activation_patch_full`."""
    bridge, batch = check_model().bridge, patching_batch()
    comps = [P.Component("head", layer, head) for layer, head in _heads(bridge)]
    refs = P.activation_patch_full(bridge, batch.tokens, batch.cf_tokens, comps, position=-1).cpu()
    for c, ref in zip(comps, refs):
        with torch.no_grad():
            mine = _as_tensor(
                fn(bridge, batch.tokens.clone(), batch.cf_tokens.clone(), c.layer, c.index), "patch_head_logits"
            )
        _compare(mine, ref, f"patch_head_logits(layer={c.layer}, head={c.index})")
    passed(f"patch_head_logits matches arithlib.methods.patching.activation_patch_full on all {len(comps)} heads")


def check_path_patch_logit(fn: Callable) -> None:
    """``fn(bridge, tokens, cf_tokens, answer_ids, layer, head)``: the answer-token logit
    [B] under Zhang's path patching of the head at the last position (every other head
    frozen at its clean output, MLPs recomputed); reference
    :func:`arithlib.zhang.path_patching.path_patch_full`."""
    bridge, batch = check_model().bridge, patching_batch()
    comps = [P.Component("head", layer, head) for layer, head in _heads(bridge)]
    refs = PP.path_patch_full(bridge, batch.tokens, batch.cf_tokens, comps, batch.answer_ids).cpu()
    act = P.activation_patch_full(bridge, batch.tokens, batch.cf_tokens, comps, position=-1).cpu()
    act = act.gather(2, batch.answer_ids[None, :, None].expand(len(comps), -1, 1)).squeeze(-1)
    for j, (c, ref) in enumerate(zip(comps, refs)):
        with torch.no_grad():
            mine = _as_tensor(
                fn(bridge, batch.tokens.clone(), batch.cf_tokens.clone(), batch.answer_ids.clone(), c.layer, c.index),
                "path_patch_logit",
            )
        try:
            _compare(mine, ref, f"path_patch_logit(layer={c.layer}, head={c.index})")
        except CheckFailed as err:
            if mine.shape == act[j].shape and float((mine - act[j]).abs().max()) <= TOL:
                raise CheckFailed(
                    f"{err}; your values equal activation patching: freeze every other head at its "
                    "clean output (all positions) so the change reaches the logits only through "
                    "the MLPs and the residual stream"
                ) from None
            raise
    passed(f"path_patch_logit matches arithlib.zhang.path_patching.path_patch_full on all {len(comps)} heads")


def check_head_effects(fn: Callable) -> None:
    """``fn(bridge, tokens, cf_tokens, answer_ids)``: Zhang's path-patching effect of every
    head, the mean over prompts of the relative logit change, as [n_layers, n_heads];
    reference :func:`arithlib.zhang.path_patching.path_patching` (the fast path of notebook 01)."""
    bridge, batch = check_model().bridge, patching_batch()
    res = PP.path_patching(
        bridge,
        batch.prompts,
        senders=P.head_components(bridge.cfg.n_layers, bridge.cfg.n_heads),
        capture_attention=False,
        progress=False,
    )
    means = PP.mean_effects(res.effects, [])
    ref = torch.zeros(bridge.cfg.n_layers, bridge.cfg.n_heads)
    for r in means.itertuples():
        ref[int(r.layer), int(r.head)] = float(r.effect)
    with torch.no_grad():
        mine = _as_tensor(
            fn(bridge, batch.tokens.clone(), batch.cf_tokens.clone(), batch.answer_ids.clone()), "head_effects"
        )
    _compare(mine, ref, "head_effects")
    passed("head_effects matches the path-patching effects of arithlib.zhang.path_patching.path_patching")


# --------------------------------------------------------------------------- notebook 02


@dataclass(frozen=True)
class AnswerBatch:
    """Prompts the toy model answers correctly (Zhang's ``A + B =`` and ``A - B =``,
    2-shot), their answer-position cache (:class:`arithlib.zhang.answer_cache.AnswerCache`) and
    the answer's first token ``answer_ids`` [N]."""

    prompts: PromptSet
    cache: AC.AnswerCache
    answer_ids: torch.Tensor


@lru_cache(maxsize=1)
def answer_batch() -> AnswerBatch:
    """The prompts and cache of the logit-lens and cosine checks (:class:`AnswerBatch`)."""
    model = check_model()
    recs = ds.zhang_prompts(ops=["+", "-"], n_per_template=12, seed=0, fewshot=2, templates=[0])
    ps = PromptSet.build([replace(r, counterfactual=None) for r in recs], model.tokenizer)
    cache = AC.cache_answer_position(model.bridge, ps, check_full_answer=False, progress=False)
    keep = cache.correct.nonzero().flatten().tolist()
    ps = ps.subset(keep)
    return AnswerBatch(ps, cache.subset(keep), ps.first_answer_ids)


def check_logit_lens(fn: Callable) -> None:
    """``fn(bridge, resid, answer_ids)`` with ``resid`` [N, n_layers + 1, d_model] (the
    embedding, then the residual stream after each block, at the answer position):
    ``(logprob, rank)``, each [N, n_layers + 1], of the answer token when each row is read
    through the final norm and the unembedding (rank 0 = top prediction); reference
    :func:`arithlib.zhang.lens.logit_lens_answer`."""
    bridge, data = check_model().bridge, answer_batch()
    ref = L.logit_lens_answer(bridge, data.cache, data.prompts).sort_values(["prompt", "layer"])
    stack, layers = L.lens_stack(data.cache)
    shape = (len(data.prompts), len(layers))
    with torch.no_grad():
        out = fn(bridge, stack.clone(), data.answer_ids.clone())
    if not (isinstance(out, tuple) and len(out) == 2):
        raise CheckFailed("logit_lens should return a tuple (logprob, rank)")
    logprob, rank = (_as_tensor(x, "logit_lens") for x in out)
    try:
        _compare(logprob, torch.tensor(ref["logprob"].to_numpy()).reshape(shape).float(), "logit_lens logprob", 1e-3)
    except CheckFailed as err:
        with torch.no_grad():
            raw = (stack @ bridge.W_U.detach().float() + bridge.b_U.detach().float()).log_softmax(-1)
        raw = raw.gather(-1, data.answer_ids[:, None, None].expand(-1, shape[1], 1)).squeeze(-1)
        if logprob.shape == raw.shape and float((logprob - raw).abs().max()) <= 1e-3:
            raise CheckFailed(
                f"{err}; your values are the unembedding of the raw residual stream: apply the "
                "final norm (bridge.ln_final) first"
            ) from None
        raise
    _compare(rank, torch.tensor(ref["rank"].to_numpy()).reshape(shape).float(), "logit_lens rank", 0.0)
    passed("logit_lens matches arithlib.zhang.lens.logit_lens_answer (log-probabilities and ranks)")


def check_delta_cosine(fn: Callable) -> None:
    """``fn(mlp_in, mlp_out, W_U, answer_ids)`` with activations [N, n_layers, d_model]:
    cos(MLP_out - MLP_in, W_U[:, C]) [N, n_layers] (Zhang et al. Fig. 6b); reference the
    ``delta_C`` measure of :func:`arithlib.zhang.mlp_curves.unembed_cosines`."""
    model, data = check_model(), answer_batch()
    W_U = MC.unembed_matrix(model.bridge)
    numbers = single_token_numbers(model.tokenizer, 30)
    cos = MC.unembed_cosines(data.cache, data.prompts, W_U, numbers)
    ref = cos[cos.measure == "delta_C"].sort_values(["prompt", "layer"])["value"].to_numpy()
    ref = torch.tensor(ref).reshape(len(data.prompts), -1).float()
    mine = _as_tensor(
        fn(data.cache.acts["mlp_in"].clone(), data.cache.acts["mlp_out"].clone(), W_U.clone(), data.answer_ids.clone()),
        "delta_cosine",
    )
    _compare(mine, ref, "delta_cosine", 1e-5)
    passed("delta_cosine matches the delta_C measure of arithlib.zhang.mlp_curves.unembed_cosines")


@dataclass(frozen=True)
class ProbeData:
    """Answer-position residual streams of Yu's 2-digit + and - prompts (2-shot):
    ``acts`` [N, n_layers + 1, d_model] (the embedding first), ``layers`` (-1 = the
    embedding), ``labels`` (:func:`arithlib.zhang.probing.probe_labels`: a, b, result, group)
    and the grouped ``train`` / ``test`` rows (operand pairs never on both sides)."""

    acts: torch.Tensor
    layers: list[int]
    labels: pd.DataFrame
    train: np.ndarray
    test: np.ndarray


@lru_cache(maxsize=1)
def probe_data() -> ProbeData:
    """The probing set of the probe check (:class:`ProbeData`)."""
    model = check_model()
    recs = ds.yu_prompts(ops=["+", "-"], n_digits=2, n_per_template=60, seed=0, fewshot=2, templates=[3])
    ps = PromptSet.build(recs, model.tokenizer)
    cache = AC.cache_answer_position(
        model.bridge, ps, kinds=["resid_pre", "resid_post"], check_full_answer=False, progress=False
    )
    acts, layers = L.lens_stack(cache)
    labels = PR.probe_labels(ps, ["a", "b", "result"])
    train, test = PR.grouped_split(labels["group"].to_numpy(), 0.25, 0)
    return ProbeData(acts, layers, labels, train, test)


def check_probe_r2(fn: Callable) -> None:
    """``fn(x_train, y_train, x_test, y_test)`` (numpy; x [n, d_model], y [n]): the held-out
    R^2 of a linear probe fitted on the training rows. Checked on the operands and the
    result at every layer: within :data:`PROBE_TOL` of :func:`arithlib.zhang.probing.linear_probes`
    (standardised features, ridge regression with alpha chosen by cross-validation)."""
    data = probe_data()
    ref = PR.linear_probes(data.acts, data.labels, ["a", "b", "result"], layer_labels=data.layers, progress=False)
    x = data.acts.float().numpy()
    rows = []
    for r in ref.itertuples():
        i = data.layers.index(int(r.layer))
        y = data.labels[r.target].to_numpy()
        score = fn(x[data.train, i].copy(), y[data.train].copy(), x[data.test, i].copy(), y[data.test].copy())
        if not np.isscalar(score) and np.asarray(score).shape != ():
            raise CheckFailed(f"probe_r2 should return one number (the held-out R^2), got {type(score).__name__}")
        rows.append({"target": r.target, "layer": int(r.layer), "yours": float(score), "reference": float(r.score)})
    table = pd.DataFrame(rows)
    table["difference"] = (table["yours"] - table["reference"]).abs()
    bad = table[~(table["difference"] <= PROBE_TOL)]
    if len(bad):
        raise CheckFailed(
            f"probe_r2 is more than {PROBE_TOL} away from the reference (StandardScaler, then RidgeCV "
            f"over alphas 10^-1..10^5) for:\n{bad.round(3).to_string(index=False)}"
        )
    passed(
        f"probe_r2 is within {PROBE_TOL} of arithlib.zhang.probing.linear_probes on {len(table)} probes "
        f"(largest difference {table['difference'].max():.3f})"
    )
