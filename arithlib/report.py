"""The run's report: each headline finding of the three papers, the paper's number, ours
(computed from the CSV tables the notebooks wrote into a figures folder) and a verdict
by a rule stated in words and applied in code.

A finding is a small declarative :class:`Finding`: where the claim is in the paper, the
paper's number (quoted from the published papers, cited by section in :data:`ZHANG_TXT`
and its neighbours; where the paper gives none, the qualitative claim), the tables it needs, a function computing our numbers and the
verdict rule. Rules are fixed from the papers' claims, with three shared constants:

* a quantitative claim is *reproduced* when our effect is at least half the paper's
  (:data:`HALF`);
* "much more" claims without a number need a gap of at least :data:`CLEAR_GAP`
  (10 points) to be reproduced;
* a gap of at least :data:`NOISE_GAP` (5 points) in the paper's direction is *partly*.

A finding whose tables are missing (notebook not run, or a study skipped for this
model) gets the verdict "not run"; one whose computation raises (a bug, a malformed
table) gets "error" with the exception in its text, so a crash never passes for a
study that was not run.

Usage: ``python -m arithlib.report figures/<model> [figures/<model2> ...]`` writes
``REPORT.md`` and ``REPORT.html`` into each folder and, for two or more folders,
``CROSS_MODEL.md`` / ``CROSS_MODEL.csv`` next to them (layer positions as
layer / n_layers, so models of different depth compare). ``python -m arithlib.report
--cross-in figures --readme README.md`` (what ``run_all.sh`` calls) writes the cross-model
files over every model folder in ``figures`` and the verdict table into the README.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from .environment import environment_line
from .outputs import write_text
from .stats import (INCONCLUSIVE, NOT_REPRODUCED, PARTLY, REPRODUCED, Interval, binomial_ci, bootstrap_ci,
                    crossed_bootstrap_ci, decode_correct, interval_verdict)
from . import papers
from .papers import (CLEAR_GAP, FAITHFULNESS_TARGET, HALF, KEY_HEAD_THRESHOLD, KNOCKOUT_K, NIKANKIN_FAITHFULNESS,
                     NIKANKIN_MATCH_T, NIKANKIN_NEURON_SHARE, NIKANKIN_TXT, NOISE_GAP, PAPERS, PAPERS_SHORT,
                     YU_TXT, ZHANG_PRECISE_MARGIN, ZHANG_TXT)

NOT_RUN = "not run"
#: A finding measured at smoke-test sizes (a notebook's ``quick`` mode, or fine-tuning at
#: scale "quick"): its numbers are shown, but the rule is not applied to them.
NOT_JUDGED = "not judged"
#: A finding whose computation raised (a bug or a malformed table), kept apart from "not run".
ERROR = "error"
VERDICTS = (REPRODUCED, PARTLY, NOT_REPRODUCED, INCONCLUSIVE, NOT_RUN, NOT_JUDGED, ERROR)
#: Verdicts counted in a summary only where some finding has them.
_RARE_VERDICTS = (NOT_JUDGED, ERROR)

NOTEBOOKS: dict[str, str] = {
    "00": "Model accuracy",
    "01": "Key heads and MLPs (Zhang; Yu's head sweep; Nikankin's circuit)",
    "02": "MLP probing (Zhang Sec. 5.2)",
    "03": "Neuron heuristics (Nikankin)",
    "04": "Comparative neuron analysis (Yu Sec. 4)",
    "05": "LoRA mechanism (Yu Sec. 5)",
    "06": "Pruning (Yu Sec. 6.1)",
    "07": "Gender-bias editing (Yu Sec. 6.2)",
    "08": "Precise SFT of the key heads (Zhang Sec. 4.3, 5.3)",
}


# --------------------------------------------------------------------------- reading a figures folder


class NotRun(Exception):
    """A finding cannot be computed from this folder (the reason is the message)."""


class MissingTable(NotRun):
    """A table the finding needs is not in the folder."""


class Tables:
    """Read-only access to one figures folder: its CSV tables and the model info that
    every notebook's ``*_params.json`` carries."""

    def __init__(self, fig_dir: str | os.PathLike):
        self.dir = Path(fig_dir)
        self._cache: dict[str, pd.DataFrame] = {}
        self._params: dict[str, dict] | None = None

    def has(self, name: str) -> bool:
        return (self.dir / f"{name}.csv").exists()

    def csv(self, name: str) -> pd.DataFrame:
        """``<dir>/<name>.csv``; raises :class:`MissingTable` when absent."""
        if name not in self._cache:
            path = self.dir / f"{name}.csv"
            if not path.exists():
                raise MissingTable(f"{name}.csv missing")
            try:
                self._cache[name] = pd.read_csv(path, keep_default_na=True)
            except pd.errors.EmptyDataError:
                self._cache[name] = pd.DataFrame()
        return self._cache[name].copy()

    def params(self) -> dict[str, dict]:
        """Notebook number -> its ``NN_*_params.json`` (empty when none); read once."""
        if self._params is None:
            self._params = {}
            for path in sorted(self.dir.glob("[0-9][0-9]_*_params.json")):
                try:
                    self._params[path.name[:2]] = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
        return self._params

    def info(self) -> dict:
        """The model info (n_layers, n_heads, d_mlp, ...) of the first params file."""
        for p in self.params().values():
            if isinstance(p.get("model_info"), dict):
                return p["model_info"]
        return {}

    def model(self) -> str:
        for p in self.params().values():
            if p.get("model"):
                return str(p["model"])
        return self.dir.name

    def n_layers(self, fallback: pd.Series | None = None) -> int:
        """Number of layers from the params, else 1 + the largest layer in ``fallback``."""
        n = self.info().get("n_layers")
        if n:
            return int(n)
        if fallback is not None and len(fallback):
            return int(pd.to_numeric(fallback).max()) + 1
        raise NotRun("number of layers unknown (no params json)")


# --------------------------------------------------------------------------- findings


@dataclass(frozen=True)
class Outcome:
    """Our side of a finding: a one-line summary, the verdict and named numbers (the
    first is the headline; layer positions are layer / n_layers)."""

    ours: str
    verdict: str
    metrics: dict[str, float] = field(default_factory=dict)
    #: 95 % interval of the headline metric (the first of ``metrics``) that the verdict reads;
    #: None only for a finding whose rule reads no estimate (not run, error).
    interval: Interval | None = None


@dataclass(frozen=True)
class Finding:
    """One headline claim of a paper and how this run is judged against it."""

    id: str
    paper: str            # key of PAPERS
    where: str            # section / table / figure of the paper
    claim: str            # the claim in one line
    paper_number: str     # the paper's number (or "no number: ..." with the qualitative claim)
    source: str           # where that number is in the paper texts
    rule: str             # the verdict rule in words (applied by ``compute``)
    notebook: str         # "01"...
    compute: Callable[[Tables], Outcome]
    figures: tuple[str, ...] = ()  # the PNGs (names without suffix) that show it, beside it in REPORT.md


def _grade(full: bool, partial: bool) -> str:
    return REPRODUCED if full else PARTLY if partial else NOT_REPRODUCED


def _gap_verdict(gap: float, full_gap: float) -> str:
    """Reproduced if ``gap`` >= ``full_gap``; partly if >= NOISE_GAP; else not."""
    return _grade(gap >= full_gap, gap >= NOISE_GAP)


def _pct(x: float, digits: int = 1, signed: bool = False) -> str:
    """``x`` as a percentage; ``signed``: a change, with its sign ("+25 %", "-40 %", "0 %")."""
    if x is None or not np.isfinite(x):
        return "n/a"
    v = round(100 * x, digits) + 0.0  # + 0.0: no "-0 %"
    return f"{v:+.{digits}f} %" if signed and v != 0 else f"{v:.{digits}f} %"


def _paper_depth(layer_of_32: float, n_layers: int) -> int:
    """A layer index of the papers' 32-layer models scaled to ``n_layers`` (as
    ``cna.deep_layers``: floor(layer / 32 * L + 0.5))."""
    return int(math.floor(layer_of_32 / 32 * n_layers + 0.5))


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
    from .probing import curve_points

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


def _yu_op(op: str) -> str:
    return {"add": "+", "sub": "-", "mul": "*", "div": "/"}.get(str(op), str(op))


def _yu_single_head(t: Tables) -> Outcome:
    if not t.has("01_yu_head_sweep_rows"):
        raise NotRun("01_yu_head_sweep_rows.csv missing: this run's sweep predates the exact every-position sweep "
                     "(rerun notebook 01)")
    sw = t.csv("01_yu_head_sweep")
    rows = t.csv("01_yu_head_sweep_rows")
    for f in (sw, rows):
        f["op"] = f["op"].map(_yu_op)
    top = sw[(sw["n_digits"] == 1) & (sw["rank"] == 1) & sw["op"].isin(["+", "-", "/"])
             & (sw["baseline_accuracy"] > 0)]
    if top.empty:
        raise NotRun("no 1-digit +, -, / setting the model answers")
    # Yu's Table 2 gives relative decreases: 1D+ 88.9 -> 47.6 % is 46.5 % (Table 24)
    parts = [rows[(rows["n_digits"] == 1) & (rows["op"] == r.op) & (rows["layer"] == r.layer)
                  & (rows["head"] == r.head)] for r in top.itertuples()]
    data = pd.concat(parts, ignore_index=True)
    ops = data["op"].to_numpy()

    def stat(op, correct, clean):
        drops = [1 - correct[op == o].sum() / clean[op == o].sum() for o in dict.fromkeys(op.tolist())
                 if clean[op == o].sum() > 0]
        return float(np.mean(drops)) if drops else float("nan")

    ci = bootstrap_ci(stat, ops, data["correct"].astype(bool).to_numpy(), data["clean_correct"].astype(bool).to_numpy(),
                      groups=ops)
    per_op = ", ".join(f"{r.op} L{int(r.layer)}H{int(r.head)} {_pct(r.relative_drop, 0)} (n = {int(r.n)})"
                       for r in top.itertuples())
    spec = ""
    if t.has("01_yu_specificity"):
        sp = t.csv("01_yu_specificity")
        if len(sp):
            sp["op"] = sp["op"].map(_yu_op)
            g = sp.groupby("op").agg(before=("clean_correct", "mean"), after=("correct", "mean"))
            spec = ("; factual recall with that head zeroed: "
                    + ", ".join(f"{o} {_pct(r.before, 0)} -> {_pct(r.after, 0)}" for o, r in g.iterrows()))
    return Outcome(f"largest relative 1D accuracy decrease from one head (every position, all 1D prompts): {per_op}; "
                   f"mean {ci.text()}{spec}",
                   interval_verdict(ci, HALF * (papers.YU_TABLE2["+"] + papers.YU_TABLE2["-"] + papers.YU_TABLE2["/"]) / 300, NOISE_GAP),
                   {"mean top-head relative 1D accuracy decrease (+ - /)": ci.estimate}, ci)


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
    from .patching import faithfulness_by_operator

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


