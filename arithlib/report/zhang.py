"""Zhang et al. 2024's findings: key heads, knockout, late MLPs, the MLP answer curve,
transfer, precise SFT; each function reads a figures folder and returns an Outcome."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import papers
from ..papers import HALF, KEY_HEAD_THRESHOLD, KNOCKOUT_K, NOISE_GAP, ZHANG_PRECISE_MARGIN
from ..stats import INCONCLUSIVE, NOT_REPRODUCED, PARTLY, REPRODUCED, bootstrap_ci, interval_verdict
from .rules import (RERUN_PER_PROMPT, Outcome, _above_zero, _ci_text, _correct_matrix, _grade, _judged, _paper_depth,
                    _pct, _possible)
from .tables import NotRun, Tables


def _pooled(t: Tables, kind: str) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Per-prompt path-patching effects of one ``kind`` ("head" / "mlp"), from
    01_path_patching_per_prompt.csv: (effects [N prompts, C components], each prompt's
    operator [N] for stratified bootstraps, the components [(layer, head)], head -1 for MLPs)."""
    p01 = t.params().get("01")
    if p01 is not None and "knockout_k" not in p01:
        raise NotRun("01_path_patching_per_prompt.csv predates issue 28: its X_c prefix kept the true answers, so "
                     "the counterfactual still carried the calculation: rerun notebook 01")
    pp = t.csv("01_path_patching_per_prompt")
    rows = pp[pp["kind"] == kind]
    if rows.empty:
        raise NotRun(f"no per-prompt {kind} effects in 01_path_patching_per_prompt.csv (no correct Zhang prompts)")
    wide = rows.pivot_table(index="prompt", columns=["layer", "head"], values="effect", aggfunc="first")
    if wide.isna().any().any():
        raise ValueError(f"01_path_patching_per_prompt.csv: some {kind} effects missing (NaN)")
    ops = rows.groupby("prompt")["op"].first().loc[wide.index].astype(str).to_numpy()
    return wide.to_numpy(float), ops, [(int(l), int(h)) for l, h in wide.columns]


def _key_share(effects: np.ndarray) -> float:
    """Share of heads whose mean effect over the prompts (rows) is below -5 % (Zhang Sec. 5.1)."""
    return float((effects.mean(0) < KEY_HEAD_THRESHOLD).mean())


def _zhang_key_heads(t: Tables) -> Outcome:
    eff, ops, comps = _pooled(t, "head")
    mean = eff.mean(0)
    key = [c for c, m in zip(comps, mean) if m < KEY_HEAD_THRESHOLD]
    share = len(key) / len(comps)
    ci = bootstrap_ci(_key_share, eff, groups=ops)
    L = t.n_layers(pd.Series([c[0] for c in comps]))
    depth = float(np.mean([c[0] for c in key]) / L) if key else float("nan")
    layers = sorted({c[0] for c in key})
    if ci.high == 0:
        verdict = NOT_REPRODUCED  # no key head in at least 97.5 % of the resamples
    elif ci.low == 0:
        verdict = INCONCLUSIVE    # "some key heads" is itself undecided
    else:
        verdict = interval_verdict(ci, papers.ZHANG_KEY_HEAD_SHARE, 2 * papers.ZHANG_KEY_HEAD_SHARE, higher_is_better=False)
    return Outcome(f"{len(key)} of {len(comps)} heads = {ci.text(digits=1)} (layers {layers or 'none'}; "
                   f"{eff.shape[0]} prompts)",
                   verdict,
                   {"key-head share": share, "key heads": float(len(key)),
                    "mean key-head layer / n_layers": depth}, ci)


