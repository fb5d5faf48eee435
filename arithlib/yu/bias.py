"""Gender-bias editing with CNA: Yu & Ananiadou 2024 (EMNLP), Sec. 6.2 and App. D
(Tables 12, 13, 22, 23), with controls and side effects the paper does not report.

Pipeline (notebook 07); steps 1-2 are :mod:`arithlib.yu.bias_professions`, step 3 is
:mod:`arithlib.yu.bias_cna`, steps 4-5 and the edit's controls are here:

1. **Professions from the model** (App. D, Table 23). The 8 Table-22 prompts with
   "man" and "woman"; each prompt's top-100 next tokens; a token is a *profession
   token* when a profession of the lexicon ``data/professions.json`` starts with it
   (:func:`profession_tokens`). A profession token is biased towards a gender when
   it is in that gender's top-100 and not the other's on more prompts than the
   reverse (:func:`biased_professions`).
2. **Scoring rule.** A profession is scored by log p of the FIRST token of
   ``" " + profession`` at the prompt's last position (the paper compares top-100 token
   predictions; its Table 23 lists single words such as "reception" beside multi-word
   professions such as "domestic helper" and "machine operator", and does not say how
   those were scored); professions sharing a first token are one profession token.
3. **CNA between genders** (Sec. 4.1 importance, Sec. 6.2): for each biased
   profession token w on the first prompt, run a = the prompt with w's gender,
   run b = with the other gender, target w; neurons ranked by
   imp_a - imp_b (:func:`gender_cna` on :func:`arithlib.yu.cna.cna_compare`). The edit
   set is the top-K neurons of the mean change over professions
   (:func:`bias_neurons`).
4. **Bias metric** (Table 13): mean over professions and prompts of
   |log p(prof | woman) - log p(prof | man)|, overall and per bias gender
   (:func:`bias_scores`, :func:`bias_summary`), before and after zeroing the
   neurons at every position (= setting their parameters to zero), against as
   many layer-matched random neurons (:func:`arithlib.yu.bias_cna.random_neuron_sets`).
5. **Side effects** (:func:`side_effects`): LM loss on fixed neutral text,
   arithmetic accuracy, profession probability on gender-free prompts.

TransformerLens gives hooks; :mod:`arithlib.yu.cna` the importance. What is here is
the gender-specific glue: the bias metric, the edit conditions and their controls, the
held-out split and the side effects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.components import Hook, Neuron
from ..core.prompt_sets import PromptSet
from ..core.stats import bootstrap_ci, crossed_bootstrap_ci
from ..methods import general_ability as GA
from ..methods.ablation import is_position_invariant, zero_neurons_hooks
from ..methods.answer_runs import correct_mask
from .bias_professions import GENDERS, gender_logprobs_many, next_token_logprobs, table22_prompts

#: The gender-free filler for Table 22's <gend> in the side-effect prompts.
NEUTRAL_WORD = "person"


# --------------------------------------------------------------------------- bias metric (Table 13)


def bias_scores(
    logprobs: Mapping[str, torch.Tensor], biased: pd.DataFrame, genders: Sequence[str] = GENDERS
) -> pd.DataFrame:
    """Per prompt and biased profession token: log p under each gender, ``diff`` =
    log p(w | woman) - log p(w | man), ``abs_diff`` and ``toward`` = the difference
    in the direction of the token's bias gender (positive: still biased that way)."""
    g1, g2 = genders
    rows = []
    for p in range(logprobs[g1].shape[0]):
        for r in biased.itertuples():
            a, b = float(logprobs[g1][p, r.token_id]), float(logprobs[g2][p, r.token_id])
            d = a - b
            rows.append(
                {
                    "prompt_id": p,
                    "token_id": r.token_id,
                    "token": r.token,
                    "bias_gender": r.bias_gender,
                    f"logprob_{g1}": a,
                    f"logprob_{g2}": b,
                    "diff": d,
                    "abs_diff": abs(d),
                    "toward": d if r.bias_gender == g1 else -d,
                }
            )
    return pd.DataFrame(
        rows,
        columns=[
            "prompt_id",
            "token_id",
            "token",
            "bias_gender",
            f"logprob_{g1}",
            f"logprob_{g2}",
            "diff",
            "abs_diff",
            "toward",
        ],
    )


def bias_summary(scores: pd.DataFrame, genders: Sequence[str] = GENDERS) -> dict[str, float]:
    """Table 13's numbers: mean |log p(prof | g1) - log p(prof | g2)| over all
    (prompt, profession) pairs (``total``) and over each bias gender's professions
    (``<gender>``), plus the signed mean towards the stereotype (``toward``) and n."""
    out = {
        "total": float(scores.abs_diff.mean()) if len(scores) else float("nan"),
        "toward": float(scores.toward.mean()) if len(scores) else float("nan"),
        "n": int(len(scores)),
    }
    for g in genders:
        sub = scores[scores.bias_gender == g]
        out[g] = float(sub.abs_diff.mean()) if len(sub) else float("nan")
    return out


