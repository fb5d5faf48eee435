"""Yu & Ananiadou 2024's findings on the heads and neurons that carry arithmetic (Sec. 3-4):
the single head whose ablation breaks an operation, the key head's mask / keep of the
neurons CNA finds, and the shallow neurons it reads; each function reads a figures folder
and returns an Outcome. The findings on changing the model (LoRA, pruning, the gender-bias
edit) are in :mod:`arithlib.report.yu_edits`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd

from ..core import papers
from ..core.papers import HALF, NOISE_GAP, YU_GROUPS
from ..core.stats import (
    Interval,
    bootstrap_ci,
    crossed_bootstrap_ci,
    decode_correct,
    interval_verdict,
)
from ..yu.head_specificity import own_drop, specific_chain_group, specificity_statistic
from .rules import (
    Outcome,
    _ci_text,
    _correct_matrix,
    _decrease_ci,
    _grade,
    _judged,
    _pct,
    _possible,
)
from .tables import NotApplicable, NotRun, Tables

_YU_04_STALE = (
    "{name}.csv predates the current notebook-04 method (key head from notebook 01's exact sweep, 'keep' on the layers CNA "
    "scored, shallow neurons through every attention layer that reads them, random controls over seeds "
    "with per-case correctness): rerun notebook 04"
)


def _yu_op(op: str) -> str:
    return {"add": "+", "sub": "-", "mul": "*", "div": "/"}.get(str(op), str(op))


def _head_pattern(
    t: Tables,
    layer: int,
    head: int,
    own: Sequence[str],
    rows_table: str = "01_yu_head_sweep_rows",
    facts_table: str = "01_yu_specificity",
) -> tuple[set[bool], str, dict[str, float]]:
    """Whether head (``layer``, ``head``) is arithmetic-operator-specific, as Yu's heads are
    (Table 1: 17^22 lowers 2D* by 10.8 % against 39.5 % on its own 2D+ and 2D-; no other
    task is reported, the factual-recall control is ours):

    * **operator-specific**: its relative 1D decrease on * is at most half its mean relative
      decrease on its own operators ``own``: the statistic own - 2 x (*) >= 0, with a
      bootstrap over the 1D prompts stratified by operator (``rows_table``; the statistic is
      :func:`arithlib.yu.head_specificity.specificity_statistic`). A
      head the sweep did not measure on * (not among the screen's top heads there) is
      taken as specific, and the text says so;
    * **leaves factual recall intact**: its factual-recall accuracy drop (``facts_table``,
      paired bootstrap over the facts) lies within 5 points.

    Returns the possible truth values of "specific" (both when an interval straddles), a
    text with the numbers and intervals, and the metrics."""
    rows = t.csv(rows_table)
    rows = rows.assign(op=rows["op"].map(_yu_op))
    mine = rows[
        (rows["n_digits"] == 1) & (rows["layer"] == layer) & (rows["head"] == head) & rows["op"].isin([*own, "*"])
    ]
    ops = mine["op"].to_numpy()
    correct, clean = mine["correct"].astype(bool).to_numpy(), mine["clean_correct"].astype(bool).to_numpy()
    name, metrics = f"L{layer}H{head}", {}
    own_ci = bootstrap_ci(lambda o, c, k: own_drop(o, c, k, own), ops, correct, clean, groups=ops)
    text = f"{name} lowers its own 1D {', '.join(own)} by {_pct(own_ci.estimate, 0)}{_ci_text(own_ci.scaled(100))}"
    if (ops == "*").any():
        times = bootstrap_ci(
            lambda c, k: 1 - c.sum() / k.sum() if k.sum() else float("nan"), correct[ops == "*"], clean[ops == "*"]
        )
        spec = bootstrap_ci(lambda o, c, k: specificity_statistic(o, c, k, own), ops, correct, clean, groups=ops)
        operator = _possible(spec, 0.0)  # * decrease at most half the own decrease
        metrics["relative 1D * decrease from the head"] = times.estimate
        text += (
            f" and 1D * by {_pct(times.estimate, 0)}{_ci_text(times.scaled(100))} (specific if at most half "
            f"of its own: own - 2 x (*) = {_pct(spec.estimate, 0)}{_ci_text(spec.scaled(100))})"
        )
    else:
        operator = {True}
        text += " (not measured on *: not among the sweep's top heads for *, taken as specific)"
    intact: set[bool] = {True}
    if t.has(facts_table):
        sp = t.csv(facts_table)
        sp = sp[(sp["layer"] == layer) & (sp["head"] == head)].drop_duplicates("prompt")
        if len(sp):
            fact = bootstrap_ci(
                lambda c, k: float(k.mean() - c.mean()),
                sp["correct"].astype(float).to_numpy(),
                sp["clean_correct"].astype(float).to_numpy(),
            )
            intact = _possible(fact, NOISE_GAP, higher=False)
            metrics["factual-recall accuracy drop from the head"] = fact.estimate
            text += (
                f"; factual recall {_pct(float(sp['clean_correct'].mean()), 0)} -> "
                f"{_pct(float(sp['correct'].mean()), 0)} (drop {_pct(fact.estimate, 0)}"
                f"{_ci_text(fact.scaled(100))}; intact if within 5 points)"
            )
    else:  # a sweep from before the control: judged on * alone, and said
        intact = {True}
        text += f"; no factual-recall control ({facts_table}.csv missing)"
    return {a and b for a in operator for b in intact}, text, metrics


def _yu_head_premise(t: Tables, group: str) -> str:
    """The premise of the findings that build on a key head (mask / keep, shallow neurons):
    ``group``'s key head in 04_key_heads.csv lowers 1D accuracy and is an arithmetic head
    (:func:`_head_pattern`). Raises NotApplicable, naming the failed premise, when the head
    is a fallback (no head lowers 1D accuracy) or is clearly not specific; returns the
    pattern's text otherwise ("" without a key-head table, and for a chain group, whose head
    was chosen for passing these tests)."""
    r = _yu_key_head(t, group)
    chain = _chain_base(group) is not None
    rows_table, facts_table = (
        ("04_head_pattern_rows", "04_head_pattern_facts") if chain else ("01_yu_head_sweep_rows", "01_yu_specificity")
    )
    if r is None or not t.has(rows_table):
        return ""
    name = f"L{int(r['layer'])}H{int(r['head'])}"
    if "lowers_1d" in r and str(r["lowers_1d"]).lower() != "true":
        raise NotApplicable(
            f"premise failed: no head lowers 1D {' / '.join(YU_GROUPS[group])} accuracy in notebook "
            f"01's exact sweep (key head {name} is the fallback), so there is no arithmetic head "
            "whose neurons to analyse"
        )
    own = YU_GROUPS[_chain_base(group) or group]
    specific, text, _ = _head_pattern(t, int(r["layer"]), int(r["head"]), own, rows_table, facts_table)
    if specific == {False}:
        raise NotApplicable(f"premise failed: key head {name} is not an arithmetic-specific head ({text})")
    # a chain group's head was chosen for passing these tests (04_head_patterns): not repeated
    return "" if chain else f"premise: {text}; "


def _chain_base(group: str) -> str | None:
    """The operator group whose best specific head a chain group ("+- specific") runs on, or
    None for a key-head group."""
    return next((g for g in YU_GROUPS if specific_chain_group(g) == group), None)


def _specific_chain(compute: Callable[[Tables, str], Outcome], t: Tables, group: str) -> str:
    """What the same rule finds on ``group``'s best arithmetic-specific head (notebook 04's
    chain group, :mod:`arithlib.yu.head_specificity`), as a sentence to append to the key head's
    result; "" when notebook 04 measured no head patterns or the key head is itself the best
    specific head. Shown beside the key head's verdict, never in its place: the verdict
    follows Yu's procedure, whose head is the key head."""
    if not t.has("04_specific_heads"):
        return ""
    sh = t.csv("04_specific_heads")
    r = sh[sh["group"].astype(str) == group]
    if r.empty or str(r.iloc[0]["is_key_head"]).lower() == "true":
        return ""
    r = r.iloc[0]
    if int(r["layer"]) < 0:
        return (
            f". No head that lowers 1D {' / '.join(YU_GROUPS[group])} accuracy passes the specificity tests "
            "(04_head_patterns), so there is no arithmetic-specific head to run the chain on"
        )
    name = f"L{int(r['layer'])}H{int(r['head'])}"
    try:
        out = compute(t, specific_chain_group(group))
    except NotApplicable as err:
        return f". On the best arithmetic-specific head {name}: not applicable ({err})"
    except NotRun as err:
        return f". The chain on the best arithmetic-specific head {name} was not run ({err})"
    return (
        f". The chain on the best arithmetic-specific head {name} (shown, not judged: {r['selection']}): "
        f"{out.ours}; the same rule gives '{out.verdict}' there"
    )


