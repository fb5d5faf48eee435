"""Checks for exercise 04, Yu & Ananiadou's Comparative Neuron Analysis (``notebooks/exercises/04_*``),
on the toy model's correct 1-digit + and - cases: a neuron's CNA importance (Sec. 4.1, read
through the final norm with the original run's fixed scale, as the authors' code does), the
top neurons by the change of importance when the key head is zeroed, and the mask / keep
interventions of Table 5. As in :mod:`arithlib.course.exercises`, a check prints one line when
the student's function agrees with arithlib's and raises :class:`CheckFailed` saying what
differs (naming the usual mistake where it recognises one) when it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
import torch

from ..core import datasets as ds
from ..core.components import Neuron
from ..core.prompt_sets import PromptSet
from ..core.readout import final_norm, unembedding
from ..methods import answer_runs as AR
from ..methods import neuron_zeroing as NZ
from ..methods.ablation import zero_heads_hooks
from ..methods.neurons import w_out
from ..yu import cna as C
from ..yu import head_sweep as HS
from ..yu import mask_keep as MK
from .exercises import TOL, CheckFailed, check_model, passed

#: The case of the paper's Table 4 (its index is :attr:`CNAData.case`).
CASE = "3+5"
#: The paper's Table 5 (Llama-7B, all 1-digit + and - cases): accuracy decrease (%) per K.
PAPER_TABLE5 = {
    "mask": {99: 100.0, 50: 96.0, 30: 89.5, 20: 86.8, 10: 68.4},
    "keep": {99: 3.9, 50: 7.8, 30: 13.2, 20: 18.4, 10: 38.2},
}


@dataclass(frozen=True)
class CNAData:
    """The toy model's correct 1-digit + and - cases analysed as notebook 04 does: the cases
    (``prompts``, their tokens [N, T], all of one length), the ``key_head`` (the head whose
    zeroing at every position lowers their first-token accuracy most), the exact CNA
    ``result`` (:class:`arithlib.yu.cna.CNAResult`, run a the original model, run b the key
    head zeroed, the authors' fixed-scale reading), the ``keep_layers`` (the layers CNA
    scored) and the index ``case`` of "3+5"."""

    prompts: PromptSet
    tokens: torch.Tensor
    key_head: tuple[int, int]
    result: C.CNAResult
    keep_layers: list[int]
    case: int


@lru_cache(maxsize=1)
def cna_data() -> CNAData:
    """The cases, key head and CNA result every notebook-04 check uses (:class:`CNAData`)."""
    model = check_model()
    bridge = model.bridge
    recs = ds.yu_prompts(ops=["+", "-"], n_digits=1, n_per_template=None, templates=[3], fewshot=2)
    ps = PromptSet.build(recs, model.tokenizer)
    ps = ps.subset(AR.correct_mask(bridge, ps, "full", batch_size=256))
    sweep = HS.exact_head_sweep(bridge, ps, progress=False)
    heads = sweep.groupby(["layer", "head"]).agg(acc=("correct", "mean"), logit=("answer_logit", "mean"))
    key = heads.reset_index().sort_values(["acc", "logit", "layer", "head"]).iloc[0]
    key_head = (int(key["layer"]), int(key["head"]))
    result = C.cna_compare(bridge, ps, zero_heads_hooks([key_head]), mode="exact", progress=False)
    case = next(i for i, r in enumerate(ps.records) if f"{r.a}{r.op}{r.b}" == CASE)
    return CNAData(ps, torch.tensor(ps.input_ids), key_head, result, list(result.layers), case)


def _cases(n: int, k: int = 8) -> list[int]:
    """``k`` evenly spaced case indices, the Table 4 case among them."""
    return sorted(set(np.linspace(0, n - 1, k).round().astype(int).tolist()) | {cna_data().case})


# --------------------------------------------------------------------------- importance


def _readout_logprob(x: torch.Tensor, target: int, bridge, scale, weight: bool = True, logit: bool = False):
    """log p(target) (or the logit) of vectors x [n, d] read with scale s ([] or [n, 1]; None:
    no norm) and the final norm's weight: the variants :func:`check_neuron_importance` names."""
    norm = final_norm(bridge)
    W_U, b_U = unembedding(bridge)
    y = x if scale is None else x / scale
    y = y * norm.weight if weight and scale is not None else y
    z = y @ W_U + b_U
    return z[:, target] if logit else z.log_softmax(-1)[:, target]


