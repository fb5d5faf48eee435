"""Comparative Neuron Analysis (CNA), Yu & Ananiadou 2024 (EMNLP), Sec. 4 and App. B.

The importance of FFN neuron k of layer l for the predicted token w at the answer
position (Sec. 4.1) is

    imp = log p(w | x^{l-1} + A^l + m_k fc2_k) - log p(w | x^{l-1} + A^l),

where x^{l-1} + A^l is the residual stream after layer l's attention ("resid_mid"),
m_k the neuron's coefficient (its activation, ``blocks.l.mlp.hook_post``) and fc2_k
its value vector (row k of ``W_out``). CNA compares the same neuron between two runs
(the original model and a model with the key head zeroed, or two inputs) and ranks
neurons by the change.

How p reads a vector (``norm_reading``, :mod:`arithlib.yu.cna_norm`): every vector, r + m v
as well as r alone, goes through the final norm with ONE fixed scale per case, s, the RMS
of the original run's final hidden state at the answer position, for every layer and
for the compared run (the authors' code; ``"final"``, what the verdicts read); ``"own"``
normalises each vector by its own RMS (a sensitivity variant).

Computing it for every neuron at once
-------------------------------------
With an RMSNorm final norm (LayerNorm: the same after centring), for r = resid_mid
and v = fc2_k::

    logits(r + m v) = (A + m B_k) / sigma_k + beta,   A = (g*r) W_U,  B_k = (g*v) W_U,
    beta = b_U (+ b_ln W_U),

where sigma_k = s, the fixed final scale of the case, in the ``"final"`` reading, and
sigma_k^2 = (|r|^2 + 2 m r.v + m^2 |v|^2) / d + eps in the ``"own"`` reading.

B is prompt-independent ([d_mlp, vocab] per layer), sigma_k is cheap for all neurons,
but the log-partition needs one pass over the vocabulary per (neuron, prompt). Two
modes:

* ``"exact"``: every neuron, vocabulary in chunks with an online logsumexp (the
  matrix products are shared by all prompts). Affordable on a GPU and for small
  models (timings: benchmarks/RESULTS.md).
* ``"two_stage"``: stage 1 scores every neuron with the first-order importance,
  whose logit change is exact and whose log-partition is linearised at the
  baseline distribution p = softmax(logits(r)):
  ``imp1 = dz_w - sum_v p_v dz_v`` (:func:`first_order_importance`, cost
  O(d_mlp * d) per prompt and layer once p is known); stage 2 computes the exact
  importance of the top ``n_candidates`` neurons per prompt (ranked by the stage-1
  score or its change between runs). Exact values of the neurons it scores are
  identical to the exact mode's; the others are NaN.

Layers where both runs have bit-identical inputs at the answer position (those
below an ablated head) have zero change; :func:`cna_compare` skips them.

Also here: the key head from notebook 01's exact sweep (:func:`select_key_heads`) and the
coefficient decrease. The runs CNA reads are :mod:`arithlib.methods.answer_runs`'s; the sections
that build on CNA sit in their own modules: mask / keep and the lowest-neuron test
(Tables 5-6, :mod:`arithlib.yu.mask_keep`), the PE-DAG (:mod:`arithlib.yu.pe_dag`) and the
hidden-interpretable shallow neurons (Tables 7-8, :mod:`arithlib.yu.shallow_neurons`).
TransformerLens gives the hooks and weights; it has no CNA, hence this module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core import datasets as ds
from ..core.components import Head, Hook, Neuron
from ..core.datasets import PromptRecord, PromptSet
from ..core.papers import DEEP_FROM_FRACTION, YU_GROUPS
from ..core.readout import FinalNorm, final_norm, top_tokens, unembedding
from ..engine import input_device
from ..methods.answer_runs import LastPosition, answer_targets, run_conditions, run_last_position
from ..methods.neurons import w_out
from ..run.outputs import find_table, read_table
from .cna_norm import check_norm_reading, run_scales

# --------------------------------------------------------------------------- model pieces


def deep_layers(n_layers: int, fraction: float = DEEP_FROM_FRACTION) -> list[int]:
    """Yu's deep layers scaled by depth: 17..31 of 32 -> round(17/32 * L)..L-1."""
    start = int(round(fraction * n_layers))
    return list(range(min(start, n_layers - 1), n_layers))


# --------------------------------------------------------------------------- prompts


def yu_division_1d(fewshot: int = 2, template_id: int = 3) -> list[PromptRecord]:
    """Yu's 1D division cases as in the paper's example "72/8=": divisor and quotient in
    1..9, dividend = divisor * quotient (81 prompts), in template ``template_id`` of
    Table 14 with the few-shot prefix. (``datasets.yu_prompts(n_digits=1)`` keeps both
    operands <= 9, which leaves 23 mostly trivial divisions.)"""
    base = ds.load_json("templates.json")["yu"]
    template, sep = base["/"][template_id], base["sep"]
    prefix = ds.fewshot_prefix(template, "/", sep, fewshot)
    records = []
    for b in range(1, 10):
        for q in range(1, 10):
            a = b * q
            text = re.sub(r"\[([^\]]+)\]", r"\1", template.replace("{A}", str(a)).replace("{B}", str(b)))
            records.append(
                PromptRecord(
                    family="yu",
                    op="/",
                    a=a,
                    b=b,
                    answer=q,
                    template_id=template_id,
                    template=template,
                    text=text + sep,
                    answer_text=str(q),
                    prefix=prefix,
                    n_digits=1,
                    carry=False,
                    meta=(("numerals", "digits"),),
                )
            )
    return records


