"""Exercise 07 (gender-bias editing, Yu & Ananiadou Sec. 6.2): the checks of
:mod:`arithlib.course.bias_checks` reject the typical wrong answers, naming the mistake, and
accept an equivalent right one. That they pass on the solution and raise on the stubs is
tested for every exercise source by tests/notebooks/test_exercises.py."""

from __future__ import annotations

import pytest
import torch

import arithlib.course.bias_checks as bx
from arithlib.yu.bias_professions import table22_prompts


def _diff(model, tokenizer, token_ids, genders, hooks=None, *, kind="logprob", bos=True, position=-1, sign=1):
    """bias_diff with a switchable mistake: ``kind`` "logprob" (right), "prob" or "logit"."""
    rows = []
    with model.hooks(fwd_hooks=list(hooks or [])):
        for g in genders:
            per = []
            for text in table22_prompts(g):
                tokens = torch.tensor([tokenizer(text, add_special_tokens=bos)["input_ids"]])
                logits = model(tokens)[0, position].float()
                value = {"logprob": logits.log_softmax(-1), "prob": logits.softmax(-1), "logit": logits}[kind]
                per.append(value[token_ids])
            rows.append(torch.stack(per))
    return sign * (rows[0] - rows[1])


@pytest.mark.toy_model
def test_bias_checks_reject_wrong_answers_to_the_metric():
    bx.check_bias_diff(_diff)  # the reference-shaped right answer passes
    for kwargs, message in (
        ({"sign": -1}, "sign is reversed"),
        ({"kind": "prob"}, "probabilities"),
        ({"kind": "logit"}, "logits"),
        ({"bos": False}, "BOS"),
        ({"position": -2}, "last token"),
    ):
        with pytest.raises(bx.CheckFailed, match=message):
            bx.check_bias_diff(lambda m, t, i, g, hooks=None, kw=kwargs: _diff(m, t, i, g, hooks, **kw))

    def ignores_hooks(model, tokenizer, token_ids, genders, hooks=None):
        return _diff(model, tokenizer, token_ids, genders, None)

    with pytest.raises(bx.CheckFailed, match="model.hooks"):
        bx.check_bias_diff(ignores_hooks)


def _zero_hooks(neurons, *, name="blocks.{}.mlp.hook_post", layer_of=lambda lay: lay, positions=slice(None)):
    by_layer: dict[int, list[int]] = {}
    for lay, k in neurons:
        by_layer.setdefault(layer_of(lay), []).append(k)
    hooks = []
    for lay, idx in by_layer.items():

        def fn(act, hook, idx=idx):
            act[:, positions, idx] = 0.0
            return act

        hooks.append((name.format(lay), fn))
    return hooks


@pytest.mark.toy_model
def test_bias_checks_reject_wrong_edits():
    bx.check_zero_neuron_hooks(_zero_hooks)
    # SiLU(0) = 0 and the MLP has no biases: zeroing the gate's pre-activation is the same edit
    bx.check_zero_neuron_hooks(lambda ns: _zero_hooks(ns, name="blocks.{}.mlp.hook_pre"))

    with pytest.raises(bx.CheckFailed, match="last position only"):
        bx.check_zero_neuron_hooks(lambda ns: _zero_hooks(ns, positions=slice(-1, None)))
    with pytest.raises(bx.CheckFailed, match="another layer"):
        bx.check_zero_neuron_hooks(lambda ns: _zero_hooks(ns, layer_of=lambda lay: 1 - lay))
    with pytest.raises(bx.CheckFailed, match="not a hook point"):
        bx.check_zero_neuron_hooks(lambda ns: _zero_hooks(ns, layer_of=lambda lay: lay + 1))

    def not_returned(neurons):  # edits a copy and returns nothing: the hook has no effect
        idx = [k for _, k in neurons]

        def fn(act, hook):
            act = act.clone()
            act[:, :, idx] = 0.0

        return [(f"blocks.{lay}.mlp.hook_post", fn) for lay in sorted({lay for lay, _ in neurons})]

    with pytest.raises(bx.CheckFailed, match="change nothing"):
        bx.check_zero_neuron_hooks(not_returned)

    def residual_dimension(neurons):  # zeroes dimension k of the MLP's output instead of neuron k
        d_model = bx.bias_data().bridge.cfg.d_model
        return _zero_hooks([(lay, k % d_model) for lay, k in neurons], name="blocks.{}.hook_mlp_out")

    with pytest.raises(bx.CheckFailed, match="hook_post"):
        bx.check_zero_neuron_hooks(residual_dimension)

    def edits_the_weights(neurons):  # zeroes W_out's columns in place and returns no hooks
        bridge = bx.bias_data().bridge
        with torch.no_grad():
            for lay, k in neurons:
                bridge.blocks[lay].mlp.out.weight[:, k] = 0.0
        return []

    with pytest.raises(bx.CheckFailed, match="parameters"):
        bx.check_zero_neuron_hooks(edits_the_weights)
    bx.check_zero_neuron_hooks(_zero_hooks)  # the weights were restored


def _reduction(scores, k, *, signed=False, relative_to_edited=False, one_seed=False, fraction=False, flip=False):
    s = scores.assign(a=scores["diff"] if signed else scores["diff"].abs())
    o = s.loc[s.kind == "original", "a"].mean()
    e = s.loc[(s.kind == "cna") & (s.K == k), "a"].mean()
    r = s[(s.kind == "random") & (s.K == k)].groupby("seed").a.mean()
    if one_seed:
        r = r.iloc[:1]
    scale = 1 if fraction else 100
    red = scale * ((o - e) / e if relative_to_edited else 1 - e / o)
    rnd = float((scale * ((o - r) / r if relative_to_edited else 1 - r / o)).mean())
    return {"reduction_pct": red, "random_pct": rnd, "diff_pts": (rnd - red) if flip else (red - rnd)}


@pytest.mark.toy_model
def test_bias_checks_reject_wrong_reductions():
    bx.check_reduction_vs_random(_reduction)
    for kwargs, message in (
        ({"signed": True}, "signed difference"),
        ({"relative_to_edited": True}, "relative to the edited"),
        ({"one_seed": True}, "one seed only"),
        ({"fraction": True}, "fraction"),
        ({"flip": True}, "sign is reversed"),
    ):
        with pytest.raises(bx.CheckFailed, match=message):
            bx.check_reduction_vs_random(lambda s, k, kw=kwargs: _reduction(s, k, **kw))

    def mean_of_ratios(scores, k):
        s = scores.assign(a=scores["diff"].abs())
        key = ["prompt_id", "token_id"]
        o = s[s.kind == "original"].set_index(key).a
        e = s[(s.kind == "cna") & (s.K == k)].set_index(key).a.reindex(o.index)
        right = _reduction(scores, k)
        red = float((100 * (1 - e / o)).mean())
        return {**right, "reduction_pct": red, "diff_pts": red - right["random_pct"]}

    with pytest.raises(bx.CheckFailed, match="mean of each pair"):
        bx.check_reduction_vs_random(mean_of_ratios)
    with pytest.raises(bx.CheckFailed, match="dict"):
        bx.check_reduction_vs_random(lambda s, k: 43.0)
