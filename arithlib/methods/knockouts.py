"""Head knockouts: Zhang et al. 2024's mean-ablation knockout of the key heads (Sec. 3.3,
Fig. 3) and of random heads, per prompt and per position; Yu & Ananiadou 2024's sweep that
zeroes each head's slice of W_O (Sec. 3.2); the counterfactual-answer rate of Zhang's
knockout prompts. Every intervention runs through :func:`arithlib.methods.patching.run_interventions`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from ..core.components import Head, z_hook
from ..core.positions import locate_operands
from ..core.prompt_sets import PromptSet
from ..engine import RunCache
from .patching import Component, Edit, ablation_edits, resolve_position, run_interventions


def head_sweep(
    model,
    prompts: PromptSet,
    heads: Sequence[Head] | None = None,
    value: Mapping[int, torch.Tensor] | float = 0.0,
    position: int | None = -1,
    batch_size: int = 16,
    max_rows: int = 1024,
    progress: bool = True,
    cache: RunCache | None = None,
) -> pd.DataFrame:
    """Ablate one head at a time (``value=0``: zero its W_O slice, Yu & Ananiadou Sec. 3.2;
    a mean mapping: Zhang's knockout) at ``position`` (-1: answer position only; None:
    every position, Yu's intervention, recomputing every position of every prompt: the
    reference of :func:`arithlib.yu.head_sweep.exact_head_sweep`) and record first-token
    correctness. Returns one row per head and
    prompt: ``prompt``, ``layer``, ``head``, ``correct``, ``clean_correct`` plus the
    prompt's ``op``, ``n_digits``, ``template_id``, ``carry`` and ``case``."""
    cfg = model.cfg
    heads = list(heads) if heads is not None else [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    variants = [ablation_edits([hd], value, position) for hd in heads]
    ro = run_interventions(
        model, prompts, variants, batch_size, max_rows, progress=progress, desc="head sweep", cache=cache
    )
    correct = ro.correct.numpy()
    clean = (ro.clean_pred == ro.answer_ids).numpy()
    meta = pd.DataFrame(
        {
            "prompt": range(len(prompts)),
            "op": [r.op for r in prompts.records],
            "n_digits": [r.n_digits for r in prompts.records],
            "template_id": [r.template_id for r in prompts.records],
            "carry": [r.carry for r in prompts.records],
            "case": [r.get("case", "") for r in prompts.records],
        }
    )
    frames = []
    for j, (layer, head) in enumerate(heads):
        f = meta.copy()
        f["layer"], f["head"], f["correct"], f["clean_correct"] = layer, head, correct[j], clean
        frames.append(f)
    return pd.concat(frames, ignore_index=True)


def sweep_accuracy(sweep: pd.DataFrame, by: Sequence[str] = ("op", "n_digits")) -> pd.DataFrame:
    """Accuracy per head (and ``by`` groups) from :func:`head_sweep` rows, with the clean
    baseline and the drop: ``accuracy``, ``baseline_accuracy``, ``accuracy_drop``."""
    keys = list(by) + ["layer", "head"]
    g = (
        sweep.groupby(keys)
        .agg(accuracy=("correct", "mean"), baseline_accuracy=("clean_correct", "mean"), n=("correct", "size"))
        .reset_index()
    )
    g["accuracy_drop"] = g["baseline_accuracy"] - g["accuracy"]
    return g


def mean_ablation_edits(
    heads: Iterable[Head],
    means: Mapping[str, Mapping[int, torch.Tensor]],
    length: int,
    position: int | None = None,
    start: int = 0,
) -> list[Edit]:
    """Edits replacing each head's output by its mean over a reference set at the same
    position, for prompts of ``length`` tokens; ``means`` is an
    :func:`arithlib.methods.ablation.mean_activations` cache (``{hook_z: {length: [T, H, d_head]}}``).
    ``position`` None ablates every position from ``start`` on (``start`` 0: all of them,
    = :func:`arithlib.methods.ablation.mean_heads_hooks`; the query's first token: the query only)."""
    edits = []
    for layer, head in heads:
        name = z_hook(int(layer))
        try:
            m = means[name][length]
        except KeyError:
            raise KeyError(f"no mean of {name} for prompts of length {length}") from None
        ps = range(start, length) if position is None else [resolve_position(position, length)]
        edits += [Edit(Component("head", int(layer), int(head)), p, m[p, int(head)]) for p in ps]
    return edits


def random_orders(n_layers: int, n_heads: int, n_random: int, seed: int) -> dict[str, list[Head]]:
    """``{"random0": [...], ...}``: ``n_random`` seeded permutations of all heads (Zhang's
    "random-rank" orders; the first k of each is a random set of k heads)."""
    all_heads = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_random):
        perm = rng.permutation(len(all_heads))
        out[f"random{i}"] = [all_heads[j] for j in perm]
    return out


