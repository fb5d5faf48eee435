"""Yu & Ananiadou 2024's findings on changing the model: LoRA on one layer at a time and the
coefficients it raises (Sec. 5), pruning and retraining (Sec. 6.1) and the gender-bias edit
(Sec. 6.2); each function reads a figures folder and returns an Outcome. The findings on
the heads and neurons themselves are in :mod:`arithlib.report.yu`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from ..core import papers
from ..core.papers import HALF, NOISE_GAP
from ..core.stats import (
    INCONCLUSIVE,
    UNDECIDABLE,
    Interval,
    binomial_ci,
    bootstrap_ci,
    crossed_bootstrap_ci,
    decode_correct,
)
from .rules import (
    RERUN_PER_PROMPT,
    Outcome,
    _above_zero,
    _ci_text,
    _correct_matrix,
    _grade,
    _judged,
    _pct,
    _possible,
    _seed_resampled_gap,
)
from .tables import MissingTable, NotApplicable, NotRun, Tables


def _baseline_premise(rows: pd.DataFrame, what: str) -> None:
    """The premise of the fine-tuning findings: the original model answers the 2-digit test
    prompts often enough to carry an accuracy change of the rules' smallest size. Raises
    NotApplicable, with the numbers, when the exact binomial interval of the original's
    accuracy (``rows``' first row: ``correct_by_prompt``, else ``accuracy`` and ``n_test``)
    lies wholly below 5 % (``NOISE_GAP``, the 'partly' gap): at about 1 % (SmolLM2) every
    arm stays near zero whatever the mechanism."""
    if rows.empty:
        return
    r = rows.iloc[0]
    c = decode_correct(r.get("correct_by_prompt"))
    k, n = (
        (int(c.sum()), len(c))
        if c is not None
        else (int(round(float(r["accuracy"]) * int(r["n_test"]))), int(r["n_test"]))
        if "n_test" in r
        else (0, 0)
    )
    if n == 0:
        return
    ci = binomial_ci(k, n)
    if ci.high < NOISE_GAP:
        raise NotApplicable(
            f"premise failed: the original model answers {_pct(ci.estimate)} "
            f"[{100 * ci.low:.1f}, {100 * ci.high:.1f}] of the {n} 2-digit test prompts, below the "
            f"{100 * NOISE_GAP:.0f}-point gap the rule reads, so {what} cannot show the paper's effect"
        )


def _band_layers(text: object) -> list[int]:
    """Layers of a band cell of notebook 05's tables ("1-7", or one layer "0")."""
    lo, _, hi = str(text).partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


#: A LoRA layer "beats" the original when its accuracy is higher by at least this margin (the
#: 'partly' gap, stated before any run): one prompt more is not an improvement.
LORA_MARGIN = NOISE_GAP
#: "Every layer beats the original" judged on a share of layers resampled with the prompts:
#: reproduced when the interval lies at >= 0.9 (at most one layer in ten falls short).
LORA_NEARLY_ALL = 0.9


def _yu_lora_layers(t: Tables) -> Outcome:
    acc = t.csv("05_lora_accuracy_by_layer")
    base_rows = acc[acc["layer"] == -1]
    lora = acc[acc["layer"] >= 0]
    if base_rows.empty or lora.empty:
        raise NotRun("no original row or no LoRA model")
    _baseline_premise(base_rows, "LoRA on one layer")
    base = float(base_rows["accuracy"].iloc[0])
    above = float((lora["accuracy"] >= base + LORA_MARGIN).mean())
    bands = t.csv("05_lora_accuracy_bands") if t.has("05_lora_accuracy_bands") else pd.DataFrame()
    means = bands.set_index("band")["mean_accuracy"] if len(bands) else pd.Series(dtype=float)
    has_bands = {"shallow", "deep"} <= set(means.index)
    L = t.n_layers(acc["layer"])
    best = lora.loc[lora["accuracy"].idxmax()]
    band_txt = ", ".join(f"{b} {_pct(v, 0)}" for b, v in means.items())
    text = (
        f"original {_pct(base, 0)}; {_pct(above, 0)} of {len(lora)} LoRA layers beat it by >= "
        f"{100 * LORA_MARGIN:.0f} points; best layer "
        f"{int(best['layer'])} ({_pct(best['accuracy'], 0)})" + (f"; bands: {band_txt}" if band_txt else "")
    )
    metrics = {
        "share of LoRA layers beating the original by the margin": above,
        "best LoRA layer / n_layers": float(best["layer"]) / L,
        "shallow minus deep band accuracy": float(means["shallow"] - means["deep"]) if has_bands else float("nan"),
    }
    mat = _correct_matrix(pd.concat([base_rows.iloc[:1], lora]))
    if mat is None:
        raise NotRun(f"{text}; {RERUN_PER_PROMPT.format(nb='05', table='05_lora_accuracy_by_layer')}")
    # the unit of the claim is the layer: prompts and layers resampled (crossed bootstrap)
    share = crossed_bootstrap_ci(
        lambda orig, x: float((x.mean(0) >= orig.mean() + LORA_MARGIN).mean()),
        mat[:, 0].astype(float),
        replicates=mat[:, 1:].astype(float),
    )
    falls: set[bool] = {False}
    if has_bands and "layers" in bands:
        layers = lora["layer"].astype(int).tolist()
        band = bands.set_index("band")["layers"]
        cols = {b: [1 + i for i, l in enumerate(layers) if l in _band_layers(band[b])] for b in ("shallow", "deep")}
        gap = bootstrap_ci(
            lambda x: float(x[:, cols["shallow"]].mean(0).mean() - x[:, cols["deep"]].mean(0).mean()), mat
        )
        falls = _above_zero(gap)
        text += f" (shallow minus deep {_pct(gap.estimate, 0)}{_ci_text(gap.scaled(100))})"
    verdict = _judged(
        lambda full, half, f: _grade(full and f, half), _possible(share, LORA_NEARLY_ALL), _possible(share, 0.5), falls
    )
    text = (
        f"{text}; share beating the original by the margin {_pct(share.estimate, 0)}{_ci_text(share.scaled(100))} "
        f"(bootstrap over {share.n} test prompts crossed with the {len(lora)} layers; one LoRA training per layer: "
        "the interval excludes training variance)"
    )
    if verdict == INCONCLUSIVE and len(lora) >= L:  # every layer of the model is trained: nothing left to add
        return Outcome(f"{text}; undecidable here: all {L} layers are trained", UNDECIDABLE, metrics, share)
    return Outcome(
        text, verdict, metrics, share, thresholds=(LORA_NEARLY_ALL, 0.5), unit=f"LoRA layers (now {len(lora)} of {L})"
    )


def _coef_increase_stats(
    per_case: pd.DataFrame, layer_of: dict[str, int], bands: dict[str, list[int]]
) -> tuple[np.ndarray, np.ndarray, Callable[[np.ndarray, np.ndarray], dict[str, float]]]:
    """Notebook 05's per-case coefficient parts (cases x (model, k) arrays of num and den)
    and the function giving each band's mean increase (%) over its models and k from them,
    as ``lora.band_increase_table`` does from all cases."""
    pc = per_case.assign(layer=per_case["model"].map(layer_of)).dropna(subset=["layer"])
    num = pc.pivot_table(index="case", columns=["model", "k"], values="num", aggfunc="sum").fillna(0.0)
    den = (
        pc.pivot_table(index="case", columns=["model", "k"], values="den", aggfunc="sum").reindex_like(num).fillna(0.0)
    )
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
    if t.has("05_lora_accuracy_by_layer"):
        acc = t.csv("05_lora_accuracy_by_layer")
        _baseline_premise(acc[acc["layer"] == -1], "the LoRA models' coefficient changes on its correct cases")
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
        big = _possible(
            bootstrap_ci(lambda n, d: band_means(n, d)["shallow"], num, den), HALF * papers.YU_SHALLOW_COEF_MIN
        )
    else:
        falls = big = {False}
    return Outcome(
        f"{text}; mean over bands {mean.estimate:+.1f} %{_ci_text(mean)} (bootstrap over {mean.n} cases; "
        "one LoRA training per layer: the interval excludes training variance)",
        _judged(
            lambda pos, f, b, half: _grade(pos and f and b, half),
            _above_zero(low),
            falls,
            big,
            _possible(mean, 100 * NOISE_GAP),
        ),
        metrics,
        mean,
        thresholds=(100 * NOISE_GAP,),
    )


def _yu_pruning(t: Tables) -> Outcome:
    tab = t.csv("06_table11")
    _baseline_premise(tab[tab["model"] == "original"], "pruning and retraining")
    acc = tab.groupby("model")["accuracy"].mean()
    needed = {"original", "LoRA on CNA-pruned", "LoRA on random-pruned"}
    if not needed <= set(acc.index):
        raise NotRun("Table 11 rows missing")
    orig, cna, rnd = acc["original"], acc["LoRA on CNA-pruned"], acc["LoRA on random-pruned"]
    lora = acc.get("LoRA", float("nan"))
    gap = float(cna - rnd)
    text = f"original {_pct(orig)}, LoRA {_pct(lora)}, LoRA on CNA-pruned {_pct(cna)}, on random-pruned {_pct(rnd)}"
    metrics = {"CNA-pruned minus random-pruned accuracy": gap, "CNA-pruned minus original accuracy": float(cna - orig)}
    pick = lambda name: tab[tab["model"] == name]  # noqa: E731
    n_seeds = len(pick("LoRA on random-pruned"))
    mat = _correct_matrix(
        pd.concat([pick("original").iloc[:1], pick("LoRA on CNA-pruned").iloc[:1], pick("LoRA on random-pruned")])
    )
    if mat is None:
        raise NotRun(f"{text}; {RERUN_PER_PROMPT.format(nb='06', table='06_table11')}")
    ci = bootstrap_ci(_seed_resampled_gap(n_seeds), mat)
    full = HALF * (papers.YU_TABLE11["LoRA on CNA-pruned"] - papers.YU_TABLE11["LoRA on random-pruned"]) / 100
    vs_orig = bootstrap_ci(lambda x: float(x[:, 1].mean() - x[:, 0].mean()), mat)
    return Outcome(
        f"{text}; CNA minus random {_pct(ci.estimate)}{_ci_text(ci.scaled(100))}, minus original "
        f"{_pct(vs_orig.estimate)}{_ci_text(vs_orig.scaled(100))} (paired bootstrap over {ci.n} test "
        f"prompts{f' and the {n_seeds} random prunings' if n_seeds > 1 else ''}; one LoRA training per "
        "arm: the interval excludes training variance)",
        _judged(
            lambda big, above, half: _grade(big and above, half),
            _possible(ci, full),
            _above_zero(vs_orig),
            _possible(ci, NOISE_GAP),
        ),
        metrics,
        ci,
        thresholds=(full, NOISE_GAP),
    )


def _yu_gender(t: Tables) -> Outcome:
    if not t.has("07_table13"):
        if t.has("07_top_predictions"):
            raise NotRun("no profession token differs by gender in the top-100 lists")
        raise MissingTable("07_table13.csv missing")
    p07 = t.params().get("07")
    if (
        (p07 is not None and "early_layers" not in p07)
        or not t.has("07_bias_scores")
        or not t.has("07_paper_bias_scores")
    ):
        raise NotRun(
            "07's tables predate the current notebook-07 method (edit set from a 20-per-profession screen, 3 random seeds, no "
            "Table-23 professions, no early-layer check): rerun notebook 07"
        )
    from ..yu.bias import reduction_intervals

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
    ci = Interval(
        float(r["reduction_pct"]),
        float(r["reduction_low"]),
        float(r["reduction_high"]),
        int(r["n_professions"]),
        "bootstrap",
    )
    diff = Interval(
        float(r["diff_pts"]), float(r["diff_low"]), float(r["diff_high"]), int(r["n_professions"]), "crossed bootstrap"
    )
    rnd = Interval(
        float(r["random_pct"]),
        float(r["random_low"]),
        float(r["random_high"]),
        int(r["n_professions"]),
        "crossed bootstrap",
    )
    text = (
        f"model's {int(r['n_professions'])} biased professions x {int(r['n_prompts'])} prompts: top-{k} CNA "
        f"neurons zeroed reduce the bias by {ci.estimate:.1f} %{_ci_text(ci)}, layer-matched random sets "
        f"({int(r['n_seeds'])} seeds) by {rnd.estimate:.1f} %{_ci_text(rnd)}; CNA minus random "
        f"{diff.estimate:.1f} points{_ci_text(diff)}"
    )
    metrics = {
        "CNA bias reduction (%)": ci.estimate,
        "random bias reduction (%)": float(r["random_pct"]),
        "CNA minus random (points)": diff.estimate,
    }
    paper = reduction_intervals(t.csv("07_paper_bias_scores"), ("cna",), [k])
    if len(paper):
        q = paper.iloc[0]
        text += (
            f"; on Table 23's professions ({int(q['n_professions'])} first tokens) "
            f"{q['reduction_pct']:.1f} % [{q['reduction_low']:.1f}, {q['reduction_high']:.1f}] vs random "
            f"{q['random_pct']:.1f} %"
        )
        metrics["Table-23 professions: CNA bias reduction (%)"] = float(q["reduction_pct"])
    if (sc["kind"] == "cna_late").any():
        late = reduction_intervals(sc, ("cna_late",), [k])
        if len(late):
            q = late.iloc[0]
            text += (
                f"; top-{k} without the early layers {q['reduction_pct']:.1f} % [{q['reduction_low']:.1f}, "
                f"{q['reduction_high']:.1f}] (random {q['random_pct']:.1f} %)"
            )
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
    return Outcome(
        text,
        _judged(
            lambda big, above: _grade(big and above, above),
            _possible(ci, HALF * papers.YU_BIAS_REDUCTION_PCT),
            _possible(diff, 100 * NOISE_GAP),
        ),
        metrics,
        ci,
        thresholds=(HALF * papers.YU_BIAS_REDUCTION_PCT,),
        population=ci.n,
    )  # the model's biased professions: the lexicon's whole list
