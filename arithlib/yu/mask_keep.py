"""Per-prompt neuron interventions of Yu & Ananiadou 2024 (Sec. 4.2): mask the top-K CNA
neurons of each prompt, or keep only them on the scored layers (Table 5), and remove the
lowest of them (Table 6), each against random neuron sets of the same layers over
:data:`N_RANDOM_SEEDS` seeds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from ..core.components import Neuron
from ..core.prompt_sets import PromptSet
from ..core.stats import encode_correct
from ..methods.neuron_zeroing import Masks, zeroing_runs
from ..methods.neurons import prompt_neuron_masks
from .cna import CNAResult, coefficient_decrease


def neuron_masks(
    sets: Sequence[Iterable[Neuron]], n_layers: int, d_mlp: int, keep_layers: Sequence[int] | None = None
) -> dict[int, torch.Tensor]:
    """Bool masks [N, d_mlp] per layer from per-prompt neuron sets. Mask mode
    (``keep_layers=None``): True on each prompt's neurons. Keep mode: True on every
    neuron of ``keep_layers`` except the prompt's own (Yu's "keep")."""
    if keep_layers is None:
        layers = dict.fromkeys(int(layer) for neurons in sets for layer, _ in neurons)  # in order of appearance
        return prompt_neuron_masks(sets, list(layers), d_mlp)
    keep = {int(layer) for layer in keep_layers}
    own = prompt_neuron_masks([[(l, n) for l, n in neurons if int(l) in keep] for neurons in sets], keep, d_mlp)
    return {layer: ~own[int(layer)] for layer in keep_layers}


def random_layer_matched(sets: Sequence[Sequence[Neuron]], d_mlp: int, seed: int) -> list[list[Neuron]]:
    """For each prompt's neuron set, as many random neurons of the same layers (one per
    neuron, not in the set): the control of a mask intervention."""
    rng = np.random.default_rng(seed)
    out = []
    for neurons in sets:
        taken = set(neurons)
        chosen = []
        for layer, _ in neurons:
            while True:
                cand = (layer, int(rng.integers(d_mlp)))
                if cand not in taken:
                    taken.add(cand)
                    chosen.append(cand)
                    break
        out.append(chosen)
    return out


def top_k_sets(result: CNAResult, n_cases: int, k: int) -> list[list[Neuron]]:
    """Each case's top-``k`` CNA neurons, for a table row labelled K = ``k``: a ValueError
    when a case has fewer than ``k`` finite scores (two-stage mode scores only
    ``n_candidates`` neurons per case), since the row would act on fewer neurons than its
    label says."""
    sets = [result.top(i, k) for i in range(n_cases)]
    short = [i for i, s in enumerate(sets) if len(s) < k]
    if short:
        i = short[0]
        fix = (
            f"raise n_candidates to at least {k} or use mode='exact'"
            if result.mode == "two_stage"
            else f"use K <= {len(sets[i])}, the neurons of the scored layers {result.layers} (the others have "
            "identical runs a and b)"
        )
        raise ValueError(
            f"K={k}: {len(short)} of {n_cases} cases have fewer than {k} finite CNA scores (case {i}: "
            f"{len(sets[i])}; mode {result.mode!r}, n_candidates={result.n_candidates}); {fix}"
        )
    return sets


#: Random controls of notebook 04 (mask / keep, the lowest-neuron test, the shallow
#: sets): independent random draws per K or M, each its own seed.
N_RANDOM_SEEDS = 10


def control_seed(*parts: int) -> int:
    """A reproducible integer seed from ``parts`` (e.g. notebook seed, draw, K)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def layer_span(layers: Iterable[int]) -> str:
    """Layers as text, runs joined: [13, 14, 15, 20] -> "13-15,20"."""
    ls = sorted(set(int(l) for l in layers))
    parts, i = [], 0
    while i < len(ls):
        j = i
        while j + 1 < len(ls) and ls[j + 1] == ls[j] + 1:
            j += 1
        parts.append(f"{ls[i]}-{ls[j]}" if j > i else f"{ls[i]}")
        i = j + 1
    return ",".join(parts)


def random_in_layers(
    sets: Sequence[Sequence[Neuron]], layers: Sequence[int], d_mlp: int, seed: int
) -> list[list[Neuron]]:
    """For each prompt's neuron set, as many distinct random neurons of ``layers`` (any of
    them, uniformly over their neurons), none in the set: the control of a "keep"."""
    rng = np.random.default_rng(seed)
    layers = list(layers)
    out = []
    for neurons in sets:
        taken = set(neurons)
        chosen: list[Neuron] = []
        while len(chosen) < len(neurons):
            cand = (layers[int(rng.integers(len(layers)))], int(rng.integers(d_mlp)))
            if cand not in taken:
                taken.add(cand)
                chosen.append(cand)
        out.append(chosen)
    return out


