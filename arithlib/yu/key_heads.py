"""The key head of each of Yu & Ananiadou's head groups (Sec. 3, Sec. 4), read from notebook
01's every-position head sweep: the head whose ablation lowers 1D accuracy most (else,
as a stated fallback, the largest mean drop over all digit counts), and the table of
the heads chosen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ..core import datasets as ds
from ..core.components import Head
from ..core.papers import YU_GROUPS
from ..run.outputs import find_table, read_table

#: How :func:`select_key_heads` chose a group's head (the ``selection`` column of 04_key_heads.csv).
KEY_HEAD_BY_1D = "largest mean 1D accuracy drop"
KEY_HEAD_FALLBACK = "fallback: no head lowers 1D accuracy; largest mean accuracy drop over all digit counts"


def read_head_sweep(sweep: str | Path | pd.DataFrame) -> pd.DataFrame:
    """Notebook 01's exact head sweep (``01_yu_head_sweep.csv``) as a frame with operator
    symbols; FileNotFoundError (run notebook 01) when missing, ValueError when it lacks
    the exact stage's columns."""
    if isinstance(sweep, pd.DataFrame):
        frame = sweep.copy()
    else:
        path = find_table(sweep)  # .csv or .csv.gz
        if path is None:
            raise FileNotFoundError(
                f"{sweep} not found: notebook 04 needs notebook 01's head sweep. Run "
                "notebooks/01 (Yu head sweep) with the same model and out_dir first."
            )
        frame = read_table(path)
    missing = {"op", "n_digits", "layer", "head", "accuracy", "baseline_accuracy", "accuracy_drop", "logit_drop"} - set(
        frame.columns
    )
    if missing:
        raise ValueError(
            f"head sweep lacks columns {sorted(missing)}: it predates notebook 01's exact every-position "
            "sweep (01_yu_head_sweep.csv with logit_drop); rerun notebook 01"
        )
    names = {v: k for k, v in ds.OP_NAMES.items()}
    frame["op"] = frame["op"].map(lambda o: names.get(o, o))
    frame["n_digits"] = frame["n_digits"].astype(int)
    return frame


def _best_head(rows: pd.DataFrame, n_settings: int) -> pd.Series:
    """The head of ``rows`` (one row per head and setting) measured in the most settings,
    then with the largest mean ``accuracy_drop`` over them, then the largest mean
    ``logit_drop``, then the lowest (layer, head)."""
    g = (
        rows.assign(_ld=rows["logit_drop"].fillna(-np.inf))
        .groupby(["layer", "head"])
        .agg(n_settings=("accuracy_drop", "size"), score=("accuracy_drop", "mean"), logit_score=("_ld", "mean"))
        .reset_index()
    )
    g = g.sort_values(
        ["n_settings", "score", "logit_score", "layer", "head"], ascending=[False, False, False, True, True]
    )
    best = g.iloc[0].copy()
    best["settings_total"] = n_settings
    return best


def select_key_heads(
    sweep: str | Path | pd.DataFrame, groups: Mapping[str, Sequence[str]] | None = None, n_digits: int = 1
) -> pd.DataFrame:
    """The key head of each operator group from notebook 01's **exact** head sweep
    (``01_yu_head_sweep.csv``: the top heads of every setting zeroed at every position on
    all of the setting's prompts), one row per group.

    Rule, fixed before looking at any model (Yu Sec. 4 / App. B: one head for + and -,
    one for /):

    1. Among the heads the exact sweep measured on every operator of the group at
       ``n_digits`` digits (else on the most of them), the largest mean accuracy drop
       over those operators; ties: the larger mean answer-logit drop, then the lower
       (layer, head). It is the key head when that drop is > 0 (``lowers_1d`` True).
    2. When no head lowers ``n_digits``-digit accuracy (a model that answers every 1D
       prompt with any single head zeroed), no head reproduces Yu's premise; the
       comparison head is then, among the heads measured on the most of the group's
       settings (operators x every digit count of the sweep), the one with the largest
       mean accuracy drop over those settings; same ties. ``lowers_1d`` is False and
       ``selection`` says so.

    Columns: group, layer, head, selection, lowers_1d, score (the mean drop the rule
    ranked by), settings_measured, settings_total, logit_score. Raises
    FileNotFoundError when the file is missing (run notebook 01) and ValueError when an
    operator has no rows or the file predates the exact sweep."""
    groups = {g: tuple(ops) for g, ops in (groups or YU_GROUPS).items()}
    frame = read_head_sweep(sweep)
    out = []
    for group, ops in groups.items():
        sub = frame[frame["op"].isin(ops)]
        one = sub[sub["n_digits"] == int(n_digits)]
        absent = set(ops) - set(one["op"])
        if absent:
            raise ValueError(f"head sweep has no {n_digits}-digit rows for operator(s) {sorted(absent)}")
        best = _best_head(one, len(ops))
        selection, lowers = KEY_HEAD_BY_1D, bool(best["score"] > 0)
        if not lowers:
            best = _best_head(sub, sub[["op", "n_digits"]].drop_duplicates().shape[0])
            selection = KEY_HEAD_FALLBACK
        out.append(
            {
                "group": group,
                "layer": int(best["layer"]),
                "head": int(best["head"]),
                "selection": selection,
                "lowers_1d": lowers,
                "score": float(best["score"]),
                "settings_measured": int(best["n_settings"]),
                "settings_total": int(best["settings_total"]),
                "logit_score": float(best["logit_score"]) if np.isfinite(best["logit_score"]) else float("nan"),
            }
        )
    return pd.DataFrame(out)


def key_heads_from_sweep(
    sweep: str | Path | pd.DataFrame, n_digits: int = 1, groups: Mapping[str, Sequence[str]] | None = None
) -> dict[str, Head]:
    """Group -> (layer, head) of :func:`select_key_heads` (its rule and fallback there)."""
    sel = select_key_heads(sweep, groups, n_digits)
    return {r.group: (int(r.layer), int(r.head)) for r in sel.itertuples()}


def key_head_table(
    sweep: str | Path | pd.DataFrame,
    selected: pd.DataFrame,
    groups: Mapping[str, Sequence[str]] | None = None,
    n_digits: int = 1,
) -> pd.DataFrame:
    """04_key_heads.csv: for each group's selected head (:func:`select_key_heads`), its
    exact-sweep rows on the group's ``n_digits``-digit operators (accuracy with the head
    zeroed, baseline, drop, the binomial interval of the accuracy, logit drop) with the
    selection columns; an operator on which the sweep did not measure the head gets a
    row with NaN numbers (the screen did not rank it among its top heads there)."""
    groups = {g: tuple(ops) for g, ops in (groups or YU_GROUPS).items()}
    frame = read_head_sweep(sweep)
    keep = [
        c
        for c in (
            "n",
            "accuracy",
            "baseline_accuracy",
            "accuracy_drop",
            "relative_drop",
            "accuracy_low",
            "accuracy_high",
            "logit_drop",
        )
        if c in frame.columns
    ]
    rows = []
    for sel in selected.itertuples(index=False):
        for op in groups[sel.group]:
            r = frame[
                (frame["op"] == op)
                & (frame["n_digits"] == int(n_digits))
                & (frame["layer"] == sel.layer)
                & (frame["head"] == sel.head)
            ]
            vals = r.iloc[0][keep].to_dict() if len(r) else {c: float("nan") for c in keep}
            rows.append({**sel._asdict(), "op": op, "n_digits": int(n_digits), **vals})
    return pd.DataFrame(rows)