def _wrong_importances(bridge, layer: int, resid, coef, h_final, target: int) -> dict[str, torch.Tensor]:
    """What the usual mistakes compute, for the message of :func:`check_neuron_importance`."""
    eps = final_norm(bridge).eps
    values = w_out(bridge, layer)
    x = resid[None] + coef[:, None] * values
    s = torch.sqrt(h_final.pow(2).mean() + eps)

    def rms(v):
        return torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    def imp(vectors, **kw):
        return _readout_logprob(vectors, target, bridge, **kw) - _readout_logprob(resid[None], target, bridge, **kw)

    W_in = bridge.blocks[layer].mlp.W_in.detach().float().T  # [d_mlp, d_model]
    own = _readout_logprob(x, target, bridge, rms(x)) - _readout_logprob(resid[None], target, bridge, rms(resid[None]))
    return {
        "each vector normalised by its own RMS (the model's ln_final applied to it): CNA reads every vector "
        "with ONE fixed scale s, the RMS of the original run's final hidden state h_final": own,
        "no final norm at all (the raw vector times W_U): divide by s and multiply by the norm's weight first": imp(
            x, scale=None
        ),
        "divided by s but not multiplied by the final norm's weight g": imp(x, scale=s, weight=False),
        "s taken from resid instead of from h_final (the final hidden state of the original run)": imp(
            x, scale=rms(resid)
        ),
        "the change of the target's logit, not of its log-probability (log_softmax over the vocabulary)": imp(
            x, scale=s, logit=True
        ),
        "the neuron's input weights (a column of W_in) instead of its value vector W_out[k]": imp(
            resid[None] + coef[:, None] * W_in, scale=s
        ),
        "without the coefficient: add m_k * W_out[k], not W_out[k]": imp(resid[None] + values, scale=s),
        "the sign is reversed: log p(with the neuron) - log p(without it)": -imp(x, scale=s),
    }


def _name_mistake(mine: torch.Tensor, wrong: dict[str, torch.Tensor], tol: float = TOL) -> str:
    for why, value in wrong.items():
        if mine.shape == value.shape and float((mine - value).abs().max()) <= tol:
            return f": your values are {why}"
    return ""


def check_neuron_importance(fn: Callable) -> None:
    """``fn(bridge, layer, resid, coef, h_final, target)`` (one case: ``resid`` [d_model] the
    residual stream after layer ``layer``'s attention at the answer position, ``coef``
    [d_mlp] the layer's coefficients, ``h_final`` [d_model] the original run's final hidden
    state, ``target`` the predicted token): the CNA importance of every neuron of the layer,
    [d_mlp], log p(target | resid + m_k W_out[k]) - log p(target | resid), every vector read
    as softmax(W_U (g * x / s) + b_U) with s = sqrt(mean(h_final^2) + eps). Checked on 9
    cases, every layer, in both runs (the head-zeroed run with the original run's h_final),
    against the exact importance of :func:`arithlib.yu.cna.cna_compare`."""
    bridge, data = check_model().bridge, cna_data()
    res = data.result
    checked = 0
    for i in _cases(len(data.prompts)):
        target = int(res.targets[i])
        h_final = res.run_a.final_resid[i]
        for run, ref_all, name in (
            (res.run_a, res.importance_a, "original"),
            (res.run_b, res.importance_b, "head-zeroed"),
        ):
            for layer in data.keep_layers:
                resid, coef = run.resid_mid[i, layer], run.coef[i, layer]
                with torch.no_grad():
                    mine = fn(bridge, layer, resid.clone(), coef.clone(), h_final.clone(), target)
                if not isinstance(mine, torch.Tensor):
                    raise CheckFailed(f"neuron_importance should return a torch.Tensor, got {type(mine).__name__}")
                mine = mine.detach().float().cpu()
                ref = ref_all[i, layer]
                where = f"neuron_importance (case {i}, layer {layer}, {name} run)"
                if tuple(mine.shape) != tuple(ref.shape):
                    raise CheckFailed(
                        f"{where}: shape {tuple(mine.shape)}, expected {tuple(ref.shape)} (one per neuron)"
                    )
                diff = float((mine - ref).abs().nan_to_num(torch.inf).max())
                if diff > TOL:
                    with torch.no_grad():
                        why = _name_mistake(mine, _wrong_importances(bridge, layer, resid, coef, h_final, target))
                    raise CheckFailed(f"{where}: differs from the reference by up to {diff:.3g} (allowed {TOL:g}){why}")
                checked += 1
    passed(
        f"neuron_importance matches the exact importance of arithlib.yu.cna.cna_compare on {checked} (case, layer, run) rows"
    )


