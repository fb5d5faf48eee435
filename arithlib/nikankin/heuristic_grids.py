"""The operand grids of the neuron-heuristic analysis (Nikankin et al. 2025, Sec. 4.1).

Nikankin's grids are every operand pair 0..299 of Llama3-8B, one token per number. Here:

* a tokenizer with one token per integer up to 99 at least (the toy model) keeps the
  full grids it was trained on (+ and - with operands 0..99, * and / with 0..31);
* a per-digit tokenizer (Qwen, SmolLM2) gets 2-digit operands, 0..``per_digit_max``
  (default 99), rather than only its single-token operands 0..9: the match score of a
  rule is judged on many more prompts. The target stays the first answer token. Such a
  grid (10,000 pairs for + and *) is subsampled to at most ``max_prompts`` pairs per
  operator (seeded), since every prompt's KV cache is kept.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..core.datasets import OPS, PromptRecord

#: The toy model's training ranges (arithlib.core.toy), and a corner of them for smoke tests.
TOY_RANGES = {"+": (0, 99), "-": (0, 99), "*": (0, 31), "/": (0, 31)}
TOY_QUICK_RANGES = {"+": (0, 29), "-": (0, 29), "*": (0, 15), "/": (0, 15)}


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
