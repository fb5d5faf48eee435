"""The arithmetic-head pattern (Yu Table 1) and the best specific head of a group."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import arithlib.yu.head_specificity as HSP

GROUPS = {"+-": ["+", "-"], "/": ["/"]}


def _rows(head: tuple[int, int], drops: dict[str, float], n: int = 40) -> list[dict]:
    """exact_head_sweep-style rows: the head cuts each operator's 1D accuracy by drops[op]."""
    return [
        {
            "op": op,
            "n_digits": 1,
            "layer": head[0],
            "head": head[1],
            "prompt": i,
            "correct": i >= round(v * n),
            "clean_correct": True,
        }
        for op, v in drops.items()
        for i in range(n)
    ]


def _facts(head: tuple[int, int], before: int, after: int, n: int = 40) -> list[dict]:
    return [
        {
            "op": f"L{head[0]}H{head[1]}",
            "layer": head[0],
            "head": head[1],
            "prompt": f"fact {i}",
            "correct": i < after,
            "clean_correct": i < before,
        }
        for i in range(n)
    ]


def _literal_statistic(rows: pd.DataFrame, own: list[str]) -> float:
    """Spelled out: mean over own operators of 1 - after / before, minus twice that on *."""

    def rel(op):
        r = rows[rows.op == op]
        return 1 - r.correct.sum() / r.clean_correct.sum()

    return sum(rel(o) for o in own) / len(own) - 2 * rel("*")


def test_statistic_is_the_literal_formula():
    rows = pd.DataFrame(_rows((0, 8), {"+": 0.6, "-": 0.7, "*": 0.25}))
    args = rows.op.to_numpy(), rows.correct.to_numpy(), rows.clean_correct.to_numpy()
    assert HSP.own_drop(*args, ["+", "-"]) == pytest.approx(0.65)
    assert HSP.specificity_statistic(*args, ["+", "-"]) == pytest.approx(_literal_statistic(rows, ["+", "-"]))
    assert HSP.specificity_statistic(*args, ["+", "-"]) == pytest.approx(0.15)
    no_times = rows[rows.op != "*"]
    assert HSP.specificity_statistic(
        no_times.op.to_numpy(), no_times.correct.to_numpy(), no_times.clean_correct.to_numpy(), ["+", "-"]
    ) == pytest.approx(0.65)


def test_candidates_are_the_heads_that_lower_any_operator_of_the_group():
    sweep = pd.DataFrame(
        [
            {"op": "+", "n_digits": 1, "layer": 0, "head": 8, "accuracy_drop": 0.5},
            {"op": "-", "n_digits": 1, "layer": 16, "head": 8, "accuracy_drop": 0.2},
            {"op": "-", "n_digits": 1, "layer": 3, "head": 1, "accuracy_drop": 0.0},
            {"op": "+", "n_digits": 2, "layer": 9, "head": 9, "accuracy_drop": 0.9},
            {"op": "/", "n_digits": 1, "layer": 10, "head": 12, "accuracy_drop": 0.1},
        ]
    )
    sweep = sweep.assign(accuracy=0.5, baseline_accuracy=1.0, logit_drop=0.0)  # the exact sweep's columns
    assert HSP.candidate_heads(sweep, GROUPS) == {"+-": [(0, 8), (16, 8)], "/": [(10, 12)]}
    named = sweep.assign(op=sweep.op.map({"+": "add", "-": "sub", "/": "div"}))  # read as select_key_heads reads it
    assert HSP.candidate_heads(named, GROUPS) == {"+-": [(0, 8), (16, 8)], "/": [(10, 12)]}


def test_best_specific_head_skips_generic_heads_and_heads_that_break_factual_recall():
    generic, specific, forgetful = (0, 8), (16, 8), (5, 1)
    rows = pd.DataFrame(
        _rows(generic, {"+": 0.6, "-": 0.7, "*": 0.75})
        + _rows(specific, {"+": 0.1, "-": 0.3, "*": 0.0})
        + _rows(forgetful, {"+": 0.5, "-": 0.5, "*": 0.0})
    )
    facts = pd.DataFrame(_facts(generic, 40, 40) + _facts(specific, 40, 39) + _facts(forgetful, 40, 20))
    patterns = HSP.head_patterns(rows, facts, {"+-": ["+", "-"]}, {"+-": [generic, specific, forgetful]})
    p = patterns.set_index(["layer", "head"])
    assert not p.loc[generic, "operator_specific"] and p.loc[generic, "recall_intact"]
    assert p.loc[forgetful, "operator_specific"] and not p.loc[forgetful, "recall_intact"]
    assert p.loc[forgetful, "factual_drop"] == pytest.approx(0.5)
    assert p.loc[specific, "specific"] and p.loc[specific, "own_drop"] == pytest.approx(0.2)
    best = HSP.best_specific_heads(patterns, {"+-": generic}).iloc[0]
    assert (best["layer"], best["head"], bool(best["is_key_head"])) == (16, 8, False)
    assert "1 of 3 candidates pass" in best.selection
    # the key head itself when it is specific
    same = HSP.best_specific_heads(patterns, {"+-": specific}).iloc[0]
    assert bool(same.is_key_head) and same.selection.startswith("the key head itself")


def test_no_specific_head_is_a_row_that_says_so():
    rows = pd.DataFrame(_rows((0, 8), {"+": 0.6, "-": 0.7, "*": 0.75}))
    patterns = HSP.head_patterns(rows, pd.DataFrame(), {"+-": ["+", "-"]}, {"+-": [(0, 8)]})
    assert np.isnan(patterns.iloc[0].factual_drop) and patterns.iloc[0].recall_intact  # no facts: not judged
    best = HSP.best_specific_heads(patterns, {"+-": (0, 8)}).iloc[0]
    assert best["layer"] == -1 and "no head" in best["selection"]
    assert HSP.specific_chain_group("+-") == "+- specific"
