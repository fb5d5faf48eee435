"""Zhang et al. 2024's findings: key heads, knockout, late MLPs, the MLP answer curve,
transfer, precise SFT; each function reads a figures folder and returns an Outcome."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..core import papers
from ..core.papers import HALF, KEY_HEAD_THRESHOLD, KNOCKOUT_K, NOISE_GAP, ZHANG_PRECISE_MARGIN
from ..core.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    PARTLY,
    REPRODUCED,
    Interval,
    bootstrap_ci,
    crossed_bootstrap_ci,
    interval_verdict,
)
from .rules import (
    RERUN_PER_PROMPT,
    Outcome,
    _above_zero,
    _ci_text,
    _correct_matrix,
    _grade,
    _judged,
    _paper_depth,
    _pct,
    _possible,
)
from .tables import NotRun, Tables


def _pooled(t: Tables, kind: str) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Per-prompt path-patching effects of one ``kind`` ("head" / "mlp"), from
    01_path_patching_per_prompt.csv.gz: (effects [N prompts, C components], each prompt's
    operator [N] for stratified bootstraps, the components [(layer, head)], head -1 for MLPs)."""
    p01 = t.params().get("01")
    if p01 is not None and "knockout_k" not in p01:
        raise NotRun(
            "01_path_patching_per_prompt.csv.gz comes from an older run: its X_c prefix kept the true answers, so "
            "the counterfactual still carried the calculation: rerun notebook 01"
        )
    pp = t.csv("01_path_patching_per_prompt")
    rows = pp[pp["kind"] == kind]
    if rows.empty:
        raise NotRun(f"no per-prompt {kind} effects in 01_path_patching_per_prompt.csv.gz (no correct Zhang prompts)")
    wide = rows.pivot_table(index="prompt", columns=["layer", "head"], values="effect", aggfunc="first")
    if wide.isna().any().any():
        raise ValueError(f"01_path_patching_per_prompt.csv.gz: some {kind} effects missing (NaN)")
    ops = rows.groupby("prompt")["op"].first().loc[wide.index].astype(str).to_numpy()
    return wide.to_numpy(float), ops, [(int(l), int(h)) for l, h in wide.columns]


def _zhang_population(ops: list[str] | None = None) -> int:
    """Zhang prompts that could ever be drawn: every operand pair 1-9 of every template
    (8 per operator) of ``ops`` (default: all four), results non-negative integers
    (:func:`arithlib.core.datasets.zhang_prompts` with no sampling). The correct ones a verdict
    reads are a subset, so a verdict called undecidable against this number is one that
    even every candidate prompt could not decide."""
    from ..core.datasets import OPS, zhang_prompts

    return len(zhang_prompts(ops=tuple(ops) if ops else OPS))


def _population_01(t: Tables) -> int:
    """:func:`_zhang_population` of notebook 01's operators (its params' ``ops``)."""
    ops = t.params().get("01", {}).get("ops")
    return _zhang_population(list(ops) if isinstance(ops, list) and ops else None)


def _key_share(effects: np.ndarray) -> float:
    """Share of heads whose mean effect over the prompts (rows) is below -5 % (Zhang Sec. 5.1)."""
    return float((effects.mean(0) < KEY_HEAD_THRESHOLD).mean())


def _top_count(n_heads: int) -> int:
    """Heads in the "top 5 %": as many as make up at most 5 % of the heads (at least one)."""
    return max(1, math.floor(papers.ZHANG_KEY_HEAD_SHARE * n_heads))


def top_share(effects: np.ndarray, top: int) -> float:
    """Share of the total |mean effect| over the heads (columns; mean over the prompts,
    rows, as Zhang Fig. 2's per-head effect) carried by the ``top`` heads of largest
    |mean effect|: 1 when they carry all of it, ``top / n_heads`` when every head carries
    as much. A scale-free measure of how sparse the heads' effect is, whatever its size."""
    a = np.abs(effects.mean(0))
    total = a.sum()
    return float(np.sort(a)[::-1][:top].sum() / total) if total > 0 else float("nan")


#: Permutations of the null of :func:`permuted_top_share`, and their seed.
N_PERMUTATIONS, PERMUTATION_SEED = 1000, 0


