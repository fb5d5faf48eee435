"""Which deep FFN neurons pruning keeps (Yu & Ananiadou 2024, Sec. 6.1): the CNA change
between a model and its LoRA model on every 1D case, each neuron's best rank over the
cases (so a prefix of one nested order is the union of every case's top-K), shares of
neurons to keep as such prefixes, and random layer-matched prunings as the control."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..core.prompt_sets import PromptSet
from ..methods import model_weights as MW
from ..methods.answer_runs import run_last_position
from . import cna as C
from . import lora as LO
from .pruned_model import Keep

# --------------------------------------------------------------------------- selection by CNA


def yu_1d_cases(
    tokenizer, ops: Sequence[str] = ("+", "-", "*", "/"), fewshot: int = 2, per_op: int | None = None, seed: int = 0
) -> PromptSet:
    """Yu Sec. 6.1's cases: every 1D case of each operator in the symbolic template
    "n1 + n2 =" (Table 14's last) with the few-shot prefix: + and * with operands 0..9,
    - with a >= b (1D results are non-negative, as in Sec. 4), / as "72/8=" (divisor
    and quotient 1..9, ``cna.yu_division_1d``). ``per_op``: a random subset of that
    many per operator (``seed``), for CPU runs."""
    from ..core import datasets as ds

    rng = np.random.default_rng(seed)
    records = []
    for op in ops:
        recs = (
            C.yu_division_1d(fewshot=fewshot)
            if op == "/"
            else ds.yu_prompts(ops=[op], n_digits=1, n_per_template=None, templates=[3], fewshot=fewshot, seed=seed)
        )
        if per_op is not None and len(recs) > per_op:
            recs = [recs[i] for i in sorted(rng.choice(len(recs), per_op, replace=False).tolist())]
        records.extend(recs)
    return PromptSet.build(records, tokenizer)


@dataclass
class CNAScores:
    """CNA between a LoRA model and the original on ``cases``, restricted to ``layers``:
    ``change`` [N, len(layers), d_mlp] is imp_LoRA - imp_orig where exact (NaN where
    two-stage mode did not score the neuron), ``approx_change`` the stage-1 change of
    every neuron; first-token accuracy of each model on the cases, and per case whether
    the target is each model's top prediction."""

    change: torch.Tensor
    approx_change: torch.Tensor
    layers: list[int]
    mode: str
    n_candidates: int | None
    accuracy_original: float
    accuracy_lora: float
    targets: torch.Tensor
    correct_original: torch.Tensor | None = None
    correct_lora: torch.Tensor | None = None


@torch.no_grad()
def lora_cna_scores(
    bridge,
    cases: PromptSet,
    lora_weights: Mapping[str, torch.Tensor],
    layers: Sequence[int],
    *,
    mode: str = "auto",
    n_candidates: int = 300,
    batch_size: int = 32,
    progress: bool = True,
    norm_reading: str = "final",
) -> CNAScores:
    """Yu Sec. 6.1: CNA (Sec. 4.1) between the LoRA model (``lora_weights`` swapped into
    ``bridge``) and the original on ``cases``, target = each case's correct first answer
    token, for every FFN neuron of ``layers``. LoRA in attention leaves the FFN values,
    final norm and unembedding unchanged, so one importance formula serves both
    models (checked: the weights may not touch MLPs, norms or the unembedding); with
    ``norm_reading`` "final" both are read with the original run's final norm scale."""
    names = LO._mlp_weight_names(bridge)
    touched = set(lora_weights) & set(names)
    if touched:
        raise ValueError(f"the LoRA weights change FFN/norm/unembedding weights ({sorted(touched)[:3]})")
    layers = sorted(int(l) for l in layers)
    targets = cases.first_answer_ids
    mode = C.resolve_mode(bridge, mode)
    run_o = run_last_position(
        bridge, cases, None, targets=targets, batch_size=batch_size, progress=progress, desc="original"
    )
    with MW.use_weights(bridge, lora_weights):
        run_l = run_last_position(
            bridge, cases, None, targets=targets, batch_size=batch_size, progress=progress, desc="LoRA"
        )
    out = C.importance_from_runs(
        bridge,
        [run_l, run_o],
        targets,
        mode=mode,
        n_candidates=n_candidates,
        select="change",
        layers=layers,
        progress=progress,
        norm_reading=norm_reading,
        scale_from=1,
    )  # "final": both read with the original's final scale
    imp, approx = out["importance"][:, :, layers], out["approx"][:, :, layers]
    return CNAScores(
        change=imp[0] - imp[1],
        approx_change=approx[0] - approx[1],
        layers=layers,
        mode=mode,
        n_candidates=None if mode == "exact" else n_candidates,
        accuracy_original=run_o.accuracy,
        accuracy_lora=run_l.accuracy,
        targets=targets,
        correct_original=run_o.correct,
        correct_lora=run_l.correct,
    )


def case_ranks(change: torch.Tensor, approx_change: torch.Tensor | None = None) -> torch.Tensor:
    """Each case's rank (0 = best) of every neuron, [N, M] from scores [N, M]: neurons
    with an exact ``change`` first, by it, then the others by ``approx_change``
    (two-stage mode), then any left (NaN) in index order. Ties keep index order."""
    finite = torch.isfinite(change)
    value = torch.where(
        finite, change, approx_change if approx_change is not None else torch.full_like(change, torch.nan)
    )
    value = torch.nan_to_num(value.float(), nan=-torch.inf)
    tier = torch.where(finite, 0, torch.where(torch.isfinite(value), 1, 2)).to(torch.int8)
    order = torch.argsort(-value, dim=1, stable=True)
    order = order.gather(1, torch.argsort(tier.gather(1, order), dim=1, stable=True))
    N, M = change.shape
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(M).expand(N, M).contiguous())
    return ranks


