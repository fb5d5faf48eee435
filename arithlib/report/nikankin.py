"""Nikankin et al. 2025's findings: circuit faithfulness, heuristic and prompt ablations;
each function reads a figures folder and returns an Outcome. Both ablations read only the
heuristic labels that beat a shuffled-operand null (:mod:`arithlib.nikankin.heuristic_nulls`); the
prompt knockout's control is disjoint from the tested neurons and matched to them layer by
layer (:mod:`arithlib.nikankin.prompt_knockout`); an operator whose faithfulness has a denominator
not above zero is excluded with its reason (:mod:`arithlib.nikankin.faithfulness_checks`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.papers import (
    CLEAR_GAP,
    FAITHFULNESS_TARGET,
    HALF,
    NIKANKIN_FAITHFULNESS,
    NIKANKIN_KNOCKOUT_CAP_SHARE,
    NOISE_GAP,
)
from ..core.stats import bootstrap_ci, interval_verdict
from .rules import Outcome, _pct
from .tables import NotApplicable, NotRun, Tables

RERUN_03 = "rerun notebook 03"


def _faith_by_share(t: Tables) -> pd.Series:
    """Mean over operators of the neuron-only faithfulness curve (notebook 03, on the
    selection prompts): a descriptive metric, not the verdict's."""
    curve = t.csv("03_faithfulness_curve")
    by = curve.groupby("share_per_layer")["faithfulness"].mean().sort_index()
    if by.empty:
        raise NotRun("empty faithfulness curve")
    return by


def _op_codes(ops: pd.Series | pd.Index) -> np.ndarray:
    return pd.factorize(pd.Series(np.asarray(ops, dtype=str)))[0]


def _population(t: Tables) -> int | None:
    """Held-out prompts that could be drawn at all: per operator, the correctly answered
    grid prompts not used for selection (03_grid_accuracy), summed; None when a grid is a
    subsample (more prompts exist) or the table is missing."""
    if not t.has("03_grid_accuracy"):
        return None
    if t.has("03_grids"):
        grids = t.csv("03_grids")
        if "subsampled" in grids and grids["subsampled"].astype(bool).any():
            return None
    acc = t.csv("03_grid_accuracy")
    need = {"n_grid", "accuracy_full_answer", "n_analysed"}
    if acc.empty or need - set(acc.columns):
        return None
    n_correct = (acc["accuracy_full_answer"].astype(float) * acc["n_grid"].astype(float)).round()
    return int((n_correct - acc["n_analysed"].astype(float)).clip(lower=0).sum())


def _labels_beat_null(t: Tables) -> str:
    """Premise of both ablations: some circuit neuron's heuristic label beats the
    shuffled-operand null (notebook 03's permutation test, Benjamini-Hochberg). Returns the
    labelled share against the null's as text; NotRun for a table without the test,
    NotApplicable when no label survives."""
    ms = t.csv("03_matched_share")
    if "labelled_share" not in ms:
        raise NotRun("03_matched_share.csv predates the test of the labels against shuffled operands: " + RERUN_03)
    n = ms["n_circuit"].astype(float)
    share = lambda c: float((ms[c].astype(float) * n).sum() / n.sum()) if n.sum() else float("nan")  # noqa: E731
    fdr = float(ms["label_fdr"].iloc[0])
    text = (
        f"labelled circuit neurons (t and BH at {_pct(fdr, 0)}) {_pct(share('labelled_share'), 0)} vs "
        f"{_pct(share('labelled_share_null'), 0)} on shuffled operands (at t alone {_pct(share('matched_share'), 0)}"
        f" vs {_pct(share('matched_share_null'), 0)})"
    )
    if int(ms["n_labelled"].sum()) == 0:
        raise NotApplicable(
            f"no circuit neuron's heuristic label beats the shuffled-operand null: 0 of {int(n.sum())} neurons; {text}"
        )
    return text


def _nikankin_faithfulness(t: Tables) -> Outcome:
    from ..nikankin.faithfulness_checks import denominators, faithfulness_of_kept_operators, kept

    fp = t.csv("03_circuit_faithfulness_prompts")
    if fp.empty:
        raise NotRun("no held-out prompts scored for the full circuit")
    meta = t.csv("03_circuit_faithfulness")
    wide = fp.pivot_table(index=["op", "prompt"], columns="circuit", values="normalized_logit")
    missing = {"circuit", "full", "ablated"} - set(wide.columns)
    if missing:
        raise NotRun(f"03_circuit_faithfulness_prompts.csv.gz lacks the conditions {sorted(missing)}")
    dens = denominators(wide)
    out = dens[dens["excluded"]]
    excluded = "; ".join(f"{r.op} excluded: {r.reason}" for r in out.itertuples())
    wide = kept(wide, dens)
    if wide.empty:
        raise NotApplicable(f"no operator has a faithfulness: {excluded}")
    op = _op_codes(wide.index.get_level_values("op"))
    ci = bootstrap_ci(
        faithfulness_of_kept_operators,
        wide["circuit"].to_numpy(),
        wide["full"].to_numpy(),
        wide["ablated"].to_numpy(),
        op,
        groups=op,
    )
    pooled = meta[meta["op"].astype(str) == "all"].iloc[0] if (meta["op"].astype(str) == "all").any() else meta.iloc[0]
    share, n_heads = float(pooled["share_per_layer"]), float(pooled["n_heads"])
    n_ops = wide.index.get_level_values("op").nunique()
    metrics = {
        "held-out faithfulness of the full circuit (mean over operators)": ci.estimate,
        "neurons kept per layer (share)": share,
        "heads in the circuit": n_heads,
        "operators excluded (F's denominator not above 0)": float(len(out)),
    }
    try:
        by = _faith_by_share(t)
        reach = by[by >= FAITHFULNESS_TARGET]
        metrics["smallest share per layer reaching 0.9"] = float(reach.index.min()) if len(reach) else float("nan")
    except NotRun:
        pass
    return Outcome(
        f"held-out faithfulness {ci.text()} ({ci.n} prompts, {n_ops} operators) of the full "
        f"circuit: {int(n_heads)} head-positions and {_pct(share, 2)} of the neurons of each analysed MLP at "
        "'='; every other head and neuron mean-ablated at op1, operator, op2 and '=' (chosen on other "
        "prompts)" + (f"; {excluded}" if excluded else ""),
        interval_verdict(ci, FAITHFULNESS_TARGET, HALF * NIKANKIN_FAITHFULNESS),
        metrics,
        ci,
        thresholds=(FAITHFULNESS_TARGET, HALF * NIKANKIN_FAITHFULNESS),
        population=_population(t),
    )


