"""Exercise 05 (Yu & Ananiadou's LoRA mechanism): the checks of arithlib.course.lora_checks
reject the typical wrong answers, naming the mistake where they recognise it, and the peft
reference leaves the toy model as it was. (That the checks pass on the solution and raise on
the stubs is tests/notebooks/test_exercises.py's generic test.)"""

from __future__ import annotations

import pytest
import torch

import arithlib.course.lora_checks as lx
import arithlib.methods.model_weights as MW

# --------------------------------------------------------------------------- right answers, to vary


def _merge(params, layer, factors, scale):
    return {
        f"model.layers.{layer}.{m}.weight": params[f"model.layers.{layer}.{m}.weight"] + scale * (B @ A)
        for m, (A, B) in factors.items()
    }


def _increase(before, after):
    m0, m1 = before.float(), after.float()
    return float(100 * (torch.sign(m0) * (m1 - m0)).sum() / m0.abs().sum())


def _top(scores, k):
    """[cases, k] flat indices of each case's k largest finite scores."""
    n = len(scores)
    return scores.nan_to_num(nan=-torch.inf).reshape(n, -1).topk(k, dim=1).indices


def _pooled(c0, c1, idx, increase=_increase):
    n = len(c0)
    return increase(c0.reshape(n, -1).gather(1, idx), c1.reshape(n, -1).gather(1, idx))


# --------------------------------------------------------------------------- 1 · merged weights


@pytest.mark.toy_model
def test_peft_lora_leaves_the_model_as_it_was():
    bridge = lx.check_model().bridge
    before = {n: p.detach().clone() for n, p in MW.params_by_clean_name(bridge).items()}
    flags = {n: p.requires_grad for n, p in MW.params_by_clean_name(bridge).items()}
    factors = lx.random_factors(1, 4)
    merged, _ = lx.peft_lora(1, factors, 8, 4)
    after = MW.params_by_clean_name(bridge)
    assert set(after) == set(before)
    assert all(torch.equal(after[n].detach(), before[n]) for n in before)
    assert {n: p.requires_grad for n, p in after.items()} == flags
    assert sorted(merged) == sorted(f"model.layers.1.{m}.weight" for m in lx.TARGETS)
    assert torch.allclose(
        merged["model.layers.1.self_attn.v_proj.weight"],
        _merge(before, 1, factors, 2.0)["model.layers.1.self_attn.v_proj.weight"],
        atol=1e-6,
    )


@pytest.mark.toy_model
def test_lora_weights_check_rejects_wrong_answers():
    lx.check_lora_weights(lambda p, layer, f, alpha, r: _merge(p, layer, f, alpha / r))
    with pytest.raises(lx.CheckFailed, match="alpha instead of alpha / r"):
        lx.check_lora_weights(lambda p, layer, f, alpha, r: _merge(p, layer, f, alpha))
    with pytest.raises(lx.CheckFailed, match="without the scaling"):
        lx.check_lora_weights(lambda p, layer, f, alpha, r: _merge(p, layer, f, 1.0))

    def transposed(params, layer, factors, alpha, r):  # A^T B^T: the square q and o projections come first
        return {
            f"model.layers.{layer}.{m}.weight": params[f"model.layers.{layer}.{m}.weight"] + alpha / r * (A.T @ B.T)
            for m, (A, B) in factors.items()
        }

    with pytest.raises(lx.CheckFailed, match="transposed"):
        lx.check_lora_weights(transposed)

    def every_layer(params, layer, factors, alpha, r):  # matches the module's name in every block
        return {
            n: W + alpha / r * (B @ A)
            for m, (A, B) in factors.items()
            for n, W in params.items()
            if n.endswith(f"{m}.weight")
        }

    with pytest.raises(lx.CheckFailed, match=r"you adapt layer\(s\) \[0\] too"):
        lx.check_lora_weights(every_layer)

    def unchanged(params, layer, factors, alpha, r):
        return {f"model.layers.{layer}.{m}.weight": params[f"model.layers.{layer}.{m}.weight"] for m in factors}

    with pytest.raises(lx.CheckFailed, match="add the low-rank update"):
        lx.check_lora_weights(unchanged)

    def all_four(params, layer, factors, alpha, r):  # every projection whatever the factors
        return _merge(params, layer, {**{m: factors[m] for m in factors}}, alpha / r) | {
            f"model.layers.{layer}.self_attn.k_proj.weight": params[f"model.layers.{layer}.self_attn.k_proj.weight"]
        }

    with pytest.raises(lx.CheckFailed, match="only the projections of `factors`"):
        lx.check_lora_weights(all_four)


