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

import re
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core import datasets as ds
from ..core.components import Hook, Neuron
from ..core.datasets import PromptRecord
from ..core.papers import DEEP_FROM_FRACTION
from ..core.prompt_sets import PromptSet
from ..core.readout import final_norm, top_tokens, unembedding
from ..engine import input_device
from ..methods.answer_runs import LastPosition, answer_targets, run_conditions, run_last_position
from ..methods.neurons import value_vectors, w_out
from .cna_importance import VOCAB_CHUNK, exact_importance, first_order_importance, layer_stats_stacked
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
            vecs = value_vectors(model, list(zip(frame.layer, frame.neuron)))
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
    vocab_chunk: int = VOCAB_CHUNK,
    progress: bool = False,
    norm_reading: str = "final",
    scale_from: int | None = 0,
) -> dict[str, torch.Tensor]:
    """Importance of every neuron in each of ``runs`` (LastPosition with resid_mid, coef
    and final_resid; all runs' rows share each layer's products). Returns ``importance``
    [n_runs, N, L, K] (NaN where not exact), ``approx`` (stage 1) and ``base_logprob``
    [n_runs, N, L].

    ``norm_reading`` "final" (default, the authors'): every vector of run j's row i is read
    with the fixed scale of row i of run ``scale_from`` (the unintervened run of the same
    inputs; None: each run's own final state, for runs of different inputs); "own": each
    vector by its own RMS (:func:`run_scales`).

    Two-stage candidates: per prompt, the ``n_candidates`` neurons over all ``layers``
    with the largest stage-1 score (``select="score"``, of the first run; their exact
    importance is computed in every run) or stage-1 change from the reference run, the
    last one (``select="change"``): run j's candidates are its largest changes
    ``approx[j] - approx[-1]``, its exact importance is computed there, and the reference
    run's at the union of all runs' candidates (two runs: both at the same neurons; more:
    several models compared with one original at once, each row read where its own run
    needs it)."""
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

    resids = [torch.cat([run.resid_mid[:, layer] for run in runs]).to(device) for layer in layers]
    all_stats = layer_stats_stacked(resids, t_all, norm, W_U, b_U, vocab_chunk=vocab_chunk, scale=scale)
    for layer, resid, (stats, b) in tqdm(
        zip(layers, resids, all_stats),
        total=len(layers),
        desc="stage 1" if mode == "two_stage" else "importance",
        disable=not progress,
        leave=False,
    ):
        coef = torch.cat([run.coef[:, layer] for run in runs]).to(device)
        values = w_out(model, layer).to(device)
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
    per_run = select == "change" and n_runs >= 2
    scores = [approx[j] - approx[n_runs - 1] for j in range(n_runs - 1)] if per_run else [approx[0]]
    cands = [_candidates(s, layers, K, n_candidates) for s in scores]  # (layer, neuron) [N, c] each
    for layer, resid in tqdm(
        zip(layers, resids), total=len(layers), desc="stage 2 (exact)", disable=not progress, leave=False
    ):
        rows, cols = _stage2_pairs(cands, layer, N, K, n_runs, per_run)
        if not len(rows):
            continue
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
        importance[rows // N, rows % N, layer, cols] = imp
    return {"importance": importance, "approx": approx, "base_logprob": base}


def _candidates(score: torch.Tensor, layers: Sequence[int], K: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's ``n`` neurons with the largest stage-1 ``score`` [N, L, K] over
    ``layers`` (non-finite scores last): their layers and indices, [N, min(n, len(layers) K)] each."""
    N = score.shape[0]
    flat = score[:, layers].reshape(N, -1)
    flat = torch.where(torch.isfinite(flat), flat, torch.tensor(-torch.inf))
    cand = flat.topk(min(n, flat.shape[1]), dim=1).indices
    return torch.tensor(list(layers))[cand // K], cand % K


def _stage2_pairs(
    cands: Sequence[tuple[torch.Tensor, torch.Tensor]], layer: int, N: int, K: int, n_runs: int, per_run: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, neuron) pairs of ``layer`` whose exact importance stage 2 computes, rows
    numbered run-major (row ``j * N + i`` is prompt i of run j). Shared candidates (one
    set): every run at each candidate. Per run (``select="change"``): run j at its own
    candidates, and the reference run (the last) at the union of all of them, once each."""
    picked = []
    for cand_layer, cand_neuron in cands:
        prompt, slot = (cand_layer == layer).nonzero(as_tuple=True)
        picked.append((prompt, cand_neuron[prompt, slot]))
    if not per_run:
        prompt, neuron = picked[0]
        return torch.cat([prompt + j * N for j in range(n_runs)]), neuron.repeat(n_runs)
    union = torch.unique(torch.cat([p * K + n for p, n in picked]))  # the reference's pairs, once each
    rows = [p + j * N for j, (p, _) in enumerate(picked)] + [union // K + (n_runs - 1) * N]
    cols = [n for _, n in picked] + [union % K]
    return torch.cat(rows), torch.cat(cols)


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
    vocab_chunk: int = VOCAB_CHUNK,
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
