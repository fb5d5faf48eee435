"""CNA between genders: Yu & Ananiadou 2024, Sec. 4.1 (importance) and Sec. 6.2. For each
biased profession token, the importance of every neuron with the prompt of its bias gender
against the other gender's, the edit set of the top-K neurons of the gender-balanced mean
change, the screen's recall against the exact importance, and the tables of the edit set
(Table 12, the edit set's layers, random layer-matched controls)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.components import Neuron
from ..core.datasets import PromptRecord
from ..core.prompt_sets import PromptSet
from ..core.readout import final_norm, top_tokens, unembedding
from ..engine import input_device
from ..methods.answer_runs import LastPosition, run_last_position
from ..methods.neurons import value_vectors, w_out
from . import cna as C
from . import cna_importance as CI
from .bias_professions import GENDERS, next_token_logprobs, table22_prompts
from .cna_norm import check_norm_reading, run_scales
from .mask_keep import random_layer_matched

#: Layers below this index are "early" in the early-layer check of notebook 07: layer 0,
#: whose residual x^{-1} + A^0 is the token embedding plus one attention layer, read
#: directly through the final norm. Fixed before measuring the edit (from what layer 0's
#: residual is, not from the bias numbers) and not tuned: the notebook reports the edit
#: with and without these layers side by side.
EARLY_LAYERS = 1
#: :func:`exact_affordable`: the exact importance of every neuron costs about
#: n_layers * d_mlp * d_model * vocab multiply-adds (one unembedding per neuron) plus
#: a few passes over n_layers * d_mlp * vocab logits per prompt. Above this bound
#: (SmolLM2-135M: 1.3e12 runs exact; Qwen2.5-0.5B: 1.6e13 gets the screen; timings in
#: benchmarks/RESULTS.md) the screen is used, its recall measured on every
#: ``RECALL_LAYER_STRIDE``-th layer.
MAX_EXACT_MACS = 5e12
#: Without the exact importance of every neuron, the screen's recall is measured on the
#: exact importance of every neuron of layers 0, stride, 2 * stride, ... (a quarter of
#: the cost of all layers; layer 0 included).
RECALL_LAYER_STRIDE = 4


# --------------------------------------------------------------------------- CNA between genders


def _prompt_set(tokenizer, texts: Sequence[str]) -> PromptSet:
    """``texts`` as a PromptSet (one row each; targets are given separately)."""
    recs, ids = [], []
    for text in texts:
        recs.append(
            PromptRecord(
                family="gender", op="", a=0, b=0, answer=0, template_id=0, template=text, text=text, answer_text=""
            )
        )
        ids.append(list(tokenizer(text)["input_ids"]))
    return PromptSet(recs, ids, [[0] for _ in texts], [None] * len(texts), tokenizer)


def exact_affordable(model, max_macs: float = MAX_EXACT_MACS) -> bool:
    """Whether :func:`gender_cna` should compute the exact importance of every neuron: on
    a GPU, or when n_layers * d_mlp * d_model * vocab <= ``max_macs``."""
    cfg = model.cfg
    if input_device(model).type == "cuda":
        return True
    return cfg.n_layers * cfg.d_mlp * cfg.d_model * cfg.d_vocab <= max_macs


def screen_candidates(
    approx_change: torch.Tensor, n_candidates: int, n_aggregate: int, groups: Sequence[str] | None = None
) -> torch.Tensor:
    """The two-stage screen's candidates, a boolean mask [L, K]: the union of each case's
    top-``n_candidates`` neurons by stage-1 change (``approx_change`` [N, L, K]) and the
    top-``n_aggregate`` by the mean stage-1 change over the cases (gender-balanced with
    ``groups``, :func:`balanced_mean`). Only these get an exact importance in the screen."""
    N, L, K = approx_change.shape
    change = torch.nan_to_num(approx_change.reshape(N, L * K), nan=-torch.inf)
    mask = torch.zeros(L * K, dtype=torch.bool)
    if n_candidates > 0:
        mask[change.topk(min(n_candidates, L * K), dim=1).indices.flatten()] = True
    if n_aggregate > 0:
        mean = balanced_mean(torch.nan_to_num(approx_change, nan=0.0), groups).flatten()
        mask[mean.topk(min(n_aggregate, L * K)).indices] = True
    return mask.view(L, K)


@torch.no_grad()
def shared_input_importance(
    model,
    resid: torch.Tensor,
    coef: torch.Tensor,
    rows_a: Sequence[int],
    rows_b: Sequence[int],
    targets: torch.Tensor,
    *,
    groups: Sequence[str] | None = None,
    n_candidates: int | None = 20,
    n_aggregate: int = 200,
    exact_layers: Sequence[int] = (),
    vocab_chunk: int = CI.VOCAB_CHUNK,
    block_elems: int = 2**24,
    progress: bool = False,
    scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """CNA importance (Sec. 4.1) when many cases share few inputs: ``resid`` [G, L, d] and
    ``coef`` [G, L, K] are the answer-position captures of G distinct prompts; case i
    compares input ``rows_a[i]`` with ``rows_b[i]`` for target token ``targets[i]``.

    Why not :func:`arithlib.yu.cna.cna_compare`: it treats every case as its own input, so
    its vocabulary passes (baseline statistics and, per candidate neuron, the
    log-partition of softmax(W_U norm(r + m v))) are repeated for every case. Here the
    log-partition of each (input, neuron) is computed once and shared by all targets;
    only the target logits differ, and those are cheap. Same two-stage scheme as
    :mod:`arithlib.yu.cna`: stage 1 (:func:`arithlib.yu.cna_importance.first_order_importance`) scores
    every neuron for every case; stage 2 computes the exact importance, for EVERY case,
    of the union of each case's top-``n_candidates`` neurons by stage-1 change and the
    top-``n_aggregate`` by the mean stage-1 change (gender-balanced with ``groups``,
    :func:`balanced_mean`; :func:`screen_candidates`). ``n_candidates=None``: no screen,
    the exact importance of EVERY neuron (one log-partition per input and neuron, so its
    cost does not grow with the number of cases: about the cost of one prompt in
    :func:`arithlib.yu.cna_importance.exact_importance`). ``exact_layers``: every neuron of these layers
    is exact besides the screen's candidates (to measure the screen's recall there).
    ``scale`` [G]: each input's fixed final norm scale (``cna.final_scale`` of its own
    run, the authors' reading); None: each vector's own RMS (the "own" variant).

    Returns ``importance`` and ``approx`` [2, N, L, K] (side a, side b; importance NaN
    outside the candidates) and ``base_logprob`` [2, N, L]."""
    norm = final_norm(model)
    W_U, b_U = unembedding(model)  # float32, as in cna: log-probability differences need it
    device = W_U.device  # a split model's unembedding device
    beta = CI._beta(norm, W_U, b_U)
    G, L, d = resid.shape
    K = coef.shape[-1]
    N = len(targets)
    rows_a = torch.as_tensor(list(rows_a), dtype=torch.long)
    rows_b = torch.as_tensor(list(rows_b), dtype=torch.long)
    if len(rows_a) != N or len(rows_b) != N:
        raise ValueError("rows_a, rows_b and targets must have one entry per case")
    sides = torch.stack([rows_a, rows_b])  # [2, N] input of each case on each side
    t = targets.to(device)
    w_cols = W_U[:, t].T  # [N, d]
    approx = torch.full((2, N, L, K), torch.nan)
    base = torch.full((2, N, L), torch.nan)
    stats_by_layer = {}
    scale = None if scale is None else scale.float().to(device)
    rows = [resid[:, layer].to(device).float() for layer in range(L)]
    all_stats = CI.layer_stats_stacked(
        rows,
        torch.zeros(G, dtype=torch.long, device=device),
        norm,
        W_U,
        b_U,
        vocab_chunk=vocab_chunk,
        scale=scale,
    )
    for layer in tqdm(range(L), desc="stage 1", disable=not progress, leave=False):
        r = rows[layer]
        m = coef[:, layer].to(device).float()
        stats, _ = all_stats[layer]
        gr = CI._centre(r, norm) * norm.weight  # [G, d]
        A_t = gr @ w_cols.T  # [G, N]: target logits before scaling, every input x every target
        stats_by_layer[layer] = (stats, A_t)
        values = w_out(model, layer).to(device)
        for s in range(2):
            g = sides[s]
            st = CI.LayerStats(
                sigma0=stats.sigma0[g], A_w=A_t[g, torch.arange(N)], lse0=stats.lse0[g], pA=stats.pA[g], q=stats.q[g]
            )
            approx[s, :, layer] = CI.first_order_importance(
                r[g], m[g], values, t, norm, W_U, st, None if scale is None else scale[g]
            ).cpu()
            base[s, :, layer] = (st.A_w / st.sigma0 + beta[t] - st.lse0).cpu()
    # candidates: the screen's, or every neuron
    if n_candidates is None:
        cand = torch.ones(L, K, dtype=torch.bool)
    else:
        cand = screen_candidates(approx[0] - approx[1], n_candidates, n_aggregate, groups)
        cand[list(exact_layers)] = True
    by_layer = {layer: cand[layer].nonzero().flatten().tolist() for layer in range(L) if cand[layer].any()}
    importance = torch.full((2, N, L, K), torch.nan)
    for layer, neurons in tqdm(sorted(by_layer.items()), desc="stage 2 (exact)", disable=not progress, leave=False):
        stats, A_t = stats_by_layer[layer]
        idx = torch.tensor(neurons, device=device)
        r = rows[layer]
        m = coef[:, layer].to(device).float()[:, idx]  # [G, U]
        values = w_out(model, layer).to(device)[idx]
        rc, v, sigma = CI._pair_terms(r, m, values, norm, scale)  # sigma [G, U]
        gr, gv = rc * norm.weight, v * norm.weight
        lse = CI.log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk, block_elems)  # [G, U]
        B_t = gv @ w_cols.T  # [U, N]
        z_t = (A_t[:, None, :] + m[:, :, None] * B_t[None]) / sigma[:, :, None] + beta[t]  # [G, U, N]
        lp = z_t - lse[:, :, None]  # log p(target_n | input g with neuron u added)
        base_g = A_t / stats.sigma0[:, None] + beta[t] - stats.lse0[:, None]  # [G, N]
        imp = lp - base_g[:, None, :]  # [G, U, N]
        for s in range(2):
            g = sides[s].to(device)
            importance[s, :, layer, idx.cpu()] = imp[g, :, torch.arange(N, device=device)].cpu()
    return {"importance": importance, "approx": approx, "base_logprob": base}


def gender_cna(
    model,
    tokenizer,
    biased: pd.DataFrame,
    prompt_id: int = 0,
    genders: Sequence[str] = GENDERS,
    *,
    n_candidates: int | None = None,
    n_aggregate: int = 200,
    exact_layers: Sequence[int] = (),
    progress: bool = True,
    norm_reading: str = "final",
) -> C.CNAResult:
    """CNA between the genders (Sec. 6.2) on Table-22 prompt ``prompt_id``, one case per
    row of ``biased``: run a = the prompt with the row's bias gender, run b = with the
    other gender, target = the profession token; ``result.change[i]`` ranks the
    neurons that raise p(w_i | its gender) over p(w_i | other gender). The two prompts
    are run once and every case shares their captures (:func:`shared_input_importance`).
    ``n_candidates=None`` (default): the exact importance of every neuron (mode "exact");
    an int: the two-stage screen (:func:`screen_candidates`), plus every neuron of
    ``exact_layers``. ``norm_reading`` "final": each prompt's vectors are read with its own
    run's final norm scale (each gender's prompt is its own original run); "own": each
    vector's own RMS (``cna.NORM_READINGS``)."""
    check_norm_reading(norm_reading)
    if len(biased) == 0:
        raise ValueError("no biased professions: nothing to compare")
    genders = list(genders)
    texts = [table22_prompts(g)[prompt_id] for g in genders]
    ps = _prompt_set(tokenizer, texts)
    targets = torch.tensor(biased.token_id.tolist(), dtype=torch.long)
    run = run_last_position(
        model,
        ps,
        None,
        capture=("resid_mid", "coef"),
        targets=torch.zeros(len(texts), dtype=torch.long),
        share_prefix=False,
    )
    own = [genders.index(g) for g in biased.bias_gender]
    other = [1 - i for i in own]
    out = shared_input_importance(
        model,
        run.resid_mid,
        run.coef,
        own,
        other,
        targets,
        groups=list(biased.bias_gender),
        n_candidates=n_candidates,
        n_aggregate=n_aggregate,
        exact_layers=exact_layers,
        progress=progress,
        scale=run_scales([run], final_norm(model), norm_reading, None)[0],
    )
    lp_final = {}
    with torch.no_grad():
        lp_all = next_token_logprobs(model, tokenizer, texts)
    for side, rows in (("a", own), ("b", other)):
        lp_final[side] = LastPosition(
            targets=targets,
            pred=lp_all[rows].argmax(-1),
            logprob=lp_all[rows, targets],
            resid_mid=run.resid_mid[rows],
            coef=run.coef[rows],
            final_resid=run.final_resid[rows],
        )
    imp, approx, base = out["importance"], out["approx"], out["base_logprob"]
    return C.CNAResult(
        importance_a=imp[0],
        importance_b=imp[1],
        approx_a=approx[0],
        approx_b=approx[1],
        coef_a=run.coef[own],
        coef_b=run.coef[other],
        base_logprob_a=base[0],
        base_logprob_b=base[1],
        run_a=lp_final["a"],
        run_b=lp_final["b"],
        targets=targets,
        mode="exact" if n_candidates is None else "two_stage",
        n_candidates=n_candidates,
        layers=list(range(run.coef.shape[1])),
        norm_reading=norm_reading,
    )


