"""Exercise 04 (Yu & Ananiadou's CNA): the checks of :mod:`arithlib.course.cna_checks` reject
the typical wrong answers on the toy model, naming the mistake where they recognise it. (That
every check passes on the solution and raises on the stubs is tested for every exercise
source by tests/notebooks/test_exercises.py.)"""

from __future__ import annotations

import pytest
import torch

import arithlib.course.cna_checks as cx
from arithlib.core.readout import final_norm, unembedding


def _importance(bridge, layer, resid, coef, h_final, target, *, vectors=None, read="final", logit=False, sign=1.0):
    """CNA importance with one deliberate mistake (the keyword arguments)."""
    norm = final_norm(bridge)
    W_U, b_U = unembedding(bridge)
    values = bridge.blocks[layer].mlp.W_out.float() if vectors is None else vectors
    s = torch.sqrt(h_final.pow(2).mean() + norm.eps)

    def readout(x):
        if read == "final":
            y = x / s * norm.weight
        elif read == "own":  # the model's own final norm applied to each vector
            y = bridge.ln_final(x[:, None, :])[:, 0].float()
        else:  # no norm
            y = x
        z = y @ W_U + b_U
        return z[:, target] if logit else z.log_softmax(-1)[:, target]

    return sign * (readout(resid[None] + coef[:, None] * values) - readout(resid[None]))


@pytest.mark.toy_model
def test_cna_importance_check_rejects_wrong_answers():
    def w_in(bridge, layer, *args):
        return _importance(bridge, layer, *args, vectors=bridge.blocks[layer].mlp.W_in.float().T)

    for wrong, message in (
        (lambda *a: _importance(*a, read="own"), "its own RMS"),
        (lambda *a: _importance(*a, read="none"), "no final norm"),
        (lambda *a: _importance(*a, logit=True), "logit, not of its log-probability"),
        (w_in, "input weights"),
        (lambda *a: _importance(*a, sign=-1.0), "sign is reversed"),
        (lambda *a: _importance(*a)[:-1], "shape"),
    ):
        with pytest.raises(cx.CheckFailed, match=message):
            cx.check_neuron_importance(wrong)


def _top(change, k, *, key=None, nan=True, order=True):
    """Top-k (layer, neuron) with one deliberate mistake."""
    scores = change if key is None else key(change)
    flat = scores.flatten()
    if nan:
        flat = flat.nan_to_num(nan=-torch.inf)
    d = change.shape[1]
    out = [(f // d, f % d) for f in flat.topk(k).indices.tolist()]
    return out if order else sorted(out)


@pytest.mark.toy_model
def test_cna_top_neurons_check_rejects_wrong_answers():
    for wrong, message in (
        (lambda c, k: _top(c, k, key=lambda x: -x), "smallest changes"),
        (lambda c, k: _top(c, k, key=torch.abs), r"\|change\|"),
        (lambda c, k: _top(c, k, nan=False), "NaN"),
        (lambda c, k: _top(c, k, order=False), "best .largest change. first"),
        (
            lambda c, k: [(f % c.shape[0], f // c.shape[0]) for f in c.flatten().topk(k).indices.tolist()],
            "decoded with n_layers",
        ),
        (
            lambda c, k: [(f // c.shape[0], f % c.shape[0]) for f in c.flatten().topk(k).indices.tolist()],
            "out of range",
        ),
    ):
        with pytest.raises(cx.CheckFailed, match=message):
            cx.check_top_neurons(wrong)


def _zeroed(
    bridge, tokens, sets, keep_layers=None, *, position=-1, mode=None, own_too=False, layers_of_set=False, union=False
):
    """zeroed_logits with one deliberate mistake (the keyword arguments)."""
    N, d_mlp = tokens.shape[0], bridge.cfg.d_mlp
    keep = keep_layers is not None if mode is None else mode == "keep"
    if union:
        sets = [sorted({n for s in sets for n in s})] * N
    layers = sorted(keep_layers) if keep_layers is not None else sorted({layer for s in sets for layer, _ in s})
    zero = {layer: torch.full((N, d_mlp), keep) for layer in layers}
    for i, s in enumerate(sets):
        for layer, n in s:
            if layer in zero and not own_too:
                zero[layer][i, n] = not keep
        if layers_of_set:
            for layer in layers:
                if layer not in {lay for lay, _ in s}:
                    zero[layer][i] = False

    def hook_for(mask):
        def fn(act, hook):
            if position is None:
                return act.masked_fill(mask[:, None, :], 0.0)
            act[:, position] = act[:, position].masked_fill(mask, 0.0)
            return act

        return fn

    with bridge.hooks(fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", hook_for(m)) for layer, m in zero.items()]):
        return bridge(tokens)[:, -1]


@pytest.mark.toy_model
def test_cna_zeroed_logits_check_rejects_wrong_answers():
    for wrong, message in (
        (lambda *a: _zeroed(*a, position=None), "every position"),
        (lambda *a: _zeroed(*a, mode="keep"), "keep instead of mask"),
        (lambda *a: _zeroed(*a, union=True), "each prompt has its own set"),
        (lambda b, t, s, keep=None: _zeroed(b, t, s, keep, layers_of_set=keep is not None), "EVERY keep layer"),
        (lambda b, t, s, keep=None: _zeroed(b, t, s, keep, own_too=keep is not None), "the prompt's own too"),
        (lambda b, t, s, keep=None: _zeroed(b, t, s, keep, mode="mask"), "mask instead of keep"),
        (lambda b, t, s, keep=None: b(t)[:, -1], "without any intervention"),
        (lambda b, t, s, keep=None: _zeroed(b, t, s, keep)[:, :10], "shape"),
    ):
        with pytest.raises(cx.CheckFailed, match=message):
            cx.check_zeroed_logits(wrong)

    bridge = cx.check_model().bridge

    def leaves_hooks(b, tokens, sets, keep_layers=None):
        b.add_hook("blocks.1.mlp.hook_post", lambda act, hook: act * 0.5)
        return b(tokens)[:, -1]

    try:
        with pytest.raises(cx.CheckFailed, match="left its hooks"):
            cx.check_zeroed_logits(leaves_hooks)
    finally:
        bridge.reset_hooks()