def _heuristic_gap(correct: np.ndarray, assoc: np.ndarray) -> float:
    """Mean over heuristics (columns) of accuracy on the other prompts minus accuracy on
    the associated prompts (rows; NaN: the prompt is not in that heuristic's operator);
    a heuristic without prompts on one side in a resample is left out."""
    a, o = assoc == 1, assoc == 0
    na, no = a.sum(0), o.sum(0)
    ok = (na > 0) & (no > 0)
    if not ok.any():
        return float("nan")
    c = np.nan_to_num(correct)
    return float(np.mean((c * o).sum(0)[ok] / no[ok] - (c * a).sum(0)[ok] / na[ok]))


def _nikankin_heuristic_ablation(t: Tables) -> Outcome:
    labels = _labels_beat_null(t)
    rows = t.csv("03_heuristic_ablation_prompts")
    if rows.empty:
        raise NotRun("no heuristic had neurons and enough associated prompts to ablate")
    key = ["op", "prompt"]
    col = rows["op"].astype(str) + " " + rows["heuristic"].astype(str)
    rows = rows.assign(col=col, correct=rows["correct"].astype(float), associated=rows["associated"].astype(float))
    correct = rows.pivot_table(index=key, columns="col", values="correct")
    assoc = rows.pivot_table(index=key, columns="col", values="associated").reindex_like(correct)
    op = _op_codes(correct.index.get_level_values("op"))
    ci = bootstrap_ci(_heuristic_gap, correct.to_numpy(), assoc.to_numpy(), groups=op)
    n_h = correct.shape[1]
    acc_a = float(rows.loc[rows.associated == 1, "correct"].mean())
    acc_o = float(rows.loc[rows.associated == 0, "correct"].mean())
    return Outcome(
        f"{n_h} heuristics, {ci.n} held-out prompts: other minus associated accuracy {ci.text()} "
        f"(associated {_pct(acc_a, 0)}, others {_pct(acc_o, 0)}; every rule a neuron matches at t and beats "
        f"the null; {labels})",
        interval_verdict(ci, CLEAR_GAP, NOISE_GAP),
        {"other minus associated accuracy": ci.estimate, "heuristics ablated": float(n_h)},
        ci,
        thresholds=(CLEAR_GAP, NOISE_GAP),
        population=_population(t),
    )


def _nikankin_prompt_ablation(t: Tables) -> Outcome:
    from ..nikankin.prompt_knockout import verdict_cap

    pa = t.csv("03_prompt_ablation")
    if not {"cap", "testable", "k_per_layer"} <= set(pa.columns):
        raise NotRun(
            "03_prompt_ablation.csv predates the per-layer capped knockout with a disjoint, layer-matched "
            "control: " + RERUN_03
        )
    labels = _labels_beat_null(t)
    if pa.empty:
        raise NotRun("no held-out prompts")
    pa = pa[[int(c) == verdict_cap(int(k), NIKANKIN_KNOCKOUT_CAP_SHARE) for c, k in zip(pa["cap"], pa["k_per_layer"])]]
    if pa.empty:
        raise NotRun("03_prompt_ablation.csv lacks the cap the rule reads: " + RERUN_03)
    cap = int(pa["cap"].iloc[0])
    ok = pa["testable"].astype(bool)
    untested = int((~ok).sum())
    pa = pa[ok]
    if pa.empty:
        raise NotApplicable(
            f"no held-out prompt has a disjoint, layer-matched control of its size at {cap} neurons per "
            f"layer ({untested} prompts not testable)"
        )
    if not (pa["n_ablated"].astype(float) > 0).any():
        raise NotApplicable(f"no held-out prompt has an associated labelled neuron to knock out ({labels})")
    h = pa["correct_heuristic_ablated"].astype(float).to_numpy()
    r = pa["correct_random_ablated"].astype(float).to_numpy()
    ci = bootstrap_ci(lambda h_, r_: float(np.mean(r_ - h_)), h, r, groups=_op_codes(pa["op"]))
    return Outcome(
        f"{len(pa)} held-out prompts ({untested} not testable), at most {cap} neurons per layer zeroed "
        f"(mean {pa['n_ablated'].mean():.1f} in all): accuracy with their heuristic neurons zeroed "
        f"{_pct(h.mean(), 0)} vs as many random circuit neurons of the same layers, disjoint from them, "
        f"{_pct(r.mean(), 0)}; random minus heuristic {ci.text()}; {labels}",
        interval_verdict(ci, CLEAR_GAP, NOISE_GAP),
        {
            "random minus heuristic-ablated accuracy": ci.estimate,
            "prompts not testable": float(untested),
            "neurons zeroed per layer (cap)": float(cap),
        },
        ci,
        thresholds=(CLEAR_GAP, NOISE_GAP),
        population=_population(t),
    )