# --------------------------------------------------------------------------- edit and controls


def edit_conditions(
    neurons_by_k: Mapping[int, Sequence[Neuron]],
    random_by_k: Mapping[int, Mapping[int, Sequence[Neuron]]],
    kind: str = "cna",
) -> dict[tuple[str, int, int], list[Hook]]:
    """Hooks per condition ``(kind, K, seed)``: ("original", 0, -1) no edit; (``kind``, K, -1)
    zero the top-K CNA neurons; (:func:`control_kind` of ``kind``, K, seed) zero the seed's
    random set. Zeroing is at every position, which equals setting the neurons' parameters
    to zero. ``kind``: "cna", or a variant such as "cna_late" (the edit set without the
    early layers) whose controls are "random_late"."""
    conds: dict[tuple[str, int, int], list[Hook]] = {("original", 0, -1): []}
    ctrl = control_kind(kind)
    for k, ns in neurons_by_k.items():
        conds[(kind, k, -1)] = zero_neurons_hooks(ns, position=None)
        for seed, rs in random_by_k.get(k, {}).items():
            conds[(ctrl, k, seed)] = zero_neurons_hooks(rs, position=None)
    return conds


def bias_under_conditions(
    model,
    tokenizer,
    biased: pd.DataFrame,
    conditions: Mapping[tuple[str, int, int], list[Hook]],
    genders: Sequence[str] = GENDERS,
    progress: bool = True,
) -> pd.DataFrame:
    """:func:`bias_scores` on all 8 prompts under each condition (the conditions sharing
    forward passes); rows as bias_scores plus kind, K, seed."""
    return bias_by_set(model, tokenizer, {"": biased}, conditions, genders, progress)[""]


def bias_by_set(
    model,
    tokenizer,
    sets: Mapping[str, pd.DataFrame],
    conditions: Mapping[tuple[str, int, int], list[Hook]],
    genders: Sequence[str] = GENDERS,
    progress: bool = True,
) -> dict[str, pd.DataFrame]:
    """:func:`bias_under_conditions` for several profession sets (the model's own list,
    the paper's Table 23) from the same forward passes: ``{name: scores}``."""
    frames: dict[str, list[pd.DataFrame]] = {name: [] for name in sets}
    for (kind, k, seed), lp in zip(
        conditions, gender_logprobs_many(model, tokenizer, list(conditions.values()), genders, progress)
    ):
        for name, profs in sets.items():
            frames[name].append(bias_scores(lp, profs, genders).assign(kind=kind, K=k, seed=seed))
    return {name: pd.concat(f, ignore_index=True) for name, f in frames.items()}


def control_kind(kind: str) -> str:
    """The random control's kind of an edit kind: "cna" -> "random", "cna_late" -> "random_late"."""
    if not kind.startswith("cna"):
        raise ValueError(f"edit kinds start with 'cna', got {kind!r}")
    return "random" + kind[3:]


def _per_profession(scores: pd.DataFrame, kind: str, k: int, seed: int | None = None) -> pd.DataFrame:
    """|bias| of one condition as a professions x prompts matrix (rows token_id, sorted)."""
    sub = scores[(scores.kind == kind) & (scores.K == k)]
    if seed is not None:
        sub = sub[sub.seed == seed]
    return sub.pivot_table(index="token_id", columns="prompt_id", values="abs_diff", aggfunc="first").sort_index()


