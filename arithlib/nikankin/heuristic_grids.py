"""The operand grids of the neuron-heuristic analysis (Nikankin et al. 2025, Sec. 4.1).

Nikankin's grids are every operand pair 0..299 of Llama3-8B, one token per number. Here:

* a tokenizer with one token per integer up to 99 at least (the toy model) keeps the
  full grids it was trained on (+ and - with operands 0..99, * and / with 0..31);
* a per-digit tokenizer (Qwen, SmolLM2) gets 2-digit operands, 0..``per_digit_max``
  (default 99), rather than only its single-token operands 0..9: the match score of a
  rule is judged on many more prompts. The target stays the first answer token. Such a
  grid (10,000 pairs for + and *) is subsampled to at most ``max_prompts`` pairs per
  operator (seeded), since every prompt's KV cache is kept.

:func:`grid_records` writes a grid's prompts, :func:`operand_ranges` picks its ranges and
:func:`subsample` thins it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..core.datasets import OPS, PromptRecord, apply_op, fewshot_prefix, load_json

#: The toy model's training ranges (arithlib.core.toy), and a corner of them for smoke tests.
TOY_RANGES = {"+": (0, 99), "-": (0, 99), "*": (0, 31), "/": (0, 31)}
TOY_QUICK_RANGES = {"+": (0, 29), "-": (0, 29), "*": (0, 15), "/": (0, 15)}


def grid_records(
    op: str,
    operand_range: tuple[int, int],
    max_result: int | None = None,
    fewshot: int = 2,
    allow_negative: bool = False,
) -> list[PromptRecord]:
    """Nikankin's "{x}{op}{y}=" prompt for every operand pair of ``operand_range`` (the
    operand grid), with an integer result (exact division; non-negative unless
    ``allow_negative``; at most ``max_result``), and a ``fewshot`` prefix in the same
    template. Unlike :func:`arithlib.core.datasets.nikankin_prompts` no counterfactual is
    paired (its pairing is quadratic in the grid size; the grid is read without one)."""
    template = load_json("templates.json")["nikankin"][op][0]
    sep = load_json("templates.json")["nikankin"]["sep"]
    prefix = fewshot_prefix(template, op, sep, fewshot)
    lo, hi = operand_range
    out = []
    for a in range(lo, hi + 1):
        for b in range(lo, hi + 1):
            if op == "/" and (b == 0 or a % b):
                continue
            c = apply_op(a, b, op)
            if (c < 0 and not allow_negative) or (max_result is not None and c > max_result):
                continue
            text = template.replace("{A}", str(a)).replace("{B}", str(b))
            text = text.replace(f"[{op}]", op)
            out.append(
                PromptRecord(
                    family="nikankin",
                    op=op,
                    a=a,
                    b=b,
                    answer=c,
                    template_id=0,
                    template=template,
                    text=text + sep,
                    answer_text=str(c) if c >= 0 else f"-{-c}",
                    prefix=prefix,
                    n_digits=len(str(hi)),
                    meta=(("numerals", "digits"),),
                )
            )
    return out


def operand_ranges(
    single: int, quick: bool = False, per_digit_max: int = 99, ops: Sequence[str] = OPS
) -> dict[str, tuple[int, int]]:
    """Operand range per operator: the toy ranges when every number up to 99 is one token
    (``single`` >= 99; a corner of them when ``quick``), else 0..``per_digit_max`` (at
    least the single-token range 0..``single``)."""
    if single >= 99:
        ranges = TOY_QUICK_RANGES if quick else TOY_RANGES
        return {op: ranges[op] for op in ops}
    return {op: (0, max(int(single), int(per_digit_max))) for op in ops}


def subsample(records: Sequence[PromptRecord], max_prompts: int | None, seed: int) -> list[PromptRecord]:
    """At most ``max_prompts`` of the grid's records, drawn without replacement (seeded),
    in grid order; all of them when ``max_prompts`` is None or not smaller."""
    records = list(records)
    if max_prompts is None or len(records) <= max_prompts:
        return records
    keep = sorted(random.Random(seed).sample(range(len(records)), int(max_prompts)))
    return [records[i] for i in keep]