def _with_specific_chain(compute: Callable[[Tables, str], Outcome], t: Tables, group: str) -> Outcome:
    """``compute`` on ``group``'s key head, with the result on its best specific head appended
    (:func:`_specific_chain`), also when the key head's premise fails."""
    try:
        out = compute(t, group)
    except NotApplicable as err:
        raise NotApplicable(f"{err}{_specific_chain(compute, t, group)}") from None
    extra = _specific_chain(compute, t, group)
    return replace(out, ours=out.ours + extra) if extra else out


def _yu_single_head(t: Tables) -> Outcome:
    if not t.has("01_yu_head_sweep_rows"):
        raise NotRun(
            "01_yu_head_sweep_rows.csv.gz missing: this run's sweep predates the exact every-position sweep "
            "(rerun notebook 01)"
        )
    sw = t.csv("01_yu_head_sweep")
    rows = t.csv("01_yu_head_sweep_rows")
    for f in (sw, rows):
        f["op"] = f["op"].map(_yu_op)
    top = sw[(sw["n_digits"] == 1) & (sw["rank"] == 1) & sw["op"].isin(["+", "-", "/"]) & (sw["baseline_accuracy"] > 0)]
    if top.empty:
        raise NotRun("no 1-digit +, -, / setting the model answers")
    # Yu's Table 2 gives relative decreases: 1D+ 88.9 -> 47.6 % is 46.5 % (Table 24)
    parts = [
        rows[(rows["n_digits"] == 1) & (rows["op"] == r.op) & (rows["layer"] == r.layer) & (rows["head"] == r.head)]
        for r in top.itertuples()
    ]
    data = pd.concat(parts, ignore_index=True)
    ops = data["op"].to_numpy()

    def stat(op, correct, clean):
        drops = [
            1 - correct[op == o].sum() / clean[op == o].sum()
            for o in dict.fromkeys(op.tolist())
            if clean[op == o].sum() > 0
        ]
        return float(np.mean(drops)) if drops else float("nan")

    ci = bootstrap_ci(
        stat, ops, data["correct"].astype(bool).to_numpy(), data["clean_correct"].astype(bool).to_numpy(), groups=ops
    )
    per_op = ", ".join(
        f"{r.op} L{int(r.layer)}H{int(r.head)} {_pct(r.relative_drop, 0)} (n = {int(r.n)})" for r in top.itertuples()
    )
    full = HALF * (papers.YU_TABLE2["+"] + papers.YU_TABLE2["-"] + papers.YU_TABLE2["/"]) / 300
    metrics = {"mean top-head relative 1D accuracy decrease (+ - /)": ci.estimate}
    specific: set[bool] = {True}
    patterns = []
    for (layer, head), own in top.groupby(["layer", "head"])["op"]:
        s, text, m = _head_pattern(t, int(layer), int(head), sorted(own))
        specific = {a and b for a in specific for b in s}
        patterns.append(text)
        metrics.update({f"{k} ({', '.join(sorted(own))})": v for k, v in m.items()})
    verdict = _judged(
        lambda big, spec, some: _grade(big and spec, some), _possible(ci, full), specific, _possible(ci, NOISE_GAP)
    )
    return Outcome(
        f"largest relative 1D accuracy decrease from one head (every position, all 1D prompts): {per_op}; "
        f"mean {ci.text()}; " + "; ".join(patterns),
        verdict,
        metrics,
        ci,
        thresholds=(full, NOISE_GAP),
        population=ci.n,
    )  # every 1D operand pair


