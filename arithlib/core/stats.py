"""Confidence intervals for the numbers a verdict reads, and the verdict they give.

Every number the report judges is an estimate from a finite set of prompts, so it is
judged through its 95 % interval:

* an accuracy (k correct of n) gets the exact Clopper-Pearson binomial interval
  (:func:`binomial_ci`);
* any other statistic of per-prompt values (a mean effect, a difference of two
  accuracies on the same prompts, a relative drop) gets a percentile bootstrap over
  prompts (:func:`bootstrap_ci`), resampling the prompts jointly in every array passed,
  so paired designs stay paired;
* :func:`interval_verdict` maps an interval to *reproduced* / *partly* / *not
  reproduced* only when the whole interval lies in one band of the rule, and to
  *inconclusive* when it straddles a threshold.

scipy's ``binomtest`` gives the exact interval; the bootstrap is a few lines of numpy
(``scipy.stats.bootstrap`` does not resample several arrays of different statistics as
one paired design, which the report needs), seeded so the same tables give the same
intervals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: Confidence level of every interval in the report.
LEVEL = 0.95
#: Bootstrap resamples (the percentile interval's Monte-Carlo error is below 0.5 points
#: of a proportion at this size).
N_BOOT = 2000
#: Seed of the bootstrap (an interval is a function of its tables only).
BOOT_SEED = 0

REPRODUCED, PARTLY, NOT_REPRODUCED = "reproduced", "partly", "not reproduced"
#: The interval straddles a threshold of the rule and more prompts from the same population
#: would decide (the report estimates how many: :func:`prompts_to_decide`).
INCONCLUSIVE = "inconclusive"
#: The interval straddles a threshold and the population of prompts is exhausted (every
#: 1-digit operand pair, every profession of a fixed list): this model cannot decide it.
UNDECIDABLE = "undecidable here"
#: A premise the finding builds on failed on this model (named in the text): the test does
#: not apply, which is not the same as "not reproduced".
NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95 % interval and the number of prompts behind it."""

    estimate: float
    low: float
    high: float
    n: int
    method: str  # "binomial" (Clopper-Pearson), "bootstrap", "crossed bootstrap" or "none" (n too small)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def scaled(self, factor: float) -> Interval:
        lo, hi = sorted((self.low * factor, self.high * factor))
        return Interval(self.estimate * factor, lo, hi, self.n, self.method)

    def text(self, pct: bool = True, digits: int = 0) -> str:
        """ "12 % [8, 17]" (``pct``) or "0.12 [0.08, 0.17]"."""
        if not np.isfinite(self.estimate):
            return "n/a"
        if pct:
            f = lambda x: f"{round(100 * x, digits) + 0.0:.{digits}f}"  # noqa: E731 (+0.0: no "-0")
            return f"{f(self.estimate)} % [{f(self.low)}, {f(self.high)}]"
        return f"{self.estimate:.2f} [{self.low:.2f}, {self.high:.2f}]"


def binomial_ci(k: int, n: int, level: float = LEVEL) -> Interval:
    """Exact (Clopper-Pearson) interval of the proportion k / n."""
    from scipy.stats import binomtest

    k, n = int(k), int(n)
    if n <= 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0, "none")
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
    return Interval(k / n, float(ci.low), float(ci.high), n, "binomial")


def accuracy_ci(correct: Sequence[bool] | np.ndarray, level: float = LEVEL) -> Interval:
    """:func:`binomial_ci` of a vector of per-prompt correctness."""
    c = np.asarray(correct, dtype=bool)
    return binomial_ci(int(c.sum()), int(c.size), level)


def bootstrap_ci(
    stat: Callable[..., float],
    *arrays: Sequence | np.ndarray,
    level: float = LEVEL,
    n_boot: int = N_BOOT,
    seed: int = BOOT_SEED,
    groups: Sequence | np.ndarray | None = None,
) -> Interval:
    """Percentile bootstrap of ``stat(*arrays)`` over prompts: every resample draws the
    same row indices for every array (paired). ``groups``: resample within each group
    (stratified, e.g. per operator) so each resample keeps the design's group sizes."""
    arrs = [np.asarray(a) for a in arrays]
    if not arrs:
        raise ValueError("bootstrap_ci needs at least one array")
    n = len(arrs[0])
    if any(len(a) != n for a in arrs):
        raise ValueError(f"bootstrap_ci: arrays of different lengths {[len(a) for a in arrs]} (rows are prompts)")
    est = float(stat(*arrs))
    if n < 2:
        return Interval(est, float("nan"), float("nan"), n, "none")
    rng = np.random.default_rng(seed)
    if groups is None:
        strata = [np.arange(n)]
    else:
        g = np.asarray(groups)
        strata = [np.flatnonzero(g == v) for v in dict.fromkeys(g.tolist())]
    vals = np.empty(n_boot)
    for b in range(n_boot):
        idx = np.concatenate([s[rng.integers(0, len(s), len(s))] for s in strata])
        vals[b] = stat(*(a[idx] for a in arrs))
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        return Interval(est, float("nan"), float("nan"), n, "none")
    alpha = (1 - level) / 2
    lo, hi = np.quantile(vals, [alpha, 1 - alpha])
    return Interval(est, float(lo), float(hi), n, "bootstrap")


def mean_ci(values: Sequence[float] | np.ndarray, **kw) -> Interval:
    """Bootstrap interval of a mean over prompts."""
    return bootstrap_ci(lambda v: float(np.mean(v)), values, **kw)