NO_PER_PROMPT = "no per-prompt table: rerun notebook {nb} for an interval"


def _possible(ci: Interval | None, threshold: float, higher: bool = True) -> set[bool]:
    """Truth values that "x >= ``threshold``" (``higher=False``: "x <= threshold") can take
    inside the 95 % interval ``ci`` (both when the interval straddles it)."""
    if ci is None:
        return {True, False}
    v = interval_verdict(ci, threshold, threshold, higher_is_better=higher)
    return {True} if v == REPRODUCED else {False} if v == NOT_REPRODUCED else {True, False}


def _judged(grade: Callable[..., str], *conditions: set[bool]) -> str:
    """The verdict ``grade(*conditions)`` when every combination of the conditions' possible
    truth values (:func:`_possible`) gives the same one, else *inconclusive*."""
    from itertools import product

    got = {grade(*combo) for combo in product(*conditions)}
    return got.pop() if len(got) == 1 else INCONCLUSIVE


def _above_zero(ci: Interval | None) -> set[bool]:
    """Possible truth values of "x > 0" within ``ci``."""
    return _possible(ci, float(np.nextafter(0.0, 1.0)))


def _ci_text(ci: Interval | None, unit: str = "%") -> str:
    """" [lo, hi]" of an interval already in ``unit`` (points or %), or "" without one."""
    if ci is None or not (np.isfinite(ci.low) and np.isfinite(ci.high)):
        return ""
    return f" [{ci.low:.1f}, {ci.high:.1f}]"


def _decrease_ci(accuracy: float, n: int, base: float) -> Interval:
    """Accuracy decrease (%) of ``base`` from an accuracy of ``n`` cases (exact binomial;
    ``base`` is the unablated accuracy on the same cases, 1 for Yu's correct cases)."""
    acc = binomial_ci(int(round(accuracy * n)), int(n))
    if not base > 0:
        return Interval(float("nan"), float("nan"), float("nan"), int(n), "none")
    f = lambda x: 100 * (base - x) / base  # noqa: E731
    return Interval(f(acc.estimate), f(acc.high), f(acc.low), acc.n, acc.method)


def _correct_matrix(rows: pd.DataFrame) -> np.ndarray | None:
    """Prompts x rows boolean matrix of the rows' ``correct_by_prompt`` cells (the same
    prompts in every row), or None when a cell is missing or the lengths differ."""
    if "correct_by_prompt" not in rows:
        return None
    cols = [decode_correct(c) for c in rows["correct_by_prompt"]]
    if not cols or any(c is None for c in cols) or len({len(c) for c in cols}) != 1:
        return None
    return np.stack(cols, axis=1)


#: Notebook 04 tables from before issue 29 (key head from notebook 01's exact sweep, keep =
#: the layers CNA scored, shallow sets through every reading attention layer with the
#: number/operation concept list, random controls over seeds) are not judged.
_YU_04_STALE = ("{name}.csv predates issue 29 (key head from notebook 01's exact sweep, 'keep' on the layers CNA "
                "scored, shallow neurons through every attention layer that reads them, random controls over seeds "
                "with per-case correctness): rerun notebook 04")


def _yu_key_head(t: Tables, group: str) -> pd.Series | None:
    """The row of ``group``'s key head in 04_key_heads.csv, or None without one."""
    if not t.has("04_key_heads"):
        return None
    kh = t.csv("04_key_heads")
    kh = kh[kh["group"].astype(str) == group] if "group" in kh else kh.iloc[:0]
    return None if kh.empty else kh.iloc[0]


def _yu_key_head_text(t: Tables, group: str) -> str:
    """"key head L14H2 (lowers 1D accuracy)" from 04_key_heads.csv, or "" without it."""
    r = _yu_key_head(t, group)
    if r is None or "lowers_1d" not in r:
        return ""
    lowers = str(r["lowers_1d"]).lower() == "true"
    return (f"key head L{int(r['layer'])}H{int(r['head'])} "
            + ("(lowers 1D accuracy in notebook 01's exact sweep)" if lowers else
               "(NO head lowers 1D accuracy in notebook 01's exact sweep: fallback head, "
               "Yu's premise does not hold)") + "; ")


def _yu_mask_keep(t: Tables) -> Outcome:
    mk = t.csv("04_mask_keep")
    mk = mk[mk["group"].astype(str) == "+-"]
    if mk.empty:
        raise NotRun("no correct 1D + / - cases")
    if not {"seed", "correct_by_prompt"} <= set(mk.columns):
        raise NotRun(_YU_04_STALE.format(name="04_mask_keep"))
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
    verdict = _judged(lambda big, b, k: _grade(big and b and k, (big and b) or k),
                      _possible(mask, 50), beats, _possible(keep, 50, higher=False))
    nan = float("nan")
    txt = lambda ci: f"{ci.estimate:.1f} %{_ci_text(ci)}" if ci is not None else "n/a"  # noqa: E731
    n_seeds = int(at.loc[at["intervention"] == "random mask", "seed"].nunique())
    layers = at.loc[at["intervention"] == "keep", "keep_layers"] if "keep_layers" in at else pd.Series(dtype=str)
    span = str(layers.iloc[0]) if len(layers) else "n/a"
    span = span[:-2] if span.endswith(".0") else span  # one layer, read back as a number
    return Outcome(f"{_yu_key_head_text(t, '+-')}top-{K}: mask {txt(mask)}, keep {txt(keep)} (layers "
                   f"{span}), random mask {txt(rnd)}, random keep {txt(rkeep)} "
                   f"accuracy decrease ({mask.n} correct cases; exact binomial 95 % intervals, random controls over "
                   f"{n_seeds} seeds by a bootstrap over cases and seeds)",
                   verdict,
                   {"mask accuracy decrease (%)": mask.estimate, "keep accuracy decrease (%)": keep.estimate,
                    "random-mask accuracy decrease (%)": rnd.estimate if rnd is not None else nan,
                    "random-keep accuracy decrease (%)": rkeep.estimate if rkeep is not None else nan, "K": float(K)},
                   mask)


def _yu_shallow_group(t: Tables, sweep: pd.DataFrame) -> tuple[str, str]:
    """The group the shallow-neuron rule reads and the text that says why: + / - (Yu's
    Table 8), or / (App. B, Table 17: the division head shares the mechanism) when the
    + / - key head sits in layer 0, so no FFN layer lies below it and notebook 04 has no
    + / - sweep."""
    groups = set(sweep["group"].astype(str)) if "group" in sweep else set()
    pm = _yu_key_head(t, "+-")
    if "+-" in groups or "/" not in groups or pm is None or int(pm["layer"]) != 0:
        return "+-", ""
    return "/", (f"+ / - key head L0H{int(pm['head'])} is in layer 0, so no FFN layer lies below it: "
                 "judged on 1D / instead (Yu App. B, Table 17: the division head shares the mechanism); ")


def _yu_shallow(t: Tables) -> Outcome:
    if not t.has("04_hidden_m_sweep") and t.has("04_cases"):
        raise NotRun("notebook 04 wrote no M sweep (key head in layer 0: no shallow FFN layer below it)")
    sweep = t.csv("04_hidden_m_sweep")
    group, lead = _yu_shallow_group(t, sweep)
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
    ci = crossed_bootstrap_ci(lambda a, d: 100 * (d.mean() - a.mean()) / base, hm[:, 0].astype(float),
                              replicates=rm.astype(float))
    metrics = {"hidden minus random accuracy decrease (points)": ci.estimate,
               "hidden-interpretable share of shallow neurons": share,
               "hidden-interpretable accuracy decrease (%)": float(h["accuracy_decrease"]),
               "random accuracy decrease (%)": r}
    paper = f"paper {int(h['paper_n']):,} = {_pct(float(h['paper_share']))}"
    return Outcome(f"{lead}{_yu_key_head_text(t, group)}M = 2: {int(h['n_neurons']):,} of "
                   f"{int(h['n_shallow']):,} shallow neurons ({_pct(share)}; {paper}) -> "
                   f"{h['accuracy_decrease']:.1f} % decrease vs random {r:.1f} % ({rnd['seed'].nunique()} seeds); "
                   f"gap {ci.estimate:.1f} points{_ci_text(ci)} "
                   f"(bootstrap over {ci.n} cases and the seeds)",
                   interval_verdict(ci, 100 * HALF * (papers.YU_CNA_TABLES["M2"]["+-"][1] - papers.YU_CNA_TABLES["M2"]["+-"][2]) / 100,
                                    100 * NOISE_GAP), metrics, ci)


def _band_layers(text: object) -> list[int]:
    """Layers of a band cell of notebook 05's tables ("1-7", or one layer "0")."""
    lo, _, hi = str(text).partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def _yu_lora_layers(t: Tables) -> Outcome:
    acc = t.csv("05_lora_accuracy_by_layer")
    base_rows = acc[acc["layer"] == -1]
    lora = acc[acc["layer"] >= 0]
    if base_rows.empty or lora.empty:
        raise NotRun("no original row or no LoRA model")
    base = float(base_rows["accuracy"].iloc[0])
    above = float((lora["accuracy"] > base).mean())
    bands = t.csv("05_lora_accuracy_bands") if t.has("05_lora_accuracy_bands") else pd.DataFrame()
    means = bands.set_index("band")["mean_accuracy"] if len(bands) else pd.Series(dtype=float)
    has_bands = {"shallow", "deep"} <= set(means.index)
    L = t.n_layers(acc["layer"])
    best = lora.loc[lora["accuracy"].idxmax()]
    band_txt = ", ".join(f"{b} {_pct(v, 0)}" for b, v in means.items())
    text = (f"original {_pct(base, 0)}; {_pct(above, 0)} of {len(lora)} LoRA layers beat it; best layer "
            f"{int(best['layer'])} ({_pct(best['accuracy'], 0)})" + (f"; bands: {band_txt}" if band_txt else ""))
    metrics = {"share of LoRA layers beating the original": above,
               "best LoRA layer / n_layers": float(best["layer"]) / L,
               "shallow minus deep band accuracy": float(means["shallow"] - means["deep"]) if has_bands
               else float("nan")}
    mat = _correct_matrix(pd.concat([base_rows.iloc[:1], lora]))
    if mat is None:
        raise NotRun(f"{text}; {RERUN_PER_PROMPT.format(nb='05', table='05_lora_accuracy_by_layer')}")
    share = bootstrap_ci(lambda x: float((x[:, 1:].mean(0) > x[:, 0].mean()).mean()), mat)
    falls: set[bool] = {False}
    if has_bands and "layers" in bands:
        layers = lora["layer"].astype(int).tolist()
        band = bands.set_index("band")["layers"]
        cols = {b: [1 + i for i, l in enumerate(layers) if l in _band_layers(band[b])] for b in ("shallow", "deep")}
        gap = bootstrap_ci(lambda x: float(x[:, cols["shallow"]].mean(0).mean() - x[:, cols["deep"]].mean(0).mean()),
                           mat)
        falls = _above_zero(gap)
        text += f" (shallow minus deep {_pct(gap.estimate, 0)}{_ci_text(gap.scaled(100))})"
    return Outcome(f"{text}; share beating the original {_pct(share.estimate, 0)}{_ci_text(share.scaled(100))} "
                   f"(paired bootstrap over {share.n} test prompts)",
                   _judged(lambda full, half, f: _grade(full and f, half),
                           _possible(share, 1.0), _possible(share, 0.5), falls),
                   metrics, share)