def mask_keep_table(
    model,
    prompts: PromptSet,
    result: CNAResult,
    ks: Sequence[int] = (99, 50, 30, 20, 10),
    *,
    keep_layers: Sequence[int] | None = None,
    seed: int = 0,
    n_seeds: int = N_RANDOM_SEEDS,
    control_ks: Sequence[int] | None = None,
    batch_size: int = 32,
    progress: bool = True,
) -> pd.DataFrame:
    """Table 5 / 15 on every case of ``prompts``: for each K, zero each case's top-K CNA
    neurons ("mask"), or zero every other neuron of the layers CNA scored ("keep": Yu
    keeps the top neurons and zeroes the rest of layers 17-31, the layers from the key
    head's up, which are the layers CNA scores; default ``result.layers``), at the
    answer position. Controls, ``n_seeds`` draws each: "random mask" zeroes K neurons
    of the same layers as the top-K (one per top neuron, none of them), "random keep"
    keeps K random neurons of ``keep_layers`` instead of the top-K; at the K of
    ``control_ks`` only (default every K: each control is 2 x ``n_seeds`` more passes).

    One row per (K, intervention, seed; seed NaN for mask / keep): accuracy (first
    token), accuracy decrease (% of the unablated accuracy on the same cases), per-case
    correctness (``correct_by_prompt``, :func:`arithlib.core.stats.encode_correct`, for exact
    binomial and bootstrap intervals) and, for "mask", the coefficient decrease of the
    top-K neurons from run a to run b (mean over cases). Every case needs K scored
    neurons (:func:`top_k_sets`)."""
    cfg = model.cfg
    if n_seeds < 1:
        raise ValueError(f"n_seeds must be >= 1 (random controls), got {n_seeds}")
    keep_layers = list(result.layers) if keep_layers is None else sorted(int(l) for l in keep_layers)
    if not keep_layers:
        raise ValueError("no layers to keep: CNA scored no layer (runs a and b identical everywhere)")
    conditions: dict[str, Masks] = {"none": {}}
    coef_dec = {}
    for k in ks:
        sets = top_k_sets(result, len(prompts), k)
        conditions[f"mask|{k}|"] = neuron_masks(sets, cfg.n_layers, cfg.d_mlp)
        conditions[f"keep|{k}|"] = neuron_masks(sets, cfg.n_layers, cfg.d_mlp, keep_layers)
        for s in range(n_seeds if control_ks is None or k in control_ks else 0):
            conditions[f"random mask|{k}|{s}"] = neuron_masks(
                random_layer_matched(sets, cfg.d_mlp, control_seed(seed, s, k)), cfg.n_layers, cfg.d_mlp
            )
            conditions[f"random keep|{k}|{s}"] = neuron_masks(
                random_in_layers(sets, keep_layers, cfg.d_mlp, control_seed(seed, s, k, 1)),
                cfg.n_layers,
                cfg.d_mlp,
                keep_layers,
            )
        coef_dec[k] = float(
            np.nanmean(
                [
                    coefficient_decrease(result.coef_a[i][tuple(zip(*s))], result.coef_b[i][tuple(zip(*s))])
                    if s
                    else np.nan
                    for i, s in enumerate(sets)
                ]
            )
        )
    runs = zeroing_runs(
        model, prompts, conditions, targets=result.targets, batch_size=batch_size, progress=progress, desc="mask/keep"
    )
    base = runs.pop("none").accuracy
    rows = []
    for name, run in runs.items():
        kind, k, s = name.split("|")
        acc = run.accuracy
        rows.append(
            {
                "K": int(k),
                "intervention": kind,
                "seed": int(s) if s else float("nan"),
                "accuracy": acc,
                "accuracy_decrease": 100 * (base - acc) / base if base > 0 else float("nan"),
                "coef_decrease": coef_dec[int(k)] if kind == "mask" else float("nan"),
                "n_cases": len(prompts),
                "base_accuracy": base,
                "keep_layers": layer_span(keep_layers) if kind.endswith("keep") else "",
                "correct_by_prompt": encode_correct(run.correct.cpu().numpy()),
            }
        )
    return pd.DataFrame(rows)


def lowest_neuron(neurons: Sequence[Neuron], importance: torch.Tensor) -> Neuron:
    """Yu's Sec. 4.3 rule: the neuron of the lowest layer among ``neurons``; among several
    there, the one with the largest importance (``importance`` [L, d_mlp], run a)."""
    low = min(l for l, _ in neurons)
    at_low = [(l, n) for l, n in neurons if l == low]
    return max(at_low, key=lambda ln: float(torch.nan_to_num(importance[ln], nan=-math.inf)))