def _yu_key_head(t: Tables, group: str) -> pd.Series | None:
    """The row of ``group``'s key head in 04_key_heads.csv (of a chain group: its base group's
    best specific head in 04_specific_heads.csv), or None without one."""
    base = _chain_base(group)
    if base is not None:
        if not t.has("04_specific_heads"):
            return None
        sh = t.csv("04_specific_heads")
        sh = sh[sh["group"].astype(str) == base]
        if sh.empty:
            return None
        row = sh.iloc[0].copy()
        row["lowers_1d"] = "True"  # a specific head lowers its group's 1D accuracy by construction
        return row
    if not t.has("04_key_heads"):
        return None
    kh = t.csv("04_key_heads")
    kh = kh[kh["group"].astype(str) == group] if "group" in kh else kh.iloc[:0]
    return None if kh.empty else kh.iloc[0]


def _yu_key_head_text(t: Tables, group: str) -> str:
    """ "key head L14H2 (lowers 1D accuracy)" from 04_key_heads.csv, or "" without it (and for
    a chain group, whose head the chain's sentence names)."""
    r = _yu_key_head(t, group)
    if r is None or "lowers_1d" not in r:
        return ""
    if _chain_base(group) is not None:  # named by the sentence that introduces the chain
        return ""
    lowers = str(r["lowers_1d"]).lower() == "true"
    return (
        f"key head L{int(r['layer'])}H{int(r['head'])} "
        + (
            "(lowers 1D accuracy in notebook 01's exact sweep)"
            if lowers
            else "(NO head lowers 1D accuracy in notebook 01's exact sweep: fallback head, Yu's premise does not hold)"
        )
        + "; "
    )