#: How :func:`select_key_heads` chose a group's head (the ``selection`` column of 04_key_heads.csv).
KEY_HEAD_BY_1D = "largest mean 1D accuracy drop"
KEY_HEAD_FALLBACK = "fallback: no head lowers 1D accuracy; largest mean accuracy drop over all digit counts"


def read_head_sweep(sweep: str | Path | pd.DataFrame) -> pd.DataFrame:
    """Notebook 01's exact head sweep (``01_yu_head_sweep.csv``) as a frame with operator
    symbols; FileNotFoundError (run notebook 01) when missing, ValueError when it lacks
    the exact stage's columns."""
    if isinstance(sweep, pd.DataFrame):
        frame = sweep.copy()
    else:
        path = find_table(sweep)  # .csv or .csv.gz
        if path is None:
            raise FileNotFoundError(
                f"{sweep} not found: notebook 04 needs notebook 01's head sweep. Run "
                "notebooks/01 (Yu head sweep) with the same model and out_dir first."
            )
        frame = read_table(path)
    missing = {"op", "n_digits", "layer", "head", "accuracy", "baseline_accuracy", "accuracy_drop", "logit_drop"} - set(
        frame.columns
    )
    if missing:
        raise ValueError(
            f"head sweep lacks columns {sorted(missing)}: it predates notebook 01's exact every-position "
            "sweep (01_yu_head_sweep.csv with logit_drop); rerun notebook 01"
        )
    names = {v: k for k, v in ds.OP_NAMES.items()}
    frame["op"] = frame["op"].map(lambda o: names.get(o, o))
    frame["n_digits"] = frame["n_digits"].astype(int)
    return frame


def _best_head(rows: pd.DataFrame, n_settings: int) -> pd.Series:
    """The head of ``rows`` (one row per head and setting) measured in the most settings,
    then with the largest mean ``accuracy_drop`` over them, then the largest mean
    ``logit_drop``, then the lowest (layer, head)."""
    g = (
        rows.assign(_ld=rows["logit_drop"].fillna(-np.inf))
        .groupby(["layer", "head"])
        .agg(n_settings=("accuracy_drop", "size"), score=("accuracy_drop", "mean"), logit_score=("_ld", "mean"))
        .reset_index()
    )
    g = g.sort_values(
        ["n_settings", "score", "logit_score", "layer", "head"], ascending=[False, False, False, True, True]
    )
    best = g.iloc[0].copy()
    best["settings_total"] = n_settings
    return best


def select_key_heads(
    sweep: str | Path | pd.DataFrame, groups: Mapping[str, Sequence[str]] | None = None, n_digits: int = 1
) -> pd.DataFrame:
    """The key head of each operator group from notebook 01's **exact** head sweep
    (``01_yu_head_sweep.csv``: the top heads of every setting zeroed at every position on
    all of the setting's prompts), one row per group.

    Rule, fixed before looking at any model (Yu Sec. 4 / App. B: one head for + and -,
    one for /):

    1. Among the heads the exact sweep measured on every operator of the group at
       ``n_digits`` digits (else on the most of them), the largest mean accuracy drop
       over those operators; ties: the larger mean answer-logit drop, then the lower
       (layer, head). It is the key head when that drop is > 0 (``lowers_1d`` True).
    2. When no head lowers ``n_digits``-digit accuracy (a model that answers every 1D
       prompt with any single head zeroed), no head reproduces Yu's premise; the
       comparison head is then, among the heads measured on the most of the group's
       settings (operators x every digit count of the sweep), the one with the largest
       mean accuracy drop over those settings; same ties. ``lowers_1d`` is False and
       ``selection`` says so.

    Columns: group, layer, head, selection, lowers_1d, score (the mean drop the rule
    ranked by), settings_measured, settings_total, logit_score. Raises
    FileNotFoundError when the file is missing (run notebook 01) and ValueError when an
    operator has no rows or the file predates the exact sweep."""
    groups = {g: tuple(ops) for g, ops in (groups or YU_GROUPS).items()}
    frame = read_head_sweep(sweep)
    out = []
    for group, ops in groups.items():
        sub = frame[frame["op"].isin(ops)]
        one = sub[sub["n_digits"] == int(n_digits)]
        absent = set(ops) - set(one["op"])
        if absent:
            raise ValueError(f"head sweep has no {n_digits}-digit rows for operator(s) {sorted(absent)}")
        best = _best_head(one, len(ops))
        selection, lowers = KEY_HEAD_BY_1D, bool(best["score"] > 0)
        if not lowers:
            best = _best_head(sub, sub[["op", "n_digits"]].drop_duplicates().shape[0])
            selection = KEY_HEAD_FALLBACK
        out.append(
            {
                "group": group,
                "layer": int(best["layer"]),
                "head": int(best["head"]),
                "selection": selection,
                "lowers_1d": lowers,
                "score": float(best["score"]),
                "settings_measured": int(best["n_settings"]),
                "settings_total": int(best["settings_total"]),
                "logit_score": float(best["logit_score"]) if np.isfinite(best["logit_score"]) else float("nan"),
            }
        )
    return pd.DataFrame(out)


