"""Exercise 08 (precise SFT): the checks of arithlib.course.sft_checks pass on correct answers and
reject the typical wrong ones, naming the mistake. (The generic tests of
tests/notebooks/test_exercises.py run the solution and exercise notebooks.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import arithlib.course.sft_checks as sx


def _masks(
    params,
    heads,
    mlps,
    n_heads,
    n_kv_heads,
    *,
    o_axis="columns",
    kv="group",
    biases=True,
    o_bias=False,
    by_layer=False,
    extra_mlps=False,
):
    """Precise SFT's masks, correct with the defaults; each keyword makes one typical mistake."""
    masks: dict[str, torch.Tensor] = {}

    def mask(name):
        return masks.setdefault(name, torch.zeros(params[name].shape, dtype=torch.bool))

    for layer, h in heads:
        pre = f"model.layers.{layer}.self_attn."
        d = params[pre + "q_proj.weight"].shape[0] // n_heads
        own = slice(h * d, (h + 1) * d)
        g = {"group": h // (n_heads // n_kv_heads), "modulo": h % n_kv_heads, "own": h}.get(kv, 0)
        group = slice(g * d, (g + 1) * d)
        projs = [("q_proj", own)] + ([] if kv == "none" else [("k_proj", group), ("v_proj", group)])
        for proj, rows in projs:
            for suffix in ("weight", "bias") if biases else ("weight",):
                if pre + f"{proj}.{suffix}" in params:
                    mask(pre + f"{proj}.{suffix}")[slice(None) if by_layer else rows] = True
        if o_axis == "columns":
            mask(pre + "o_proj.weight")[:, slice(None) if by_layer else own] = True
        else:
            mask(pre + "o_proj.weight")[own] = True
        if o_bias and pre + "o_proj.bias" in params:
            mask(pre + "o_proj.bias")[:] = True
    layers = set(mlps) | ({layer for layer, _ in heads} if extra_mlps else set())
    for layer in layers:
        for name, p in params.items():
            if name.startswith(f"model.layers.{layer}.mlp."):
                masks[name] = torch.ones(p.shape, dtype=torch.bool)
    return masks


def _loss(logits, tokens, prompt_len, answer_len, *, shift=1, prompt=False, reduce="tokens"):
    """The answer-only loss, correct with the defaults; each keyword makes one typical mistake."""
    lp = logits.log_softmax(-1)
    rows = []
    for b in range(tokens.shape[0]):
        p, a = int(prompt_len[b]), int(answer_len[b])
        first = 1 if prompt else p
        rows.append(torch.stack([-lp[b, t - shift, tokens[b, t]] for t in range(first, p + a)]))
    if reduce == "prompts":
        return torch.stack([r.mean() for r in rows]).mean()
    flat = torch.cat(rows)
    if reduce == "sum":
        return flat.sum()
    if reduce == "positions":
        return flat.sum() / (tokens.shape[0] * (tokens.shape[1] - 1))
    return flat.mean()


def _step(params, masks, scales, loss_fn, lr, *, scale=True, mask=True, sign=1.0, clear=True, in_place=True):
    """One step of Alg. 2, correct with the defaults; each keyword makes one typical mistake."""
    for p in params.values():
        if clear:
            p.grad = None
        p.requires_grad_(True)
    loss = loss_fn()
    loss.backward()
    with torch.no_grad():
        for name, p in params.items():
            g = p.grad * (scales.get(name, 1.0) if scale else 1.0)
            if mask and name in masks:
                g = g * masks[name].to(g.dtype)
            if in_place:
                p.sub_(sign * lr * g)
            else:
                p = p - lr * g  # noqa: PLW2901 (the mistake: rebinds the name, the model keeps its weight)
    return loss.item()


@pytest.mark.toy_model
def test_sft_checks_pass_on_correct_answers(capsys):
    sx.check_precise_masks(_masks)
    sx.check_answer_only_loss(_loss)
    sx.check_answer_only_loss(
        lambda lg, tk, p, a: F.cross_entropy(
            lg.flatten(0, 1),
            torch.stack(
                [
                    torch.where(
                        (torch.arange(tk.shape[1]) >= p[b] - 1) & (torch.arange(tk.shape[1]) < p[b] + a[b] - 1),
                        tk[b].roll(-1),
                        -100,
                    )
                    for b in range(tk.shape[0])
                ]
            ).flatten(),
            ignore_index=-100,
        )
    )
    sx.check_precise_sgd_step(_step)
    assert capsys.readouterr().out.count("✓") == 4


@pytest.mark.toy_model
def test_sft_checks_reject_wrong_answers():
    for kwargs, message in (
        ({"o_axis": "rows"}, "wrong axis"),
        ({"by_layer": True}, "masked by layer only"),
        ({"kv": "modulo"}, r"h // \(n_heads // n_kv_heads\)"),
        ({"kv": "own"}, "KV group"),
        ({"kv": "none"}, "W_K / W_V are missing"),
        ({"biases": False}, "biases are missing"),
        ({"o_bias": True}, "output bias"),
        ({"extra_mlps": True}, "MLP parameters"),
    ):
        with pytest.raises(sx.CheckFailed, match=message):
            sx.check_precise_masks(lambda *a, kw=kwargs: _masks(*a, **kw))

    for kwargs, message in (
        ({"prompt": True}, "prompt tokens included"),
        ({"shift": 0}, "off by one"),
        ({"reduce": "prompts"}, "mean over prompts"),
        ({"reduce": "sum"}, "sum over the answer tokens"),
        ({"reduce": "positions"}, "whole sequence"),
    ):
        with pytest.raises(sx.CheckFailed, match=message):
            sx.check_answer_only_loss(lambda *a, kw=kwargs: _loss(*a, **kw))
    with pytest.raises(sx.CheckFailed, match="scalar"):
        sx.check_answer_only_loss(lambda *a: _loss(*a).item())

    for kwargs, message in (
        ({"scale": False}, "H/h"),
        ({"mask": False}, "outside its mask"),
        ({"sign": -1.0}, "up the gradient"),
        ({"clear": False}, "stale .grad"),
        ({"in_place": False}, "did not move"),
    ):
        with pytest.raises(sx.CheckFailed, match=message):
            sx.check_precise_sgd_step(lambda *a, kw=kwargs: _step(*a, **kw))

    def frozen(params, masks, scales, loss_fn, lr):  # never makes the parameters trainable
        loss = loss_fn()
        loss.backward()
        return loss.item()

    with pytest.raises(sx.CheckFailed, match="requires_grad"):
        sx.check_precise_sgd_step(frozen)

    # the model is left as it was after a wrong step
    params = sx.params_by_clean_name(sx.toy_hf())
    before = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(sx.CheckFailed):
        sx.check_precise_sgd_step(lambda *a: _step(*a, sign=-1.0))
    assert all(torch.equal(before[n], p) for n, p in params.items())
