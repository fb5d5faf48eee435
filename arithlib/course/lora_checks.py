"""Checks for exercise 05, Yu & Ananiadou's LoRA mechanism (``notebooks/exercises/05_*``), on
the toy model: the merged weights of a LoRA adapter on one attention layer (Sec. 5, what
:func:`arithlib.yu.lora.train_lora` returns), the sign-aware coefficient increase of a set of
neurons (Table 10's quantity) and that increase on the top-k neurons CNA picks between a LoRA
model and the original (Tables 9-10, :func:`arithlib.yu.lora.lora_cna`). As in
:mod:`arithlib.course.exercises`, a check prints one line when the student's function agrees
with arithlib's and raises :class:`CheckFailed` saying what differs (naming the usual mistake
where it recognises one) when it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
import torch

from ..core import datasets as ds
from ..core.prompt_sets import PromptSet
from ..engine import shared_hf_model
from ..methods import finetune as FT
from ..methods import model_weights as MW
from ..yu import cna as C
from ..yu import lora as LO
from .exercises import CheckFailed, check_model, passed

#: Training sentences (Yu's 2-digit + and -, 4 templates each), learning rate and adapter of
#: the check's LoRA models (one epoch, batch 16: a few seconds per layer on a CPU); r and alpha
#: are notebook 05's.
N_TRAIN, LR, LORA = 256, 1e-3, LO.LoraSpec(r=16, alpha=32)
#: CNA cases: Yu's 1-digit + and - prompts ("3 + 5 =" first), a random subset of this size.
N_CASES = 60
#: Yu's Table 10 columns.
KS = (50, 30, 20, 10)
#: The LoRA target modules of the toy model (a Llama): every attention projection.
TARGETS = MW.LORA_TARGETS["llama"]


# --------------------------------------------------------------------------- 1 · merged weights


def random_factors(
    layer: int, r: int, modules: Sequence[str] = TARGETS, seed: int = 0, std: float = 0.05
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Fixed random LoRA factors ``{module: (A [r, d_in], B [d_out, r])}`` for the projections
    ``modules`` of block ``layer`` (B non-zero, unlike a fresh adapter, so the change shows)."""
    params = MW.params_by_clean_name(check_model().bridge)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module in modules:
        d_out, d_in = params[f"model.layers.{layer}.{module}.weight"].shape
        out[module] = (std * torch.randn(r, d_in, generator=g), std * torch.randn(d_out, r, generator=g))
    return out


def peft_lora(
    layer: int,
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: float,
    r: int,
    tokens: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """peft's LoRA on block ``layer`` of the toy model (``layers_to_transform=[layer]``, as
    :func:`arithlib.yu.lora.train_lora` sets it up) with its A, B set to ``factors``: the merged
    weights (:func:`arithlib.yu.lora.merged_lora_weights`) and, given ``tokens``, the adapted
    model's last-position logits (peft's own forward, adapter not merged). The model is left as
    it was."""
    from peft import LoraConfig, get_peft_model

    hf = shared_hf_model(check_model().bridge)
    leaf = sorted({m.split(".")[-1] for m in factors})
    logits = None
    with MW.training_state(hf), torch.no_grad():
        cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=leaf, layers_to_transform=[layer])
        pm = get_peft_model(hf, cfg)
        try:
            for name, module in hf.named_modules():
                hit = [m for m in factors if name.endswith(f"layers.{layer}.{m}")]
                if hit and hasattr(module, "lora_A"):
                    A, B = factors[hit[0]]
                    module.lora_A["default"].weight.copy_(A)
                    module.lora_B["default"].weight.copy_(B)
            merged = LO.merged_lora_weights(hf, pm)
            if tokens is not None:
                logits = pm(tokens).logits[:, -1].float().cpu()
        finally:
            pm.unload()
    return merged, logits


def _factor_cases() -> list[tuple[int, tuple[str, ...], int, int]]:
    """(layer, modules, r, alpha) of :func:`check_lora_weights`: the square projections alone
    first (a transposed B A has the right shape there), then every projection of each layer."""
    return [
        (1, ("self_attn.q_proj", "self_attn.o_proj"), 4, 16),
        (0, TARGETS, 4, 8),
        (1, TARGETS, 8, 32),
    ]