def key_heads_from_sweep(
    sweep: str | Path | pd.DataFrame, n_digits: int = 1, groups: Mapping[str, Sequence[str]] | None = None
) -> dict[str, Head]:
    """Group -> (layer, head) of :func:`select_key_heads` (its rule and fallback there)."""
    sel = select_key_heads(sweep, groups, n_digits)
    return {r.group: (int(r.layer), int(r.head)) for r in sel.itertuples()}


def key_head_table(
    sweep: str | Path | pd.DataFrame,
    selected: pd.DataFrame,
    groups: Mapping[str, Sequence[str]] | None = None,
    n_digits: int = 1,
) -> pd.DataFrame:
    """04_key_heads.csv: for each group's selected head (:func:`select_key_heads`), its
    exact-sweep rows on the group's ``n_digits``-digit operators (accuracy with the head
    zeroed, baseline, drop, the binomial interval of the accuracy, logit drop) with the
    selection columns; an operator on which the sweep did not measure the head gets a
    row with NaN numbers (the screen did not rank it among its top heads there)."""
    groups = {g: tuple(ops) for g, ops in (groups or YU_GROUPS).items()}
    frame = read_head_sweep(sweep)
    keep = [
        c
        for c in (
            "n",
            "accuracy",
            "baseline_accuracy",
            "accuracy_drop",
            "relative_drop",
            "accuracy_low",
            "accuracy_high",
            "logit_drop",
        )
        if c in frame.columns
    ]
    rows = []
    for sel in selected.itertuples(index=False):
        for op in groups[sel.group]:
            r = frame[
                (frame["op"] == op)
                & (frame["n_digits"] == int(n_digits))
                & (frame["layer"] == sel.layer)
                & (frame["head"] == sel.head)
            ]
            vals = r.iloc[0][keep].to_dict() if len(r) else {c: float("nan") for c in keep}
            rows.append({**sel._asdict(), "op": op, "n_digits": int(n_digits), **vals})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- importance: the math


def _centre(x: torch.Tensor, norm: FinalNorm) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True) if norm.kind == "layer" else x


def _beta(norm: FinalNorm, W_U: torch.Tensor, b_U: torch.Tensor) -> torch.Tensor:
    return b_U + norm.bias @ W_U if norm.bias is not None else b_U


@dataclass
class LayerStats:
    """Per-row baseline quantities of one layer: sigma0 (norm scale of r), A_w (target
    logit before scaling), lse0 (log-partition of the baseline logits), pA (= p . A)
    and q (= W_U p, the expected unembedding), with p = softmax(logits(r))."""

    sigma0: torch.Tensor
    A_w: torch.Tensor
    lse0: torch.Tensor
    pA: torch.Tensor
    q: torch.Tensor


def layer_stats(
    resid: torch.Tensor,
    targets: torch.Tensor,
    norm: FinalNorm,
    W_U: torch.Tensor,
    b_U: torch.Tensor,
    vocab_chunk: int = 16384,
    scale: torch.Tensor | None = None,
) -> tuple[LayerStats, torch.Tensor]:
    """Baseline statistics of rows ``resid`` [R, d] (one pass over the vocabulary with an
    online softmax) and log p(target | resid) [R]. ``scale`` [R]: the fixed norm scale of
    each row ("final" reading); None: each row's own RMS ("own")."""
    r = _centre(resid.float(), norm)
    d = r.shape[-1]
    gr = r * norm.weight
    sigma0 = torch.sqrt(r.pow(2).sum(-1) / d + norm.eps) if scale is None else scale.float().to(r.device)
    beta = _beta(norm, W_U, b_U)
    R = r.shape[0]
    m = torch.full((R,), -torch.inf, device=r.device)
    s = torch.zeros(R, device=r.device)
    pA = torch.zeros(R, device=r.device)
    q = torch.zeros(R, d, device=r.device)
    for v0 in range(0, W_U.shape[1], vocab_chunk):
        Wc = W_U[:, v0 : v0 + vocab_chunk]
        A = gr @ Wc
        z = A / sigma0[:, None] + beta[v0 : v0 + vocab_chunk]
        m_new = torch.maximum(m, z.max(-1).values)
        scale = torch.exp(m - m_new)
        e = torch.exp(z - m_new[:, None])
        s = s * scale + e.sum(-1)
        pA = pA * scale + (e * A).sum(-1)
        q = q * scale[:, None] + e @ Wc.T
        m = m_new
    pA, q = pA / s, q / s[:, None]
    lse0 = m + torch.log(s)
    A_w = (gr * W_U[:, targets.to(W_U.device)].T).sum(-1)
    base = A_w / sigma0 + beta[targets] - lse0
    return LayerStats(sigma0, A_w, lse0, pA, q), base