def reduction_intervals(
    scores: pd.DataFrame, kinds: Sequence[str] = ("cna",), ks: Sequence[int] | None = None
) -> pd.DataFrame:
    """Table 13's reduction with 95 % intervals, per edit kind and size K: ``reduction_pct``
    = 100 (1 - mean bias edited / mean bias original) over the professions and prompts of
    ``scores`` (:func:`bias_scores` rows with kind, K, seed); ``random_pct`` the same for
    the layer-matched random sets (:func:`control_kind`), mean over seeds; ``diff_pts`` =
    reduction minus random. Intervals: a bootstrap over professions (each with all its
    prompts; stratified by bias gender where the column exists) crossed with the random
    seeds (:func:`arithlib.core.stats.crossed_bootstrap_ci`). Rows without random seeds get NaN
    intervals for the control and the difference."""
    orig = _per_profession(scores, "original", 0)
    if orig.empty:
        raise ValueError("no original-model rows in the scores")
    gender = (
        scores.drop_duplicates("token_id").set_index("token_id").bias_gender.reindex(orig.index).to_numpy()
        if "bias_gender" in scores
        else None
    )
    o = orig.to_numpy(float)

    def red(a: np.ndarray, b: np.ndarray) -> float:
        return float(100 * (1 - b.mean() / a.mean()))

    def red_rand(a: np.ndarray, x: np.ndarray) -> float:  # mean over the seeds (last axis) of x
        return float(np.mean(100 * (1 - x.reshape(-1, x.shape[-1]).mean(0) / a.mean())))

    rows = []
    for kind in kinds:
        for k in sorted(scores.loc[scores.kind == kind, "K"].unique()) if ks is None else ks:
            edited = _per_profession(scores, kind, int(k)).reindex(index=orig.index, columns=orig.columns)
            if edited.isna().all().all():
                continue
            e = edited.to_numpy(float)
            rk = scores[(scores.kind == control_kind(kind)) & (scores.K == k)]
            seeds = sorted(rk.seed.unique())
            ci = bootstrap_ci(red, o, e, groups=gender)
            row = {
                "kind": kind,
                "K": int(k),
                "n_professions": len(o),
                "n_prompts": o.shape[1],
                "n_seeds": len(seeds),
                "reduction_pct": ci.estimate,
                "reduction_low": ci.low,
                "reduction_high": ci.high,
            }
            nan = float("nan")
            if seeds:
                x = np.stack(
                    [
                        _per_profession(scores, control_kind(kind), int(k), s)
                        .reindex(index=orig.index, columns=orig.columns)
                        .to_numpy(float)
                        for s in seeds
                    ],
                    -1,
                )
                rc = crossed_bootstrap_ci(red_rand, o, replicates=x, groups=gender)
                dc = crossed_bootstrap_ci(
                    lambda a, b, xx: red(a, b) - red_rand(a, xx), o, e, replicates=x, groups=gender
                )
                row.update(
                    random_pct=rc.estimate,
                    random_low=rc.low,
                    random_high=rc.high,
                    diff_pts=dc.estimate,
                    diff_low=dc.low,
                    diff_high=dc.high,
                )
            else:
                row.update(random_pct=nan, random_low=nan, random_high=nan, diff_pts=nan, diff_low=nan, diff_high=nan)
            rows.append(row)
    return pd.DataFrame(rows)


def summarize_conditions(
    scores: pd.DataFrame,
    prompt_ids: Sequence[int] | None = None,
    token_ids: Sequence[int] | None = None,
    genders: Sequence[str] = GENDERS,
) -> pd.DataFrame:
    """Table 13 per condition (kind, K, seed), restricted to ``prompt_ids`` / ``token_ids``
    when given: total and per-gender bias, signed bias, n, and the reduction (%) of the
    total relative to the original model on the same subset."""
    sub = scores
    if prompt_ids is not None:
        sub = sub[sub.prompt_id.isin(list(prompt_ids))]
    if token_ids is not None:
        sub = sub[sub.token_id.isin(list(token_ids))]
    rows = []
    for (kind, k, seed), g in sub.groupby(["kind", "K", "seed"], sort=False):
        rows.append({"kind": kind, "K": k, "seed": seed, **bias_summary(g, genders)})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    base = out.loc[out.kind == "original", "total"]
    base = float(base.iloc[0]) if len(base) else float("nan")
    out["reduction_pct"] = 100 * (base - out.total) / base if base else float("nan")
    return out