def crossed_bootstrap_ci(
    stat: Callable[..., float],
    *arrays: Sequence | np.ndarray,
    replicates: np.ndarray,
    level: float = LEVEL,
    n_boot: int = N_BOOT,
    seed: int = BOOT_SEED,
    groups: Sequence | np.ndarray | None = None,
) -> Interval:
    """Percentile bootstrap of ``stat(*arrays, replicates)`` over two crossed sources of
    variation: the rows (prompts, professions) of every array and of ``replicates``, drawn
    as :func:`bootstrap_ci` draws them (paired, stratified by ``groups``), and,
    independently, the last axis of ``replicates`` (the seeds of a random control, [rows,
    ..., seeds]). A control averaged over a few seeds is itself an estimate; resampling the
    seeds puts its seed-to-seed spread into the interval."""
    arrs = [np.asarray(a) for a in arrays]
    rep = np.asarray(replicates)
    if rep.ndim < 2:
        raise ValueError(
            f"crossed_bootstrap_ci: replicates must be [rows (prompts), ..., seeds], got shape {rep.shape}"
        )
    n, S = len(rep), rep.shape[-1]
    if any(len(a) != n for a in arrs):
        raise ValueError(f"crossed_bootstrap_ci: arrays of different lengths {[len(a) for a in arrs]} and {n} rows")
    if S < 1:
        raise ValueError("crossed_bootstrap_ci: no replicates (seeds)")
    est = float(stat(*arrs, rep))
    if n < 2:
        return Interval(est, float("nan"), float("nan"), n, "none")
    rng = np.random.default_rng(seed)
    g = np.zeros(n, dtype=int) if groups is None else np.asarray(groups)
    strata = [np.flatnonzero(g == v) for v in dict.fromkeys(g.tolist())]
    vals = np.empty(n_boot)
    for b in range(n_boot):
        idx = np.concatenate([s[rng.integers(0, len(s), len(s))] for s in strata])
        cols = rng.integers(0, S, S)
        vals[b] = stat(*(a[idx] for a in arrs), rep[idx][..., cols])
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        return Interval(est, float("nan"), float("nan"), n, "none")
    lo, hi = np.quantile(vals, [(1 - level) / 2, 1 - (1 - level) / 2])
    return Interval(est, float(lo), float(hi), n, "crossed bootstrap")


def interval_verdict(ci: Interval, full: float, partial: float, higher_is_better: bool = True) -> str:
    """The verdict of a rule "reproduced if x >= ``full``, partly if x >= ``partial``"
    judged on the interval: a band is given only when the whole interval lies in it;
    an interval that straddles ``full`` or ``partial`` is *inconclusive*.
    ``higher_is_better=False`` reads the rule as "x <= full, x <= partial"."""
    lo, hi = ci.low, ci.high
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return INCONCLUSIVE
    if not higher_is_better:
        lo, hi, full, partial = -hi, -lo, -full, -partial
    if lo >= full:
        return REPRODUCED
    if hi < partial:
        return NOT_REPRODUCED
    if lo >= partial and hi < full:
        return PARTLY
    return INCONCLUSIVE


def prompts_to_decide(ci: Interval, thresholds: Sequence[float]) -> int | None:
    """Prompts an interval would need to stop straddling the ``thresholds`` that lie inside
    it, if its estimate stayed put and each side shrank as 1/sqrt(n): ``n * max_t
    (side_t / |estimate - t|)^2`` over the thresholds t inside [low, high], where side_t is
    the interval's reach from the estimate towards t. ``ci.n`` when no threshold lies
    inside; None when the interval is not finite or the estimate sits on a threshold (no
    number of prompts separates them)."""
    est, lo, hi = ci.estimate, ci.low, ci.high
    if not all(np.isfinite(x) for x in (est, lo, hi)) or ci.n < 1:
        return None
    factor = 1.0
    for t in thresholds:
        if not lo <= t <= hi:
            continue
        dist = abs(est - t)
        side = (est - lo) if t < est else (hi - est)
        if dist == 0 or side <= 0:
            return None
        factor = max(factor, (side / dist) ** 2)
    return int(np.ceil(round(ci.n * factor, 6)))  # round: no extra prompt from float noise


def n_for_half_width(p: float, half_width: float, level: float = LEVEL) -> int:
    """Prompts needed for a proportion near ``p`` to have a 95 % half-width of about
    ``half_width`` (normal approximation, used to choose sample sizes)."""
    from scipy.stats import norm

    z = norm.ppf(1 - (1 - level) / 2)
    p = min(max(p, 0.05), 0.95)
    return int(np.ceil(z * z * p * (1 - p) / half_width**2))


#: Characters of :func:`encode_correct` (letters, so a CSV reader never takes the cell for a number).
_YES, _NO = "T", "F"


def encode_correct(correct: Sequence[bool] | np.ndarray) -> str:
    """Per-prompt correctness as one CSV cell ("TFFT", prompts in their set's order), so a
    table with one row per model keeps what a paired bootstrap over prompts needs."""
    return "".join(_YES if bool(c) else _NO for c in np.asarray(correct).ravel())


def decode_correct(cell: object) -> np.ndarray | None:
    """The boolean vector of :func:`encode_correct`; None for an empty or missing cell."""
    if not isinstance(cell, str) or not cell or set(cell) - {_YES, _NO}:
        return None
    return np.frombuffer(cell.encode(), dtype=np.uint8) == ord(_YES)