def _pair_terms(
    resid: torch.Tensor, coef: torch.Tensor, values: torch.Tensor, norm: FinalNorm, scale: torch.Tensor | None = None
):
    """Centred r and v and the norm scale sigma [R, K] of r + m v: its own RMS, or the
    row's fixed ``scale`` [R] for every neuron ("final" reading)."""
    r = _centre(resid.float(), norm)
    v = _centre(values.float(), norm)
    m = coef.float()
    if scale is not None:
        return r, v, scale.float().to(r.device)[:, None].expand(m.shape)
    d = r.shape[-1]
    rv = r @ v.T
    rr = r.pow(2).sum(-1)
    vv = v.pow(2).sum(-1)
    sigma = torch.sqrt((rr[:, None] + 2 * m * rv + m.pow(2) * vv[None]) / d + norm.eps)
    return r, v, sigma


def first_order_importance(
    resid: torch.Tensor,
    coef: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    norm: FinalNorm,
    W_U: torch.Tensor,
    stats: LayerStats,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 1 of the two-stage mode, [R, K]: the importance with the logit change dz
    exact (norm rescaling included) and the log-partition linearised at p:
    ``imp1 = dz_w - p . dz = (A_w - p.A)(1/sigma - 1/sigma0) + m (g v).(W_U[:, w] - q) / sigma``
    (with a fixed ``scale``, sigma = sigma0 and the first term vanishes; ``stats`` must
    come from :func:`layer_stats` with the same ``scale``)."""
    r, v, sigma = _pair_terms(resid, coef, values, norm, scale)
    gv = v * norm.weight
    w_cols = W_U[:, targets.to(W_U.device)].T  # [R, d]
    term_v = (w_cols - stats.q) @ gv.T  # [R, K]
    return (stats.A_w - stats.pA)[:, None] * (1 / sigma - 1 / stats.sigma0[:, None]) + coef.float() * term_v / sigma


class _Scratch:
    """Reusable blocks for the logits chunks of :func:`exact_importance`: one flat buffer
    per slot, grown when needed, viewed at each chunk's shape. Allocating a fresh block
    per chunk (tens of MB, each mapped and zeroed anew by the OS) took several times
    longer than the arithmetic on it; the values are the same."""

    def __init__(self, device: torch.device | str):
        self.device = device
        self.flat: dict[int, torch.Tensor] = {}

    def get(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.flat.get(slot)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self.flat[slot] = torch.empty(n, device=self.device, dtype=dtype)
        return buf[:n].view(shape)


def exact_importance(
    resid: torch.Tensor,
    coef: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    norm: FinalNorm,
    W_U: torch.Tensor,
    b_U: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    base_logprob: torch.Tensor | None = None,
    vocab_chunk: int = 8192,
    block_elems: int = 2**24,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact CNA importance (Sec. 4.1) of neurons with values ``values`` [K, d] and
    coefficients ``coef`` [R, K] for rows ``resid`` [R, d] and target tokens [R].

    ``pairs=None``: every (row, neuron), returns [R, K]. ``pairs=(rows, cols)``: only those
    (row, neuron) pairs, returns [P]. The vocabulary is processed in chunks with an
    online logsumexp; the value projections (g v) W_U are computed once per chunk for
    the neurons involved and shared by all rows. ``block_elems`` bounds the size of the
    [pairs, vocab chunk] logits block (memory). ``scale`` [R]: each row's fixed norm scale
    ("final" reading; None: each vector's own RMS)."""
    device = W_U.device
    targets = targets.to(device)
    if base_logprob is None:
        _, base_logprob = layer_stats(resid, targets, norm, W_U, b_U, scale=scale)
    r, v, sigma = _pair_terms(resid, coef, values, norm, scale)
    gr, gv = r * norm.weight, v * norm.weight
    beta = _beta(norm, W_U, b_U)
    R, K = coef.shape
    if pairs is None:
        return _exact_importance_all(
            gr, gv, coef.float(), sigma, targets, W_U, beta, base_logprob.to(device), vocab_chunk, block_elems
        )
    rows, cols = (p.to(device) for p in pairs)
    used, inverse = torch.unique(cols, return_inverse=True)  # neurons involved
    P = rows.numel()
    m_pair = coef.float()[rows, cols]
    inv_sigma = 1.0 / sigma[rows, cols]
    # exact target logit
    w_cols = W_U[:, targets].T  # [R, d]
    Aw = (gr * w_cols).sum(-1)
    Bw = gv[used] @ w_cols.T  # [U, R]
    z_w = (Aw[rows] + m_pair * Bw[inverse, rows]) * inv_sigma + beta[targets][rows]
    run_max = torch.full((P,), -torch.inf, device=device)
    run_sum = torch.zeros(P, device=device)
    pair_chunk = max(1, block_elems // vocab_chunk)
    gv_used = gv[used]
    row_used = torch.unique(rows)
    row_pos = torch.full((R,), -1, dtype=torch.long, device=device)
    row_pos[row_used] = torch.arange(len(row_used), device=device)
    rows_c = row_pos[rows]
    gr_used = gr[row_used]
    scratch = _Scratch(device)
    for v0 in range(0, W_U.shape[1], vocab_chunk):
        Wc = W_U[:, v0 : v0 + vocab_chunk]
        A = gr_used @ Wc  # [rows with pairs, C]
        B = gv_used @ Wc  # [neurons with pairs, C]
        bc = beta[v0 : v0 + vocab_chunk]
        for p0 in range(0, P, pair_chunk):
            sl = slice(p0, p0 + pair_chunk)
            n = min(pair_chunk, P - p0)
            z, other = scratch.get(0, (n, Wc.shape[1]), A.dtype), scratch.get(1, (n, Wc.shape[1]), B.dtype)
            torch.index_select(A, 0, rows_c[sl], out=z)
            torch.index_select(B, 0, inverse[sl], out=other)
            z.addcmul_(other, m_pair[sl, None])
            z.mul_(inv_sigma[sl, None]).add_(bc)
            new = torch.maximum(run_max[sl], z.amax(-1))
            run_sum[sl] = run_sum[sl] * torch.exp(run_max[sl] - new) + z.sub_(new[:, None]).exp_().sum(-1)
            run_max[sl] = new
    return z_w - (run_max + torch.log(run_sum)) - base_logprob.to(device)[rows]


def _exact_importance_all(
    gr: torch.Tensor,
    gv: torch.Tensor,
    m: torch.Tensor,
    sigma: torch.Tensor,
    targets: torch.Tensor,
    W_U: torch.Tensor,
    beta: torch.Tensor,
    base_logprob: torch.Tensor,
    vocab_chunk: int,
    block_elems: int,
) -> torch.Tensor:
    """:func:`exact_importance` for every (row, neuron): logits blocks [rows, K, chunk] by
    broadcasting (no gathers), online logsumexp over vocabulary chunks. [R, K]. A block
    holds at most ``block_elems`` values: the vocabulary chunk shrinks below
    ``vocab_chunk`` when one row's [K, chunk] block would exceed it (a layer of many neurons)."""
    w_cols = W_U[:, targets].T  # [R, d]
    z_w = ((gr * w_cols).sum(-1)[:, None] + m * (w_cols @ gv.T)) * (1.0 / sigma) + beta[targets][:, None]
    return z_w - log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk, block_elems) - base_logprob[:, None]


def log_partition_all(
    gr: torch.Tensor,
    gv: torch.Tensor,
    m: torch.Tensor,
    sigma: torch.Tensor,
    W_U: torch.Tensor,
    beta: torch.Tensor,
    vocab_chunk: int = 8192,
    block_elems: int = 2**24,
) -> torch.Tensor:
    """log sum_v exp(logits_v(r + m_k v_k)) for every row r and neuron k, [R, K]: the part
    of the exact importance that needs a pass over the vocabulary (``gr``, ``gv``: the
    centred rows and values times the norm weight; ``sigma`` [R, K]: the norm scale of
    r + m_k v_k; ``beta``: the logit offset). It does not depend on the target token, so
    several targets of one row share it (:func:`arithlib.yu.bias_cna.shared_input_importance`)."""
    R, K = m.shape
    device = W_U.device
    inv_sigma = 1.0 / sigma
    run_max = torch.full((R, K), -torch.inf, device=device)
    run_sum = torch.zeros(R, K, device=device)
    chunk = max(1, min(vocab_chunk, W_U.shape[1], block_elems // K))
    row_block = max(1, block_elems // (K * chunk))
    scratch = _Scratch(device)
    for v0 in range(0, W_U.shape[1], chunk):
        Wc = W_U[:, v0 : v0 + chunk]
        A = gr @ Wc  # [R, C]
        B = gv @ Wc  # [K, C]
        bc = beta[v0 : v0 + chunk]
        dtype = torch.promote_types(torch.promote_types(A.dtype, m.dtype), B.dtype)
        for r0 in range(0, R, row_block):
            rs = slice(r0, r0 + row_block)
            z = torch.addcmul(
                A[rs, None, :],
                m[rs, :, None],
                B[None],
                out=scratch.get(0, (min(row_block, R - r0), K, Wc.shape[1]), dtype),
            )  # [r, K, C]
            z.mul_(inv_sigma[rs, :, None]).add_(bc)
            new = torch.maximum(run_max[rs], z.amax(-1))
            run_sum[rs] = run_sum[rs] * torch.exp(run_max[rs] - new) + z.sub_(new[..., None]).exp_().sum(-1)
            run_max[rs] = new
    return run_max + torch.log(run_sum)


@torch.no_grad()
def importance_loop(
    model,
    resid: torch.Tensor,
    coef: torch.Tensor,
    layer: int,
    targets: torch.Tensor,
    neurons: Sequence[int] | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference implementation, one neuron at a time: for each neuron k add m_k fc2_k to
    resid_mid, read it through the final norm and the unembedding, and take the change
    of log p(target). [R, len(neurons)]. ``scale=None`` ("own" reading): the model's own
    ``ln_final`` module; ``scale`` [R] ("final" reading): x / s times the norm's weight
    (plus its bias; x centred for a LayerNorm), as the authors' ``get_bsvalues``. The
    baseline of the benchmark."""
    W_U, b_U = unembedding(model)
    values = w_out(model, layer)
    neurons = range(values.shape[0]) if neurons is None else neurons
    dtype = next(model.parameters()).dtype
    t = targets.to(W_U.device)
    norm = final_norm(model)

    def logprob(x):
        if scale is None:
            y = model.ln_final(x.to(dtype)[:, None, :])[:, 0].float()
        else:
            y = _centre(x.float(), norm) / scale.float()[:, None] * norm.weight
            y = y + norm.bias if norm.bias is not None else y
        return (y @ W_U + b_U).log_softmax(-1).gather(1, t[:, None])[:, 0]

    base = logprob(resid)
    out = [logprob(resid + coef[:, k, None] * values[k]) - base for k in neurons]
    return torch.stack(out, 1)


# --------------------------------------------------------------------------- CNA over runs


@dataclass
class CNAResult:
    """Importance and coefficient of every neuron in two runs a (original) and b
    (intervened or other input), [N, L, d_mlp] each. ``importance_*`` is exact where
    computed and NaN elsewhere (two-stage mode, or layers skipped because both runs are
    identical there); ``approx_*`` is the stage-1 score of every neuron (NaN in skipped
    layers); ``base_logprob_*`` [N, L] is log p(w | x^{l-1} + A^l)."""

    importance_a: torch.Tensor
    importance_b: torch.Tensor
    approx_a: torch.Tensor
    approx_b: torch.Tensor
    coef_a: torch.Tensor
    coef_b: torch.Tensor
    base_logprob_a: torch.Tensor
    base_logprob_b: torch.Tensor
    run_a: LastPosition
    run_b: LastPosition
    targets: torch.Tensor
    mode: str
    n_candidates: int | None
    layers: list[int]
    #: How vectors were read through the final norm (``cna_norm.NORM_READINGS``).
    norm_reading: str = "final"

    @property
    def change(self) -> torch.Tensor:
        """imp_a - imp_b: the CNA score (NaN where not computed)."""
        return self.importance_a - self.importance_b

    @property
    def approx_change(self) -> torch.Tensor:
        return self.approx_a - self.approx_b

    def change_of(self, i: int) -> torch.Tensor:
        """Row ``i`` of :attr:`change`, [L, d_mlp], without computing the other rows (the
        per-case loops of the tables call it once per case and K)."""
        return self.importance_a[i] - self.importance_b[i]

    def __len__(self) -> int:
        return len(self.targets)

    def top(self, i: int, k: int) -> list[Neuron]:
        """The ``k`` neurons with the largest change for case ``i`` (exact scores only)."""
        return top_neurons(self.change_of(i), k)

    def top_frame(self, i: int, k: int, tokenizer=None, model=None, n_tokens: int = 10) -> pd.DataFrame:
        """Table 4 for case ``i``: rank, layer, neuron, importance and coefficient in both
        runs, change, stage-1 change; with ``model`` and ``tokenizer`` the top
        ``n_tokens`` tokens of each neuron's value projected on the vocabulary."""
        rows = []
        change, approx_change = self.change_of(i), self.approx_a[i] - self.approx_b[i]
        for rank, (layer, n) in enumerate(self.top(i, k), 1):
            rows.append(
                {
                    "rank": rank,
                    "layer": layer,
                    "neuron": n,
                    "name": f"{layer}_{n}",
                    "imp_a": float(self.importance_a[i, layer, n]),
                    "imp_b": float(self.importance_b[i, layer, n]),
                    "coef_a": float(self.coef_a[i, layer, n]),
                    "coef_b": float(self.coef_b[i, layer, n]),
                    "change": float(change[layer, n]),
                    "approx_change": float(approx_change[layer, n]),
                }
            )
        frame = pd.DataFrame(rows)
        if model is not None and tokenizer is not None and len(frame):
            vecs = torch.stack([w_out(model, l)[n] for l, n in zip(frame.layer, frame.neuron)])
            frame["top_tokens"] = [", ".join(t) for t in top_tokens(model, tokenizer, vecs, n_tokens)]
        return frame


def top_neurons(scores: torch.Tensor, k: int) -> list[Neuron]:
    """(layer, neuron) of the ``k`` largest finite entries of ``scores`` [L, d_mlp], best first."""
    flat = scores.flatten().clone()
    flat[~torch.isfinite(flat)] = -torch.inf
    k = min(k, int(torch.isfinite(flat).sum()))
    idx = flat.topk(k).indices.tolist() if k > 0 else []
    K = scores.shape[-1]
    return [(i // K, i % K) for i in idx]


def resolve_mode(model, mode: str = "auto", max_exact_elems: float = 2e9) -> str:
    """ "exact" on a GPU or when L * d_mlp * vocab <= ``max_exact_elems``, else
    "two_stage"; explicit modes pass."""
    if mode in ("exact", "two_stage"):
        return mode
    if mode != "auto":
        raise ValueError("mode must be 'auto', 'exact' or 'two_stage'")
    cfg = model.cfg
    if input_device(model).type == "cuda" or cfg.n_layers * cfg.d_mlp * cfg.d_vocab <= max_exact_elems:
        return "exact"
    return "two_stage"


@torch.no_grad()
def importance_from_runs(
    model,
    runs: Sequence[LastPosition],
    targets: torch.Tensor,
    *,
    mode: str = "auto",
    n_candidates: int = 200,
    select: str = "change",
    layers: Sequence[int] | None = None,
    vocab_chunk: int = 8192,
    progress: bool = False,
    norm_reading: str = "final",
    scale_from: int | None = 0,
) -> dict[str, torch.Tensor]:
    """Importance of every neuron in each of ``runs`` (1 or 2 LastPosition with
    resid_mid, coef and final_resid). Returns ``importance`` [n_runs, N, L, K] (NaN where
    not exact), ``approx`` (stage 1) and ``base_logprob`` [n_runs, N, L].

    ``norm_reading`` "final" (default, the authors'): every vector of run j's row i is read
    with the fixed scale of row i of run ``scale_from`` (the unintervened run of the same
    inputs; None: each run's own final state, for runs of different inputs); "own": each
    vector by its own RMS (:func:`run_scales`).

    Two-stage candidates: per prompt, the ``n_candidates`` neurons over all ``layers``
    with the largest stage-1 score (``select="score"``, of the first run) or stage-1
    change between the two runs (``select="change"``); their exact importance is
    computed in every run."""
    mode = resolve_mode(model, mode)
    norm = final_norm(model)
    W_U, b_U = unembedding(model)  # float32: log-probability differences are computed in fp32
    device = W_U.device  # (where the unembedding is; a split model's last device)
    n_runs = len(runs)
    N = len(targets)
    L, K = runs[0].coef.shape[1], runs[0].coef.shape[2]
    layers = list(range(L)) if layers is None else list(layers)
    importance = torch.full((n_runs, N, L, K), torch.nan)
    approx = torch.full((n_runs, N, L, K), torch.nan)
    base = torch.full((n_runs, N, L), torch.nan)
    t_all = targets.repeat(n_runs).to(device)
    scales = run_scales(runs, norm, norm_reading, scale_from)
    scale = None if scales[0] is None else torch.cat(scales).to(device)  # [n_runs * N], rows as resid's
    base_by_layer = {}
    for layer in tqdm(
        layers, desc="stage 1" if mode == "two_stage" else "importance", disable=not progress, leave=False
    ):
        resid = torch.cat([run.resid_mid[:, layer] for run in runs]).to(device)
        coef = torch.cat([run.coef[:, layer] for run in runs]).to(device)
        values = w_out(model, layer).to(device)
        stats, b = layer_stats(resid, t_all, norm, W_U, b_U, vocab_chunk=max(vocab_chunk, 16384), scale=scale)
        base[:, :, layer] = b.view(n_runs, N).cpu()
        approx[:, :, layer] = (
            first_order_importance(resid, coef, values, t_all, norm, W_U, stats, scale).view(n_runs, N, K).cpu()
        )
        if mode == "exact":
            imp = exact_importance(
                resid, coef, values, t_all, norm, W_U, b_U, base_logprob=b, vocab_chunk=vocab_chunk, scale=scale
            )
            importance[:, :, layer] = imp.view(n_runs, N, K).cpu()
        else:
            base_by_layer[layer] = b
    if mode == "exact":
        return {"importance": importance, "approx": approx, "base_logprob": base}
    # stage 2: exact for each prompt's candidates
    score = approx[0] - approx[1] if (select == "change" and n_runs == 2) else approx[0]
    score = score[:, layers].reshape(N, -1)
    score = torch.where(torch.isfinite(score), score, torch.tensor(-torch.inf))
    c = min(n_candidates, score.shape[1])
    cand = score.topk(c, dim=1).indices  # [N, c] into (len(layers) * K)
    cand_layer = torch.tensor(layers)[cand // K]
    cand_neuron = cand % K
    for layer in tqdm(layers, desc="stage 2 (exact)", disable=not progress, leave=False):
        sel = cand_layer == layer
        if not sel.any():
            continue
        prompt_idx, slot = sel.nonzero(as_tuple=True)
        neurons = cand_neuron[prompt_idx, slot]
        rows = torch.cat([prompt_idx + j * N for j in range(n_runs)])
        cols = neurons.repeat(n_runs)
        resid = torch.cat([run.resid_mid[:, layer] for run in runs]).to(device)
        coef = torch.cat([run.coef[:, layer] for run in runs]).to(device)
        imp = exact_importance(
            resid,
            coef,
            w_out(model, layer),
            t_all,
            norm,
            W_U,
            b_U,
            pairs=(rows.to(device), cols.to(device)),
            base_logprob=base_by_layer[layer].to(device),
            vocab_chunk=vocab_chunk,
            scale=scale,
        ).cpu()
        run_of = torch.arange(n_runs).repeat_interleave(len(prompt_idx))
        importance[run_of, prompt_idx.repeat(n_runs), layer, cols] = imp
    return {"importance": importance, "approx": approx, "base_logprob": base}


def _differing_layers(a: LastPosition, b: LastPosition) -> list[int]:
    L = a.coef.shape[1]
    return [
        l
        for l in range(L)
        if not (torch.equal(a.resid_mid[:, l], b.resid_mid[:, l]) and torch.equal(a.coef[:, l], b.coef[:, l]))
    ]


@torch.no_grad()
def cna_compare(
    model,
    prompts: PromptSet,
    hooks_b: list[Hook] | None = None,
    prompts_b: PromptSet | None = None,
    *,
    hooks_a: list[Hook] | None = None,
    targets: torch.Tensor | None = None,
    mode: str = "auto",
    n_candidates: int = 200,
    batch_size: int = 32,
    skip_identical_layers: bool = True,
    vocab_chunk: int = 8192,
    progress: bool = True,
    norm_reading: str = "final",
) -> CNAResult:
    """CNA between two runs at the answer position (Sec. 4.1): run a = ``prompts`` with
    ``hooks_a`` (default the plain model), run b = ``prompts_b`` (default the same
    prompts) with ``hooks_b`` (e.g. ``zero_heads_hooks([key_head])``). The target token
    w of case i is ``targets[i]`` (default the first answer token, the prediction of a
    correct case) in both runs. Neurons are ranked by imp_a - imp_b (``.change``).
    ``norm_reading`` "final": both runs are read with run a's final scale (same prompts),
    or each with its own (``prompts_b``: another input); "own": ``cna_norm.NORM_READINGS``."""
    check_norm_reading(norm_reading)
    if prompts_b is not None and len(prompts_b) != len(prompts):
        raise ValueError("prompts and prompts_b must have the same number of cases")
    targets = answer_targets(prompts, targets)
    if prompts_b is None:
        runs = run_conditions(
            model,
            prompts,
            {"a": hooks_a, "b": hooks_b},
            targets=targets,
            batch_size=batch_size,
            progress=progress,
            desc="runs a and b",
        )
        run_a, run_b = runs["a"], runs["b"]
    else:
        run_a = run_last_position(
            model, prompts, hooks_a, targets=targets, batch_size=batch_size, progress=progress, desc="run a"
        )
        run_b = run_last_position(
            model, prompts_b, hooks_b, targets=targets, batch_size=batch_size, progress=progress, desc="run b"
        )
    layers = _differing_layers(run_a, run_b) if skip_identical_layers else list(range(run_a.coef.shape[1]))
    mode = resolve_mode(model, mode)
    if layers:
        out = importance_from_runs(
            model,
            [run_a, run_b],
            targets,
            mode=mode,
            n_candidates=n_candidates,
            select="change",
            layers=layers,
            vocab_chunk=vocab_chunk,
            progress=progress,
            norm_reading=norm_reading,
            scale_from=0 if prompts_b is None else None,
        )
    else:
        shape = (2, len(targets), *run_a.coef.shape[1:])
        out = {
            "importance": torch.full(shape, torch.nan),
            "approx": torch.full(shape, torch.nan),
            "base_logprob": torch.full(shape[:3], torch.nan),
        }
    imp, approx, base = out["importance"], out["approx"], out["base_logprob"]
    return CNAResult(
        importance_a=imp[0],
        importance_b=imp[1],
        approx_a=approx[0],
        approx_b=approx[1],
        coef_a=run_a.coef,
        coef_b=run_b.coef,
        base_logprob_a=base[0],
        base_logprob_b=base[1],
        run_a=run_a,
        run_b=run_b,
        targets=targets,
        mode=mode,
        n_candidates=None if mode == "exact" else n_candidates,
        layers=layers,
        norm_reading=norm_reading,
    )


def candidate_recall(
    small: CNAResult,
    large: CNAResult,
    ks: Sequence[int],
    small_cases: Sequence[int] | None = None,
    large_cases: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Share of the top-k neurons found with a large candidate pool (``large``) that a
    smaller pool (``small``) also ranks top-k, per case and k (rows ``small_cases[j]`` of
    ``small`` and ``large_cases[j]`` of ``large`` are the same case): a check that the
    stage-1 ranking does not miss neurons the exact score ranks high."""
    small_cases = list(range(len(small))) if small_cases is None else list(small_cases)
    large_cases = list(range(len(large))) if large_cases is None else list(large_cases)
    if len(small_cases) != len(large_cases):
        raise ValueError("small_cases and large_cases must pair up")
    rows = []
    for i, j in zip(small_cases, large_cases):
        for k in ks:
            a, b = set(small.top(i, k)), set(large.top(j, k))
            rows.append({"case": i, "k": k, "overlap": len(a & b) / max(1, len(b))})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- coefficient decrease


def coefficient_decrease(before: torch.Tensor, after: torch.Tensor) -> float:
    """Decrease (%) of a set of neurons' coefficients from ``before`` to ``after``,
    sign-aware: 100 * sum sign(m0) (m0 - m1) / sum |m0| (SwiGLU coefficients can be
    negative; a neuron whose coefficient moves towards zero decreases)."""
    before, after = before.float(), after.float()
    denom = before.abs().sum()
    if denom == 0:
        return float("nan")
    return float(100 * (torch.sign(before) * (before - after)).sum() / denom)
