"""Which operators have a faithfulness at all? Nikankin et al.'s F (Eq. 2) per operator is
(mean y_circuit - mean y_ablated) / (mean y_full - mean y_ablated), y the correct-answer
logit over the maximum logit. Its denominator is what mean-ablating every component does
to y. Where the fully ablated model still answers like the full one, the denominator is
zero up to float noise and F is undefined (an arbitrarily large ratio of noise), so such an
operator is excluded, with its reason, before F is averaged over operators.

Rule: an operator is excluded when its denominator is not above zero at 95 %: the
percentile bootstrap interval over its prompts (:func:`arithlib.core.stats.bootstrap_ci`) of
mean(y_full - y_ablated) reaches :data:`FLAT_TOLERANCE` (float32 noise) or below (with
fewer than two prompts, when the mean itself does). No torch: the report reads this.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.stats import bootstrap_ci

#: A denominator at most this far above zero is float noise (y is a ratio of float32 logits,
#: relative precision about 1e-7).
FLAT_TOLERANCE = 1e-6


def denominators(wide: pd.DataFrame) -> pd.DataFrame:
    """Per operator of ``wide`` (index (op, prompt), columns "circuit", "full", "ablated": the
    normalised logit y): n prompts, F's denominator mean(y_full - y_ablated) with its 95 %
    interval, F itself, ``excluded`` and ``reason`` ("" when kept)."""
    rows = []
    for op, g in wide.groupby(level="op", sort=False):
        d = (g["full"] - g["ablated"]).to_numpy(dtype=float)
        ci = bootstrap_ci(lambda x: float(np.mean(x)), d)
        den = float(np.mean(d))
        num = float(np.mean(g["circuit"].to_numpy(dtype=float) - g["ablated"].to_numpy(dtype=float)))
        flat = (ci.low if np.isfinite(ci.low) else den) <= FLAT_TOLERANCE
        reason = (
            (
                f"F's denominator (full minus fully ablated normalised logit) {den:.3g} "
                f"[{ci.low:.3g}, {ci.high:.3g}] on {len(d)} prompts is not above zero: the ablated model answers as "
                "the full one, so F is undefined"
            )
            if flat
            else ""
        )
        rows.append(
            {
                "op": str(op),
                "n": len(d),
                "denominator": den,
                "denominator_low": ci.low,
                "denominator_high": ci.high,
                "faithfulness": num / den if abs(den) > FLAT_TOLERANCE else np.nan,
                "excluded": bool(flat),
                "reason": reason,
            }
        )
    return pd.DataFrame(
        rows,
        columns=["op", "n", "denominator", "denominator_low", "denominator_high", "faithfulness", "excluded", "reason"],
    )


def kept(wide: pd.DataFrame, table: pd.DataFrame | None = None) -> pd.DataFrame:
    """The rows of ``wide`` whose operator is not excluded by :func:`denominators`."""
    table = denominators(wide) if table is None else table
    keep = set(table.loc[~table["excluded"], "op"])
    return wide[[str(o) in keep for o in wide.index.get_level_values("op")]]


def faithfulness_of_kept_operators(
    y_circuit: np.ndarray, y_full: np.ndarray, y_ablated: np.ndarray, op: np.ndarray
) -> float:
    """Mean over operators (integer codes ``op``) of F, the means over each operator's prompts
    (:func:`arithlib.nikankin.activation_patching.faithfulness_by_operator`), leaving out an operator
    whose denominator is within :data:`FLAT_TOLERANCE` of zero (in a bootstrap resample as
    well); NaN if none is left."""
    op = np.asarray(op, dtype=int)
    n = np.bincount(op)
    keep = n > 0
    m = [np.bincount(op, weights=np.asarray(y, dtype=float))[keep] / n[keep] for y in (y_circuit, y_full, y_ablated)]
    den = m[1] - m[2]
    ok = np.abs(den) > FLAT_TOLERANCE
    return float(np.mean((m[0][ok] - m[2][ok]) / den[ok])) if ok.any() else float("nan")