def _coef_increase_stats(per_case: pd.DataFrame, layer_of: dict[str, int], bands: dict[str, list[int]]
                         ) -> tuple[np.ndarray, np.ndarray, Callable[[np.ndarray, np.ndarray], dict[str, float]]]:
    """Notebook 05's per-case coefficient parts (cases x (model, k) arrays of num and den)
    and the function giving each band's mean increase (%) over its models and k from them,
    as ``finetune.band_increase_table`` does from all cases."""
    pc = per_case.assign(layer=per_case["model"].map(layer_of)).dropna(subset=["layer"])
    num = pc.pivot_table(index="case", columns=["model", "k"], values="num", aggfunc="sum").fillna(0.0)
    den = pc.pivot_table(index="case", columns=["model", "k"], values="den", aggfunc="sum").reindex_like(num).fillna(0.0)
    groups = {}
    for b, layers in bands.items():
        idx = [j for j, (model, _k) in enumerate(num.columns) if layer_of.get(model) in layers]
        ks = {k for j, (_m, k) in enumerate(num.columns) if j in idx}
        if idx:
            groups[b] = [[j for j in idx if num.columns[j][1] == k] for k in sorted(ks)]

    def band_means(n: np.ndarray, d: np.ndarray) -> dict[str, float]:
        with np.errstate(divide="ignore", invalid="ignore"):
            inc = 100 * n.sum(0) / d.sum(0)
        return {b: float(np.nanmean([np.nanmean(inc[js]) for js in per_k])) for b, per_k in groups.items()}

    return num.to_numpy(), den.to_numpy(), band_means


def _yu_lora_coef(t: Tables) -> Outcome:
    tab = t.csv("05_cna_coef_increase_by_band")
    if "selection" in tab:
        tab = tab[tab["selection"] == "cna"]
    cols = [c for c in tab.columns if str(c).startswith("top")]
    if tab.empty or not cols:
        raise NotRun("no LoRA layer in a band")
    means = tab.set_index("band")[cols].mean(axis=1)
    text = "mean coefficient increase of the top neurons: " + ", ".join(f"{b} {v:+.1f} %" for b, v in means.items())
    metrics = {"mean coefficient increase over bands (%)": float(means.mean())}
    if not (t.has("05_cna_coef_per_case") and t.has("05_cna_coef_increase")):
        raise NotRun(f"{text}; {RERUN_PER_PROMPT.format(nb='05', table='05_cna_coef_per_case')}")
    pc = t.csv("05_cna_coef_per_case")
    pc = pc[pc["selection"] == "cna"]
    rows = t.csv("05_cna_coef_increase").dropna(subset=["layer"])
    layer_of = {str(m): int(l) for m, l in zip(rows["model"], rows["layer"])}
    bands = {str(b): _band_layers(x) for b, x in zip(tab["band"], tab["layers"])}
    num, den, band_means = _coef_increase_stats(pc, layer_of, bands)
    if not len(num):
        raise NotRun(f"{text}; {RERUN_PER_PROMPT.format(nb='05', table='05_cna_coef_per_case')}")
    has = {"shallow", "deep"} <= set(band_means(num, den))
    mean = bootstrap_ci(lambda n, d: float(np.mean(list(band_means(n, d).values()))), num, den)
    low = bootstrap_ci(lambda n, d: float(min(band_means(n, d).values())), num, den)
    if has:
        falls = _above_zero(bootstrap_ci(lambda n, d: band_means(n, d)["shallow"] - band_means(n, d)["deep"], num, den))
        big = _possible(bootstrap_ci(lambda n, d: band_means(n, d)["shallow"], num, den), HALF * papers.YU_SHALLOW_COEF_MIN)
    else:
        falls = big = {False}
    return Outcome(f"{text}; mean over bands {mean.estimate:+.1f} %{_ci_text(mean)} (bootstrap over {mean.n} cases)",
                   _judged(lambda pos, f, b, half: _grade(pos and f and b, half),
                           _above_zero(low), falls, big, _possible(mean, 100 * NOISE_GAP)),
                   metrics, mean)


RERUN_PER_PROMPT = "{table}.csv has no per-prompt column (older run): rerun notebook {nb}"


def _seed_resampled_gap(n_seeds: int) -> Callable[[np.ndarray], float]:
    """Statistic of Table 11's gap for :func:`bootstrap_ci` on a prompts x (original,
    CNA-pruned, random-pruned seeds...) matrix: CNA minus the mean of the random
    prunings. Its first call (the estimate) uses every seed; every later call (a
    resample of the prompts) also redraws the seeds with replacement (a fixed-seed
    generator), so the interval covers the spread between random prunings, not only
    the prompts'."""
    rng = np.random.default_rng(0)
    calls = [0]

    def stat(x: np.ndarray) -> float:
        seeds = np.arange(n_seeds) if calls[0] == 0 or n_seeds < 2 else rng.integers(0, n_seeds, n_seeds)
        calls[0] += 1
        return float(x[:, 1].mean() - x[:, 2 + seeds].mean(0).mean())

    return stat


def _yu_pruning(t: Tables) -> Outcome:
    tab = t.csv("06_table11")
    acc = tab.groupby("model")["accuracy"].mean()
    needed = {"original", "LoRA on CNA-pruned", "LoRA on random-pruned"}
    if not needed <= set(acc.index):
        raise NotRun("Table 11 rows missing")
    orig, cna, rnd = acc["original"], acc["LoRA on CNA-pruned"], acc["LoRA on random-pruned"]
    lora = acc.get("LoRA", float("nan"))
    gap = float(cna - rnd)
    text = (f"original {_pct(orig)}, LoRA {_pct(lora)}, LoRA on CNA-pruned {_pct(cna)}, "
            f"on random-pruned {_pct(rnd)}")
    metrics = {"CNA-pruned minus random-pruned accuracy": gap, "CNA-pruned minus original accuracy": float(cna - orig)}
    pick = lambda name: tab[tab["model"] == name]  # noqa: E731
    n_seeds = len(pick("LoRA on random-pruned"))
    mat = _correct_matrix(pd.concat([pick("original").iloc[:1], pick("LoRA on CNA-pruned").iloc[:1],
                                     pick("LoRA on random-pruned")]))
    if mat is None:
        raise NotRun(f"{text}; {RERUN_PER_PROMPT.format(nb='06', table='06_table11')}")
    ci = bootstrap_ci(_seed_resampled_gap(n_seeds), mat)
    vs_orig = bootstrap_ci(lambda x: float(x[:, 1].mean() - x[:, 0].mean()), mat)
    return Outcome(f"{text}; CNA minus random {_pct(ci.estimate)}{_ci_text(ci.scaled(100))}, minus original "
                   f"{_pct(vs_orig.estimate)}{_ci_text(vs_orig.scaled(100))} (paired bootstrap over {ci.n} test "
                   f"prompts{f' and the {n_seeds} random prunings' if n_seeds > 1 else ''})",
                   _judged(lambda big, above, half: _grade(big and above, half),
                           _possible(ci, HALF * (papers.YU_TABLE11["LoRA on CNA-pruned"] - papers.YU_TABLE11["LoRA on random-pruned"]) / 100), _above_zero(vs_orig), _possible(ci, NOISE_GAP)),
                   metrics, ci)


def _zhang_precise_sft(t: Tables) -> Outcome:
    """Zhang Sec. 5.3, Table 1: precise SFT of the (scaled) top-32 key heads against full
    SFT on the same data (notebook 08's 08_sft_comparison, rows by ``role``). Paired
    bootstraps over the arithmetic test prompts (gains and their difference) and over the
    factual-recall prompts (general ability kept); margin ``ZHANG_PRECISE_MARGIN``."""
    tab = t.csv("08_sft_comparison")
    if "role" not in tab or "arithmetic_2d_by_prompt" not in tab or "facts_by_prompt" not in tab:
        raise NotRun(RERUN_PER_PROMPT.format(nb="08", table="08_sft_comparison"))
    roles = tab.set_index("role")
    if "full" not in roles.index:
        raise NotRun("notebook 08 ran no full SFT (not enough memory): nothing to compare precise SFT with")
    if not {"original", "precise"} <= set(roles.index):
        raise NotRun("08_sft_comparison lacks the original or the precise-SFT row")
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


def _yu_gender(t: Tables) -> Outcome:
    if not t.has("07_table13"):
        if t.has("07_top_predictions"):
            raise NotRun("no profession token differs by gender in the top-100 lists")
        raise MissingTable("07_table13.csv missing")
    p07 = t.params().get("07")
    if (p07 is not None and "early_layers" not in p07) or not t.has("07_bias_scores") \
            or not t.has("07_paper_bias_scores"):
        raise NotRun("07's tables predate issue 29 (edit set from a 20-per-profession screen, 3 random seeds, no "
                     "Table-23 professions, no early-layer check): rerun notebook 07")
    from .bias import reduction_intervals

    t13 = t.csv("07_table13")
    cna = t13[t13["model"].astype(str).str.startswith("CNA")]
    if cna.empty:
        raise NotRun("Table 13 has no CNA row")
    k = int(cna["K"].iloc[0])
    sc = t.csv("07_bias_scores")
    row = reduction_intervals(sc, ("cna",), [k])
    if row.empty:
        raise NotRun(f"no CNA top-{k} rows in 07_bias_scores")
    r = row.iloc[0]
    ci = Interval(float(r["reduction_pct"]), float(r["reduction_low"]), float(r["reduction_high"]),
                  int(r["n_professions"]), "bootstrap")
    diff = Interval(float(r["diff_pts"]), float(r["diff_low"]), float(r["diff_high"]), int(r["n_professions"]),
                    "crossed bootstrap")
    rnd = Interval(float(r["random_pct"]), float(r["random_low"]), float(r["random_high"]), int(r["n_professions"]),
                   "crossed bootstrap")
    text = (f"model's {int(r['n_professions'])} biased professions x {int(r['n_prompts'])} prompts: top-{k} CNA "
            f"neurons zeroed reduce the bias by {ci.estimate:.1f} %{_ci_text(ci)}, layer-matched random sets "
            f"({int(r['n_seeds'])} seeds) by {rnd.estimate:.1f} %{_ci_text(rnd)}; CNA minus random "
            f"{diff.estimate:.1f} points{_ci_text(diff)}")
    metrics = {"CNA bias reduction (%)": ci.estimate, "random bias reduction (%)": float(r["random_pct"]),
               "CNA minus random (points)": diff.estimate}
    paper = reduction_intervals(t.csv("07_paper_bias_scores"), ("cna",), [k])
    if len(paper):
        q = paper.iloc[0]
        text += (f"; on Table 23's professions ({int(q['n_professions'])} first tokens) "
                 f"{q['reduction_pct']:.1f} % [{q['reduction_low']:.1f}, {q['reduction_high']:.1f}] vs random "
                 f"{q['random_pct']:.1f} %")
        metrics["Table-23 professions: CNA bias reduction (%)"] = float(q["reduction_pct"])
    if (sc["kind"] == "cna_late").any():
        late = reduction_intervals(sc, ("cna_late",), [k])
        if len(late):
            q = late.iloc[0]
            text += (f"; top-{k} without the early layers {q['reduction_pct']:.1f} % [{q['reduction_low']:.1f}, "
                     f"{q['reduction_high']:.1f}] (random {q['random_pct']:.1f} %)")
            metrics["CNA without early layers: bias reduction (%)"] = float(q["reduction_pct"])
    if t.has("07_edit_layers") and p07 is not None:
        lay = t.csv("07_edit_layers")
        lay = lay[lay["edit_set"] == "cna"]
        early = int(lay.loc[lay["layer"] < int(p07["early_layers"]), "n_neurons"].sum())
        text += f"; {early} of the {k} edited neurons in layers < {int(p07['early_layers'])}"
        metrics["edited neurons in early layers"] = float(early)
    text += f" (bootstrap over professions crossed with seeds; paper {papers.YU_BIAS_REDUCTION_PCT} %)"
    if not int(r["n_seeds"]):
        return Outcome(text + "; no random control", INCONCLUSIVE, metrics, ci)
    return Outcome(text, _judged(lambda big, above: _grade(big and above, above),
                                 _possible(ci, HALF * papers.YU_BIAS_REDUCTION_PCT), _possible(diff, 100 * NOISE_GAP)),
                   metrics, ci)