def balanced_mean(x: torch.Tensor, groups: Sequence[str] | None = None) -> torch.Tensor:
    """Mean over dim 0 of ``x``; with ``groups`` (one label per row) the mean of the group
    means, so that each group (bias gender) weighs the same however many rows it has."""
    if groups is None:
        return x.mean(0)
    labels = np.asarray(list(groups))
    if len(labels) != x.shape[0]:
        raise ValueError(f"{len(labels)} group labels for {x.shape[0]} rows")
    return torch.stack([x[torch.as_tensor(np.flatnonzero(labels == g))].mean(0) for g in sorted(set(labels))]).mean(0)


def aggregate_change(
    result: C.CNAResult, cases: Sequence[int] | None = None, groups: Sequence[str] | None = None
) -> torch.Tensor:
    """Mean CNA change over ``cases`` (default all), [L, d_mlp]: the exact change where
    computed, the stage-1 change elsewhere (a neuron outside the exact candidates is
    outside every case's top by the stage-1 score). With ``groups`` (the bias gender of
    every case of ``result``) the mean is gender-balanced (:func:`balanced_mean`): a
    neuron that shifts every profession towards one gender scores + on that gender's
    professions and - on the other's, and cancels out instead of ranking because the
    two lists have different lengths. This aggregation is ours; the paper does not say
    how it pools its 32 professions."""
    idx = list(range(len(result))) if cases is None else list(cases)
    if not idx:
        raise ValueError("no cases to aggregate")
    exact = result.change[idx]
    approx = result.approx_change[idx]
    filled = torch.nan_to_num(torch.where(torch.isfinite(exact), exact, approx), nan=0.0)
    return balanced_mean(filled, None if groups is None else [list(groups)[i] for i in idx])


