"""Findings of notebook 09 (number representations): Kantamneni & Tegmark's helix patch
and Zhou et al.'s Fourier features; each function reads a figures folder and returns an
Outcome. A folder without notebook 09's tables is "not run"."""

from __future__ import annotations

import numpy as np

from ..core.papers import KT_HELIX_SHARE, ZHOU_EXCESS, ZHOU_MIN_NUMBERS
from ..core.stats import INCONCLUSIVE, NOT_REPRODUCED, PARTLY, REPRODUCED, Interval, bootstrap_ci
from .rules import Outcome, _above_zero, _judged, _pct, _possible
from .tables import NotApplicable, NotRun, Tables

RERUN_09 = "rerun notebook 09"


def _number_init(t: Tables) -> str:
    return str(t.params().get("09", {}).get("number_init", "pretrained"))


def _kantamneni_helix_patch(t: Tables) -> Outcome:
    """Share of the layer patch restored by the helix fit, pooled over the pairs and the
    first half of the layers, and helix minus PCA of the same size; bootstrap over pairs."""
    if not t.has("09_helix_patch_prompts"):
        raise NotRun("09_helix_patch_prompts missing: run notebook 09")
    p = t.csv("09_helix_patch_prompts")
    if p.empty:
        raise NotApplicable("no pair of correctly answered prompts to patch")
    n_layers = t.n_layers(p["layer"])
    early = [L for L in sorted(p.layer.unique()) if L < max(1, n_layers // 2)]
    wide = p[p.layer.isin(early)].pivot_table(index="prompt", columns=["method", "layer"], values="effect")
    need = {"layer", "helix", "pca"}
    if need - set(wide.columns.get_level_values(0)):
        raise NotRun(f"09_helix_patch_prompts lacks the methods {sorted(need)}: {RERUN_09}")
    lay, hel, pca = (wide[m][early].sum(1).to_numpy() for m in ("layer", "helix", "pca"))
    lay_ci = bootstrap_ci(np.mean, lay)
    lay_text = (
        f"the layer patch's mean logit difference in layers 0-{early[-1]} {lay_ci.estimate:.3g} "
        f"[{lay_ci.low:.3g}, {lay_ci.high:.3g}]"
    )
    if not lay_ci.high > 0:
        raise NotApplicable(f"patching the whole layer does not move the answer toward a'+b: {lay_text}")
    share = bootstrap_ci(lambda h, ly: float(h.mean() / ly.mean()), hel, lay)
    if not lay_ci.low > 0:  # the premise itself is uncertain: a share of an effect that may be 0 decides nothing
        return Outcome(
            f"{lay_text} reaches 0 ({lay_ci.n} pairs): the share restored is not yet defined",
            INCONCLUSIVE,
            {"helix_share": share.estimate, "layer_effect": lay_ci.estimate},
            share,
            thresholds=(KT_HELIX_SHARE,),
        )
    diff = bootstrap_ci(lambda h, q, ly: float((h.mean() - q.mean()) / ly.mean()), hel, pca, lay)

    def grade(big: bool, better: bool) -> str:
        return REPRODUCED if big and better else PARTLY if big or better else NOT_REPRODUCED

    verdict = _judged(grade, _possible(share, KT_HELIX_SHARE), _above_zero(diff))
    ours = (
        f"helix fit restores {_pct(share.estimate)} [{_pct(share.low)}, {_pct(share.high)}] of the layer patch "
        f"(layers 0-{early[-1]} of {n_layers}, {share.n} pairs); helix minus PCA-{_helix_k(p)} "
        f"{_pct(diff.estimate, signed=True)} [{_pct(diff.low)}, {_pct(diff.high)}] of it"
    )
    return Outcome(
        ours,
        verdict,
        {"helix_share": share.estimate, "helix_minus_pca": diff.estimate, "layer_effect": lay_ci.estimate},
        share,
        thresholds=(KT_HELIX_SHARE,),
    )


def _helix_k(p) -> str:
    drops = [m for m in p.method.unique() if str(m).startswith("helix without")]
    return str(2 * len(drops) + 1) if drops else "k"


def _embedding_zhou(t: Tables) -> tuple[Interval, float, int]:
    if not t.has("09_band_shares"):
        raise NotRun("09_band_shares missing: run notebook 09")
    b = t.csv("09_band_shares")
    row = b[b.source == "embedding"]
    if row.empty or "zhou_share_low" not in b:
        raise NotRun(f"09_band_shares has no embedding interval: {RERUN_09}")
    r = row.iloc[0]
    n_numbers = int(t.params().get("09", {}).get("single_token_max", -1)) + 1
    ci = Interval(
        float(r.zhou_share),
        float(r.zhou_share_low),
        float(r.zhou_share_high),
        int(r.zhou_share_n),
        "bootstrap over embedding dimensions",
    )
    return ci, float(r.zhou_null), n_numbers


def _zhou_fourier_features(t: Tables) -> Outcome:
    """A pre-trained model's number embeddings put their Fourier power at periods 2, 2.5,
    5 and 10 far beyond the shuffled null."""
    if not t.has("09_band_shares"):
        raise NotRun("09_band_shares missing: run notebook 09")
    init = _number_init(t)
    if init != "pretrained":
        raise NotApplicable(
            f"the claim is about pre-trained models; this model's number embeddings are {init!r} "
            "(trained here from scratch)"
        )
    ci, null, n = _embedding_zhou(t)
    if n < ZHOU_MIN_NUMBERS:
        raise NotApplicable(
            f"only the numbers 0..{n - 1} are one token: Zhou's periods 2, 2.5, 5, 10 are most of "
            "their frequencies, so a spectrum cannot show them standing out"
        )
    verdict = _judged(
        lambda full, part: REPRODUCED if full else PARTLY if part else NOT_REPRODUCED,
        _possible(ci, ZHOU_EXCESS * null),
        _possible(ci, null),
    )
    ours = (
        f"embedding of 0..{n - 1}: {_pct(ci.estimate)} [{_pct(ci.low)}, {_pct(ci.high)}] of the Fourier power at "
        f"periods 2, 2.5, 5, 10 (shuffled numbers: {_pct(null)})"
    )
    return Outcome(
        ours,
        verdict,
        {"zhou_share": ci.estimate, "null_share": null},
        ci,
        thresholds=(ZHOU_EXCESS * null, null),
        unit="embedding dimensions",
    )


def _zhou_scratch(t: Tables) -> Outcome:
    """A model trained from scratch on arithmetic, its numbers starting unordered, has no
    excess power at periods 2..10."""
    if not t.has("09_band_shares"):
        raise NotRun("09_band_shares missing: run notebook 09")
    init = _number_init(t)
    if init == "pretrained":
        raise NotApplicable("a pre-trained model: the claim is about models trained from scratch")
    if init != "random":
        raise NotApplicable(
            f"the toy model's number embeddings start as Fourier features of periods 2 to 1000 "
            f"(number_init = {init!r}): trained from scratch, but not from unordered numbers as in "
            "Zhou et al.; train one with number_init = 'random' to test the claim"
        )
    ci, null, n = _embedding_zhou(t)
    verdict = {REPRODUCED: NOT_REPRODUCED, NOT_REPRODUCED: REPRODUCED}.get(
        _judged(lambda x: REPRODUCED if x else NOT_REPRODUCED, _possible(ci, ZHOU_EXCESS * null)), INCONCLUSIVE
    )
    ours = (
        f"embedding of 0..{n - 1}: {_pct(ci.estimate)} [{_pct(ci.low)}, {_pct(ci.high)}] of the Fourier power at "
        f"periods 2, 2.5, 5, 10 (shuffled numbers: {_pct(null)})"
    )
    return Outcome(
        ours,
        verdict,
        {"zhou_share": ci.estimate, "null_share": null},
        ci,
        thresholds=(ZHOU_EXCESS * null,),
        unit="embedding dimensions",
    )