# --------------------------------------------------------------------------- top neurons


def _as_neurons(value, what: str) -> list[Neuron]:
    try:
        return [(int(layer), int(k)) for layer, k in value]
    except (TypeError, ValueError):
        raise CheckFailed(f"{what} should return a list of (layer, neuron) pairs, got {value!r:.80}") from None


def check_top_neurons(fn: Callable) -> None:
    """``fn(change, k)`` (``change`` [n_layers, d_mlp], the CNA score imp_a - imp_b, NaN
    where a layer was not scored): the ``k`` neurons with the largest change, as (layer,
    neuron) pairs, best first; on 9 cases and k = 1, 5, 20, 99, and once with layer 0 left
    unscored, against :func:`arithlib.yu.cna.top_neurons`."""
    data = cna_data()
    res = data.result
    trials = [(i, res.change_of(i), k) for i in _cases(len(data.prompts)) for k in (1, 5, 20, 99)]
    skipped = res.change_of(data.case).clone()
    skipped[0] = torch.nan  # as when both runs are identical in layer 0 (a key head above it)
    trials.append((data.case, skipped, 10))
    for i, change, k in trials:
        ref = C.top_neurons(change, k)
        mine = _as_neurons(fn(change.clone(), k), "top_neurons")
        if mine == ref:
            continue
        where = f"top_neurons (case {i}, k={k}{', layer 0 NaN' if torch.isnan(change[0]).all() else ''})"
        flat = change.flatten()
        n_layers, d_mlp = change.shape
        flat_ref = [layer * d_mlp + n for layer, n in ref]
        decode = "of a flat index f into [n_layers, d_mlp], layer = f // d_mlp and neuron = f % d_mlp"
        if any(not (0 <= layer < n_layers and 0 <= n < d_mlp) for layer, n in mine):
            why = f"a (layer, neuron) out of range: {decode}"
        elif mine in (
            [(f % n_layers, f // n_layers) for f in flat_ref],
            [(f // n_layers, f % n_layers) for f in flat_ref],
        ):
            why = f"the flat indices decoded with n_layers: {decode}"
        elif any(torch.isnan(change[layer, n]) for layer, n in mine):
            why = "it picks neurons whose score is NaN (a layer CNA did not score): leave them out"
        elif set(mine) == set(ref):
            why = "the right neurons in the wrong order: best (largest change) first"
        elif mine in (C.top_neurons(-change, k), C.top_neurons(change.abs(), k)):
            why = " or ".join(
                text
                for text, wrong in (
                    (
                        "the smallest changes (CNA ranks by the largest: the neurons the head's removal hurts most)",
                        C.top_neurons(-change, k),
                    ),
                    (
                        "ranked by |change| (CNA ranks by the signed change: a neuron that gains importance "
                        "without the head is not one the head switches on)",
                        C.top_neurons(change.abs(), k),
                    ),
                )
                if mine == wrong
            )
        elif len(mine) != len(ref):
            why = f"{len(mine)} neurons, expected {len(ref)}"
        else:
            why = f"expected {ref[:5]}..., got {mine[:5]}... (largest value {float(flat.nan_to_num(-torch.inf).max()):.3f})"
        raise CheckFailed(f"{where}: {why}")
    passed(f"top_neurons matches arithlib.yu.cna.top_neurons on {len(trials)} (case, k) trials")


# --------------------------------------------------------------------------- mask / keep


def _hooked_logits(bridge, tokens: torch.Tensor, masks: dict[int, torch.Tensor], position: int | None = -1):
    """Last-position logits with arithlib's per-prompt zeroing hooks (a variant's position)."""
    hooks = NZ.rowwise_neuron_hooks(masks, position)(torch.arange(len(tokens)))
    with torch.no_grad(), bridge.hooks(fwd_hooks=hooks):
        return bridge(tokens)[:, -1].float()


def _logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1).gather(1, targets[:, None])[:, 0]


def _wrong_zeroings(bridge, tokens, sets, keep_layers) -> dict[str, dict[int, torch.Tensor] | tuple]:
    """Masks of the usual mistakes (a tuple: masks and position), for :func:`check_zeroed_logits`."""
    L, K = bridge.cfg.n_layers, bridge.cfg.d_mlp
    right = MK.neuron_masks(sets, L, K, keep_layers)
    union = sorted({n for s in sets for n in s})
    wrong: dict[str, dict[int, torch.Tensor] | tuple] = {
        "the model without any intervention: were the hooks active during the forward pass?": {},
        "zeroed at every position: Yu's neurons are scored, and zeroed, at the answer position only": (right, None),
        "the same neurons (every prompt's together) zeroed for every prompt: each prompt has its own set": MK.neuron_masks(
            [union] * len(sets), L, K, keep_layers
        ),
    }
    if keep_layers is None:
        wrong["keep instead of mask: mask zeroes the prompt's own neurons"] = MK.neuron_masks(
            sets, L, K, sorted({layer for s in sets for layer, _ in s})
        )
    else:
        wrong["mask instead of keep: keep zeroes every OTHER neuron of the keep layers"] = MK.neuron_masks(sets, L, K)
        wrong["every neuron of the keep layers zeroed, the prompt's own too: keep spares them"] = MK.neuron_masks(
            [[] for _ in sets], L, K, keep_layers
        )
        own_layers = {layer: m.clone() for layer, m in right.items()}
        for i, s in enumerate(sets):
            for layer in own_layers:
                if layer not in {lay for lay, _ in s}:
                    own_layers[layer][i] = False
        wrong[
            "only the layers that hold the prompt's neurons zeroed: keep zeroes every other neuron of EVERY keep "
            "layer, also of a layer where none of the prompt's neurons is"
        ] = own_layers
    return wrong


def check_zeroed_logits(fn: Callable) -> None:
    """``fn(bridge, tokens, sets, keep_layers=None)`` (``tokens`` [N, T], ``sets`` one list of
    (layer, neuron) per prompt): the last-position logits [N, vocab] with, at the answer
    position, each prompt's own neurons zeroed ("mask", ``keep_layers`` None) or every other
    neuron of ``keep_layers`` zeroed ("keep"). On every case, with the top-1, 5 and 20 CNA
    neurons, in both modes: log p(target) against :func:`arithlib.methods.answer_runs.run_answer_conditions`
    with :func:`arithlib.methods.neuron_zeroing.rowwise_neuron_hooks` and :func:`arithlib.yu.mask_keep.neuron_masks`,
    the interventions of :func:`arithlib.yu.mask_keep.mask_keep_table`."""
    bridge, data = check_model().bridge, cna_data()
    res, tokens, N = data.result, data.tokens, len(data.prompts)
    L, K = bridge.cfg.n_layers, bridge.cfg.d_mlp
    with torch.no_grad():
        clean = bridge(tokens)[:, -1].float()
    trials = [(k, mode) for k in (1, 5, 20) for mode in ("mask", "keep")]
    conditions, sets_of = {}, {}
    for k, mode in trials:
        sets_of[k] = MK.top_k_sets(res, N, k)
        keep = data.keep_layers if mode == "keep" else None
        conditions[f"{mode} {k}"] = NZ.rowwise_neuron_hooks(MK.neuron_masks(sets_of[k], L, K, keep))
    refs = AR.run_answer_conditions(bridge, data.prompts, conditions, targets=res.targets)
    for k, mode in trials:
        keep = list(data.keep_layers) if mode == "keep" else None
        sets = [list(s) for s in sets_of[k]]
        with torch.no_grad():
            out = fn(bridge, tokens.clone(), sets, keep)
        if not isinstance(out, torch.Tensor):
            raise CheckFailed(f"zeroed_logits should return a torch.Tensor, got {type(out).__name__}")
        where = f"zeroed_logits ({mode}, top-{k} CNA neurons{f', keep_layers={keep}' if keep else ''})"
        if tuple(out.shape) != (N, bridge.cfg.d_vocab):
            raise CheckFailed(
                f"{where}: shape {tuple(out.shape)}, expected {(N, bridge.cfg.d_vocab)} (the last position's logits)"
            )
        if k == trials[0][0] and mode == trials[0][1]:
            with torch.no_grad():
                after = bridge(tokens)[:, -1].float()
            if float((after - clean).abs().max()) > TOL:
                raise CheckFailed(
                    "zeroed_logits left its hooks on the model (a plain forward pass changed): add them in a "
                    "`with bridge.hooks(fwd_hooks=...):` block"
                )
        mine = _logprob(out.detach(), res.targets)
        ref = refs[f"{mode} {k}"].logprob
        diff = float((mine - ref).abs().nan_to_num(torch.inf).max())
        if diff > TOL:
            why = ""
            for name, variant in _wrong_zeroings(bridge, tokens, sets, keep).items():
                masks, position = variant if isinstance(variant, tuple) else (variant, -1)
                if (
                    float((mine - _logprob(_hooked_logits(bridge, tokens, masks, position), res.targets)).abs().max())
                    <= TOL
                ):
                    why = f": your values equal {name}"
                    break
            raise CheckFailed(f"{where}: log p(target) differs from the reference by up to {diff:.3g}{why}")
    passed(
        f"zeroed_logits matches arithlib.yu.mask_keep's mask and keep (answer position) on {N} cases, "
        f"K = 1, 5, 20, keep layers {data.keep_layers}"
    )


def mask_keep_accuracy(
    top_neurons: Callable, zeroed_logits: Callable, ks: Sequence[int] = (99, 50, 30, 20, 10), n_seeds: int = 3
) -> pd.DataFrame:
    """Table 5 in small with the student's functions: for each K, the accuracy decrease (%,
    first answer token, relative to the unablated accuracy) when each case's top-K CNA
    neurons are zeroed ("mask") or kept alone in the scored layers ("keep"), beside the
    random controls of :func:`arithlib.yu.mask_keep.mask_keep_table` (mean over ``n_seeds``
    draws) and the paper's numbers (Llama-7B). The conditions of each mode run as one batch
    (the cases repeated, each copy with its own sets)."""
    bridge, data = check_model().bridge, cna_data()
    res, tokens = data.result, data.tokens
    N, d_mlp, keep = len(tokens), bridge.cfg.d_mlp, data.keep_layers
    conditions: dict[str, dict[tuple[str, int], list]] = {"mask": {}, "keep": {}}
    for k in ks:
        sets = [top_neurons(res.change_of(i), k) for i in range(N)]
        conditions["mask"][("mask", k)] = sets
        conditions["keep"][("keep", k)] = sets
        for s in range(n_seeds):
            conditions["mask"][("random mask", k)] = conditions["mask"].get(("random mask", k), []) + list(
                MK.random_layer_matched(sets, d_mlp, MK.control_seed(0, s, k))
            )
            conditions["keep"][("random keep", k)] = conditions["keep"].get(("random keep", k), []) + list(
                MK.random_in_layers(sets, keep, d_mlp, MK.control_seed(0, s, k, 1))
            )
    base = res.run_a.accuracy
    table: dict[tuple[str, int], float] = {}
    for mode, conds in conditions.items():
        all_sets = [s for sets in conds.values() for s in sets]
        with torch.no_grad():
            logits = zeroed_logits(
                bridge, tokens.repeat(len(all_sets) // N, 1), all_sets, keep if mode == "keep" else None
            )
        correct = (logits.argmax(-1).cpu() == res.targets.repeat(len(all_sets) // N)).float()
        start = 0
        for key, sets in conds.items():
            acc = float(correct[start : start + len(sets)].mean())
            table[key] = 100 * (base - acc) / base
            start += len(sets)
    rows = [
        {
            "K": k,
            "mask": table[("mask", k)],
            "random mask": table[("random mask", k)],
            "mask (paper)": PAPER_TABLE5["mask"].get(k, np.nan),
            "keep": table[("keep", k)],
            "random keep": table[("random keep", k)],
            "keep (paper)": PAPER_TABLE5["keep"].get(k, np.nan),
        }
        for k in ks
    ]
    return pd.DataFrame(rows).set_index("K").round(1)