FINDINGS: tuple[Finding, ...] = (
    Finding("zhang_key_heads", "zhang", "Abstract; Sec. 5.1 'Location of key heads', Fig. 2",
            "Fewer than 5 % of the attention heads carry arithmetic (path-patching effect below -5 %).",
            "< 5 % of heads (LLaMA2-7B; key heads in layers 12-17 of 32)",
            f"{ZHANG_TXT}: Abstract; Sec. 1; Sec. 5.1 'Location of key heads'",
            "key-head share = share of heads whose mean path-patching effect over the prompts is below -5 %, its "
            "95 % interval by a bootstrap over prompts (stratified by operator, 01_path_patching_per_prompt.csv); "
            "reproduced if the interval lies in (0, 5 %]; partly if in (0, 10 %) and not within 5 %; not reproduced "
            "if above 10 % or if no resample has a key head; inconclusive if it straddles 0, 5 % or 10 %",
            "01", _zhang_key_heads, figures=("01_path_patching",)),
    Finding("zhang_knockout", "zhang", "Sec. 1; Sec. 5.1 'Validation of key components', Fig. 3",
            "Knocking out heads in effect order breaks arithmetic; in random order it barely matters.",
            "about -70 % accuracy (effect-rank); random-rank within 2 %",
            f"{ZHANG_TXT}: Sec. 1 ('a decrease of around 70% in accuracy'); Sec. 5.1 ('within 2%')",
            "k = 10 heads (Table 4's top-10 knockout, -69 %; the same k as the transfer test), mean-ablated at every "
            "position of the query (per-position means over X_c; the few-shot prefix, which the paper's prompts lack, "
            "is left intact); gap = effect-rank relative accuracy drop minus the mean "
            "random-rank drop (random sets of 10 heads), 95 % interval by a bootstrap over prompts stratified by "
            "operator (01_knockout_per_prompt.csv); reproduced if the interval is >= 34 points (half of 70 - 2); "
            "partly if within [5, 34); not reproduced if below 5; else inconclusive",
            "01", _zhang_knockout, figures=("01_knockout",)),
    Finding("zhang_late_mlps", "zhang", "Sec. 5.1 'Location of key MLPs', Fig. 2 (last column)",
            "MLPs before the key heads have no effect on the answer; MLPs from layer 17 of 32 on do.",
            "MLPs 0-16: about +-0.0 %; from layer 17: about +-10.0 % logit effect",
            f"{ZHANG_TXT}: Sec. 5.1 'Location of key MLPs'",
            "split at layer round(17/32 x L); ratio = late MLPs' mean |mean effect| / early MLPs', 95 % interval by a "
            "bootstrap over prompts (stratified by operator); reproduced if the ratio's interval is >= 2 and the late "
            "MLPs' mean |effect| interval >= 5 % (half of 10 %); partly if the ratio is within [1, 2), or >= 2 with "
            "late effects below 5 %; not reproduced if the ratio is below 1; else inconclusive",
            "01", _zhang_late_mlps, figures=("01_path_patching",)),
    Finding("zhang_mlp_answer", "zhang", "Sec. 5.2 'Key MLPs behavior', Fig. 6b, 14",
            "cos(MLP_out - MLP_in, W_U[C]) rises from layer 17 of 32 on: late MLPs write the answer.",
            "start-inflection-end (13-18-28) of 32 layers (LLaMA2-7B)",
            f"{ZHANG_TXT}: Sec. 5.2; App. C (Fig. 13, 14)",
            "the paper's inflection of this curve is where its initial plateau turns into the climb (App. C, Fig. 14; "
            "Sec. 5.2 'starting from the 17th layer'): the start of the climb to the maximum by the rule of "
            "probing.curve_points, searched from layer 1 (layer 0's MLP reads the raw embedding; rule fixed in "
            "advance); depth = that layer / n_layers with a 95 % interval by a bootstrap over prompts (stratified by "
            "operator, 02_mlp_cosines_per_prompt.csv); reproduced if the interval is >= 17/32; partly if within "
            "[13/32, 17/32) (13 is the paper's start); not reproduced if below 13/32 or if the curve does not climb; "
            "else inconclusive",
            "02", _zhang_mlp_answer, figures=("02_mlp_cosines",)),
    Finding("zhang_transfer", "zhang", "Sec. 5.1, Fig. 4; App. D, E",
            "Knocking out the key heads also breaks other formats (SVAMP, multi-digit, decimals...).",
            "SVAMP: -66.0 % relative (34.7 % -> 11.8 %)",
            f"{ZHANG_TXT}: Sec. 5.1 ('-22.9% / 34.7% = -66.0%')",
            "over the formats the model answers, gap = mean of (relative accuracy drop after knocking out the top-10 "
            "heads by path-patching effect, the k of the knockout finding, minus the drop after knocking out as many "
            "random heads), 95 % interval by a bootstrap over prompts stratified by format "
            "(01_transfer_per_prompt.csv); reproduced if the interval is >= 33 points (half of 66 %); partly if "
            "within [5, 33); not reproduced if below 5; else inconclusive",
            "01", _zhang_transfer, figures=("01_transfer",)),
    Finding("zhang_precise_sft", "zhang", "Sec. 4.3 (Alg. 2), Sec. 5.3, Table 1",
            "Fine-tuning only the key heads improves arithmetic about as much as full SFT and keeps general ability.",
            "LLaMA2-7B: math +2.8 to +21.1 points (full SFT +2.8 to +23.2); general -5.5 for full SFT, +0.4 precise",
            f"{ZHANG_TXT}: Sec. 5.3, Table 1 ('matches or even surpasses'; full SFT 'about 5% drops')",
            "precise SFT of the top-32 heads by path-patching effect (scaled to the model's heads) and full SFT on the "
            "same data; on the arithmetic test prompts, precise SFT's gain (after - before) and precise minus full "
            "accuracy, and on the factual-recall prompts precise minus full accuracy, 95 % paired bootstrap intervals "
            f"(08_sft_comparison's per-prompt columns); reproduced if the gain lies > 0 and both differences lie >= "
            f"-{100 * ZHANG_PRECISE_MARGIN:.0f} points (Table 1's shortfalls of precise SFT reach 3.1 points, full "
            "SFT's general drop is 'about 5%'); partly if the gain lies > 0 and one difference does; not reproduced "
            "otherwise; inconclusive when the verdict depends on where in an interval the value is; not run "
            "when full SFT's arithmetic gain lies wholly below 0 (a full SFT that did not train is not Zhang's "
            "reference, whose gains were +2.8 to +23.2 points)",
            "08", _zhang_precise_sft, figures=("08_sft_comparison",)),
    Finding("yu_single_head", "yu", "Sec. 3.4, Table 2",
            "Zeroing one head destroys 1-digit +, -, / (not *).",
            "relative 1D accuracy decrease from the top head: + 46.5, - 62.2, / 54.9 (* 6.8) %",
            f"{YU_TXT}: Table 2",
            "the head of largest accuracy drop per operator, zeroed at every position on every 1D prompt (exact "
            "stage of the two-stage sweep); mean over +, -, / of its relative accuracy decrease (1 - after / before, "
            "as in the paper's table), 95 % interval by a bootstrap over prompts within each operator; reproduced if "
            "the interval lies above 27 % (half of the paper's mean 54.5 %), partly if it lies in 5-27 %, not "
            "reproduced if below 5 %, inconclusive if it straddles 5 % or 27 %",
            "01", _yu_single_head, figures=("01_yu_head_sweep",)),
    Finding("nikankin_faithfulness", "nikankin", "Sec. 2-3, Fig. 4b",
            "A sparse circuit (a few heads, about 1 % of the neurons of each middle/late MLP) reproduces the "
            "model's arithmetic.",
            "about 96 % faithfulness; about 200 neurons per layer of Llama3-8B (about 1 %)",
            f"{NIKANKIN_TXT}: authors' answer ('roughly 96%, see lines 173 and 244'); Sec. 2-3 (circuit size)",
            "full circuit = the heads (per position) of largest activation-patching effect, as many as reach "
            f"faithfulness {FAITHFULNESS_TARGET} on the selection prompts, plus the neurons at the grid share nearest "
            f"{NIKANKIN_NEURON_SHARE:.0%} of each analysed MLP at '='; every other head and neuron mean-ablated at op1, "
            "operator, op2 and '='; F (Eq. 2, means over prompts first) per operator on held-out prompts, averaged "
            "over operators, 95 % bootstrap interval over prompts (stratified by operator); reproduced if the whole "
            f"interval >= {FAITHFULNESS_TARGET}; partly if it lies in [{HALF * NIKANKIN_FAITHFULNESS:.2f}, "
            f"{FAITHFULNESS_TARGET}) (half of the paper's 0.96); not reproduced if below "
            f"{HALF * NIKANKIN_FAITHFULNESS:.2f}; inconclusive if it straddles a threshold",
            "03", _nikankin_faithfulness, figures=("03_circuit_faithfulness", "03_faithfulness_curve")),
    Finding("nikankin_heuristic_ablation", "nikankin", "Sec. 4.2, Fig. 7",
            "Ablating one heuristic's neurons hurts the prompts it covers more than other prompts.",
            "no number in the available text: associated prompts drop much more (baseline about 0.95)",
            f"{NIKANKIN_TXT}: authors' answers on Fig. 7",
            f"a neuron is associated with every heuristic it matches at t = {NIKANKIN_MATCH_T}; gap = mean over the ablated "
            "heuristics of (accuracy on other held-out prompts minus on associated ones), 95 % paired bootstrap "
            "interval over prompts (stratified by operator); reproduced if the whole interval >= 10 points; partly "
            "if it lies in [5, 10) points; not reproduced if below 5 points; inconclusive if it straddles 5 or 10",
            "03", _nikankin_heuristic_ablation, figures=("03_heuristic_ablation",)),
    Finding("nikankin_prompt_ablation", "nikankin", "Sec. 4.2, Fig. 8",
            "Ablating a prompt's heuristic neurons hurts it much more than ablating as many random neurons.",
            "no number in the available text: random neurons affect prompts 'much less'",
            f"{NIKANKIN_TXT}: authors' answer on Fig. 8",
            "gap = accuracy with as many random circuit neurons ablated minus with the prompt's heuristic neurons "
            "ablated, on held-out prompts, 95 % paired bootstrap interval over prompts (stratified by operator); "
            "reproduced if the whole interval >= 10 points; partly if it lies in [5, 10) points; not reproduced if "
            "below 5 points; inconclusive if it straddles 5 or 10",
            "03", _nikankin_prompt_ablation, figures=("03_prompt_ablation",)),
    Finding("yu_mask_keep", "yu", "Sec. 4.2, Table 5",
            "The top CNA neurons hold the answer: masking them breaks 1D +/-, keeping only them preserves it.",
            "top99: mask -100.0 %, keep -3.9 % accuracy (top10: 68.4 / 38.2)",
            f"{YU_TXT}: Table 5",
            "at K = 99 (else the largest K), on all correct 1D + and - cases: exact binomial (Clopper-Pearson) 95 % "
            "intervals of the mask and keep accuracy decreases (keep = zero every other neuron of the layers CNA "
            "scored, from the key head's layer up), the random mask's interval by a bootstrap over cases and its "
            "seeds (notebook 04's n_random_seeds draws); mask OK if the mask decrease's interval lies >= 50 % and "
            "its low end > 2x the random mask's high end (at least 1 %); keep OK if the keep decrease's interval "
            "lies <= 50 %; reproduced if both, partly if one; inconclusive when an interval straddles a threshold "
            "and the verdict depends on it; not run for tables from before issue 29 (rerun notebook 04)",
            "04", _yu_mask_keep, figures=("04_mask_keep",)),
    Finding("yu_shallow_neurons", "yu", "Sec. 4.4, Table 8",
            "Zeroing the hidden-interpretable shallow neurons (M = 2) hurts far more than random ones.",
            "M = 2: 1,953 neurons, -53.9 % accuracy vs -2.6 % for random",
            f"{YU_TXT}: Table 8 and the text below it",
            "shallow neurons (FFN layers below the key head) qualify at M = 2 when their value vector carried "
            "through the OV map of any attention layer that reads it (up to the key head's layer) has >= 2 number/"
            "operation concepts among its top-50 tokens; gap = hidden minus random accuracy decrease at M = 2 on all "
            "correct 1D + and - cases (on the 1D / cases with the division key head, Yu App. B Table 17, when the "
            "+ / - key head is in layer 0 and has no FFN layer below it), 95 % interval by a bootstrap over the "
            "cases and the random sets' seeds (per-case correctness in 04_hidden_m_sweep's correct_by_prompt); "
            "reproduced if the interval lies >= 25.7 points (half of 51.3); partly if it lies in [5, 25.7); not "
            "reproduced if below 5; else inconclusive; not run for tables from before issue 29 (rerun notebook 04)",
            "04", _yu_shallow, figures=("04_hidden_m_sweep",)),
    Finding("yu_lora_layers", "yu", "Sec. 5, Fig. 2",
            "LoRA in any single attention layer beats the original; shallow layers most.",
            "all 32 LoRA models > original 62.96 %; layers 1-9 about 90 %, falling from layer 10",
            f"{YU_TXT}: Sec. 5 (text under Fig. 2)",
            "share of LoRA layers whose test accuracy beats the original's, 95 % interval by a paired bootstrap over "
            "the test prompts (correct_by_prompt of 05_lora_accuracy_by_layer); reproduced if the interval lies at 1 "
            "(every layer beats it) and the shallow minus deep band accuracy's interval lies > 0; partly if the "
            "share's interval lies >= 0.5; inconclusive when the verdict depends on where in an interval the value is "
            "(or without per-prompt columns)",
            "05", _yu_lora_layers, figures=("05_lora_accuracy_by_layer",)),
    Finding("yu_lora_coef", "yu", "Sec. 5, Table 10",
            "LoRA amplifies the answer neurons' coefficients, more for shallow LoRA layers.",
            "+42-59 % (layers 1-9), +29-53 % (10-16), +2-28 % (17-30)",
            f"{YU_TXT}: Table 10",
            "intervals by a bootstrap over the CNA cases (05_cna_coef_per_case): reproduced if the smallest band "
            "mean, shallow minus deep, lie > 0 and shallow >= 21 % (half of the paper's smallest shallow value, 42 %); "
            "partly if the mean over bands lies >= 5 %; inconclusive when an interval straddles a threshold the "
            "verdict depends on (or without the per-case table)",
            "05", _yu_lora_coef, figures=("05_cna_coef_increase_by_band",)),
    Finding("yu_pruning", "yu", "Sec. 6.1, Table 11",
            "LoRA on a model keeping only the CNA neurons of the deep FFN (5 %) works; on a random one it fails.",
            "original 62.9, LoRA9 89.3, LoRA9-p 82.3, LoRA9-r 17.1 %",
            f"{YU_TXT}: Table 11",
            "gap = CNA-pruned minus random-pruned (mean over seeds) accuracy after LoRA, 95 % interval by a paired "
            "bootstrap over the test prompts (correct_by_prompt of 06_table11); reproduced if the gap's interval lies "
            ">= 32.6 points (half of 65.2) and CNA-pruned minus original lies > 0; partly if the gap lies >= 5 "
            "points; inconclusive when the verdict depends on where in an interval the value is (or without "
            "per-prompt columns)",
            "06", _yu_pruning, figures=("06_table11",)),
    Finding("yu_gender_bias", "yu", "Sec. 6.2, Table 13",
            "Zeroing 18 CNA neurons reduces the gender bias of profession predictions.",
            "1.26 -> 0.81 nats (-35.7 %)",
            f"{YU_TXT}: Sec. 6.2, Table 13",
            "on the model's own biased professions (07_bias_scores, all 8 prompts): reduction of the mean bias by "
            "the top-18 CNA neurons (exact importance of every neuron where affordable) and reduction minus the "
            "layer-matched random sets' (mean over >= 10 seeds), 95 % intervals by a bootstrap over professions "
            "(each with its prompts, stratified by bias gender) crossed with the seeds; reproduced if the reduction "
            "lies >= 17.85 % (half of 35.7) and the difference lies >= 5 points; partly if the difference lies >= 5 "
            "points; not reproduced if it lies below; inconclusive when an interval straddles a threshold the "
            "verdict depends on. Shown, not judged: the same on Table 23's professions, the edit without the early "
            "layers (layer 0), the edit set's early neurons; runs before issue 29 are not run (rerun notebook 07)",
            "07", _yu_gender, figures=("07_table13",)),
)