def _knockout_variants(sets: Sequence[Sequence[Head]], means: Mapping, position: int | None, start: int = 0):
    """Variants mean-ablating each head set: at ``position`` with ``{layer: [H, d_head]}``
    means, or at every position from ``start`` on (``position=None``) with a per-length cache."""
    if position is None:

        def variants(batch, run):
            T = batch.tokens.shape[1]
            return [mean_ablation_edits(hs, means, T, None, start) for hs in sets]

        return variants
    return [ablation_edits(hs, means, position) for hs in sets]


def knockout_curves(
    model,
    prompts: PromptSet,
    ranking: Sequence[Head],
    ks: Sequence[int],
    means: Mapping,
    n_random: int = 5,
    seed: int = 0,
    position: int | None = -1,
    by: str | None = "op",
    batch_size: int = 16,
    max_rows: int = 1024,
    orders: Sequence[str] | None = None,
    progress: bool = True,
    cache: RunCache | None = None,
) -> pd.DataFrame:
    """Zhang et al. Fig. 3: mean-ablate the first k heads of ``ranking`` ("effect-rank")
    and of ``n_random`` random permutations of all heads ("random-rank", seeded,
    :func:`random_orders`), for each k in ``ks``; first-token accuracy on ``prompts``.

    ``position=-1``: ablate at the answer position only, ``means`` ``{layer: [H, d_head]}``
    (e.g. :meth:`PathPatchingResult.end_means`, Zhang's mean over X_c). ``position=None``:
    ablate at every position, ``means`` a per-length cache (``{hook_z: {length: [T, H, d_head]}}``,
    e.g. :attr:`PathPatchingResult.cf_means`). ``orders`` restricts which orders run
    (names "effect", "random0", ...). Returns rows ``order`` ("effect"/"random"),
    ``order_name``, ``k``, ``group`` (``by`` value or "all"), ``accuracy``, ``n``."""
    cfg = model.cfg
    named = {"effect": list(ranking), **random_orders(cfg.n_layers, cfg.n_heads, n_random, seed)}
    if orders is not None:
        named = {k: v for k, v in named.items() if k in orders}
    labels, sets = [], []
    for name, order in named.items():
        for k in ks:
            if k <= len(order):
                labels.append((name, k))
                sets.append(order[:k])
    ro = run_interventions(
        model,
        prompts,
        _knockout_variants(sets, means, position),
        batch_size,
        max_rows,
        progress=progress,
        desc="knockout",
        cache=cache,
    )
    correct = ro.correct.float()
    groups = {"all": torch.arange(len(prompts))}
    if by is not None:
        values = [getattr(r, by) for r in prompts.records]
        for v in dict.fromkeys(values):
            groups[str(v)] = torch.tensor([i for i, x in enumerate(values) if x == v])
    rows = []
    for j, (name, k) in enumerate(labels):
        for g, idx in groups.items():
            rows.append(
                {
                    "order": "effect" if name == "effect" else "random",
                    "order_name": name,
                    "k": k,
                    "group": g,
                    "accuracy": float(correct[j, idx].mean()),
                    "n": len(idx),
                }
            )
    return pd.DataFrame(rows)


def query_starts(prompts: PromptSet) -> list[int]:
    """Position of each prompt's first query token: the first token after its few-shot
    prefix (:func:`locate_operands`' ``prefix`` positions; 0 without a prefix)."""
    return [max(loc["prefix"]) + 1 if loc["prefix"] else 0 for loc in locate_operands(prompts)]


def knockout_screen_agreement(query: pd.DataFrame, end: pd.DataFrame) -> pd.DataFrame:
    """The END-only knockout screen against the judged knockout at every query position,
    per condition, from two :func:`knockout_per_prompt` tables: ``n``, both accuracies,
    per-prompt ``agreement``, ``broken_by_query`` (prompts the judged knockout breaks) and
    ``recall_of_end`` (the share of those the screen also breaks)."""
    both = query.merge(end, on=["prompt", "condition"], suffixes=("_query", "_end"))
    rows = []
    for condition, g in both.groupby("condition"):
        broken = ~g["correct_query"].astype(bool)
        rows.append(
            {
                "condition": condition,
                "n": len(g),
                "accuracy_query": g["correct_query"].mean(),
                "accuracy_end": g["correct_end"].mean(),
                "agreement": (g["correct_query"] == g["correct_end"]).mean(),
                "broken_by_query": int(broken.sum()),
                "recall_of_end": float((broken & ~g["correct_end"].astype(bool)).sum()) / max(int(broken.sum()), 1),
            }
        )
    return pd.DataFrame(rows)