# --------------------------------------------------------------------------- 2 · coefficient increase


@pytest.mark.toy_model
def test_coefficient_increase_check_rejects_wrong_answers():
    lx.check_coefficient_increase(_increase)
    with pytest.raises(lx.CheckFailed, match="the decrease"):
        lx.check_coefficient_increase(lambda b, a: -_increase(b, a))
    with pytest.raises(lx.CheckFailed, match="a fraction"):
        lx.check_coefficient_increase(lambda b, a: _increase(b, a) / 100)
    with pytest.raises(lx.CheckFailed, match="own ratios"):
        lx.check_coefficient_increase(lambda b, a: float(100 * ((a - b) / b.abs()).mean()))
    with pytest.raises(lx.CheckFailed, match="not sign-aware"):
        lx.check_coefficient_increase(lambda b, a: float(100 * (a - b).sum() / b.sum()))
    with pytest.raises(lx.CheckFailed, match="sign-blind"):
        lx.check_coefficient_increase(lambda b, a: float(100 * (a - b).sum() / b.abs().sum()))
    with pytest.raises(lx.CheckFailed, match="mean absolute change"):
        lx.check_coefficient_increase(lambda b, a: float(100 * (a - b).mean()))
    with pytest.raises(lx.CheckFailed, match="mean over rows"):
        lx.check_coefficient_increase(
            lambda b, a: float(100 * ((torch.sign(b) * (a - b)).sum(1) / b.abs().sum(1)).mean())
        )
    with pytest.raises(lx.CheckFailed, match="one number"):
        lx.check_coefficient_increase(lambda b, a: torch.sign(b) * (a - b))


# --------------------------------------------------------------------------- 3 · Table 10


@pytest.mark.toy_model
def test_cna_increase_check_rejects_wrong_answers():
    lx.check_cna_increase(lambda c0, c1, i0, i1, k: _pooled(c0, c1, _top(i1 - i0, k)))
    with pytest.raises(lx.CheckFailed, match="original model's own top-k"):
        lx.check_cna_increase(lambda c0, c1, i0, i1, k: _pooled(c0, c1, _top(i0, k)))
    with pytest.raises(lx.CheckFailed, match="importance decrease"):
        lx.check_cna_increase(lambda c0, c1, i0, i1, k: _pooled(c0, c1, _top(i0 - i1, k)))
    with pytest.raises(lx.CheckFailed, match="circular"):
        lx.check_cna_increase(
            lambda c0, c1, i0, i1, k: _pooled(c0, c1, _top(torch.where(torch.isfinite(i1 - i0), c1 - c0, torch.nan), k))
        )

    def with_nan(c0, c1, i0, i1, k):  # torch.topk ranks NaN first: the unranked layers' neurons
        n = len(c0)
        return _pooled(c0, c1, (i1 - i0).reshape(n, -1).topk(k, dim=1).indices)

    with pytest.raises(lx.CheckFailed, match="NaN"):
        lx.check_cna_increase(with_nan)

    def per_case_mean(c0, c1, i0, i1, k):
        idx = _top(i1 - i0, k)
        return sum(_pooled(c0[i : i + 1], c1[i : i + 1], idx[i : i + 1]) for i in range(len(c0))) / len(c0)

    with pytest.raises(lx.CheckFailed, match="mean of the per-case"):
        lx.check_cna_increase(per_case_mean)

    def jointly(c0, c1, i0, i1, k):  # the top k * cases entries over every case at once
        flat = (i1 - i0).nan_to_num(nan=-torch.inf).flatten()
        idx = flat.topk(k * len(c0)).indices
        return _increase(c0.flatten()[idx][None], c1.flatten()[idx][None])

    with pytest.raises(lx.CheckFailed, match="jointly"):
        lx.check_cna_increase(jointly)