def smoke_test_reason(finding: Finding, tables: Tables) -> str | None:
    """Why ``finding`` was measured at smoke-test sizes in this folder, or None: its
    notebook ran with ``quick``, or it rests on fine-tuning at scale "quick" (notebook
    05's for notebooks 05 and 06, notebook 08's own; "quick" is what ``scale="auto"``
    gave on a CPU before issue 29), which shows the pipeline, not the paper's numbers."""
    params = tables.params()
    if params.get(finding.notebook, {}).get("quick"):
        return f"notebook {finding.notebook} ran in quick mode (smoke-test sizes)"
    tuned_by = {"05": "05", "06": "05", "08": "08"}.get(finding.notebook)
    if tuned_by is not None and "scale" in params.get(tuned_by, {}):
        from .finetune import SCALES, resolve_scale

        p = params[tuned_by]
        # the scale the run used: recorded since issue 29; before, "auto" meant "quick" on a CPU
        used = p.get("scale_resolved") or resolve_scale(str(p["scale"]), str(p.get("device", "cpu")),
                                                        bool(p.get("quick")), auto_cpu="quick")
        if used == "quick":
            return (f"fine-tuned at scale 'quick' (notebook {tuned_by}'s smoke-test sizes: "
                    f"{SCALES['quick']['n_train']} training prompts, a few layers; run scale='cpu', or 'paper' on a "
                    "GPU, for a verdict)")
    return None


def judge(finding: Finding, tables: Tables) -> Outcome:
    """Apply one finding to a folder; a missing table or a skipped study is 'not run', an
    exception in the computation is 'error' (also printed to stderr), and numbers measured
    at smoke-test sizes (:func:`smoke_test_reason`) are shown but 'not judged'."""
    try:
        out = finding.compute(tables)
        reason = smoke_test_reason(finding, tables)
        return out if reason is None else Outcome(f"{reason}: {out.ours}", NOT_JUDGED, out.metrics, out.interval)
    except NotRun as err:
        return Outcome(str(err), NOT_RUN)
    except Exception as err:  # a malformed table must not stop the report: shown, not hidden
        print(f"arithlib.report: {finding.id}: {type(err).__name__}: {err}", file=sys.stderr)
        return Outcome(f"could not compute ({type(err).__name__}: {err})", ERROR)


