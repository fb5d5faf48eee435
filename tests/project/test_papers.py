"""arithlib.core.papers: the one home of the papers' numbers. Its numbers agree with
each other where a paper states one from another, and no other module defines one."""

from __future__ import annotations

import ast
from pathlib import Path

from arithlib.core import papers

ARITHLIB = Path(papers.__file__).parent


def test_numbers_the_papers_derive_from_each_other_agree():
    t13 = papers.YU_TABLE13
    assert round(100 * (1 - t13["edited"]["total"] / t13["original"]["total"]), 1) == papers.YU_BIAS_REDUCTION_PCT
    m2_neurons, m2_decrease, _ = papers.YU_CNA_TABLES["M2"]["+-"]
    assert m2_neurons == papers.YU_CNA_TABLES["M_neurons"][2]
    assert m2_decrease == papers.YU_CNA_TABLES["M_decrease"]["+-"][2]
    t1 = papers.YU_TABLE1
    rel = {op: 100 * (1 - t1["17^22"][op] / t1["original"][op]) for op in "+-*"}
    assert round(rel["*"], 1) == 10.8 and round((rel["+"] + rel["-"]) / 2, 1) == 39.5  # as its comment says
    assert papers.ZHANG_HEAD_COUNTS[2] == 32 and max(papers.ZHANG_HEAD_COUNTS) < papers.ZHANG_TOTAL_HEADS
    assert papers.ZHANG_SFT["lr"] in papers.SFT_LR_GRID  # the CPU grid brackets Zhang's lr
    assert papers.FAITHFULNESS_TARGET < papers.NIKANKIN_FAITHFULNESS
    lo, hi = papers.ZHANG_MLP_CURVE_START_32, papers.ZHANG_MLP_CURVE_CLIMB_32
    assert 0 < lo < hi <= papers.ZHANG_LATE_MLP_LAYER_32 < 32


def test_no_other_module_defines_a_paper_number():
    """A module-level name starting ZHANG_, YU_ or NIKANKIN_ is defined in papers.py only."""
    found = []
    for path in sorted(ARITHLIB.rglob("*.py")):
        if path.name == "papers.py":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            found += [
                f"{path.name}:{t.id}"
                for t in targets
                if isinstance(t, ast.Name) and t.id.startswith(("ZHANG_", "YU_", "NIKANKIN_"))
            ]
    assert not found, f"paper numbers outside arithlib/core/papers.py: {found}"