def table13(summary: pd.DataFrame, k: int, genders: Sequence[str] = GENDERS) -> pd.DataFrame:
    """Table 13 layout for edit size ``k``: original, CNA-edited, random control (mean and
    standard deviation over seeds) with total and per-gender bias and the reduction (%)."""
    cols = ["total", *genders, "toward", "reduction_pct"]
    rows = []
    orig = summary[summary.kind == "original"]
    if len(orig):
        rows.append({"model": "original", "K": 0, **{c: float(orig[c].iloc[0]) for c in cols}})
    cna = summary[(summary.kind == "cna") & (summary.K == k)]
    if len(cna):
        rows.append({"model": f"CNA top-{k} zeroed", "K": k, **{c: float(cna[c].iloc[0]) for c in cols}})
    rnd = summary[(summary.kind == "random") & (summary.K == k)]
    if len(rnd):
        rows.append(
            {
                "model": f"random {k} zeroed (mean of {len(rnd)} seeds)",
                "K": k,
                **{c: float(rnd[c].mean()) for c in cols},
                **{
                    f"{c}_sd": float(rnd[c].std(ddof=1)) if len(rnd) > 1 else float("nan")
                    for c in ("total", "reduction_pct")
                },
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- held-out split


def split_professions(biased: pd.DataFrame, seed: int, frac: float = 0.5) -> tuple[list[int], list[int]]:
    """Row indices of ``biased`` split into (selection, held-out), stratified by bias
    gender: a ``frac`` share of each gender's professions (at least one, and at least
    one left out when the gender has two or more) chosen with ``seed``."""
    rng = np.random.default_rng(seed)
    sel, held = [], []
    for g in sorted(biased.bias_gender.unique()):
        idx = np.flatnonzero(biased.bias_gender.values == g)
        idx = rng.permutation(idx)
        n = int(round(frac * len(idx)))
        n = min(max(n, 1), len(idx) - 1) if len(idx) > 1 else len(idx)
        sel += idx[:n].tolist()
        held += idx[n:].tolist()
    return sorted(sel), sorted(held)


# --------------------------------------------------------------------------- side effects


def profession_mass(logprobs: torch.Tensor, token_ids: Sequence[int]) -> dict[str, float]:
    """On gender-free prompts ([n, vocab] log-probs): total probability of the profession
    tokens (mean over prompts) and their mean log-probability."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    if len(ids) == 0:
        return {"profession_mass": float("nan"), "profession_mean_logprob": float("nan")}
    lp = logprobs[:, ids]
    return {"profession_mass": float(lp.exp().sum(-1).mean()), "profession_mean_logprob": float(lp.mean())}


def arithmetic_accuracy(model, prompts: PromptSet, hooks: Sequence[Hook] | None = None) -> float:
    """Exact-answer accuracy (teacher forcing, :func:`arithlib.methods.answer_runs.correct_mask`, "full")
    of ``prompts`` with ``hooks`` active; NaN for an empty set. ``correct_mask`` runs
    each batch's shared prefix once, so only hooks that act on every position alike
    (:func:`arithlib.methods.ablation.is_position_invariant`) give the full forward's verdict:
    any other hook is refused."""
    odd = [name for name, fn in (hooks or []) if not is_position_invariant(fn)]
    if odd:
        raise ValueError(
            f"arithmetic_accuracy shares each prompt's prefix, so its hooks must act on every position "
            f"alike (zero/keep units with position=None); these do not: {odd[:3]}"
        )
    if len(prompts) == 0:
        return float("nan")
    with model.hooks(fwd_hooks=list(hooks or [])):
        return float(correct_mask(model, prompts, "full").float().mean())


def side_effects(
    model,
    tokenizer,
    conditions: Mapping[tuple[str, int, int], list[Hook]],
    *,
    prose: str,
    arith: PromptSet | None,
    profession_ids: Sequence[int],
    chunk_tokens: int = 128,
    max_chunks: int = 2,
    progress: bool = True,
) -> pd.DataFrame:
    """Side effects of each condition (hooks active): LM loss (nats/token) on the fixed
    English text ``prose`` (:func:`arithlib.methods.general_ability.lm_loss`, the first
    ``max_chunks`` chunks of ``chunk_tokens`` tokens), exact-answer arithmetic accuracy
    on ``arith``, and the profession tokens' total probability and mean log-probability
    on the gender-free Table-22 prompts ("A person works as a", ...). Rows: kind, K,
    seed, the measures and their change from the original model."""
    neutral = table22_prompts(NEUTRAL_WORD)
    rows = []
    for (kind, k, seed), hooks in tqdm(conditions.items(), desc="side effects", disable=not progress, leave=False):
        with model.hooks(fwd_hooks=list(hooks)):
            lm = GA.lm_loss(model, tokenizer, prose, chunk_tokens=chunk_tokens, max_chunks=max_chunks)
        acc = arithmetic_accuracy(model, arith, hooks) if arith is not None else float("nan")
        mass = profession_mass(next_token_logprobs(model, tokenizer, neutral, hooks), profession_ids)
        rows.append(
            {
                "kind": kind,
                "K": k,
                "seed": seed,
                "lm_loss": lm["lm_loss"],
                "lm_tokens": lm["n_tokens"],
                "unk_share": lm["unk_share"],
                "arith_accuracy": acc,
                "n_arith": len(arith) if arith is not None else 0,
                **mass,
            }
        )
    out = pd.DataFrame(rows)
    base = out[out.kind == "original"]
    if len(base):
        b = base.iloc[0]
        out["lm_loss_change"] = out.lm_loss - b.lm_loss
        out["arith_accuracy_change"] = out.arith_accuracy - b.arith_accuracy
        out["profession_mass_ratio"] = out.profession_mass / b.profession_mass if b.profession_mass else float("nan")
    return out