def _yu_mask_keep(t: Tables) -> Outcome:
    return _with_specific_chain(_yu_mask_keep_group, t, "+-")


def _yu_mask_keep_group(t: Tables, group: str) -> Outcome:
    mk = t.csv("04_mask_keep")
    mk = mk[mk["group"].astype(str) == group]
    if mk.empty:
        raise NotRun(f"no correct 1D + / - cases for group {group}")
    if not {"seed", "correct_by_prompt"} <= set(mk.columns):
        raise NotRun(_YU_04_STALE.format(name="04_mask_keep"))
    premise = _yu_head_premise(t, group)
    K = 99 if (mk["K"] == 99).any() else int(mk["K"].max())
    at = mk[mk["K"] == K]

    def exact(kind: str) -> Interval | None:
        r = at[at["intervention"] == kind]
        if r.empty:
            return None
        c = decode_correct(r.iloc[0]["correct_by_prompt"])
        if c is None:
            raise ValueError(f"04_mask_keep.csv: no per-case correctness for {kind} at K = {K}")
        return _decrease_ci(float(c.mean()), len(c), float(r.iloc[0]["base_accuracy"]))

    def control(kind: str) -> Interval | None:
        rows = at[at["intervention"] == kind]
        mat = _correct_matrix(rows)
        base = float(rows.iloc[0]["base_accuracy"]) if len(rows) else float("nan")
        if mat is None or not base > 0:
            return None
        return crossed_bootstrap_ci(lambda d: 100 * (base - d.mean()) / base, replicates=mat.astype(float))

    mask, keep, rnd, rkeep = exact("mask"), exact("keep"), control("random mask"), control("random keep")
    if mask is None or keep is None:
        raise NotRun(f"no mask / keep row at K = {K}")
    # mask > 2x the random mask (at least 1 %), judged on both intervals
    r_lo, r_hi = (max(rnd.low, 1.0), max(rnd.high, 1.0)) if rnd is not None else (1.0, 1.0)
    beats = {True} if mask.low > 2 * r_hi else {False} if mask.high <= 2 * r_lo else {True, False}
    verdict = _judged(
        lambda big, b, k: _grade(big and b and k, (big and b) or k),
        _possible(mask, 50),
        beats,
        _possible(keep, 50, higher=False),
    )
    nan = float("nan")
    txt = lambda ci: f"{ci.estimate:.1f} %{_ci_text(ci)}" if ci is not None else "n/a"  # noqa: E731
    n_seeds = int(at.loc[at["intervention"] == "random mask", "seed"].nunique())
    layers = at.loc[at["intervention"] == "keep", "keep_layers"] if "keep_layers" in at else pd.Series(dtype=str)
    span = str(layers.iloc[0]) if len(layers) else "n/a"
    span = span[:-2] if span.endswith(".0") else span  # one layer, read back as a number
    return Outcome(
        f"{premise}{_yu_key_head_text(t, group)}top-{K}: mask {txt(mask)}, keep {txt(keep)} (layers "
        f"{span}), random mask {txt(rnd)}, random keep {txt(rkeep)} "
        f"accuracy decrease ({mask.n} correct cases; exact binomial 95 % intervals, random controls over "
        f"{n_seeds} seeds by a bootstrap over cases and seeds)",
        verdict,
        {
            "mask accuracy decrease (%)": mask.estimate,
            "keep accuracy decrease (%)": keep.estimate,
            "random-mask accuracy decrease (%)": rnd.estimate if rnd is not None else nan,
            "random-keep accuracy decrease (%)": rkeep.estimate if rkeep is not None else nan,
            "K": float(K),
        },
        mask,
        thresholds=(50.0,),
        population=mask.n,
    )