def knockout_per_prompt(
    model,
    prompts: PromptSet,
    head_sets: Mapping[str, Sequence[Head]],
    means: Mapping,
    position: int | None = None,
    query_only: bool = True,
    batch_size: int = 16,
    max_rows: int = 1024,
    progress: bool = True,
    cache: RunCache | None = None,
) -> pd.DataFrame:
    """Zhang et al. Sec. 4.1 / Fig. 3 knockout, one row per prompt and condition: each
    named head set of ``head_sets`` mean-ablated (means over X_c), plus the condition
    "none" (nothing ablated). ``position`` None: at every position of the query (the
    prompt the paper uses; with ``query_only`` the few-shot prefix is left intact, so its
    cached keys and values are reused; :func:`query_starts`) with a per-length cache such
    as :attr:`PathPatchingResult.cf_means`; -1: at the answer position with
    ``{layer: [H, d_head]}`` means. Columns ``prompt, op, template_id, condition,
    n_heads, position`` ("every" / "query" / "end"), ``correct`` (first answer token is
    the argmax), for the report's bootstrap over prompts."""
    names = ["none"] + list(head_sets)
    sets = [[]] + [list(head_sets[n]) for n in head_sets]
    correct = np.zeros((len(sets), len(prompts)), dtype=bool)
    if position is None:
        starts = query_starts(prompts) if query_only else [0] * len(prompts)
        parts = {}
        for i, s0 in enumerate(starts):
            parts.setdefault(s0, []).append(i)
    else:
        parts = {None: list(range(len(prompts)))}
    for s0, idx in parts.items():
        sub = prompts.subset(idx)
        if position is None:
            inner = _knockout_variants(sets[1:], means, None, s0)

            def variants(batch, run, inner=inner):
                return [[]] + inner(batch, run)
        else:
            variants = _knockout_variants(sets, means, position)
        ro = run_interventions(
            model, sub, variants, batch_size, max_rows, progress=progress, desc="knockout per prompt", cache=cache
        )
        correct[:, idx] = ro.correct.numpy()
    where = ("query" if query_only else "every") if position is None else "end" if position == -1 else str(position)
    rows = []
    for j, (name, hs) in enumerate(zip(names, sets)):
        for i, r in enumerate(prompts.records):
            rows.append((i, r.op, r.template_id, name, len(hs), where, bool(correct[j, i])))
    return pd.DataFrame(rows, columns=["prompt", "op", "template_id", "condition", "n_heads", "position", "correct"])


@torch.no_grad()
def counterfactual_answer_rate(model, prompts: PromptSet, seed: int = 0, batch_size: int = 64) -> pd.DataFrame:
    """How much of the calculation X_c still carries (Zhang Sec. 3 asks for none): per
    prompt of X_r, whether the model's top-1 token after X_c is the first token of the
    true answer C (``answer_on_xc``), and the reference a model without the operation
    gives: whether it is the first token of a decoy C', the answer of another prompt of
    the same operator whose first token differs from C's (seeded draw; ``decoy_on_xc``).
    Columns ``prompt, op, template_id, answer, decoy, answer_on_xc, decoy_on_xc``."""
    from ..core.evaluate import answer_logits

    if not prompts.has_counterfactuals:
        raise ValueError("counterfactual_answer_rate needs a counterfactual for every prompt")
    xc = PromptSet(
        prompts.records,
        [list(c) for c in prompts.cf_input_ids],
        prompts.answer_ids,
        [None] * len(prompts),
        prompts.tokenizer,
    )
    top1 = answer_logits(model, xc, batch_size, False).argmax(-1)
    first = prompts.first_answer_ids
    rng = np.random.default_rng(seed)
    decoys = []
    for i, r in enumerate(prompts.records):
        pool = [j for j, q in enumerate(prompts.records) if q.op == r.op and int(first[j]) != int(first[i])]
        decoys.append(int(rng.choice(pool)) if pool else -1)
    rows = []
    for i, r in enumerate(prompts.records):
        d = decoys[i]
        rows.append(
            (
                i,
                r.op,
                r.template_id,
                r.answer,
                prompts.records[d].answer if d >= 0 else None,
                bool(top1[i] == first[i]),
                bool(d >= 0 and top1[i] == first[d]),
            )
        )
    return pd.DataFrame(rows, columns=["prompt", "op", "template_id", "answer", "decoy", "answer_on_xc", "decoy_on_xc"])


def answer_rate_table(rates: pd.DataFrame, by: Sequence[str] = ("op",)) -> pd.DataFrame:
    """Per group (and "all"): the share of prompts whose X_c top-1 is C and the decoy
    reference share, each with its exact binomial 95 % interval (:func:`arithlib.core.stats.binomial_ci`)."""
    from ..core.stats import binomial_ci

    rows = []
    groups = [(dict(zip(by, k if isinstance(k, tuple) else (k,))), g) for k, g in rates.groupby(list(by))]
    for keys, g in groups + [({b: "all" for b in by}, rates)]:
        row = dict(keys, n=len(g))
        for col, name in (("answer_on_xc", "answer_rate"), ("decoy_on_xc", "decoy_rate")):
            ci = binomial_ci(int(g[col].sum()), len(g))
            row.update({name: ci.estimate, f"{name}_low": ci.low, f"{name}_high": ci.high})
        rows.append(row)
    return pd.DataFrame(rows)
