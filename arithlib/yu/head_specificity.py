"""Is a head an arithmetic head? Yu & Ananiadou's pattern, and the best such head of a group.

Yu & Ananiadou's key heads are operator-specific: head 17^22 lowers its own 2D + and 2D -
accuracy by 39.5 % and 2D * by only 10.8 % (Table 1), and the chain of Sec. 4 (CNA, mask /
keep, the PE-DAG, the shallow neurons) is built on such a head. A head whose removal breaks
every operator alike (a generic early head) is not what that chain is about. This module
measures the pattern and picks, within an operator group, the head Yu's procedure would pick
among the heads that have it:

* **own drop** of a head: the mean over the group's operators of the relative 1D accuracy
  decrease 1 - (correct with the head zeroed) / (correct before) (Table 2's measure);
* **operator-specific**: the relative 1D * decrease is at most half the own drop, i.e.
  own - 2 x (*) >= 0 (:func:`specificity_statistic`; the report bootstraps the same
  statistic);
* **leaves factual recall intact**: zeroing the head costs at most ``NOISE_GAP`` (5 points)
  of factual-recall accuracy (a control of ours; Yu report no other task);
* the **best specific head** of a group: among the heads that lower the group's 1D accuracy
  (own drop > 0) and pass both tests on their point estimates, the largest own drop; ties by
  the lower (layer, head). When it is the key head of :func:`arithlib.yu.key_heads.select_key_heads`
  nothing more is run; otherwise notebook 04 runs the chain on both heads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.components import Head
from ..core.papers import NOISE_GAP
from .key_heads import read_head_sweep

#: The operator whose decrease a specific head leaves small (Yu Table 1: 2D * under 17^22).
OTHER_OPERATOR = "*"


def _relative_drop(ops: np.ndarray, correct: np.ndarray, clean: np.ndarray, op: str) -> float:
    """1 - (prompts of ``op`` still correct with the head zeroed) / (correct before)."""
    before = clean[ops == op].sum()
    return float(1 - correct[ops == op].sum() / before) if before > 0 else float("nan")


def own_drop(ops: np.ndarray, correct: np.ndarray, clean: np.ndarray, own: Sequence[str]) -> float:
    """Mean relative 1D accuracy decrease over the operators ``own`` (NaN-free mean; NaN when
    none of them has a correct prompt)."""
    drops = [d for d in (_relative_drop(ops, correct, clean, o) for o in own) if np.isfinite(d)]
    return float(np.mean(drops)) if drops else float("nan")


def specificity_statistic(ops: np.ndarray, correct: np.ndarray, clean: np.ndarray, own: Sequence[str]) -> float:
    """own drop - 2 x (relative * decrease): >= 0 when the head lowers * by at most half of
    what it takes from its own operators. Without * rows: the own drop alone."""
    mean_own = own_drop(ops[ops != OTHER_OPERATOR], correct[ops != OTHER_OPERATOR], clean[ops != OTHER_OPERATOR], own)
    if not (ops == OTHER_OPERATOR).any():
        return mean_own
    return mean_own - 2 * _relative_drop(ops, correct, clean, OTHER_OPERATOR)


def candidate_heads(
    sweep: str | Path | pd.DataFrame, groups: Mapping[str, Sequence[str]], n_digits: int = 1
) -> dict[str, list[Head]]:
    """Per group, the heads of notebook 01's exact sweep (``01_yu_head_sweep``: each
    setting's screened top heads on all its prompts) whose ``n_digits``-digit accuracy drop
    is > 0 on at least one of the group's operators, in (layer, head) order (the sweep read
    as :func:`arithlib.yu.key_heads.select_key_heads` reads it). A head the
    sweep did not re-measure on an operator is measured there by :func:`head_patterns`'s
    caller, not assumed."""
    one = read_head_sweep(sweep)
    one = one[one["n_digits"] == int(n_digits)]
    out = {}
    for g, ops in groups.items():
        sub = one[one["op"].isin(list(ops)) & (one["accuracy_drop"] > 0)]
        out[g] = sorted({(int(r.layer), int(r.head)) for r in sub.itertuples()})
    return out


def head_patterns(
    rows: pd.DataFrame,
    facts: pd.DataFrame,
    groups: Mapping[str, Sequence[str]],
    candidates: Mapping[str, Sequence[Head]],
) -> pd.DataFrame:
    """One row per (group, candidate head): ``own_drop``, ``times_drop`` (relative 1D *
    decrease), ``statistic`` (:func:`specificity_statistic`), ``factual_drop`` (clean minus
    head-zeroed factual-recall accuracy; NaN without facts), ``operator_specific``,
    ``recall_intact``, ``specific`` (own drop > 0 and both tests), ``n_own``, ``n_times``.

    ``rows``: :func:`arithlib.yu.head_sweep.exact_head_sweep` rows of the candidates on the 1D
    prompts of the group's operators and of *; ``facts``: :func:`arithlib.yu.head_sweep.specificity`
    rows of the same heads (its ``layer`` and ``head`` columns are read)."""
    out = []
    for g, heads in candidates.items():
        own = list(groups[g])
        for layer, head in heads:
            mine = rows[(rows["layer"] == layer) & (rows["head"] == head) & rows["op"].isin([*own, OTHER_OPERATOR])]
            ops = mine["op"].to_numpy()
            correct, clean = mine["correct"].astype(bool).to_numpy(), mine["clean_correct"].astype(bool).to_numpy()
            drop = own_drop(ops, correct, clean, own)
            times = _relative_drop(ops, correct, clean, OTHER_OPERATOR)
            stat = specificity_statistic(ops, correct, clean, own)
            f = (
                facts[(facts["layer"] == layer) & (facts["head"] == head)].drop_duplicates("prompt")
                if len(facts)
                else facts
            )
            fact = float(f["clean_correct"].mean() - f["correct"].mean()) if len(f) else float("nan")
            operator = bool(stat >= 0) if np.isfinite(stat) else False
            intact = bool(not fact > NOISE_GAP)  # no factual-recall prompt the model can take: not judged
            out.append(
                {
                    "group": g,
                    "layer": layer,
                    "head": head,
                    "own_drop": drop,
                    "times_drop": times,
                    "statistic": stat,
                    "factual_drop": fact,
                    "operator_specific": operator,
                    "recall_intact": intact,
                    "specific": bool(drop > 0 and operator and intact),
                    "n_own": int(np.isin(ops, own).sum()),
                    "n_times": int((ops == OTHER_OPERATOR).sum()),
                    "n_facts": len(f),
                }
            )
    return pd.DataFrame(
        out,
        columns=[
            "group",
            "layer",
            "head",
            "own_drop",
            "times_drop",
            "statistic",
            "factual_drop",
            "operator_specific",
            "recall_intact",
            "specific",
            "n_own",
            "n_times",
            "n_facts",
        ],
    )


def best_specific_heads(patterns: pd.DataFrame, key_heads: Mapping[str, Head]) -> pd.DataFrame:
    """Per group of ``key_heads``: the specific head with the largest own drop (ties: lower
    layer, head), its numbers from ``patterns``, ``is_key_head`` and ``selection`` (what was
    chosen and why). A group with no specific head gets a row with layer and head -1 and
    ``selection`` saying so."""
    out = []
    for g, key in key_heads.items():
        p = patterns[(patterns["group"] == g) & patterns["specific"]] if len(patterns) else patterns
        if not len(p):
            out.append(
                {
                    "group": g,
                    "layer": -1,
                    "head": -1,
                    "is_key_head": False,
                    "key_layer": int(key[0]),
                    "key_head": int(key[1]),
                    "selection": "no head that lowers the group's 1D accuracy passes the specificity tests",
                }
            )
            continue
        best = p.sort_values(["own_drop", "layer", "head"], ascending=[False, True, True]).iloc[0]
        same = (int(best["layer"]), int(best["head"])) == (int(key[0]), int(key[1]))
        out.append(
            {
                "group": g,
                **{
                    k: best[k]
                    for k in (
                        "layer",
                        "head",
                        "own_drop",
                        "times_drop",
                        "statistic",
                        "factual_drop",
                        "n_own",
                        "n_times",
                        "n_facts",
                    )
                },
                "is_key_head": same,
                "key_layer": int(key[0]),
                "key_head": int(key[1]),
                "selection": (
                    "the key head itself is the best specific head"
                    if same
                    else "largest own 1D drop among the heads that pass the specificity tests "
                    f"({len(p)} of {int((patterns['group'] == g).sum())} candidates pass)"
                ),
            }
        )
    frame = pd.DataFrame(out)
    for c in ("layer", "head", "key_layer", "key_head"):
        frame[c] = frame[c].astype(int)
    return frame


def specific_chain_group(group: str) -> str:
    """The group label of the chain run on ``group``'s best specific head ("+- specific")."""
    return f"{group} specific"