def _yu_shallow_group(t: Tables, sweep: pd.DataFrame) -> tuple[str, str]:
    """The group the shallow-neuron rule reads and the text that says why: + / - (Yu's
    Table 8), or / (App. B, Table 17: the division head shares the mechanism) when the
    + / - key head sits in layer 0, so no FFN layer lies below it and notebook 04 has no
    + / - sweep."""
    groups = set(sweep["group"].astype(str)) if "group" in sweep else set()
    pm = _yu_key_head(t, "+-")
    if "+-" in groups or "/" not in groups or pm is None or int(pm["layer"]) != 0:
        return "+-", ""
    return "/", (
        f"+ / - key head L0H{int(pm['head'])} is in layer 0, so no FFN layer lies below it: "
        "judged on 1D / instead (Yu App. B, Table 17: the division head shares the mechanism); "
    )


def _yu_shallow(t: Tables) -> Outcome:
    if not t.has("04_hidden_m_sweep") and t.has("04_cases"):
        raise NotRun("notebook 04 wrote no M sweep (key head in layer 0: no shallow FFN layer below it)")
    sweep = t.csv("04_hidden_m_sweep")
    group, lead = _yu_shallow_group(t, sweep)
    # judged on / when the + / - key head sits in layer 0; + / -'s own specific head is shown too
    extra = _specific_chain(lambda tt, g: _yu_shallow_on(tt, sweep, g, ""), t, "+-") if group != "+-" else ""
    try:
        out = _with_specific_chain(lambda tt, g: _yu_shallow_on(tt, sweep, g, lead if g == group else ""), t, group)
    except NotApplicable as err:
        raise NotApplicable(f"{err}{extra}") from None
    return replace(out, ours=out.ours + extra) if extra else out


def _yu_shallow_on(t: Tables, sweep: pd.DataFrame, group: str, lead: str) -> Outcome:
    """The shallow-neuron rule on ``group``'s rows of the M sweep (``lead``: why that group)."""
    lead += _yu_head_premise(t, group)
    m = sweep[(sweep["group"].astype(str) == group) & (sweep["M"] == 2)]
    if not {"seed", "paper_n", "correct_by_prompt"} <= set(m.columns):
        raise NotRun(_YU_04_STALE.format(name="04_hidden_m_sweep"))
    hid, rnd = m[m["set"] == "hidden-interpretable"], m[m["set"] == "random"]
    if hid.empty or rnd.empty:
        raise NotRun(f"no M = 2 sweep for {group}")
    h = hid.iloc[0]
    base = float(h["base_accuracy"])
    hm, rm = _correct_matrix(hid.iloc[:1]), _correct_matrix(rnd)
    if hm is None or rm is None or len(hm) != len(rm):
        raise ValueError("04_hidden_m_sweep.csv: per-case correctness missing or of different lengths at M = 2")
    if not base > 0:
        raise NotRun("zero accuracy before the shallow ablation")
    r = float(rnd["accuracy_decrease"].mean())
    share = float(h["share_of_shallow"])
    ci = crossed_bootstrap_ci(
        lambda a, d: 100 * (d.mean() - a.mean()) / base, hm[:, 0].astype(float), replicates=rm.astype(float)
    )
    full = 100 * HALF * (papers.YU_CNA_TABLES["M2"]["+-"][1] - papers.YU_CNA_TABLES["M2"]["+-"][2]) / 100
    metrics = {
        "hidden minus random accuracy decrease (points)": ci.estimate,
        "hidden-interpretable share of shallow neurons": share,
        "hidden-interpretable accuracy decrease (%)": float(h["accuracy_decrease"]),
        "random accuracy decrease (%)": r,
    }
    paper = f"paper {int(h['paper_n']):,} = {_pct(float(h['paper_share']))}"
    return Outcome(
        f"{lead}{_yu_key_head_text(t, group)}M = 2: {int(h['n_neurons']):,} of "
        f"{int(h['n_shallow']):,} shallow neurons ({_pct(share)}; {paper}) -> "
        f"{h['accuracy_decrease']:.1f} % decrease vs random {r:.1f} % ({rnd['seed'].nunique()} seeds); "
        f"gap {ci.estimate:.1f} points{_ci_text(ci)} "
        f"(bootstrap over {ci.n} cases and the seeds)",
        interval_verdict(ci, full, 100 * NOISE_GAP),
        metrics,
        ci,
        thresholds=(full, 100 * NOISE_GAP),
        population=ci.n,
    )  # every correct 1D case