def bias_neurons(
    result: C.CNAResult,
    k: int,
    cases: Sequence[int] | None = None,
    groups: Sequence[str] | None = None,
    min_layer: int = 0,
) -> list[Neuron]:
    """The ``k`` neurons with the largest (gender-balanced, with ``groups``) mean change
    over ``cases``: the edit set. ``min_layer``: only neurons of layers >= it (the edit
    set without the early layers, refilled to ``k`` from the later ones)."""
    agg = aggregate_change(result, cases, groups).clone()
    if not 0 <= min_layer < agg.shape[0]:
        raise ValueError(f"min_layer {min_layer} outside 0..{agg.shape[0] - 1}")
    agg[:min_layer] = -torch.inf
    return C.top_neurons(agg, k)


def without_early(neurons: Sequence[Neuron], min_layer: int) -> list[Neuron]:
    """``neurons`` less those in layers below ``min_layer`` (the edit set with its early
    neurons removed and not replaced)."""
    return [(l, n) for l, n in neurons if l >= min_layer]


def candidate_screen_recall(
    result: C.CNAResult,
    biased: pd.DataFrame,
    ks: Sequence[int],
    n_candidates: int,
    n_aggregate: int,
    layers: Sequence[int] | None = None,
) -> pd.DataFrame:
    """How much the two-stage screen (:func:`screen_candidates` with ``n_candidates`` per
    case and ``n_aggregate`` pooled) misses, measured against the exact importance of
    every neuron (``result`` from :func:`gender_cna` with ``n_candidates=None``).

    One row per case (profession token) and k: ``recall`` = share of the case's exact
    top-k (by change) among the screen's candidates. Rows with case "pooled (edit set)":
    the same for the exact edit set (top-k of the gender-balanced mean change), and
    ``edit_set_overlap`` = share of it that the screen's edit set (exact change on the
    candidates, stage-1 change elsewhere, :func:`aggregate_change`) also holds.

    ``layers``: measure within these layers only (every neuron of them exact, e.g.
    ``gender_cna(n_candidates=..., exact_layers=layers)``): the top-k are then those of
    these layers. Default: all layers (``result`` exact everywhere)."""
    L = result.importance_a.shape[1]
    layers = list(range(L)) if layers is None else sorted(set(layers))
    if not torch.isfinite(result.importance_a[:, layers]).all():
        raise ValueError(
            "candidate_screen_recall needs the exact importance of every neuron of the layers it measures "
            "(gender_cna(n_candidates=None) or exact_layers=layers)"
        )
    groups = list(biased.bias_gender)
    mask = screen_candidates(result.approx_change, n_candidates, n_aggregate, groups)
    outside = torch.ones(L, dtype=torch.bool)
    outside[layers] = False

    def restrict(imp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.where(keep & ~outside[:, None], imp, torch.nan)

    exact = C.CNAResult(
        **{
            **result.__dict__,
            "importance_a": restrict(result.importance_a, torch.tensor(True)),
            "importance_b": restrict(result.importance_b, torch.tensor(True)),
            "approx_a": restrict(result.approx_a, torch.tensor(True)),
            "approx_b": restrict(result.approx_b, torch.tensor(True)),
        }
    )
    screened = C.CNAResult(
        **{
            **exact.__dict__,
            "importance_a": restrict(result.importance_a, mask),
            "importance_b": restrict(result.importance_b, mask),
            "mode": "two_stage",
            "n_candidates": n_candidates,
        }
    )
    rows = []
    base = {
        "n_candidates": n_candidates,
        "n_aggregate": n_aggregate,
        "n_screened": int(mask[layers].sum()),
        "n_neurons": int(mask[layers].numel()),
        "layers": "all" if len(layers) == L else " ".join(map(str, layers)),
    }
    for i, r in enumerate(biased.itertuples()):
        for k in ks:
            top = exact.top(i, k)
            rows.append(
                {
                    "case": r.token,
                    "bias_gender": r.bias_gender,
                    "k": k,
                    **base,
                    "recall": sum(bool(mask[n]) for n in top) / len(top),
                    "edit_set_overlap": float("nan"),
                }
            )
    for k in ks:
        top, screen = (
            C.top_neurons(aggregate_change(res, groups=groups).masked_fill(outside[:, None], -torch.inf), k)
            for res in (exact, screened)
        )
        rows.append(
            {
                "case": "pooled (edit set)",
                "bias_gender": "both",
                "k": k,
                **base,
                "recall": sum(bool(mask[n]) for n in top) / len(top),
                "edit_set_overlap": len(set(top) & set(screen)) / len(top),
            }
        )
    return pd.DataFrame(rows)


def edit_layers(neuron_sets: Mapping[str, Sequence[Neuron]]) -> pd.DataFrame:
    """Layers of each edit set: rows edit_set, layer, n_neurons (layers holding at least
    one of its neurons), share of the set."""
    rows = []
    for name, ns in neuron_sets.items():
        counts = pd.Series([l for l, _ in ns], dtype=int).value_counts().sort_index()
        rows += [
            {"edit_set": name, "layer": int(l), "n_neurons": int(c), "share": c / len(ns)} for l, c in counts.items()
        ]
    return pd.DataFrame(rows, columns=["edit_set", "layer", "n_neurons", "share"])


def _gender_rows(
    result: C.CNAResult, biased: pd.DataFrame, genders: Sequence[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{gender: (resid_mid [L, d], coef [L, K])}`` at the CNA prompt's last position:
    run a of a case whose bias gender it is, else run b of a case of the other gender."""
    out = {}
    labels = list(biased.bias_gender)
    for g in genders:
        if g in labels:
            i = labels.index(g)
            out[g] = (result.run_a.resid_mid[i], result.coef_a[i])
        else:
            i = next(j for j, x in enumerate(labels) if x != g)
            out[g] = (result.run_b.resid_mid[i], result.coef_b[i])
    return out


@torch.no_grad()
def layer_diagnostic(
    model, result: C.CNAResult, biased: pd.DataFrame, edit_set: Sequence[Neuron], genders: Sequence[str] = GENDERS
) -> pd.DataFrame:
    """Per layer l, what the importance of its neurons is read from (Sec. 4.1: the residual
    x^{l-1} + A^l plus m_k fc2_k, through the final norm and the unembedding):

    ``resid_rms_<g>``: RMS of the (centred) residual under each gender, the scale the final
    norm divides by; ``write_to_resid_<g>``: median over the layer's neurons of
    |m_k fc2_k| / |x^{l-1} + A^l| (a neuron's write relative to the residual it is added
    to: where the residual is small, one neuron turns the normalised direction and the
    importance is large whatever the neuron means); ``mean_abs_importance`` over neurons,
    cases and both runs; ``mean_abs_change`` and ``max_change`` of the pooled change the
    edit set is ranked by; ``n_in_edit_set``."""
    norm = final_norm(model)
    rows_g = _gender_rows(result, biased, genders)
    agg = aggregate_change(result, groups=list(biased.bias_gender))
    L = agg.shape[0]
    in_set = pd.Series([l for l, _ in edit_set], dtype=int).value_counts()
    imp = torch.cat([result.importance_a, result.importance_b]).abs()
    rows = []
    for layer in range(L):
        v = CI._centre(w_out(model, layer).float().cpu(), norm).norm(dim=-1)  # [K]
        row = {"layer": layer}
        for g, (resid, coef) in rows_g.items():
            r = CI._centre(resid[layer].float(), norm)
            row[f"resid_rms_{g}"] = float(r.pow(2).mean().sqrt())
            row[f"write_to_resid_{g}"] = float((coef[layer].float().abs() * v / r.norm()).median())
        li = imp[:, layer]
        row["mean_abs_importance"] = float(li[torch.isfinite(li)].mean()) if torch.isfinite(li).any() else float("nan")
        row["mean_abs_change"] = float(agg[layer].abs().mean())
        row["max_change"] = float(agg[layer].max())
        row["n_in_edit_set"] = int(in_set.get(layer, 0))
        rows.append(row)
    return pd.DataFrame(rows)


def random_neuron_sets(neurons: Sequence[Neuron], d_mlp: int, seeds: Sequence[int]) -> dict[int, list[Neuron]]:
    """For each seed, as many random neurons as ``neurons``, one in each of their layers
    and none of them (:func:`arithlib.yu.mask_keep.random_layer_matched`)."""
    return {s: random_layer_matched([list(neurons)], d_mlp, s)[0] for s in seeds}


def neuron_table(
    model,
    tokenizer,
    result: C.CNAResult,
    biased: pd.DataFrame,
    k: int = 3,
    n_tokens: int = 8,
    genders: Sequence[str] = GENDERS,
) -> pd.DataFrame:
    """Table 12 per profession: its top-``k`` CNA neurons with importance and coefficient
    under each gender and the top tokens of the neuron's value on the vocabulary."""
    g1, g2 = genders
    frames = []
    for i, r in enumerate(biased.itertuples()):
        f = result.top_frame(i, k, tokenizer, model, n_tokens)
        if f.empty:
            continue
        other = g2 if r.bias_gender == g1 else g1
        f = f.rename(
            columns={
                "imp_a": f"imp_{r.bias_gender}",
                "imp_b": f"imp_{other}",
                "coef_a": f"coef_{r.bias_gender}",
                "coef_b": f"coef_{other}",
            }
        )
        f.insert(0, "profession", r.token)
        f.insert(1, "bias_gender", r.bias_gender)
        frames.append(f)
    if not frames:
        return pd.DataFrame()
    cols = [
        "profession",
        "bias_gender",
        "rank",
        "name",
        "layer",
        "neuron",
        f"imp_{g1}",
        f"imp_{g2}",
        f"coef_{g1}",
        f"coef_{g2}",
        "change",
        "top_tokens",
    ]
    out = pd.concat(frames, ignore_index=True)
    return out[[c for c in cols if c in out.columns]]


def edit_set_table(
    model,
    tokenizer,
    result: C.CNAResult,
    biased: pd.DataFrame,
    neurons: Sequence[Neuron],
    n_tokens: int = 8,
    genders: Sequence[str] = GENDERS,
) -> pd.DataFrame:
    """The edit set: each neuron's mean change over all cases and over each bias
    gender's cases, its coefficient under each gender (the same prompt for every case,
    so one value per gender), and its top vocabulary tokens."""
    if not neurons:
        return pd.DataFrame()
    g1, g2 = genders
    agg = aggregate_change(result, groups=list(biased.bias_gender))
    by_g = {
        g: aggregate_change(result, np.flatnonzero(biased.bias_gender.values == g).tolist())
        if (biased.bias_gender == g).any()
        else None
        for g in genders
    }
    coef = {}
    for g in genders:
        rows_own = np.flatnonzero(biased.bias_gender.values == g)
        rows_other = np.flatnonzero(biased.bias_gender.values != g)
        coef[g] = result.coef_a[rows_own[0]] if len(rows_own) else result.coef_b[rows_other[0]]
    vecs = value_vectors(model, neurons)
    toks = top_tokens(model, tokenizer, vecs, n_tokens)
    rows = []
    for rank, ((l, n), t) in enumerate(zip(neurons, toks), 1):
        row = {"rank": rank, "name": f"{l}_{n}", "layer": l, "neuron": n, "mean_change": float(agg[l, n])}
        for g in genders:
            row[f"mean_change_{g}_profs"] = float(by_g[g][l, n]) if by_g[g] is not None else float("nan")
        for g in genders:
            row[f"coef_{g}"] = float(coef[g][l, n])
        row["top_tokens"] = ", ".join(t)
        rows.append(row)
    return pd.DataFrame(rows)