def permuted_top_share(
    effects: np.ndarray, top: int, n_perm: int = N_PERMUTATIONS, seed: int = PERMUTATION_SEED
) -> np.ndarray:
    """The null of :func:`top_share`: the same share after the head labels are permuted
    at random within each prompt (row), independently per prompt (seeded).

    Why this null: Zhang's claim (Sec. 5.1) is that the *same* few heads carry the effect.
    A within-prompt permutation keeps every prompt's set of effect sizes (how large they
    are, and how unevenly they fall on that prompt's heads) and destroys only which head
    carries them, so the null share is what the top heads would carry if no head were
    consistently more important than another. (A sign-flip null would test whether the
    effects have a consistent sign, not whether they are concentrated.) Returns the
    ``n_perm`` permuted shares."""
    rng = np.random.default_rng(seed)
    return np.array([top_share(rng.permuted(effects, axis=1), top) for _ in range(n_perm)])


def _concentration(eff: np.ndarray, ops: np.ndarray) -> tuple[str, dict[str, float]]:
    """Text and metrics of the top-5 % heads' share of |effect| (:func:`top_share`, its 95 %
    bootstrap interval over prompts stratified by operator) beside its permutation null
    (:func:`permuted_top_share`: mean and central 95 %)."""
    top = _top_count(eff.shape[1])
    ci = bootstrap_ci(lambda x: top_share(x, top), eff, groups=ops)
    null = permuted_top_share(eff, top)
    lo, hi = np.quantile(null, [0.025, 0.975])
    null_text = Interval(float(null.mean()), float(lo), float(hi), len(null), "permutation").text()
    text = (
        f"; shown, not judged: the top 5 % of heads ({top} of {eff.shape[1]}) carry {ci.text()} of the total "
        f"|mean effect|, against {null_text} with the head labels permuted within each prompt ({len(null):,} "
        f"permutations, central 95 %; {_pct(top / eff.shape[1], 1)} if every head carried as much)"
    )
    return text, {
        "top-5 % heads' share of |effect|": ci.estimate,
        "top-5 % heads' share of |effect|, head labels permuted": float(null.mean()),
    }


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
        verdict = INCONCLUSIVE  # "some key heads" is itself undecided
    else:
        verdict = interval_verdict(
            ci, papers.ZHANG_KEY_HEAD_SHARE, 2 * papers.ZHANG_KEY_HEAD_SHARE, higher_is_better=False
        )
    sparse, sparse_metrics = _concentration(eff, ops)
    return Outcome(
        f"{len(key)} of {len(comps)} heads = {ci.text(digits=1)} (layers {layers or 'none'}; "
        f"{eff.shape[0]} prompts){sparse}",
        verdict,
        {
            "key-head share": share,
            "key heads": float(len(key)),
            "mean key-head layer / n_layers": depth,
            **sparse_metrics,
        },
        ci,
        thresholds=(papers.ZHANG_KEY_HEAD_SHARE, 2 * papers.ZHANG_KEY_HEAD_SHARE),
        population=_population_01(t),
    )