def lowest_neuron_table(
    model,
    prompts: PromptSet,
    result: CNAResult,
    ks: Sequence[int] = (99, 50, 30, 20, 10),
    *,
    seed: int = 0,
    n_seeds: int = N_RANDOM_SEEDS,
    control_ks: Sequence[int] | None = None,
    batch_size: int = 32,
    progress: bool = True,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table 6 / 16 on every case: for each case and K, zero the lowest of its top-K
    neurons (at the answer position, in the original model) and measure the
    coefficient decrease of its other top-K neurons in higher layers (those it can
    influence). Control (not in the paper), ``n_seeds`` draws: zero instead a random
    neuron of the same layer that is not among the top-K, and measure the same upper
    neurons (at the K of ``control_ks`` only; default every K). Returns the summary (per K: mean over cases with at least one higher
    neuron, the mean over seeds of the random control) and the per-case rows
    (``kind`` "lowest" or "random", ``seed``), from which the report bootstraps.
    Every case needs K scored neurons (:func:`top_k_sets`)."""
    cfg = model.cfg
    if n_seeds < 0:
        raise ValueError(f"n_seeds must be >= 0, got {n_seeds}")
    per_case = []
    clean: dict = {}  # each batch's clean run, shared by the K's
    for k in ks:
        sets = top_k_sets(result, len(prompts), k)
        lows = [lowest_neuron(s, result.importance_a[i]) if s else None for i, s in enumerate(sets)]
        draws: dict[str, list[Neuron | None]] = {"lowest": lows}
        for s_ in range(n_seeds if control_ks is None or k in control_ks else 0):
            rng = np.random.default_rng(control_seed(seed, s_, k, 2))
            picks = []
            for s, low in zip(sets, lows):
                taken = set(s)
                pick = None
                while low is not None and pick is None:
                    cand = (low[0], int(rng.integers(cfg.d_mlp)))
                    pick = cand if cand not in taken else None
                picks.append(pick)
            draws[f"random|{s_}"] = picks
        conditions = {
            name: neuron_masks([[x] if x else [] for x in picks], cfg.n_layers, cfg.d_mlp)
            for name, picks in draws.items()
        }
        # the top-K neurons above each case's lowest one: the coefficients the test reads
        uppers = [[(l, n) for l, n in s if low is not None and l > low[0]] for s, low in zip(sets, lows)]
        runs = zeroing_runs(
            model,
            prompts,
            conditions,
            coef_at=uppers,
            targets=result.targets,
            batch_size=batch_size,
            progress=progress,
            desc=f"lowest neuron K={k}",
            clean_runs=clean,
        )
        for name, picks in draws.items():
            kind, _, s_ = name.partition("|")
            coef_after = runs[name].coef_at
            for i, (upper, low, zeroed) in enumerate(zip(uppers, lows, picks)):
                if not upper or zeroed is None:
                    continue
                idx = tuple(zip(*upper))
                per_case.append(
                    {
                        "K": k,
                        "kind": kind,
                        "seed": int(s_) if s_ else float("nan"),
                        "case": i,
                        "lowest_layer": low[0],
                        "lowest_neuron": low[1],
                        "zeroed_neuron": zeroed[1],
                        "n_upper": len(upper),
                        "coef_decrease": coefficient_decrease(result.coef_a[i][idx], coef_after[i, : len(upper)]),
                        "correct_after": bool(runs[name].correct[i]),
                    }
                )
        del runs
    per_case = pd.DataFrame(
        per_case,
        columns=[
            "K",
            "kind",
            "seed",
            "case",
            "lowest_layer",
            "lowest_neuron",
            "zeroed_neuron",
            "n_upper",
            "coef_decrease",
            "correct_after",
        ],
    )
    if per_case.empty:
        return pd.DataFrame(
            columns=["K", "coef_decrease", "n_cases", "mean_lowest_layer", "random_coef_decrease", "n_seeds"]
        ), per_case
    low = per_case[per_case.kind == "lowest"]
    summary = (
        low.groupby("K")
        .agg(
            coef_decrease=("coef_decrease", "mean"),
            n_cases=("case", "count"),
            mean_lowest_layer=("lowest_layer", "mean"),
        )
        .reset_index()
    )
    rnd = per_case[per_case.kind == "random"]
    summary["random_coef_decrease"] = (
        summary["K"].map(rnd.groupby("K")["coef_decrease"].mean()) if len(rnd) else float("nan")
    )
    summary["n_seeds"] = summary["K"].map(rnd.groupby("K")["seed"].nunique()).fillna(0).astype(int) if len(rnd) else 0
    return summary.sort_values("K", ascending=False).reset_index(drop=True), per_case
