"""Metrics of the three papers on answer-position logits.

All functions take tensors (logits at the answer position, token ids) and return
tensors or floats; none runs a model. Conventions: ``logits`` is ``[..., vocab]``,
token ids are ``[...]`` (one per prompt), leading dims broadcast (e.g. ``[variant,
prompt, vocab]`` against ``[prompt]`` ids).

* :func:`relative_logit_change` -- Zhang et al. 2024, Alg. 1: s = (logit_p - logit_o) / logit_o
  of the ground-truth token; key heads have a mean s below -5 % (Sec. 5.1).
* :func:`indirect_effect` -- Stolfo et al. 2023 Eq. 3, the metric of Nikankin et al. 2025's
  activation patching: how far a patch moves probability from the clean answer r
  to the counterfactual answer r'.
* :func:`normalized_logit` and :func:`faithfulness` -- Nikankin et al. 2025 Eq. 2: the
  correct-token logit divided by the largest logit, scaled so the fully mean-ablated
  model scores 0 and the full model 1.
* :func:`top1_accuracy` -- first-token accuracy (argmax equals the answer token).
"""

from __future__ import annotations

import torch


def _gather(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``logits[..., ids]`` with ``ids`` broadcast over the leading dims of ``logits``."""
    ids = torch.as_tensor(ids, device=logits.device, dtype=torch.long)
    ids = ids.expand(logits.shape[:-1])
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def answer_logit(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """The logit of each prompt's answer token, ``[...]``."""
    return _gather(logits, answer_ids)


def relative_logit_change(patched_logit: torch.Tensor, clean_logit: torch.Tensor, strict: bool = True) -> torch.Tensor:
    """Zhang et al. 2024, Alg. 1: ``(logit_p - logit_o) / logit_o`` of the answer token.

    ``patched_logit`` and ``clean_logit`` are answer-token logits (broadcastable). The
    ratio is only meaningful for a positive clean logit: with ``strict`` a ValueError is
    raised for any ``clean_logit <= 0``, otherwise those entries are NaN (a prompt whose
    answer logit is not positive should not be in the reference set X_r).
    """
    clean_logit = torch.as_tensor(clean_logit)
    bad = clean_logit <= 0
    if strict and bad.any():
        raise ValueError(
            "relative_logit_change needs positive clean answer logits (Zhang's logit_o); "
            f"got min {clean_logit.min().item():.3g}"
        )
    out = (patched_logit - clean_logit) / clean_logit
    return out.masked_fill(bad.expand_as(out), float("nan")) if bad.any() else out


def indirect_effect(
    clean_logits: torch.Tensor, patched_logits: torch.Tensor, answer_ids: torch.Tensor, cf_answer_ids: torch.Tensor
) -> torch.Tensor:
    """Stolfo et al. 2023 (Eq. 3), used by Nikankin et al. 2025 for activation patching:

    IE = 1/2 [ (P*(r') - P(r')) / P(r')  +  (P(r) - P*(r)) / P*(r) ]

    with P the clean run's next-token distribution, P* the patched run's (the
    component set to its value on the counterfactual prompt), r the clean answer and
    r' the counterfactual answer token. ``clean_logits`` ``[..., vocab]`` broadcasts
    against ``patched_logits``. Returns one value per prompt (and variant).
    """
    p_clean = clean_logits.float().softmax(-1)
    p_patch = patched_logits.float().softmax(-1)
    pr, pr_cf = _gather(p_clean, answer_ids), _gather(p_clean, cf_answer_ids)
    qr, qr_cf = _gather(p_patch, answer_ids), _gather(p_patch, cf_answer_ids)
    tiny = torch.finfo(torch.float32).tiny
    return 0.5 * ((qr_cf - pr_cf) / pr_cf.clamp_min(tiny) + (pr - qr) / qr.clamp_min(tiny))


def normalized_logit(answer_logits: torch.Tensor, max_logits: torch.Tensor) -> torch.Tensor:
    """Nikankin et al. 2025 (Eq. 2): the correct token's logit divided by the largest logit.

    Takes the two logits (not the vocabulary) so that callers that know the maximum
    without unembedding everything (:func:`arithlib.methods.patching.Unembed.top1`) can use it.
    Use :func:`normalized_logit_from_logits` for full logits.
    """
    return answer_logits / max_logits


def normalized_logit_from_logits(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """:func:`normalized_logit` from full ``[..., vocab]`` logits."""
    return normalized_logit(_gather(logits, answer_ids), logits.max(-1).values)


def faithfulness(circuit: torch.Tensor | float, full: torch.Tensor | float, ablated: torch.Tensor | float) -> float:
    """Nikankin et al. 2025: ``(m(circuit) - m(ablated)) / (m(full) - m(ablated))`` where m is
    the mean normalized logit over prompts: 1 when the circuit alone (everything else
    mean-ablated) behaves like the full model, 0 when it is no better than the fully
    mean-ablated model. Tensors are averaged first. Raises if full == ablated."""
    c, f, a = (float(torch.as_tensor(x, dtype=torch.float64).mean()) for x in (circuit, full, ablated))
    if abs(f - a) < 1e-12:
        raise ValueError("faithfulness is undefined: the full and the fully ablated model score the same")
    return (c - a) / (f - a)


def top1_accuracy(pred_ids: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """Mean of ``pred == answer`` over the last dim (prompts): accuracy per leading index."""
    pred_ids = torch.as_tensor(pred_ids)
    answer_ids = torch.as_tensor(answer_ids, device=pred_ids.device).expand_as(pred_ids)
    return (pred_ids == answer_ids).float().mean(-1)


def accuracy_from_logits(logits: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """First-token accuracy from ``[..., prompt, vocab]`` logits."""
    return top1_accuracy(logits.argmax(-1), answer_ids)
