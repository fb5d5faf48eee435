"""Nikankin et al. 2025's findings: circuit faithfulness, heuristic and prompt ablations;
each function reads a figures folder and returns an Outcome."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..papers import CLEAR_GAP, FAITHFULNESS_TARGET, HALF, NIKANKIN_FAITHFULNESS, NOISE_GAP
from ..stats import bootstrap_ci, interval_verdict
from .rules import Outcome, _pct
from .tables import NotRun, Tables


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


def _nikankin_faithfulness(t: Tables) -> Outcome:
    fp = t.csv("03_circuit_faithfulness_prompts")
    if fp.empty:
        raise NotRun("no held-out prompts scored for the full circuit")
    meta = t.csv("03_circuit_faithfulness")
    wide = fp.pivot_table(index=["op", "prompt"], columns="circuit", values="normalized_logit")
    missing = {"circuit", "full", "ablated"} - set(wide.columns)
    if missing:
        raise NotRun(f"03_circuit_faithfulness_prompts.csv lacks the conditions {sorted(missing)}")
    op = _op_codes(wide.index.get_level_values("op"))
    from ..activation_patching import faithfulness_by_operator

    ci = bootstrap_ci(faithfulness_by_operator, wide["circuit"].to_numpy(), wide["full"].to_numpy(),
                      wide["ablated"].to_numpy(), op, groups=op)
    pooled = meta[meta["op"].astype(str) == "all"].iloc[0] if (meta["op"].astype(str) == "all").any() else meta.iloc[0]
    share, n_heads = float(pooled["share_per_layer"]), float(pooled["n_heads"])
    metrics = {"held-out faithfulness of the full circuit (mean over operators)": ci.estimate,
               "neurons kept per layer (share)": share, "heads in the circuit": n_heads}
    try:
        by = _faith_by_share(t)
        reach = by[by >= FAITHFULNESS_TARGET]
        metrics["smallest share per layer reaching 0.9"] = float(reach.index.min()) if len(reach) else float("nan")
    except NotRun:
        pass
    return Outcome(f"held-out faithfulness {ci.text()} ({ci.n} prompts, {fp.op.nunique()} operators) of the full "
                   f"circuit: {int(n_heads)} head-positions and {_pct(share, 2)} of the neurons of each analysed MLP at "
                   "'='; every other head and neuron mean-ablated at op1, operator, op2 and '=' (chosen on other "
                   "prompts)",
                   interval_verdict(ci, FAITHFULNESS_TARGET, HALF * NIKANKIN_FAITHFULNESS), metrics, ci)


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
    return Outcome(f"{n_h} heuristics, {ci.n} held-out prompts: other minus associated accuracy {ci.text()} "
                   f"(associated {_pct(acc_a, 0)}, others {_pct(acc_o, 0)}; every rule a neuron matches at t)",
                   interval_verdict(ci, CLEAR_GAP, NOISE_GAP),
                   {"other minus associated accuracy": ci.estimate, "heuristics ablated": float(n_h)}, ci)


def _nikankin_prompt_ablation(t: Tables) -> Outcome:
    p03 = t.params().get("03")
    if p03 is not None and "heldout_half_width" not in p03:
        raise NotRun("03_prompt_ablation.csv predates the held-out prompts (its neurons were chosen on the same "
                     "prompts): rerun notebook 03")
    pa = t.csv("03_prompt_ablation")
    if pa.empty:
        raise NotRun("no analysed prompts")
    h = pa["correct_heuristic_ablated"].astype(float).to_numpy()
    r = pa["correct_random_ablated"].astype(float).to_numpy()
    ci = bootstrap_ci(lambda h_, r_: float(np.mean(r_ - h_)), h, r, groups=_op_codes(pa["op"]))
    return Outcome(f"{len(pa)} held-out prompts: accuracy with their heuristic neurons ablated {_pct(h.mean(), 0)} vs "
                   f"as many random circuit neurons {_pct(r.mean(), 0)}; random minus heuristic {ci.text()}",
                   interval_verdict(ci, CLEAR_GAP, NOISE_GAP),
                   {"random minus heuristic-ablated accuracy": ci.estimate}, ci)