def _wrong_merges(
    params: Mapping[str, torch.Tensor], layer: int, factors: Mapping, alpha: float, r: int
) -> dict[str, dict[str, torch.Tensor]]:
    """What the usual mistakes write, for the message of :func:`check_lora_weights`."""

    def merge(scale: float, transpose: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for module, (A, B) in factors.items():
            W = params[f"model.layers.{layer}.{module}.weight"].detach().float()
            delta = (B @ A).T if transpose else B @ A
            if delta.shape == W.shape:
                out[f"model.layers.{layer}.{module}.weight"] = W + scale * delta
        return out

    return {
        "scaled by alpha instead of alpha / r": merge(alpha),
        "without the scaling alpha / r": merge(1.0),
        "scaled by r / alpha instead of alpha / r": merge(r / alpha),
        "with (B A) transposed: B is [d_out, r] and A is [r, d_in], so B @ A has W's shape [d_out, d_in]": merge(
            alpha / r, transpose=True
        ),
    }


def check_lora_weights(fn: Callable) -> None:
    """``fn(params, layer, factors, alpha, r)`` (``params`` the toy model's weights by clean HF
    name, ``factors`` {module: (A, B)}): {``model.layers.<layer>.<module>.weight``: W + (alpha /
    r) B A} for exactly the modules of ``factors`` in block ``layer``; against the merged
    weights of peft's LoRA with those factors (:func:`peft_lora`, as
    :func:`arithlib.yu.lora.train_lora` merges them), on both layers and two adapter sizes."""
    bridge = check_model().bridge
    params = {n: p.detach().clone() for n, p in MW.params_by_clean_name(bridge).items()}
    for layer, modules, r, alpha in _factor_cases():
        factors = random_factors(layer, r, modules, seed=layer + r)
        ref, _ = peft_lora(layer, factors, alpha, r)
        with torch.no_grad():
            mine = fn(dict(params), layer, {m: (A.clone(), B.clone()) for m, (A, B) in factors.items()}, alpha, r)
        what = f"lora_weights(layer={layer}, r={r}, alpha={alpha}, modules {[m.split('.')[-1] for m in modules]})"
        if not isinstance(mine, Mapping):
            raise CheckFailed(f"{what} should return a dict {{parameter name: merged weight}}")
        extra, missing = sorted(set(mine) - set(ref)), sorted(set(ref) - set(mine))
        if extra:
            layers = sorted({int(n.split(".")[2]) for n in extra if n.startswith("model.layers.")})
            hint = (
                f": you adapt layer(s) {layers} too; LoRA goes on block {layer} only (layers_to_transform=[layer])"
                if any(l != layer for l in layers)
                else ": adapt only the projections of `factors`"
            )
            raise CheckFailed(f"{what}: names that LoRA does not change {extra[:3]}{hint}")
        if missing:
            raise CheckFailed(f"{what}: the merged weights of {missing} are missing (keys are clean HF names)")
        for name, value in ref.items():
            got = mine[name]
            if not isinstance(got, torch.Tensor):
                raise CheckFailed(f"{what}: {name} should be a torch.Tensor, got {type(got).__name__}")
            got = got.detach().float().cpu()
            if tuple(got.shape) != tuple(value.shape):
                raise CheckFailed(f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(value.shape)}")
            diff = float((got - value).abs().max())
            if diff > 1e-5:
                why = [
                    w
                    for w, alt in _wrong_merges(params, layer, factors, alpha, r).items()
                    if name in alt and float((alt[name] - got).abs().max()) <= 1e-5
                ]
                if float((got - params[name]).abs().max()) <= 1e-7:
                    why = ["the original weight: add the low-rank update (alpha / r) B A"]
                raise CheckFailed(
                    f"{what}: {name} differs from peft's merged weight by up to {diff:.3g}"
                    + (f": your weight is {why[0]}" if why else "")
                )
    passed("lora_weights matches the merged weights of peft's LoRA (arithlib.yu.lora.train_lora's merge)")


# --------------------------------------------------------------------------- 2-3 · CNA data


@dataclass(frozen=True)
class LoraData:
    """LoRA on each attention layer of the toy model, trained briefly on Yu's 2-digit + and -
    sentences with negative results (:data:`N_TRAIN`, one epoch, lr :data:`LR`, :data:`LORA`), and CNA between each
    LoRA model and the original on :data:`N_CASES` of Yu's 1-digit + and - cases ("3 + 5 =" first), neurons
    ranked in the deep layers: ``cases``; ``weights`` per model name ("LoRA L0", ...);
    ``layers`` (ranked); ``rows`` and ``details`` of :func:`arithlib.yu.lora.lora_cna`;
    ``coef_orig`` [N, L, d_mlp] the original's coefficients at the answer position and, per
    model, ``coef`` (the LoRA model's), ``imp`` and ``imp_orig`` (importance [N, L, d_mlp] of
    every neuron in the LoRA model and in the original, NaN outside ``layers``)."""

    cases: PromptSet
    weights: dict[str, dict[str, torch.Tensor]]
    layers: list[int]
    rows: pd.DataFrame
    details: dict
    coef_orig: torch.Tensor
    coef: dict[str, torch.Tensor]
    imp: dict[str, torch.Tensor]
    imp_orig: dict[str, torch.Tensor]


@lru_cache(maxsize=1)
def lora_data() -> LoraData:
    """The LoRA models and CNA every notebook-05 check after the first uses (:class:`LoraData`)."""
    model = check_model()
    bridge, tok = model.bridge, model.tokenizer
    records = ds.yu_prompts(
        ops=["+", "-"], n_digits=2, n_per_template=N_TRAIN // 8, allow_negative=True, seed=0, fewshot=2
    )  # Yu's Sec. 5 data (notebook 05's pool): 2-digit operands, negative results, 4 templates per operator
    train = PromptSet.build(records, tok)
    config = FT.TrainConfig(lr=LR, epochs=1, batch_size=16, seed=0)
    weights = {}
    with torch.enable_grad():
        for layer in range(bridge.cfg.n_layers):
            ft = LO.train_lora(bridge, layer, train, config, None, LORA, progress=False)
            weights[f"LoRA L{layer}"] = ft.weights
    cases = LO.yu_cna_cases(tok, fewshot=2, n_cases=N_CASES, seed=0)
    layers = C.deep_layers(bridge.cfg.n_layers)
    rows, details = LO.lora_cna(bridge, cases, weights, ks=KS, layers=layers, progress=False)
    return LoraData(
        cases=cases,
        weights=weights,
        layers=layers,
        rows=rows,
        details=details,
        coef_orig=details["original"]["run"].coef.float(),
        coef={m: details[m]["run"].coef.float() for m in weights},
        imp={m: details[m]["importance"].float() for m in weights},
        imp_orig={m: details[m]["importance_orig"].float() for m in weights},
    )


def _gather(coef: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] coefficients of each case's top-k neurons by ``scores`` (:func:`arithlib.yu.cna.top_neurons`)."""
    out = []
    for i in range(len(coef)):
        top = C.top_neurons(scores[i], k)
        out.append(torch.stack([coef[i, l, n] for l, n in top]))
    return torch.stack(out)


def _number(value, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckFailed(f"{what} should return one number, got a tensor of shape {tuple(value.shape)}")
        return float(value)
    if not np.isscalar(value) and np.asarray(value).shape != ():
        raise CheckFailed(f"{what} should return one number, got {type(value).__name__}")
    return float(value)


# --------------------------------------------------------------------------- 2 · coefficient increase


def _wrong_increases(before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    """What the usual mistakes compute, for the message of :func:`check_coefficient_increase`."""
    m0, m1 = before.double(), after.double()
    rows = (torch.sign(m0) * (m1 - m0)).sum(-1) / m0.abs().sum(-1)
    return {
        "the decrease (m0 - m1), not the increase": float(100 * (torch.sign(m0) * (m0 - m1)).sum() / m0.abs().sum()),
        "a fraction, not a percentage": float((torch.sign(m0) * (m1 - m0)).sum() / m0.abs().sum()),
        "the mean absolute change: divide by the sum of |m0|": float(100 * (m1 - m0).mean()),
        "the mean of the neurons' own ratios (m1 - m0) / |m0|: pool first, then divide (a ratio of sums)": float(
            100 * ((m1 - m0) / m0.abs()).mean()
        ),
        "(sum m1 - sum m0) / sum m0, not sign-aware: a negative coefficient that grows in size is an "
        "increase (multiply each change by sign(m0), divide by sum |m0|)": float(100 * (m1 - m0).sum() / m0.sum()),
        "the sign-blind ratio sum (m1 - m0) / sum |m0|: weigh each change by sign(m0)": float(
            100 * (m1 - m0).sum() / m0.abs().sum()
        ),
        "the mean over rows (cases) of each row's increase: pool every case and neuron into one ratio": float(
            100 * rows.mean()
        ),
    }


def check_coefficient_increase(fn: Callable) -> None:
    """``fn(before, after)`` ([cases, neurons] coefficients in the original and the LoRA model):
    the sign-aware increase (%) 100 sum sign(m0) (m1 - m0) / sum |m0|, pooled over every entry;
    against the negative of :func:`arithlib.yu.cna.coefficient_decrease` on the toy model's
    coefficients (its top neurons and all of a deep layer's) and on a hand-made pair."""
    data = lora_data()
    orig_imp = data.details["original"]["importance"]
    pairs = [(torch.tensor([[2.0, -1.0, 0.5], [4.0, -3.0, 1.0]]), torch.tensor([[3.0, -2.0, 0.5], [2.0, -3.5, 1.5]]))]
    for name in data.weights:
        layer = data.layers[-1]
        pairs.append((data.coef_orig[:, layer], data.coef[name][:, layer]))
        for k in (KS[0], KS[-1]):
            pairs.append((_gather(data.coef_orig, orig_imp, k), _gather(data.coef[name], orig_imp, k)))
    for before, after in pairs:
        ref = -C.coefficient_decrease(before, after)
        mine = _number(fn(before.clone(), after.clone()), "coefficient_increase")
        if abs(mine - ref) > 1e-3 * max(1.0, abs(ref)):
            why = [w for w, v in _wrong_increases(before, after).items() if abs(v - mine) <= 1e-6 * max(1.0, abs(v))]
            raise CheckFailed(
                f"coefficient_increase on [{before.shape[0]} x {before.shape[1]}] coefficients is {mine:.4f}, "
                f"expected {ref:.4f}" + (f": your value is {why[0]}" if why else "")
            )
    passed(f"coefficient_increase matches -arithlib.yu.cna.coefficient_decrease on {len(pairs)} sets of coefficients")


# --------------------------------------------------------------------------- 3 · Table 10


def _wrong_cna_increases(name: str, k: int) -> dict[str, float]:
    """What the usual mistakes compute, for the message of :func:`check_cna_increase`."""
    data = lora_data()
    c0, c1 = data.coef_orig, data.coef[name]
    change = data.imp[name] - data.imp_orig[name]

    def pooled(scores: torch.Tensor) -> float:
        return -C.coefficient_decrease(_gather(c0, scores, k), _gather(c1, scores, k))

    out = {
        "the increase on the original model's own top-k neurons: rank by the change imp_lora - imp_orig": pooled(
            data.imp_orig[name]
        ),
        "the increase on the LoRA model's own top-k neurons: rank by the change imp_lora - imp_orig": pooled(
            data.imp[name]
        ),
        "ranked by the importance decrease imp_orig - imp_lora": pooled(-change),
        "ranked by the coefficient change itself (that selects the neurons that rose: circular)": pooled(
            torch.where(torch.isfinite(change), c1 - c0, torch.nan)
        ),
        "ranked by |imp_lora - imp_orig|: rank by the increase itself, not by the size of the change either way": pooled(
            change.abs()
        ),
    }
    n, K = change.shape[0], change.shape[-1]
    idx = change.reshape(n, -1).topk(k, dim=1).indices  # torch.topk ranks NaN (the unranked layers) first
    out[
        "ranked with the unranked layers' NaN importance included (torch.topk puts NaN first): rank finite scores only"
    ] = -C.coefficient_decrease(c0.reshape(n, -1).gather(1, idx), c1.reshape(n, -1).gather(1, idx))
    per_case = data.details["per_case"]
    part = per_case[(per_case.model == name) & (per_case.selection == "cna") & (per_case.k == k)]
    out["the mean of the per-case increases: pool every case's top-k neurons into one ratio"] = float(
        100 * (part.num / part.den).mean()
    )
    top = C.top_neurons(change.reshape(-1, K), k * n)  # the top k * N (case and layer, neuron) entries
    b0 = torch.stack([c0.reshape(-1, K)[row, j] for row, j in top])
    b1 = torch.stack([c1.reshape(-1, K)[row, j] for row, j in top])
    out["ranked over all cases jointly: take the top k of each case"] = -C.coefficient_decrease(b0, b1)
    return out


def check_cna_increase(fn: Callable) -> None:
    """``fn(coef_orig, coef_lora, imp_orig, imp_lora, k)`` ([cases, layers, d_mlp] each; the
    importances NaN outside the ranked layers): per case the k neurons with the largest
    importance increase imp_lora - imp_orig (finite entries only), and the sign-aware
    coefficient increase (%) of those neurons from the original to the LoRA model, pooled
    over cases and neurons; against the ``"cna"`` rows of :func:`arithlib.yu.lora.lora_cna`
    for every LoRA model of the toy model and every k of Yu's Table 10."""
    data = lora_data()
    ref_rows = data.rows[data.rows.selection == "cna"]
    for r in ref_rows.itertuples():
        name, k, ref = r.model, int(r.k), float(r.coef_increase)
        with torch.no_grad():
            mine = fn(
                data.coef_orig.clone(),
                data.coef[name].clone(),
                data.imp_orig[name].clone(),
                data.imp[name].clone(),
                k,
            )
        mine = _number(mine, "cna_increase")
        if abs(mine - ref) > 1e-3 * max(1.0, abs(ref)):
            why = [w for w, v in _wrong_cna_increases(name, k).items() if abs(v - mine) <= 1e-4 * max(1.0, abs(v))]
            raise CheckFailed(
                f"cna_increase for {name}, top {k}: {mine:.4f} %, expected {ref:.4f} %"
                + (f": your value is {why[0]}" if why else "")
            )
    passed(f"cna_increase matches the 'cna' rows of arithlib.yu.lora.lora_cna ({len(ref_rows)} models x k)")