def union_ranking(scores: CNAScores) -> pd.DataFrame:
    """Every deep neuron in the order of Yu's union rule: by ``best_rank`` (1-based, its
    best position in any case's CNA ranking; the union of all cases' top-K is exactly
    the neurons with best_rank <= K), ties broken by the mean rank over cases. Columns:
    order (1-based), layer, neuron, best_rank, mean_rank, best_case, change (exact
    change in the best case, NaN if not scored), exact (scored exactly there)."""
    N, Ld, K = scores.change.shape
    change = scores.change.reshape(N, Ld * K)
    approx = scores.approx_change.reshape(N, Ld * K)
    ranks = case_ranks(change, approx)
    best, best_case = ranks.min(0)
    mean = ranks.float().mean(0)
    order = np.lexsort((mean.numpy(), best.numpy()))
    flat = torch.as_tensor(order)
    at_best = change[best_case[flat], flat]
    layers = torch.tensor(scores.layers)
    return pd.DataFrame(
        {
            "order": np.arange(1, len(order) + 1),
            "layer": layers[flat // K].numpy(),
            "neuron": (flat % K).numpy(),
            "best_rank": best[flat].numpy() + 1,
            "mean_rank": mean[flat].numpy() + 1,
            "best_case": best_case[flat].numpy(),
            "change": at_best.numpy(),
            "exact": torch.isfinite(at_best).numpy(),
        }
    )


def union_top_k(ranking: pd.DataFrame, k: int) -> pd.DataFrame:
    """The union of every case's top-``k`` (Yu's rule): the rows with best_rank <= k."""
    return ranking[ranking.best_rank <= k]


def union_size_curve(ranking: pd.DataFrame, ks: Sequence[int] | None = None) -> pd.DataFrame:
    """Size of the union of every case's top-K, and its share of the deep neurons, for
    each K (default: 1..max best rank on a log-spaced grid)."""
    best = np.sort(ranking.best_rank.to_numpy())
    if ks is None:
        ks = sorted(set(np.unique(np.round(np.logspace(0, math.log10(max(2, best.max())), 60)).astype(int)).tolist()))
    sizes = np.searchsorted(best, np.asarray(ks), side="right")
    return pd.DataFrame({"k": list(ks), "union_size": sizes, "share": sizes / len(ranking)})


def n_for_share(share: float, n_pool: int) -> int:
    """Neurons kept for ``share`` of a pool of ``n_pool`` (at least 1)."""
    if not 0 < share <= 1:
        raise ValueError("share must be in (0, 1]")
    return max(1, min(n_pool, int(round(share * n_pool))))


def keep_from_ranking(ranking: pd.DataFrame, n: int, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The first ``n`` neurons of ``ranking`` as a keep set over ``layers`` (a layer with
    none kept maps to an empty index: it is pruned entirely)."""
    top = ranking.iloc[:n]
    return {int(l): torch.as_tensor(sorted(top.neuron[top.layer == l].tolist()), dtype=torch.long) for l in layers}


def k_of_prefix(ranking: pd.DataFrame, n: int) -> int:
    """The per-case top-K whose union the first ``n`` neurons of ``ranking`` complete
    (best rank of the n-th neuron): the first n neurons contain the union of top-(K-1)
    and part of the union of top-K."""
    return int(ranking.best_rank.iloc[n - 1])


def random_keep(
    layers: Sequence[int],
    widths: Mapping[int, int] | int,
    n: int,
    seed: int,
    layer_counts: Mapping[int, int] | None = None,
) -> dict[int, torch.Tensor]:
    """Yu's control (LoRA9-r): ``n`` neurons drawn uniformly at random from all neurons of
    ``layers`` (``widths``: per-layer width or one for all); with ``layer_counts`` the
    same number per layer as given instead (layer-matched)."""
    rng = np.random.default_rng(seed)
    width = {int(l): int(widths if isinstance(widths, int) else widths[l]) for l in layers}
    if layer_counts is not None:
        return {
            l: torch.as_tensor(
                np.sort(rng.choice(width[l], int(layer_counts.get(l, 0)), replace=False)), dtype=torch.long
            )
            for l in width
        }
    pool = np.array([(l, i) for l in width for i in range(width[l])], dtype=np.int64)
    pick = pool[rng.choice(len(pool), min(n, len(pool)), replace=False)]
    return {l: torch.as_tensor(np.sort(pick[pick[:, 0] == l, 1]), dtype=torch.long) for l in width}


def kept_by_layer(keeps: Mapping[str, Keep], widths: Mapping[int, int]) -> pd.DataFrame:
    """Neurons kept per layer for named keep sets: selection, layer, n_kept, width, share."""
    rows = []
    for name, keep in keeps.items():
        for l, idx in sorted(keep.items()):
            n = int(torch.as_tensor(idx).numel())
            rows.append(
                {
                    "selection": name,
                    "layer": int(l),
                    "n_kept": n,
                    "width": int(widths[l]),
                    "share": n / max(1, int(widths[l])),
                }
            )
    return pd.DataFrame(rows)