def _knockout_k(t: Tables) -> int:
    info = t.info()
    n = int(info.get("n_layers", 0)) * int(info.get("n_heads", 0))
    return min(KNOCKOUT_K, n // 2) if n else KNOCKOUT_K


def _zhang_knockout(t: Tables) -> Outcome:
    ko = t.csv("01_knockout_per_prompt")
    ko = ko[ko["position"].astype(str) == "query"]
    if ko.empty:
        raise NotRun("no knockout at every query position in 01_knockout_per_prompt.csv")
    wide = ko.pivot_table(index="prompt", columns="condition", values="correct", aggfunc="first").astype(float)
    rand = [c for c in wide.columns if str(c).startswith("random")]
    if "none" not in wide or "effect" not in wide or not rand:
        raise NotRun("01_knockout_per_prompt.csv lacks the none / effect / random conditions")
    k = int(ko.loc[ko["condition"] == "effect", "n_heads"].iloc[0])
    ops = ko.groupby("prompt")["op"].first().loc[wide.index].astype(str).to_numpy()
    m = np.stack([wide["none"], wide["effect"], wide[rand].mean(axis=1)], 1)  # [N, 3]: before, effect-rank, random-rank

    def gap(x: np.ndarray) -> float:
        base = x[:, 0].mean()
        return float((x[:, 2].mean() - x[:, 1].mean()) / base) if base > 0 else float("nan")

    base = float(m[:, 0].mean())
    if not base > 0:
        raise NotRun("zero accuracy before knockout")
    drop_e, drop_r = 1 - m[:, 1].mean() / base, 1 - m[:, 2].mean() / base
    ci = bootstrap_ci(gap, m, groups=ops)
    return Outcome(f"k = {k} heads mean-ablated at every query position: effect-rank {_pct(-drop_e, 0)}, random-rank "
                   f"{_pct(-drop_r, 0)} ({len(rand)} random sets; accuracy {base:.0%} before, {len(m)} prompts); "
                   f"gap {ci.text()}",
                   interval_verdict(ci, HALF * (papers.ZHANG_KNOCKOUT_DROP - papers.ZHANG_RANDOM_KNOCKOUT_WITHIN), NOISE_GAP),
                   {"effect-rank minus random-rank accuracy drop": gap(m), "effect-rank drop": drop_e,
                    "random-rank drop": drop_r, "k knocked out": float(k)}, ci)


def _late_early(effects: np.ndarray, late: np.ndarray) -> tuple[float, float]:
    """Mean |mean effect| of the early and of the late MLPs (columns) over the prompts (rows)."""
    a = np.abs(effects.mean(0))
    return float(a[~late].mean()), float(a[late].mean())


def _zhang_late_mlps(t: Tables) -> Outcome:
    eff, ops, comps = _pooled(t, "mlp")
    layers = np.array([c[0] for c in comps])
    L = t.n_layers(pd.Series(layers))
    cut = _paper_depth(papers.ZHANG_LATE_MLP_LAYER_32, L)
    late = layers >= cut
    if late.all() or not late.any():
        raise NotRun(f"no MLPs on one side of layer {cut} (17/32 of {L})")
    e, l_ = _late_early(eff, late)

    def ratio(x: np.ndarray) -> float:
        e_, l2 = _late_early(x, late)
        return l2 / e_ if e_ > 0 else float("inf")

    ci = bootstrap_ci(ratio, eff, groups=ops)
    late_ci = bootstrap_ci(lambda x: _late_early(x, late)[1], eff, groups=ops)
    verdict = interval_verdict(ci, 2.0, 1.0)
    if verdict == REPRODUCED:  # the paper's size too: late MLPs about +-10 %, half of it needed
        size = interval_verdict(late_ci, HALF * papers.ZHANG_LATE_MLP_EFFECT, HALF * papers.ZHANG_LATE_MLP_EFFECT)
        verdict = REPRODUCED if size == REPRODUCED else PARTLY if size == NOT_REPRODUCED else INCONCLUSIVE
    top = comps[int(np.argmax(np.abs(eff.mean(0))))]
    return Outcome(f"mean |effect| of MLPs 0-{cut - 1}: {_pct(e)}; of MLPs {cut}-{L - 1}: {late_ci.text(digits=1)}; "
                   f"late / early {ci.text(pct=False)} ({eff.shape[0]} prompts)",
                   verdict,
                   {"late / early MLP mean |effect|": l_ / e if e > 0 else float("inf"),
                    "late MLP mean |effect|": l_, "early MLP mean |effect|": e,
                    "strongest MLP layer / n_layers": top[0] / L}, ci)


def _answer_curve_points(curves: np.ndarray):
    """Curve points (:func:`arithlib.probing.curve_points`, layer 0 left out) of the mean
    cos(MLP_out - MLP_in, W_U[C]) curve over the prompts (rows) of ``curves`` [N, L]."""
    from ..probing import curve_points

    return curve_points(curves.mean(0), "rise")


def _zhang_mlp_answer(t: Tables) -> Outcome:
    cur = t.csv("02_mlp_cosines_per_prompt")
    cur = cur[cur["measure"] == "delta_C"]
    if cur.empty:
        raise NotRun("no delta_C curve (no correct prompts)")
    wide = cur.pivot_table(index="prompt", columns="layer", values="value", aggfunc="first").sort_index(axis=1)
    ops = cur.groupby("prompt")["op"].first().loc[wide.index].astype(str).to_numpy()
    curves = wide.to_numpy(float)
    L = t.n_layers(pd.Series(wide.columns))
    if L < 3:
        raise NotRun(f"{L} layers: no answer curve after layer 0 (the rule leaves layer 0 out)")
    pts = _answer_curve_points(curves)

    def onset(x: np.ndarray) -> float:
        return _answer_curve_points(x).start / L

    ci = bootstrap_ci(onset, curves, groups=ops)
    rises = pts.rise > 0 and pts.peak > pts.start  # a curve whose maximum is its first searched layer has no climb
    verdict = interval_verdict(ci, papers.ZHANG_MLP_CURVE_CLIMB_32 / 32, papers.ZHANG_MLP_CURVE_START_32 / 32) if rises else NOT_REPRODUCED
    return Outcome(f"cos(MLP_out - MLP_in, W_U[C]) (layer 0 left out): climb begins at layer {pts.start} "
                   f"(depth {ci.text(pct=False)}; paper 18/32 = 0.56), steepest step {pts.inflection}, "
                   f"peak {pts.peak} of {L} layers ({curves.shape[0]} prompts)"
                   + ("" if rises else "; the curve does not climb (maximum at its first searched layer)"),
                   verdict,
                   {"answer-writing inflection layer / n_layers": pts.start / L,
                    "answer-writing start layer / n_layers": pts.start / L,
                    "answer-writing steepest layer / n_layers": pts.inflection / L,
                    "answer-writing peak layer / n_layers": pts.peak / L}, ci)


def _transfer_gap(x: np.ndarray, fmt: np.ndarray) -> float:
    """Mean over formats (answered before) of (random-heads accuracy - knockout accuracy)
    / accuracy before, i.e. relative drop after the knockout minus that after random heads;
    ``x`` [N, 3] = correct before, after the knockout, mean over the random sets."""
    gaps = []
    for f in np.unique(fmt):
        m = x[fmt == f]
        before = m[:, 0].mean()
        if before > 0:
            gaps.append((m[:, 2].mean() - m[:, 1].mean()) / before)
    return float(np.mean(gaps)) if gaps else float("nan")


def _zhang_transfer(t: Tables) -> Outcome:
    tr = t.csv("01_transfer_per_prompt")
    if tr.empty:
        raise NotRun("no transfer format could be tokenized")
    wide = tr.pivot_table(index=["format", "prompt"], columns="condition", values="correct", aggfunc="first")
    rand = [c for c in wide.columns if str(c).startswith("random")]
    if "none" not in wide or "knockout" not in wide or not rand:
        raise NotRun("01_transfer_per_prompt.csv lacks the none / knockout / random conditions")
    wide = wide.astype(float)
    fmt = wide.index.get_level_values("format").astype(str).to_numpy()
    x = np.stack([wide["none"], wide["knockout"], wide[rand].mean(axis=1)], 1)
    answered = [f for f in dict.fromkeys(fmt) if x[fmt == f, 0].mean() > 0]
    if not answered:
        raise NotRun("the model answers none of the transfer formats before knockout")
    keep = np.isin(fmt, answered)
    x, fmt = x[keep], fmt[keep]
    k = int(tr.loc[tr["condition"] == "knockout", "n_heads"].iloc[0]) if "n_heads" in tr else _knockout_k(t)
    ci = bootstrap_ci(_transfer_gap, x, fmt, groups=fmt)
    parts = []
    for f in answered:
        m = x[fmt == f]
        b = m[:, 0].mean()
        parts.append(f"{f} [{int(round(b * len(m)))}/{len(m)} correct] {_pct(m[:, 1].mean() / b - 1, 0, signed=True)} "
                     f"({_pct(m[:, 2].mean() / b - 1, 0, signed=True)})")
    drops = [1 - x[fmt == f, 1].mean() / x[fmt == f, 0].mean() for f in answered]
    drops_r = [1 - x[fmt == f, 2].mean() / x[fmt == f, 0].mean() for f in answered]
    return Outcome(f"relative accuracy change after knocking out the top-{k} heads by path-patching effect (as many "
                   f"random heads): {'; '.join(parts)}; mean gap {ci.text()}",
                   interval_verdict(ci, HALF * papers.ZHANG_TRANSFER_DROP, NOISE_GAP),
                   {"transfer: relative drop minus random-heads drop": _transfer_gap(x, fmt),
                    "mean relative accuracy drop on transfer formats": float(np.mean(drops)),
                    "mean relative drop with random heads": float(np.mean(drops_r)),
                    "formats": float(len(answered))}, ci)




def _zhang_precise_sft(t: Tables) -> Outcome:
    """Zhang Sec. 5.3, Table 1: precise SFT of the (scaled) top-32 key heads against full
    SFT on the same data (notebook 08's 08_sft_comparison, rows by ``role``). Paired
    bootstraps over the arithmetic test prompts (gains and their difference) and over the
    factual-recall prompts (general ability kept); margin ``ZHANG_PRECISE_MARGIN``."""
    tab = t.csv("08_sft_comparison")
    if "role" not in tab or "arithmetic_2d_by_prompt" not in tab or "facts_by_prompt" not in tab:
        raise NotRun(RERUN_PER_PROMPT.format(nb="08", table="08_sft_comparison"))
    roles = tab.set_index("role")
    if not {"original", "precise"} <= set(roles.index):
        raise NotRun("08_sft_comparison lacks the original or the precise-SFT row")
    if "full" not in roles.index:
        own = _correct_matrix(roles.loc[["original", "precise"]].rename(
            columns={"arithmetic_2d_by_prompt": "correct_by_prompt"}))
        gain = ""
        if own is not None:  # what did run is still shown
            ci = bootstrap_ci(lambda x: float(x[:, 1].mean() - x[:, 0].mean()), own.astype(float))
            gain = f" (precise SFT's own arithmetic gain: {_pct(ci.estimate)}{_ci_text(ci.scaled(100))}, {ci.n} test prompts)"
        raise NotRun(f"notebook 08 ran no full SFT (not enough memory): nothing to compare precise SFT with{gain}")
    rows = roles.loc[["original", "precise", "full"]]
    arith = _correct_matrix(rows.rename(columns={"arithmetic_2d_by_prompt": "correct_by_prompt"}))
    facts = _correct_matrix(rows.rename(columns={"facts_by_prompt": "correct_by_prompt"}))
    if arith is None or facts is None:
        raise NotRun(RERUN_PER_PROMPT.format(nb="08", table="08_sft_comparison"))
    a = arith.astype(float)
    f = facts.astype(float)
    gain_p = bootstrap_ci(lambda x: float(x[:, 1].mean() - x[:, 0].mean()), a)
    gain_f = bootstrap_ci(lambda x: float(x[:, 2].mean() - x[:, 0].mean()), a)
    if gain_f.high < 0:  # Zhang's full SFT is a working reference (Table 1: +2.8 to +23.2 points)
        raise NotRun(f"full SFT did not train: its arithmetic accuracy changed by {_pct(gain_f.estimate)}"
                     f"{_ci_text(gain_f.scaled(100))}, so it cannot stand in for Zhang's full-SFT reference "
                     f"(precise SFT's own gain: {_pct(gain_p.estimate)}{_ci_text(gain_p.scaled(100))}); rerun "
                     "notebook 08 with a full-SFT setting that trains")
    diff = bootstrap_ci(lambda x: float(x[:, 1].mean() - x[:, 2].mean()), a)
    kept = bootstrap_ci(lambda x: float(x[:, 1].mean() - x[:, 2].mean()), f)  # precise minus full, facts
    m = ZHANG_PRECISE_MARGIN
    precise = str(rows.loc["precise", "method"]) if "method" in rows else "precise SFT"
    lm = (f"; LM loss change precise {float(rows.loc['precise', 'lm_loss'] - rows.loc['original', 'lm_loss']):+.3f}, "
          f"full {float(rows.loc['full', 'lm_loss'] - rows.loc['original', 'lm_loss']):+.3f} nats/token"
          if "lm_loss" in rows else "")
    text = (f"{precise}: arithmetic gain {_pct(gain_p.estimate)}{_ci_text(gain_p.scaled(100))}, full SFT "
            f"{_pct(gain_f.estimate)}{_ci_text(gain_f.scaled(100))}, precise minus full {_pct(diff.estimate)}"
            f"{_ci_text(diff.scaled(100))} ({diff.n} test prompts); factual recall precise minus full "
            f"{_pct(kept.estimate)}{_ci_text(kept.scaled(100))} ({kept.n} facts){lm}")
    metrics = {"precise SFT arithmetic gain": gain_p.estimate, "full SFT arithmetic gain": gain_f.estimate,
               "precise minus full arithmetic accuracy": diff.estimate,
               "precise minus full factual recall": kept.estimate}
    verdict = _judged(lambda up, close, general: _grade(up and close and general, up and (close or general)),
                      _above_zero(gain_p), _possible(diff, -m), _possible(kept, -m))
    return Outcome(text, verdict, metrics, diff)