def findings_table(fig_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per finding: paper, where, claim, paper number, ours, verdict, rule, source,
    the headline number (``value``) and all metrics (``metrics``, a dict)."""
    tables = Tables(fig_dir)
    rows = []
    for f in FINDINGS:
        out = judge(f, tables)
        value = next(iter(out.metrics.values()), float("nan"))
        ci = out.interval
        rows.append({"id": f.id, "paper": PAPERS[f.paper], "where": f.where, "notebook": f.notebook, "claim": f.claim,
                     "paper_number": f.paper_number, "ours": out.ours, "verdict": out.verdict, "rule": f.rule,
                     "source": f.source, "value": value,
                     "ci_low": ci.low if ci is not None else float("nan"),
                     "ci_high": ci.high if ci is not None else float("nan"),
                     "ci_n": ci.n if ci is not None else 0,
                     "interval": _interval_cell(ci), "metrics": dict(out.metrics)})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- writing


def _interval_cell(ci: Interval | None) -> str:
    """The headline's 95 % interval as shown in the tables: "[lo, hi] (n = N)", or "none"."""
    if ci is None or not (np.isfinite(ci.low) and np.isfinite(ci.high)):
        return "none"
    return f"[{ci.low:.3g}, {ci.high:.3g}] (n = {ci.n})"


def _md_cell(x) -> str:
    if isinstance(x, float):
        x = "" if not np.isfinite(x) else f"{x:.3g}"
    return str(x).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-style Markdown table (no extra dependency)."""
    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(_md_cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_md_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _summary_counts(table: pd.DataFrame) -> str:
    counts = table["verdict"].value_counts()
    return ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS if v not in _RARE_VERDICTS or counts.get(v, 0))


def _notebook_lines(tables: Tables, nb: str) -> list[str]:
    path = next(iter(sorted(tables.dir.glob(f"{nb}_findings.json"))), None)
    if path is None:
        return []
    try:
        return [str(x) for x in json.loads(path.read_text()).get("lines", [])]
    except (OSError, ValueError):
        return []


def _header(tables: Tables) -> tuple[str, list[str]]:
    info, params = tables.info(), tables.params()
    model = tables.model()
    quick = sorted(nb for nb, p in params.items() if p.get("quick"))
    facts = [f"notebooks run: {', '.join(sorted(params)) or 'none'}"]
    if info:
        facts.append(f"{info.get('n_layers')} layers x {info.get('n_heads')} heads, d_mlp {info.get('d_mlp')}")
    if quick:
        facts.append(f"QUICK mode in notebooks {', '.join(quick)}: smoke-test sizes, not evidence")
    return model, facts


def environment_lines(params: dict[str, dict]) -> list[str]:
    """Markdown lines stating the software each notebook's tables were computed with (its
    params JSON's ``environment``): the packages in one line when all notebooks agree,
    else one line per distinct set naming its notebooks, then the commit(s) of the code;
    runs from before environments were recorded are named as such."""
    def grouped(key) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for nb, p in sorted(params.items()):
            env = p.get("environment")
            text = key(env) if env else "not recorded (run before arithlib recorded its environment)"
            out.setdefault(text, []).append(nb)
        return out

    packages = grouped(environment_line)
    if len(packages) == 1:
        lines = [f"**Environment:** {next(iter(packages))}."]
    else:
        lines = ["**Environment** (differs between notebooks):", ""] + [
            f"- notebooks {', '.join(nbs)}: {text}" for text, nbs in packages.items()]
    commits = {c: nbs for c, nbs in grouped(lambda e: e.get("git_commit") or "unknown").items()
               if not c.startswith("not recorded")}
    if commits:
        lines.append("**Code:** " + "; ".join(f"commit {c} (notebooks {', '.join(nbs)})" for c, nbs in commits.items())
                     + ".")
    return lines


RULES_TEXT = ("Verdicts are computed, never typed in: each finding's rule is fixed from the paper's claim. "
              f"A quantitative claim is reproduced when our effect is at least {HALF:.0%} of the paper's; a "
              f"qualitative 'much more' claim needs a gap of {100 * CLEAR_GAP:.0f} points; a gap of "
              f"{100 * NOISE_GAP:.0f} points in the paper's direction is 'partly'. Each rule is judged on the 95 % "
              "interval of the number it reads (exact binomial for an accuracy, a bootstrap over prompts otherwise): "
              "a verdict is given only when the whole interval lies on one side of every threshold, and an interval "
              "that straddles a threshold gives 'inconclusive' (more prompts would decide). Missing tables give "
              "'not run'; numbers measured at smoke-test sizes (a notebook's quick mode, fine-tuning at scale "
              "'quick') are shown but 'not judged'; a computation that fails gives 'error'.")


def notebook_verdicts(fig_dir: str | os.PathLike, notebook: str) -> list[str]:
    """Markdown lines giving the report's verdict, our numbers and the rule for each finding
    of ``notebook`` ("01".."07"), from the tables already in ``fig_dir``: a notebook ends
    with the same verdicts as REPORT.md, by the same rules (one place for every rule)."""
    if notebook not in NOTEBOOKS:
        raise ValueError(f"unknown notebook {notebook!r}; choose one of {sorted(NOTEBOOKS)}")
    tables = Tables(fig_dir)
    return [f"- Report verdict, **{f.id}** ({PAPERS_SHORT[f.paper]}, {f.where}): **{out.verdict}**: {out.ours}. "
            f"Rule: {f.rule}. Paper: {f.paper_number}."
            for f in FINDINGS if f.notebook == notebook for out in [judge(f, tables)]]


def notebook_anchor(nb: str) -> str:
    """The anchor of notebook ``nb``'s section in REPORT.md (``REPORT.md#notebook-01``): an
    explicit one, since a code host derives heading anchors by rules of its own."""
    return f"notebook-{nb}"


def notebook_links(stem: str, model: str | None = None) -> str:
    """The Markdown line a notebook in ``notebooks/`` opens with (``stem``: its file name
    without ``.ipynb``): links, relative to ``notebooks/``, to its executed copy and to its
    section of the report of ``model`` (default: the default model's committed run)."""
    if model is None:
        from .models import DEFAULT_MODEL as model
    folder = f"../figures/{model.replace('/', '__')}"
    return (f"**Results** ({model}, the committed run): [this notebook executed, with its outputs]"
            f"({folder}/notebooks/{stem}.ipynb) · [its section of the report]"
            f"({folder}/REPORT.md#{notebook_anchor(stem[:2])})")


def _executed_notebook(tables: Tables, nb: str) -> Path | None:
    """The executed copy of notebook ``nb`` beside the figures (``notebooks/NN_*.ipynb``), if any."""
    return next(iter(sorted((tables.dir / "notebooks").glob(f"{nb}_*.ipynb"))), None)


def _md_image(name: str) -> str:
    return f"![{name}]({name}.png)"


FIDELITY_TITLE = "Fidelity: the paper's setting beside ours"
FIDELITY_TEXT = ("Each finding's setting in its paper beside ours, aspect by aspect: ours is read from this "
                 "folder's params JSONs (\"not recorded\" where a run predates a parameter); the last column names "
                 "the differences the small offline models force. Every other difference is a choice of this "
                 "reimplementation, shown so it can be judged.")


def report_fidelity(tables: Tables, table: pd.DataFrame) -> pd.DataFrame:
    """:func:`fidelity.fidelity_table` of this folder's params, the prompts row of each
    finding ending with the number of prompts behind its verdict's interval."""
    from .fidelity import fidelity_table

    fid = fidelity_table(tables.params(), {f.id: f.notebook for f in FINDINGS})
    n_of = dict(zip(table["id"], table["ci_n"]))
    prompts = fid["aspect"] == "prompts"
    fid.loc[prompts, "ours"] = [f"{o}; n = {int(n_of[f])} behind the verdict's interval" if n_of.get(f) else o
                                for f, o in zip(fid.loc[prompts, "finding"], fid.loc[prompts, "ours"])]
    return fid


def report_markdown(fig_dir: str | os.PathLike, table: pd.DataFrame | None = None) -> str:
    """REPORT.md's text: the findings table, the rules, and a section per notebook with
    each finding's figure beside it, then the notebook's other figures, all inline."""
    tables = Tables(fig_dir)
    table = findings_table(fig_dir) if table is None else table
    model, facts = _header(tables)
    figures_of = {f.id: f.figures for f in FINDINGS}
    out = [f"# Reproduction report: `{model}`", "", "; ".join(facts) + ".", "",
           *(environment_lines(tables.params()) + [""] if tables.params() else []),
           f"**Verdicts:** {_summary_counts(table)}.", "", RULES_TEXT, "", "## Findings", "",
           markdown_table(table[["id", "paper", "where", "paper_number", "ours", "interval", "verdict"]]), "",
           "### Claims, rules and sources", ""]
    for r in table.itertuples():
        out.append(f"- **{r.id}** ({r.paper}, {r.where}): {r.claim} *Rule:* {r.rule}. *Paper number from:* {r.source}.")
    out += ["", f"## {FIDELITY_TITLE}", "", FIDELITY_TEXT, "",
            markdown_table(report_fidelity(tables, table))]
    for nb, title in NOTEBOOKS.items():
        pngs = [p.stem for p in sorted(tables.dir.glob(f"{nb}_*.png"))]
        sub = table[table.notebook == nb]
        lines = _notebook_lines(tables, nb)
        out += ["", f'<a id="{notebook_anchor(nb)}"></a>', "", f"## {nb} · {title}", ""]
        if not pngs and not lines:
            out.append("Not run for this model.")
            continue
        executed = _executed_notebook(tables, nb)
        if executed is not None:
            rel = executed.relative_to(tables.dir).as_posix()
            out += [f"Executed notebook, with its outputs: [{rel}]({rel})", ""]
        shown: set[str] = set()
        for r in sub.itertuples():
            out.append(f"- {r.id}: **{r.verdict}** — {r.ours}")
            for name in (n for n in figures_of.get(r.id, ()) if n in pngs):
                if name in shown:
                    out[-1] += f" (figure above: [{name}]({name}.png))"
                else:
                    out += ["", f"  {_md_image(name)}", ""]
                    shown.add(name)
        if len(sub):
            out.append("")
        if lines:
            out += ["", "What the notebook found:", ""] + lines + [""]
        rest = [n for n in pngs if n not in shown]
        if rest:
            out += ["More figures:" if shown else "Figures:", ""]
            for name in rest:
                out += [_md_image(name), ""]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip("\n") + "\n"  # one blank line between blocks


_CSS = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px 6px;"
        "vertical-align:top}th{background:#eee}img{max-width:100%;margin:0.5em 0}"
        ".reproduced{background:#d4f4d4}.partly{background:#fff3c4}.not-reproduced{background:#f8d0d0}"
        ".not-run{background:#e8e8e8}.error{background:#f0a0a0}.inconclusive{background:#dde6f8}")


def _html_findings(table: pd.DataFrame) -> str:
    cols = ["id", "paper", "where", "paper_number", "ours", "interval", "verdict", "rule"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in table[cols].itertuples(index=False):
        cls = str(r.verdict).replace(" ", "-")
        body.append("<tr>" + "".join(f'<td class="{cls}">{html.escape(str(v))}</td>' if c == "verdict"
                                     else f"<td>{html.escape(str(v))}</td>" for c, v in zip(cols, r)) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _html_table(frame: pd.DataFrame) -> str:
    """A plain HTML table of ``frame`` (escaped)."""
    e = html.escape
    head = "".join(f"<th>{e(str(c))}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td>{e(str(v))}</td>" for v in r) + "</tr>"
                   for r in frame.itertuples(index=False))
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(path: Path) -> str:
    """A figure that links the PNG beside REPORT.html (relative path).

    Linked, not base64-embedded: the page lies in the same folder as its PNGs, and an
    embedded page (6 MB per model) would add its whole size to the repository's history
    on every committed rerun.
    """
    name = html.escape(path.name, quote=True)
    return (f'<figure><img alt="{html.escape(path.stem)}" src="{name}">'
            f"<figcaption>{html.escape(path.name)}</figcaption></figure>")


def report_html(fig_dir: str | os.PathLike, table: pd.DataFrame | None = None) -> str:
    """REPORT.html's text: the findings table and each notebook's figures, shown inline (linked PNGs beside it)."""
    tables = Tables(fig_dir)
    table = findings_table(fig_dir) if table is None else table
    model, facts = _header(tables)
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Report: {e(model)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>Reproduction report: {e(model)}</h1>",
             f"<p>{e('; '.join(facts))}.</p>", f"<p><b>Verdicts:</b> {e(_summary_counts(table))}.</p>",
             f"<p>{e(RULES_TEXT)}</p>", "<h2>Findings</h2>", _html_findings(table),
             "<h2 id='fidelity'>" + e(FIDELITY_TITLE) + "</h2>", f"<p>{e(FIDELITY_TEXT)}</p>",
             _html_table(report_fidelity(tables, table))]
    for nb, title in NOTEBOOKS.items():
        pngs = sorted(tables.dir.glob(f"{nb}_*.png"))
        sub = table[table.notebook == nb]
        lines = _notebook_lines(tables, nb)
        parts.append(f'<h2 id="{notebook_anchor(nb)}">{e(nb)} · {e(title)}</h2>')
        if not pngs and not lines:
            parts.append("<p>Not run for this model.</p>")
            continue
        executed = _executed_notebook(tables, nb)
        if executed is not None:  # and its HTML rendering, where run_all.sh wrote one (not committed)
            links = [e(p.relative_to(tables.dir).as_posix(), quote=True)
                     for p in (executed, executed.with_suffix(".html")) if p.is_file()]
            parts.append("<p>Executed notebook, with its outputs: "
                         + " · ".join(f'<a href="{rel}">{rel}</a>' for rel in links) + "</p>")
        if len(sub):
            parts.append("<ul>" + "".join(f"<li>{e(r.id)}: <b>{e(r.verdict)}</b> — {e(r.ours)}</li>"
                                          for r in sub.itertuples()) + "</ul>")
        if lines:
            parts.append("<p>What the notebook found:</p><ul>"
                         + "".join(f"<li>{e(x.lstrip('- '))}</li>" for x in lines) + "</ul>")
        parts += [_img(p) for p in pngs]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(fig_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``REPORT.md`` and ``REPORT.html`` into ``fig_dir`` (atomically); return both paths."""
    fig_dir = Path(fig_dir)
    if not fig_dir.is_dir():
        raise FileNotFoundError(f"{fig_dir} is not a folder of notebook outputs")
    table = findings_table(fig_dir)
    md = write_text(fig_dir / "REPORT.md", report_markdown(fig_dir, table))
    page = write_text(fig_dir / "REPORT.html", report_html(fig_dir, table))
    return md, page


# --------------------------------------------------------------------------- across models


def cross_model_table(fig_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Findings side by side for N models: columns finding, quantity, paper (the paper's
    number, on the "ours" row) and one per model (its folder name); rows: the model's
    size, then per finding its verdict, our one-line summary and every metric (layer
    positions as layer / n_layers, so models of different depth compare)."""
    names, columns = [], []
    for d in fig_dirs:
        tables = Tables(d)
        info = tables.info()
        col: dict[tuple[str, str], object] = {
            ("model", "n_layers"): info.get("n_layers", ""), ("model", "n_heads"): info.get("n_heads", ""),
            ("model", "d_mlp"): info.get("d_mlp", ""),
            ("model", "quick notebooks"): ",".join(sorted(nb for nb, p in tables.params().items() if p.get("quick")))}
        for f, row in zip(FINDINGS, findings_table(d).itertuples()):
            col[(f.id, "verdict")] = row.verdict
            col[(f.id, "interval")] = row.interval
            col[(f.id, "ours")] = row.ours
            for k, v in row.metrics.items():
                col[(f.id, k)] = v
        names.append(Path(d).name)
        columns.append(col)
    keys: list[tuple[str, str]] = []
    for col in columns:  # rows in first-seen order: a metric only one model has still gets its row
        keys += [k for k in col if k not in keys]
    order = {f.id: i for i, f in enumerate(FINDINGS)}
    rank = {"verdict": 0, "interval": 1, "ours": 2}
    keys.sort(key=lambda k: (-1 if k[0] == "model" else order.get(k[0], len(order)), rank.get(k[1], 2)))
    paper = {f.id: f.paper_number for f in FINDINGS}
    frame = pd.DataFrame({"finding": [k[0] for k in keys], "quantity": [k[1] for k in keys],
                          "paper": [paper[k[0]] if k[1] == "ours" else "" for k in keys]})
    for name, col in zip(_unique(names), columns):
        frame[name] = [col.get(k, "") for k in keys]
    return frame


def verdict_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The verdicts of :func:`cross_model_table`'s ``frame`` in one compact table: one row
    per finding (its paper and section, the paper's number, each model's verdict followed
    by the 95 % interval of the number it read, "reproduced [0.1, 0.3] (n = 48)") and a
    last row counting each model's verdicts."""
    models = [c for c in frame.columns if c not in ("finding", "quantity", "paper")]
    verdicts = frame[frame["quantity"] == "verdict"].set_index("finding")
    intervals = frame[frame["quantity"] == "interval"].set_index("finding")
    where = {f.id: (f"{PAPERS_SHORT[f.paper]}, {f.where}", f.paper_number) for f in FINDINGS}

    def cell(f: str, m: str) -> str:
        ci = str(intervals.at[f, m]) if f in intervals.index else ""
        return f"{verdicts.at[f, m]} {ci}" if ci and ci not in ("none", "nan") else str(verdicts.at[f, m])

    rows = [{"finding": f, "paper": where[f][0], "paper's number": where[f][1], **{m: cell(f, m) for m in models}}
            for f in verdicts.index]
    counts = {m: ", ".join(f"{(verdicts[m] == v).sum()} {v}" for v in VERDICTS if (verdicts[m] == v).any())
              for m in models}
    rows.append({"finding": "**all**", "paper": "", "paper's number": "", **counts})
    return pd.DataFrame(rows)


README_START = ("<!-- verdicts: written by `python -m arithlib.report --cross-in figures --readme README.md`; "
                "do not edit -->")
README_END = "<!-- /verdicts -->"


def replace_readme_block(text: str, block: str) -> str:
    """``text`` with what lies between the lines :data:`README_START` and :data:`README_END`
    replaced by ``block``; a clear error when the markers are missing or out of order."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no verdict block: add the two lines\n{README_START}\n{README_END}\n"
                         "where the table should go, then rerun")
    head = text[:start + len(README_START)]
    return head + "\n" + block.rstrip("\n") + "\n" + text[end:]


TOY_FOLDER = "toy-arith"  # arithlib.models.TOY_MODEL (not imported: the report needs no torch)


def model_folders(figures: str | os.PathLike) -> list[Path]:
    """The folders of ``figures`` holding a real model's run (a notebook's
    ``NN_*_params.json``; the toy model's folder left out): the models of the cross-model
    report and of the README's verdict table."""
    root = Path(figures)
    return sorted(d for d in root.iterdir()
                  if d.is_dir() and d.name != TOY_FOLDER and any(d.glob("[0-9][0-9]_*_params.json")))


def _linked_models(table: pd.DataFrame, fig_dirs: Sequence[str | os.PathLike], link_from: str | os.PathLike
                   ) -> pd.DataFrame:
    """``table`` with each model column named as a link to its ``REPORT.md``, relative to
    the folder ``link_from`` of the Markdown file that shows it."""
    links = {Path(d).name: Path(os.path.relpath(Path(d).resolve() / "REPORT.md", Path(link_from).resolve())).as_posix()
             for d in fig_dirs}
    return table.rename(columns={m: f"[{m}]({link})" for m, link in links.items()})


def _verdict_markdown(frame: pd.DataFrame, fig_dirs: Sequence[str | os.PathLike],
                      link_from: str | os.PathLike | None) -> str:
    table = verdict_table(frame)
    return markdown_table(table if link_from is None else _linked_models(table, fig_dirs, link_from))


def verdict_markdown(fig_dirs: Sequence[str | os.PathLike], link_from: str | os.PathLike | None = None) -> str:
    """:func:`verdict_table` of ``fig_dirs`` (models from the smallest up) as Markdown;
    with ``link_from`` (the folder of the file that shows it) the model names link to
    their reports. The README's verdict block is this with ``link_from`` its folder
    (``tests/test_report.py`` checks the committed one)."""
    fig_dirs = sorted(fig_dirs, key=lambda d: _size_key(Tables(d)))
    return _verdict_markdown(cross_model_table(fig_dirs), fig_dirs, link_from)


def n_params(info: dict) -> float:
    """Parameter count from a model's shapes (``model_info`` of the params files):
    attention (Q, O: d_model x n_heads d_head; K, V: d_model x n_kv_heads d_head),
    MLP (3 or 2 matrices of d_model x d_mlp) per layer, plus one embedding matrix;
    norms and biases are left out (< 0.1 %). NaN when a shape is missing."""
    try:
        L, d, h, kv = (int(info[k]) for k in ("n_layers", "d_model", "n_heads", "n_kv_heads"))
        dh, dm, V = int(info["d_head"]), int(info["d_mlp"]), int(info["d_vocab"])
    except (KeyError, TypeError, ValueError):
        return float("nan")
    attn = 2 * d * h * dh + 2 * d * kv * dh
    mlp = (3 if info.get("gated_mlp", True) else 2) * d * dm
    return float(L * (attn + mlp) + V * d)


def _heuristic_share(t: Tables, _metrics: dict[str, dict]) -> dict[str, float]:
    ms = t.csv("03_matched_share")
    return {"circuit neurons matching a heuristic": float(ms["matched_share"].mean()),
            "shuffled-activation null": float(ms["matched_share_null"].mean())}


def _metric(finding_id: str, **series: str) -> Callable[[Tables, dict[str, dict]], dict[str, float]]:
    """Panel values from one finding's metrics: ``series label=metric key``."""
    def values(_t: Tables, metrics: dict[str, dict]) -> dict[str, float]:
        m = metrics[finding_id]
        return {label: float(m.get(key, float("nan"))) for label, key in series.items()}
    return values


#: The quantities compared across model sizes (issue: a size axis), one panel each:
#: (panel title, y-axis label, values from a folder's tables and its findings' metrics).
CROSS_METRICS: tuple[tuple[str, str, Callable[[Tables, dict[str, dict]], dict[str, float]]], ...] = (
    ("Key heads (Zhang Sec. 5.1)", "share of heads",
     _metric("zhang_key_heads", **{"key-head share": "key-head share"})),
    ("Knockout gap (Zhang Fig. 3)", "accuracy drop",
     _metric("zhang_knockout", **{"effect order": "effect-rank drop", "random order": "random-rank drop"})),
    ("Answer direction rises (Zhang Fig. 6b)", "layer / n_layers",
     _metric("zhang_mlp_answer", start="answer-writing start layer / n_layers",
             inflection="answer-writing inflection layer / n_layers", peak="answer-writing peak layer / n_layers")),
    ("Neuron circuit size (Nikankin Fig. 4b)", "share of neurons per layer",
     _metric("nikankin_faithfulness", **{"smallest share reaching faithfulness 0.9":
                                         "smallest share per layer reaching 0.9"})),
    ("Heuristic neurons (Nikankin Sec. 4)", "share of circuit neurons", _heuristic_share),
    ("CNA mask / keep, top 99 (Yu Table 5)", "accuracy decrease (%)",
     _metric("yu_mask_keep", mask="mask accuracy decrease (%)", keep="keep accuracy decrease (%)",
             **{"random mask": "random-mask accuracy decrease (%)"})),
    ("Gender-bias edit (Yu Table 13)", "bias reduction (%)",
     _metric("yu_gender_bias", **{"CNA neurons": "CNA bias reduction (%)", "random neurons": "random bias reduction (%)"})),
)

#: Per-layer curves compared across sizes on normalised depth (layer / n_layers):
#: title -> (table, filter column, filter value, y column, y label).
CROSS_CURVES: dict[str, tuple[str, str | None, str | None, str, str]] = {
    "LoRA in one attention layer (Yu Fig. 2)": ("05_lora_accuracy_by_layer", None, None, "accuracy",
                                                "test accuracy"),
    "cos(MLP_out - MLP_in, W_U[C]) (Zhang Fig. 6b)": ("02_mlp_cosines", "measure", "delta_C", "mean",
                                                       "mean cosine"),
    "Logit lens: answer probability (Zhang Sec. 5.2)": ("02_logit_lens", None, None, "mean_prob", "mean p(answer)"),
}


def cross_model_metrics(fig_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Long table of :data:`CROSS_METRICS` for N model folders: model, n_params
    (:func:`n_params`), panel, ylabel, series, value (NaN where a study did not run)."""
    rows = []
    for name, d in zip(_unique([Path(d).name for d in fig_dirs]), fig_dirs):
        tables = Tables(d)
        metrics = findings_table(d).set_index("id")["metrics"].to_dict()
        size = n_params(tables.info())
        for panel, ylabel, values in CROSS_METRICS:
            try:
                got = values(tables, metrics)
            except (NotRun, KeyError, ValueError):
                got = {}
            for series, v in (got or {"": float("nan")}).items():
                rows.append({"model": name, "n_params": size, "panel": panel, "ylabel": ylabel, "series": series,
                             "value": v})
    return pd.DataFrame(rows)


def cross_model_curves(fig_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Long table of :data:`CROSS_CURVES`: model, n_params, curve, ylabel, layer,
    depth (= layer / n_layers) and value; layers < 0 (the "original" row) are dropped."""
    frames = []
    for name, d in zip(_unique([Path(d).name for d in fig_dirs]), fig_dirs):
        tables = Tables(d)
        for title, (table, col, val, y, ylabel) in CROSS_CURVES.items():
            if not tables.has(table):
                continue
            tab = tables.csv(table)
            if col is not None:
                tab = tab[tab[col].astype(str) == val]
            if "op" in tab.columns:  # per-operator rows: the pooled row if present, else the mean over operators
                tab = tab[tab["op"].astype(str) == "all"] if (tab["op"].astype(str) == "all").any() else tab
            tab = tab[pd.to_numeric(tab["layer"], errors="coerce") >= 0]
            if tab.empty or y not in tab:
                continue
            curve = tab.groupby("layer")[y].mean().reset_index()
            L = tables.n_layers(curve["layer"])
            frames.append(pd.DataFrame({"model": name, "n_params": n_params(tables.info()), "curve": title,
                                        "ylabel": ylabel, "layer": curve["layer"].astype(int),
                                        "depth": curve["layer"] / L, "value": curve[y]}))
    cols = ["model", "n_params", "curve", "ylabel", "layer", "depth", "value"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)


#: A step between two models counts as a change when it exceeds this share of the
#: quantity's largest absolute value over the models (smaller steps are "flat").
TREND_TOLERANCE = 0.01


def size_trend(values: Sequence[float], tolerance: float = TREND_TOLERANCE) -> str:
    """How a quantity moves from the smallest model to the largest, ``values`` ordered by
    size (NaN = not run, skipped): "rises with size" / "falls with size" when every step
    between consecutive models goes that way by more than ``tolerance`` x max |value|,
    "flat" when no step does, "mixed" otherwise; "fewer than 3 models" when fewer
    than three have a value (two points always look monotone)."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if len(v) < 3:
        return "fewer than 3 models"
    tol = tolerance * float(np.abs(v).max())
    steps = np.diff(v)
    up, down = steps > tol, steps < -tol
    if up.all():
        return "rises with size"
    if down.all():
        return "falls with size"
    if not (up | down).any():
        return "flat"
    return "mixed"


def size_order(metrics: pd.DataFrame) -> list[str]:
    """The models of a :func:`cross_model_metrics` table by parameter count, smallest
    first, models of unknown size last (the column order of the report and its figure)."""
    sizes = metrics.drop_duplicates("model").set_index("model")["n_params"]
    return sorted(sizes.index, key=lambda m: (not np.isfinite(sizes[m]), sizes[m] if np.isfinite(sizes[m]) else 0.0))


def size_trends(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per panel and series of :func:`cross_model_metrics`: the value of each
    model (columns from the smallest model up) and :func:`size_trend` over them."""
    order = size_order(metrics)
    part = metrics[metrics["series"] != ""]
    rows = []
    for (panel, series), g in part.groupby(["panel", "series"], sort=False):
        by_model = g.set_index("model")["value"]
        vals = [float(by_model.get(m, float("nan"))) for m in order]
        rows.append({"panel": panel, "series": series, **dict(zip(order, vals)), "trend": size_trend(vals)})
    return pd.DataFrame(rows, columns=["panel", "series", *order, "trend"])


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def _size_key(tables: "Tables") -> tuple[bool, float]:
    """Sort key: parameter count, models of unknown size last."""
    size = n_params(tables.info())
    return (not np.isfinite(size), size if np.isfinite(size) else 0.0)


def write_cross_model(fig_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None,
                      readme: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write ``CROSS_MODEL.md`` and ``CROSS_MODEL.csv`` (the findings side by side, one
    column per model from the smallest up),
    ``CROSS_MODEL_metrics.csv`` / ``CROSS_MODEL_curves.csv`` (the size-axis quantities),
    ``CROSS_MODEL_trends.csv`` (each quantity's trend with size, :func:`size_trends`)
    and the figure ``CROSS_MODEL.png`` / ``.pdf`` (one panel per quantity, models
    ordered by size) into ``out_dir`` (default: the folder holding the first model
    folder); with ``readme``, the same verdict table goes into that file's verdict block
    (:func:`replace_readme_block`); return the paths of the Markdown and the CSV."""
    from .outputs import save_figure, save_table
    from .plots.report import cross_model_figure

    out = Path(out_dir) if out_dir is not None else Path(fig_dirs[0]).resolve().parent
    fig_dirs = sorted(fig_dirs, key=lambda d: _size_key(Tables(d)))  # columns from the smallest model up
    frame = cross_model_table(fig_dirs)
    metrics, curves = cross_model_metrics(fig_dirs), cross_model_curves(fig_dirs)
    save_table(metrics, out, "CROSS_MODEL_metrics")
    save_table(curves, out, "CROSS_MODEL_curves")
    save_figure(cross_model_figure(metrics, curves), out, "CROSS_MODEL")
    sizes = metrics.drop_duplicates("model").set_index("model")["n_params"]
    papers = {f.id: f"{PAPERS[f.paper]}, {f.where}: {f.paper_number}" for f in FINDINGS}
    md = ["# Findings across models", "", RULES_TEXT, "",
          "Models (parameters from their shapes): "
          + ", ".join(f"{m} ({v / 1e6:.0f} M)" if np.isfinite(v) else m for m, v in sizes.items()) + ".", "",
          "## Verdicts", "", _verdict_markdown(frame, fig_dirs, out), "",
          "![The size-axis quantities, one panel each](CROSS_MODEL.png)", "",
          "Layer positions are given as layer / n_layers. Paper numbers:", ""]
    md += [f"- **{k}**: {v}" for k, v in papers.items()]
    trends = size_trends(metrics)
    if len(trends):
        save_table(trends, out, "CROSS_MODEL_trends")
        shown = trends.copy()
        for m in sizes.index:
            if m in shown:
                shown[m] = shown[m].map(lambda x: "not run" if not np.isfinite(x) else f"{x:.3g}")
        md += ["", "## Across sizes", "",
               "Each size-axis quantity by model, smallest first, and its trend by a fixed rule: "
               "'rises' / 'falls with size' when every step between consecutive models goes that way by more than "
               f"{TREND_TOLERANCE:.0%} of the quantity's largest absolute value, 'flat' when no step does, 'mixed' "
               "otherwise (some steps flat or opposite). With three models this describes these models; it is not "
               "a scaling law.",
               "", markdown_table(shown)]
    md += ["", "## All findings", "", markdown_table(frame), ""]
    if readme is not None:
        path = Path(readme)
        write_text(path, replace_readme_block(path.read_text(), _verdict_markdown(frame, fig_dirs, path.parent)))
    md_path = write_text(out / "CROSS_MODEL.md", "\n".join(md))
    csv_path = write_text(out / "CROSS_MODEL.csv", frame.to_csv(index=False, float_format="%.6g"))
    return md_path, csv_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arithlib.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("fig_dirs", nargs="*", help="figures/<model> folders written by the notebooks")
    parser.add_argument("--cross-in", default=None, help="cross-model files over every model folder in this "
                                                          "folder (model_folders; the toy model left out)")
    parser.add_argument("--cross-out", default=None, help="folder for CROSS_MODEL.md/.csv (default: the first "
                                                          "folder's parent)")
    parser.add_argument("--cross-only", action="store_true", help="write only the cross-model files (the folders' "
                                                                    "own reports are left as they are)")
    parser.add_argument("--readme", default=None, help="also write the verdict table into this README's verdict "
                                                        "block (between the lines README_START and README_END)")
    args = parser.parse_args(argv)
    if args.cross_in:
        if args.fig_dirs or args.cross_only:
            parser.error("--cross-in takes no folders and implies --cross-only")
        args.fig_dirs, args.cross_only = model_folders(args.cross_in), True
    elif not args.fig_dirs:
        parser.error("give figures/<model> folders or --cross-in figures")
    for d in [] if args.cross_only else args.fig_dirs:
        md, page = write_report(d)
        table = findings_table(d)
        print(f"{md} and {page.name} written ({_summary_counts(table)})")
    if len(args.fig_dirs) >= 2:
        md, csv = write_cross_model(args.fig_dirs, args.cross_out, args.readme)
        print(f"{md} and {csv.name} written" + (f"; verdict table into {args.readme}" if args.readme else ""))
    elif args.readme:
        print(f"{args.readme} left as it is: the verdict table needs two or more model folders")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