def _knockout_k(t: Tables) -> int:
    info = t.info()
    n = int(info.get("n_layers", 0)) * int(info.get("n_heads", 0))
    return min(KNOCKOUT_K, n // 2) if n else KNOCKOUT_K


def _key_head_note(t: Tables, k: int) -> str:
    """How many of the ``k`` heads of largest path-patching effect (the knocked-out ones) are
    key heads by notebook 01's rule (:func:`arithlib.zhang.path_patching.stored_key_heads`, the
    pooled rows of 01_path_patching.csv): where no head crosses -5 % they are not key heads."""
    if not t.has("01_path_patching"):
        return ""
    from ..zhang.path_patching import stored_key_heads

    n_key = len(stored_key_heads(t.csv("01_path_patching")))
    if n_key >= k:
        return f"; all {k} are key heads (path-patching effect below -5 %)"
    if n_key == 0:
        return (
            f"; no head crosses -5 %, so these are the top-{k} heads by path-patching effect and none of them is "
            "a key head"
        )
    return f"; only {n_key} of the {k} are key heads (effect below -5 %), the other {k - n_key} are not"


#: Seed of the split of notebook 01's prompts into a half that selects the knockout's heads
#: and a half that scores the knockout (:func:`selection_half`).
SPLIT_SEED = 0


def selection_half(ops: np.ndarray, seed: int = SPLIT_SEED) -> np.ndarray:
    """Half A of prompts (rows) whose operators are ``ops``: per operator, floor(n / 2) of
    its prompts drawn at random (seeded); True marks half A (selection), False half B
    (scoring)."""
    ops = np.asarray(ops).astype(str)
    rng = np.random.default_rng(seed)
    a = np.zeros(len(ops), dtype=bool)
    for op in sorted(set(ops.tolist())):
        idx = np.flatnonzero(ops == op)
        a[rng.permutation(idx)[: len(idx) // 2]] = True
    return a


def _top_heads(effects: np.ndarray, comps: list[tuple[int, int]], k: int) -> set[tuple[int, int]]:
    """The ``k`` heads of most negative mean effect over the rows (notebook 01's effect order)."""
    return {comps[i] for i in np.argsort(effects.mean(0), kind="stable")[:k]}


def _knockout_split(t: Tables, ko: pd.DataFrame, k: int) -> tuple[np.ndarray | None, str]:
    """Which knockout prompts score the gap, and what the text says about it.

    Notebook 01 ranks the heads by path patching and knocks them out on the same prompts
    (both on its X_r). Held-out scoring: split those prompts in two (:func:`selection_half`);
    when the top-``k`` heads by mean path-patching effect over half A are the knockout's
    set (the top ``k`` over all prompts), the knockout's result on half B is a score on
    prompts its heads were not selected on, and only half B is scored (returned: its prompt
    ids). Otherwise (the sets differ, or the tables cannot be matched prompt by prompt) all
    prompts are scored (None) and the text says that heads were selected on them."""
    same = "; heads selected and scored on the same prompts"
    if not t.has("01_path_patching_per_prompt"):
        return None, f"{same} (no per-prompt path-patching table to split)"
    pp = t.csv("01_path_patching_per_prompt")
    pp = pp[pp["kind"] == "head"]
    wide = pp.pivot_table(index="prompt", columns=["layer", "head"], values="effect", aggfunc="first")
    cols = ["op", "template_id"]
    meta_pp = pp.groupby("prompt")[cols].first().astype(str)
    meta_ko = ko.groupby("prompt")[cols].first().astype(str)
    if wide.isna().any().any() or not meta_pp.index.equals(meta_ko.index) or not meta_pp.equals(meta_ko):
        return None, f"{same} (the knockout's prompts could not be matched to the path-patching prompts)"
    effects = wide.to_numpy(float)
    comps = [(int(l), int(h)) for l, h in wide.columns]
    half_a = selection_half(meta_pp["op"].to_numpy())
    chosen, used = _top_heads(effects[half_a], comps, k), _top_heads(effects, comps, k)
    if chosen == used:
        return (
            wide.index[~half_a].to_numpy(),
            f"; held out: the top-{k} heads by path-patching effect on half A of the prompts ({int(half_a.sum())}, "
            f"a seeded split stratified by operator) are the knockout's {k}, so the gap is scored on half B only",
        )
    return None, (
        f"{same}: the top-{k} on half A of the prompts (a seeded split by operator) share only "
        f"{len(chosen & used)} of the knockout's {k} heads, so no held-out half scores them"
    )


def _zhang_knockout(t: Tables) -> Outcome:
    ko = t.csv("01_knockout_per_prompt")
    ko = ko[ko["position"].astype(str) == "query"]
    if ko.empty:
        raise NotRun("no knockout at every query position in 01_knockout_per_prompt.csv.gz")
    wide = ko.pivot_table(index="prompt", columns="condition", values="correct", aggfunc="first").astype(float)
    rand = [c for c in wide.columns if str(c).startswith("random")]
    if "none" not in wide or "effect" not in wide or not rand:
        raise NotRun("01_knockout_per_prompt.csv.gz lacks the none / effect / random conditions")
    k = int(ko.loc[ko["condition"] == "effect", "n_heads"].iloc[0])
    scored, split_text = _knockout_split(t, ko, k)
    population = _population_01(t)
    if scored is not None:
        wide = wide.loc[scored]
        population //= 2  # a held-out half of every candidate prompt at most
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
    full, partial = HALF * (papers.ZHANG_KNOCKOUT_DROP - papers.ZHANG_RANDOM_KNOCKOUT_WITHIN), NOISE_GAP
    return Outcome(
        f"k = {k} heads mean-ablated at every query position: effect-rank {_pct(-drop_e, 0)}, random-rank "
        f"{_pct(-drop_r, 0)} ({len(rand)} random sets; accuracy {base:.0%} before, {len(m)} prompts); "
        f"gap {ci.text()}{split_text}{_key_head_note(t, k)}",
        interval_verdict(ci, full, partial),
        {
            "effect-rank minus random-rank accuracy drop": gap(m),
            "effect-rank drop": drop_e,
            "random-rank drop": drop_r,
            "k knocked out": float(k),
            "held-out scoring (1 = heads selected on other prompts)": float(scored is not None),
        },
        ci,
        thresholds=(partial, full),
        population=population,
    )


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
    return Outcome(
        f"mean |effect| of MLPs 0-{cut - 1}: {_pct(e)}; of MLPs {cut}-{L - 1}: {late_ci.text(digits=1)}; "
        f"late / early {ci.text(pct=False)} ({eff.shape[0]} prompts)",
        verdict,
        {
            "late / early MLP mean |effect|": l_ / e if e > 0 else float("inf"),
            "late MLP mean |effect|": l_,
            "early MLP mean |effect|": e,
            "strongest MLP layer / n_layers": top[0] / L,
        },
        ci,
        thresholds=(1.0, 2.0),
        population=_population_01(t),
    )


#: The answer curve the verdict reads, and the one kept as its sensitivity reading
#: (measures of 02_mlp_cosines_per_prompt.csv.gz, :data:`arithlib.zhang.mlp_curves.COSINE_MEASURES`).
#: Zhang Sec. 4.2 subtracts the MLP's input from its output "to isolate the specific
#: contribution of MLP", having named MLP_in what the MLP receives from the residual stream
#: and MLP_out what it adds back into it: the isolated contribution is the MLP's write,
#: resid_post - resid_mid. The literal "module output minus normalised input" is shown.
ANSWER_MEASURE, LITERAL_MEASURE = "write_C", "delta_C"
_ANSWER_LABEL = {
    ANSWER_MEASURE: "cos(MLP write = resid_post - resid_mid, W_U[C])",
    LITERAL_MEASURE: "literal cos(MLP_out - MLP_in, W_U[C]) with the normalised input",
}


def _answer_curve_points(curves: np.ndarray):
    """Curve points (:func:`arithlib.zhang.mlp_curves.curve_points`, layer 0 left out) of the mean
    answer curve over the prompts (rows) of ``curves`` [N, L]."""
    from ..zhang.mlp_curves import curve_points

    return curve_points(curves.mean(0), "rise")


def _climbs(curves: np.ndarray) -> float:
    """1.0 when the mean curve climbs to its maximum (its peak lies after the layer where
    the climb begins, :func:`arithlib.zhang.mlp_curves.curve_points`), else 0.0 (its maximum is at
    its first searched layer, or a single step)."""
    pts = _answer_curve_points(curves)
    return float(pts.rise > 0 and pts.peak > pts.start)


@dataclass(frozen=True)
class CurveReading:
    """An answer curve judged by the onset rule: its points, the onset depth's and the
    climb indicator's 95 % bootstrap intervals, the verdict and what to say about the climb."""

    points: object  # arithlib.zhang.mlp_curves.CurvePoints of the mean curve
    onset: Interval
    climb: Interval
    verdict: str
    note: str
    n_layers: int


def read_answer_curve(curves: np.ndarray, ops: np.ndarray, n_layers: int) -> CurveReading:
    """The onset rule on per-prompt curves [N, L] (Zhang App. C, Fig. 14: "initial
    stabilization followed by an increase"; Sec. 5.2 "starting from the 17th layer").

    Both parts are judged on 95 % bootstrap intervals over prompts (stratified by operator,
    the same resamples): first whether the mean curve climbs at all (:func:`_climbs`): not
    reproduced if it climbs in at most 2.5 % of the resamples (interval [0, 0]), inconclusive
    if the bootstrap cannot settle it (interval [0, 1]); then, for a curve that climbs,
    where the climb begins (depth = start / L): reproduced if the interval is >= 17/32,
    partly if within [13/32, 17/32), not reproduced if below 13/32, else inconclusive."""
    L = n_layers
    pts = _answer_curve_points(curves)
    onset = bootstrap_ci(lambda x: _answer_curve_points(x).start / L, curves, groups=ops)
    climb = bootstrap_ci(_climbs, curves, groups=ops)
    if climb.high == 0:
        return CurveReading(
            pts,
            onset,
            climb,
            NOT_REPRODUCED,
            "; the curve does not climb (its maximum is at its "
            "first searched layer, or a single step) in at least 97.5 % of the bootstrap resamples",
            L,
        )
    if climb.low == 0:
        mean = "climbs" if climb.estimate else "does not climb"
        return CurveReading(
            pts,
            onset,
            climb,
            INCONCLUSIVE,
            f"; the mean curve {mean}, but whether it climbs at all "
            "is not settled by the bootstrap (a climb in more than 2.5 % and fewer than 97.5 % of "
            "the resamples)",
            L,
        )
    verdict = interval_verdict(onset, papers.ZHANG_MLP_CURVE_CLIMB_32 / 32, papers.ZHANG_MLP_CURVE_START_32 / 32)
    return CurveReading(pts, onset, climb, verdict, "", L)


def _answer_curves(cur: pd.DataFrame, measure: str) -> tuple[np.ndarray, np.ndarray, pd.Index] | None:
    """Per-prompt curves [N, L] of ``measure``, the prompts' operators and the layers; None without rows."""
    rows = cur[cur["measure"] == measure]
    if rows.empty:
        return None
    wide = rows.pivot_table(index="prompt", columns="layer", values="value", aggfunc="first").sort_index(axis=1)
    ops = rows.groupby("prompt")["op"].first().loc[wide.index].astype(str).to_numpy()
    return wide.to_numpy(float), ops, wide.columns


def _reading_text(measure: str, r: CurveReading, n: int) -> str:
    p, L = r.points, r.n_layers
    return (
        f"{_ANSWER_LABEL[measure]} (layer 0 left out): climb begins at layer {p.start} (depth "
        f"{r.onset.text(pct=False)}; paper 18/32 = 0.56), steepest step {p.inflection}, peak {p.peak} of {L} "
        f"layers ({n} prompts){r.note}"
    )


def _literal_text(cur: pd.DataFrame, L: int) -> str:
    """The sensitivity reading (the literal MLP_out - MLP_in) with the verdict it would give."""
    lit = _answer_curves(cur, LITERAL_MEASURE)
    if lit is None:
        return ""
    r = read_answer_curve(lit[0], lit[1], L)
    return f"; sensitivity, not judged: {_reading_text(LITERAL_MEASURE, r, len(lit[0]))}: would read '{r.verdict}'"


def _summary_write_text(t: Tables) -> str:
    """What an older run's summary table shows of the MLP's write (the mean curve of
    cos(MLP_out, W_U[C]), the same vector in a sequential block), without an interval."""
    if not t.has("02_mlp_cosines"):
        return ""
    from ..zhang.mlp_curves import curve_points

    s = t.csv("02_mlp_cosines")
    curve = s[s["measure"] == "out_C"].sort_values("layer")["mean"].to_numpy(float)
    if len(curve) < 3:
        return ""
    p = curve_points(curve, "rise")
    return (
        f"; its summary's mean curve of cos(MLP_out, W_U[C]) (the MLP's write in a sequential block; no "
        f"per-prompt values, so no interval) climbs from layer {p.start} to its peak at layer {p.peak} of "
        f"{len(curve)}"
    )


def _zhang_mlp_answer(t: Tables) -> Outcome:
    cur = t.csv("02_mlp_cosines_per_prompt")
    if cur.empty:
        raise NotRun("no answer curve (no correct prompts)")
    got = _answer_curves(cur, ANSWER_MEASURE)
    if got is None:
        L = t.n_layers(cur["layer"]) if "layer" in cur else 0
        raise NotRun(
            "02_mlp_cosines_per_prompt.csv.gz has no per-prompt curve of the MLP's write, cos(resid_post - "
            "resid_mid, W_U[C]), which the verdict reads (older run): rerun notebook 02"
            + _summary_write_text(t)
            + (_literal_text(cur, L) if L >= 3 else "")
        )
    curves, ops, layers = got
    L = t.n_layers(pd.Series(layers))
    if L < 3:
        raise NotRun(f"{L} layers: no answer curve after layer 0 (the rule leaves layer 0 out)")
    r = read_answer_curve(curves, ops, L)
    pts = r.points
    settled = r.climb.low == 1 or r.climb.high == 0
    return Outcome(
        _reading_text(ANSWER_MEASURE, r, curves.shape[0]) + _literal_text(cur, L),
        r.verdict,
        {
            "answer-writing inflection layer / n_layers": pts.start / L,
            "answer-writing start layer / n_layers": pts.start / L,
            "answer-writing steepest layer / n_layers": pts.inflection / L,
            "answer-writing peak layer / n_layers": pts.peak / L,
            "answer curve climbs (mean curve)": r.climb.estimate,
        },
        r.onset,
        # an unsettled climb has no threshold on the onset's interval to count prompts against,
        # and is never undecidable for want of prompts: more would settle it
        thresholds=(papers.ZHANG_MLP_CURVE_START_32 / 32, papers.ZHANG_MLP_CURVE_CLIMB_32 / 32) if settled else (),
        population=_zhang_population() if settled else None,
    )


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
        raise NotRun("01_transfer_per_prompt.csv.gz lacks the none / knockout / random conditions")
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
        parts.append(
            f"{f} [{int(round(b * len(m)))}/{len(m)} correct] {_pct(m[:, 1].mean() / b - 1, 0, signed=True)} "
            f"({_pct(m[:, 2].mean() / b - 1, 0, signed=True)})"
        )
    drops = [1 - x[fmt == f, 1].mean() / x[fmt == f, 0].mean() for f in answered]
    drops_r = [1 - x[fmt == f, 2].mean() / x[fmt == f, 0].mean() for f in answered]
    full = HALF * papers.ZHANG_TRANSFER_DROP
    return Outcome(
        f"relative accuracy change after knocking out the top-{k} heads by path-patching effect (as many "
        f"random heads): {'; '.join(parts)}; mean gap {ci.text()}{_key_head_note(t, k)}",
        interval_verdict(ci, full, NOISE_GAP),
        {
            "transfer: relative drop minus random-heads drop": _transfer_gap(x, fmt),
            "mean relative accuracy drop on transfer formats": float(np.mean(drops)),
            "mean relative drop with random heads": float(np.mean(drops_r)),
            "formats": float(len(answered)),
        },
        ci,
        thresholds=(NOISE_GAP, full),
    )


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
        own = _correct_matrix(
            roles.loc[["original", "precise"]].rename(columns={"arithmetic_2d_by_prompt": "correct_by_prompt"})
        )
        gain = ""
        if own is not None:  # what did run is still shown
            ci = bootstrap_ci(lambda x: float(x[:, 1].mean() - x[:, 0].mean()), own.astype(float))
            gain = f" (precise SFT's own arithmetic gain: {_pct(ci.estimate)}{_ci_text(ci.scaled(100))}, {ci.n} test prompts)"
        raise NotRun(f"notebook 08 ran no full SFT (not enough memory): nothing to compare precise SFT with{gain}")
    seed_of = tab["train_seed"] if "train_seed" in tab else pd.Series(0, index=tab.index)
    seeds = [x for x in dict.fromkeys(seed_of[tab.role == "precise"]) if ((tab.role == "full") & (seed_of == x)).any()]
    if not seeds:
        raise NotRun("08_sft_comparison has no training seed with both a precise-SFT and a full-SFT row")

    def pair_rows(x) -> pd.DataFrame:
        """The original row and training seed x's precise and full rows, indexed by role."""
        return pd.concat(
            [
                tab[tab.role == "original"].iloc[:1],
                tab[(tab.role == "precise") & (seed_of == x)].iloc[:1],
                tab[(tab.role == "full") & (seed_of == x)].iloc[:1],
            ]
        ).set_index("role")

    per_seed = []  # [prompts, (original, precise, full)] per training seed, arithmetic and facts
    for x in seeds:
        seed_rows = pair_rows(x)
        arith = _correct_matrix(seed_rows.rename(columns={"arithmetic_2d_by_prompt": "correct_by_prompt"}))
        facts = _correct_matrix(seed_rows.rename(columns={"facts_by_prompt": "correct_by_prompt"}))
        if arith is None or facts is None:
            raise NotRun(RERUN_PER_PROMPT.format(nb="08", table="08_sft_comparison"))
        per_seed.append((arith.astype(float), facts.astype(float)))
    rows = pair_rows(seeds[0])  # the first seed's rows: the method name and LM loss in the text
    a = np.stack([x[0] for x in per_seed], axis=-1)  # [prompts, arm, seed]
    f = np.stack([x[1] for x in per_seed], axis=-1)

    def arm_gap(i: int, j: int) -> Callable[[np.ndarray], float]:
        return lambda x: float(x[:, i].mean() - x[:, j].mean())

    def interval(stat: Callable[[np.ndarray], float], x: np.ndarray) -> Interval:
        """Over the prompts, and over the training seeds when there are several (crossed)."""
        return bootstrap_ci(stat, x[..., 0]) if x.shape[-1] == 1 else crossed_bootstrap_ci(stat, replicates=x)

    gain_p, gain_f = interval(arm_gap(1, 0), a), interval(arm_gap(2, 0), a)
    if gain_f.high < 0:  # Zhang's full SFT is a working reference (Table 1: +2.8 to +23.2 points)
        raise NotRun(
            f"full SFT did not train: its arithmetic accuracy changed by {_pct(gain_f.estimate)}"
            f"{_ci_text(gain_f.scaled(100))}, so it cannot stand in for Zhang's full-SFT reference "
            f"(precise SFT's own gain: {_pct(gain_p.estimate)}{_ci_text(gain_p.scaled(100))}); rerun "
            "notebook 08 with a full-SFT setting that trains"
        )
    diff = interval(arm_gap(1, 2), a)
    kept = interval(arm_gap(1, 2), f)  # precise minus full, facts
    seeds_text = (
        f", {len(seeds)} training seeds per arm (interval over prompts and seeds)"
        if len(seeds) > 1
        else ", one training seed per arm (the interval excludes training variance)"
    )
    m = ZHANG_PRECISE_MARGIN
    precise = str(rows.loc["precise", "method"]) if "method" in rows else "precise SFT"
    lm = (
        f"; LM loss change precise {float(rows.loc['precise', 'lm_loss'] - rows.loc['original', 'lm_loss']):+.3f}, "
        f"full {float(rows.loc['full', 'lm_loss'] - rows.loc['original', 'lm_loss']):+.3f} nats/token"
        if "lm_loss" in rows
        else ""
    )
    text = (
        f"{precise}: arithmetic gain {_pct(gain_p.estimate)}{_ci_text(gain_p.scaled(100))}, full SFT "
        f"{_pct(gain_f.estimate)}{_ci_text(gain_f.scaled(100))}, precise minus full {_pct(diff.estimate)}"
        f"{_ci_text(diff.scaled(100))} ({diff.n} test prompts{seeds_text}); factual recall precise minus full "
        f"{_pct(kept.estimate)}{_ci_text(kept.scaled(100))} ({kept.n} facts){lm}"
    )
    metrics = {
        "precise SFT arithmetic gain": gain_p.estimate,
        "full SFT arithmetic gain": gain_f.estimate,
        "precise minus full arithmetic accuracy": diff.estimate,
        "precise minus full factual recall": kept.estimate,
        "training seeds per arm": float(len(seeds)),
    }
    verdict = _judged(
        lambda up, close, general: _grade(up and close and general, up and (close or general)),
        _above_zero(gain_p),
        _possible(diff, -m),
        _possible(kept, -m),
    )
    return Outcome(text, verdict, metrics, diff, thresholds=(-m,))
