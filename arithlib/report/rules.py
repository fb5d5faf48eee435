"""The pieces every verdict rule shares: a finding and its outcome, percentages, interval tests
and per-prompt correctness matrices."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ..core.papers import NOISE_GAP
from ..core.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    PARTLY,
    REPRODUCED,
    UNDECIDABLE,
    Interval,
    binomial_ci,
    decode_correct,
    interval_verdict,
    prompts_to_decide,
)
from .tables import Tables

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
    #: The rule's thresholds on the headline interval, in its units: where the interval
    #: straddles one, :func:`settle_inconclusive` estimates the prompts that would decide.
    thresholds: tuple[float, ...] = ()
    #: The size of the population the interval's unit is drawn from when it is finite and
    #: known (every 1-digit operand pair, a fixed list of professions); None when more
    #: prompts can always be drawn.
    population: int | None = None
    #: The unit whose number would decide an inconclusive interval, when it is not the
    #: prompts (e.g. "LoRA layers"): the text then names it, with no estimate of how many.
    unit: str = "prompts"


@dataclass(frozen=True)
class Finding:
    """One headline claim of a paper and how this run is judged against it."""

    id: str
    paper: str  # key of PAPERS
    where: str  # section / table / figure of the paper
    claim: str  # the claim in one line
    paper_number: str  # the paper's number (or "no number: ..." with the qualitative claim)
    source: str  # where that number is in the paper texts
    rule: str  # the verdict rule in words (applied by ``compute``)
    notebook: str  # "01"...
    compute: Callable[[Tables], Outcome]
    figures: tuple[str, ...] = ()  # the PNGs (names without suffix) that show it, beside it in REPORT.md


def settle_inconclusive(out: Outcome) -> Outcome:
    """An *inconclusive* outcome told apart: *undecidable here* when the prompts that would
    decide (:func:`arithlib.core.stats.prompts_to_decide` on the headline interval and the
    rule's thresholds) exceed the population the unit is drawn from, else *inconclusive*
    with that estimate in the text. Other verdicts pass unchanged."""
    if out.verdict != INCONCLUSIVE or out.interval is None:
        return out
    if out.unit != "prompts":
        return replace(out, ours=f"{out.ours}; more {out.unit} would decide")
    ci = out.interval
    need = prompts_to_decide(ci, out.thresholds) if out.thresholds else None
    if out.population is not None and (need is None or need > out.population):
        return replace(
            out,
            ours=f"{out.ours}; undecidable here: the interval straddles a threshold with {ci.n} of "
            f"the {out.population} possible cases measured"
            + (f" and about {need:,} needed" if need is not None else ""),
            verdict=UNDECIDABLE,
        )
    if need is not None and need > ci.n:
        return replace(out, ours=f"{out.ours}; about {need:,} prompts (now {ci.n:,}) would decide")
    return replace(out, ours=f"{out.ours}; more prompts would decide")


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
    """ " [lo, hi]" of an interval already in ``unit`` (points or %), or "" without one."""
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


#: Notebook 04 tables of the older method (key head from notebook 01's exact sweep, keep =
#: the layers CNA scored, shallow sets through every reading attention layer with the
#: number/operation concept list, random controls over seeds) are not judged.


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


def _interval_cell(ci: Interval | None) -> str:
    """The headline's 95 % interval as shown in the tables: "[lo, hi] (n = N)", or "none"."""
    if ci is None or not (np.isfinite(ci.low) and np.isfinite(ci.high)):
        return "none"
    return f"[{ci.low:.3g}, {ci.high:.3g}] (n = {ci.n})"
