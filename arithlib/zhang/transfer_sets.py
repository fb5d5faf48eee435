"""Zhang et al. 2024's transfer test (Sec. 5.1, Fig. 4, App. D-E): knock out the heads
found on one dataset and measure other formats.

* Prompt builders for the formats :mod:`arithlib.core.datasets` does not have: decimals
  ("4.2 plus 2.5 equals to" -> 6.7) and dates ("The war lasted 5 years from 1723 to
  172" -> 8). Both return :class:`arithlib.core.datasets.PromptRecord` lists
  (tokenizer-free), with a few-shot prefix in the query's own template like the other
  builders, so they go through :meth:`arithlib.core.prompt_sets.PromptSet.build`. They have no
  counterfactuals: they are only evaluated before and after a knockout.
* :func:`transfer_knockout`: each format's accuracy before and after knocking out the
  heads, and after knocking out as many random other heads. Zhang's Fig. 4 shows the
  knockout alone; the random heads are the control of Zhang's own Fig. 3 (random-rank),
  applied here so a drop can be told apart from the cost of ablating any heads.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
import torch

from ..core.components import Head
from ..core.datasets import PromptRecord
from ..core.prompt_sets import PromptSet
from ..methods.patching import ablation_edits, run_interventions

DECIMAL_TEMPLATES = {"+": "{A} plus {B} equals to", "-": "{A} minus {B} equals to"}
#: Solved examples of the few-shot prefix (tenths), as for the integer templates.
DECIMAL_FEWSHOT = {"+": [(12, 34), (25, 11)], "-": [(57, 23), (86, 41)]}

DATE_TEMPLATE = "The {EVENT} lasted {A} years from {YEAR} to {STEM}"
DATE_EVENTS = ("war", "journey", "drought", "reign", "project", "festival", "voyage", "trial")
DATE_FEWSHOT = [(3, 1841, "war"), (2, 1762, "journey")]


def _tenths(x: int) -> str:
    """Tenths as a decimal string: 42 -> '4.2'."""
    return f"{x // 10}.{x % 10}"


def _decimal_line(template: str, a: int, b: int) -> str:
    return template.format(A=_tenths(a), B=_tenths(b))


def decimal_prompts(
    ops: tuple[str, ...] = ("+",), n_per_op: int = 20, seed: int = 0, fewshot: int = 2
) -> list[PromptRecord]:
    """Zhang et al. Fig. 4's "rational numbers" format: ``"{A} plus {B} equals to"`` with
    one-decimal operands 0.1..9.9 and a result in 0.0..9.9 (so its first token is the
    units digit, then "."). ``a``/``b``/``answer`` hold tenths (42 = 4.2); the text uses
    decimals. Seeded sample of ``n_per_op`` operand pairs per operator."""
    rng = random.Random(seed)
    records = []
    for op in ops:
        if op not in DECIMAL_TEMPLATES:
            raise ValueError(f"decimal_prompts supports {tuple(DECIMAL_TEMPLATES)}, got {op!r}")
        template = DECIMAL_TEMPLATES[op]
        if fewshot > len(DECIMAL_FEWSHOT[op]):
            raise ValueError(f"at most {len(DECIMAL_FEWSHOT[op])} few-shot examples for decimals")
        prefix = "".join(
            _decimal_line(template, a, b) + " " + _tenths(a + b if op == "+" else a - b) + "\n"
            for a, b in DECIMAL_FEWSHOT[op][:fewshot]
        )
        pairs = [
            (a, b)
            for a in range(1, 100)
            for b in range(1, 100)
            if a % 10 and b % 10 and (a + b < 100 if op == "+" else a > b)
        ]
        for a, b in rng.sample(pairs, min(n_per_op, len(pairs))):
            c = a + b if op == "+" else a - b
            records.append(
                PromptRecord(
                    family="decimal",
                    op=op,
                    a=a,
                    b=b,
                    answer=c,
                    template_id=0,
                    template=template,
                    text=_decimal_line(template, a, b) + " ",
                    answer_text=_tenths(c),
                    prefix=prefix,
                    meta=(("a_text", _tenths(a)), ("b_text", _tenths(b)), ("numerals", "decimals")),
                )
            )
    return records


def _date_line(event: str, span: int, year: int) -> str:
    return DATE_TEMPLATE.format(EVENT=event, A=span, YEAR=year, STEM=str(year + span)[:-1])


def date_prompts(
    n: int = 20, seed: int = 0, fewshot: int = 2, years: tuple[int, int] = (1500, 1999)
) -> list[PromptRecord]:
    """Zhang et al. Fig. 4's date format: ``"The war lasted 5 years from 1723 to 172"`` ->
    ``"8"``: a span of 1..9 years added to a year whose last digit plus the span stays
    below 10, the end year written except its last digit (the answer, no space before
    it). ``a`` = span, ``b`` = last digit of the start year, ``answer`` = a + b."""
    rng = random.Random(seed)
    if fewshot > len(DATE_FEWSHOT):
        raise ValueError(f"at most {len(DATE_FEWSHOT)} few-shot examples for dates")
    prefix = "".join(_date_line(ev, s, y) + str((y + s) % 10) + "\n" for s, y, ev in DATE_FEWSHOT[:fewshot])
    records = []
    for _ in range(n):
        year = rng.randrange(years[0], years[1] + 1)
        span = rng.randrange(1, 10 - year % 10) if year % 10 < 9 else None
        if span is None:
            year -= 1
            span = rng.randrange(1, 10 - year % 10)
        event = rng.choice(DATE_EVENTS)
        records.append(
            PromptRecord(
                family="date",
                op="+",
                a=span,
                b=year % 10,
                answer=span + year % 10,
                template_id=0,
                template=DATE_TEMPLATE,
                text=_date_line(event, span, year),
                answer_text=str((year + span) % 10),
                prefix=prefix,
                meta=(("year", year), ("event", event)),
            )
        )
    return records


def build_tolerant(records: list[PromptRecord], tokenizer, keep_counterfactuals: bool = False) -> tuple[PromptSet, int]:
    """:meth:`PromptSet.build` record by record, dropping the records this tokenizer
    cannot split into prompt and answer (e.g. the toy tokenizer reads "172" + "8" as
    one unknown number). Counterfactuals are removed unless ``keep_counterfactuals``
    (then records whose counterfactual has another token count are dropped too).
    Returns the set and how many records were dropped."""
    sets, dropped = [], 0
    for r in records:
        if not keep_counterfactuals:
            r = replace(r, counterfactual=None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ps = PromptSet.build([r], tokenizer)
        except ValueError:
            dropped += 1
            continue
        if len(ps):
            sets.append(ps)
        else:
            dropped += 1
    if not sets:
        return PromptSet([], [], [], [], tokenizer), dropped
    out = sets[0]
    for ps in sets[1:]:
        out = out + ps
    return out, dropped


def random_head_sets(
    n_layers: int, n_heads: int, k: int, n_sets: int, seed: int, exclude: Sequence[Head] = ()
) -> list[list[Head]]:
    """``n_sets`` seeded draws of ``k`` distinct heads among those not in ``exclude``
    (the control of :func:`transfer_knockout`), each sorted by (layer, head)."""
    pool = [(l, h) for l in range(n_layers) for h in range(n_heads) if (l, h) not in set(map(tuple, exclude))]
    if k > len(pool):
        raise ValueError(f"cannot draw {k} random heads from the {len(pool)} heads outside the knocked-out set")
    rng = np.random.default_rng(seed)
    return [sorted(pool[i] for i in rng.choice(len(pool), k, replace=False)) for _ in range(n_sets)]


def transfer_knockout(
    model,
    tokenizer,
    formats: Mapping[str, list[PromptRecord]],
    heads: Sequence[Head],
    means: Mapping[int, torch.Tensor],
    *,
    n: int,
    n_random: int,
    seed: int,
    n_layers: int,
    n_heads: int,
    batch_size: int = 16,
    max_rows: int = 1024,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Zhang Fig. 4 with a random control: for each format, up to ``n`` of its
    tokenizable prompts (seeded sample; :func:`build_tolerant`), first-token accuracy
    with nothing ablated, with ``heads`` set to their mean (``means``, {layer: [H,
    d_head]}) at the answer position, and with each of ``n_random`` sets of as many
    other heads (:func:`random_head_sets`) ablated the same way; one fast-path pass
    per format for all variants.

    Returns ``(table, examples, per_prompt)``. ``table``: one row per format with ``n``,
    ``accuracy_before``, ``accuracy_after``, ``accuracy_random`` (mean over the random
    sets) and ``accuracy_random_sd``, ``relative_drop`` = 1 - after / before and
    ``relative_drop_random`` = 1 - random / before (NaN when nothing was correct
    before), ``note``. ``examples``: the top-5 next tokens before and after the
    knockout on the first prompt answered correctly (else the first prompt).
    ``per_prompt``: one row per format, prompt and condition ("none", "knockout",
    "random0", ...) with ``n_heads`` and ``correct`` (first answer token is the argmax),
    the table the report bootstraps over prompts."""
    heads = [(int(l), int(h)) for l, h in heads]
    random_sets = random_head_sets(n_layers, n_heads, len(heads), n_random, seed, exclude=heads)
    variants = [[], ablation_edits(heads, means, -1)] + [ablation_edits(r, means, -1) for r in random_sets]
    rows, examples, per_prompt = [], [], []
    conditions = ["none", "knockout"] + [f"random{i}" for i in range(len(random_sets))]
    for name, records in formats.items():
        ps, dropped = build_tolerant(records, tokenizer)
        if len(ps) > n:
            ps = ps.subset(sorted(np.random.default_rng(seed).choice(len(ps), n, replace=False).tolist()))
        if len(ps) == 0:
            rows.append({"format": name, "n": 0, "note": f"tokenizer cannot split {dropped} prompts"})
            continue
        ro = run_interventions(
            model, ps, variants, batch_size=batch_size, max_rows=max_rows, full_logits=True, progress=False
        )
        acc = ro.accuracy.numpy()
        correct = ro.correct.numpy()
        for j, cond in enumerate(conditions):
            per_prompt += [
                {
                    "format": name,
                    "prompt": i,
                    "condition": cond,
                    "n_heads": 0 if j == 0 else len(heads),
                    "correct": bool(correct[j, i]),
                }
                for i in range(len(ps))
            ]
        rows.append(
            {
                "format": name,
                "n": len(ps),
                "accuracy_before": float(acc[0]),
                "accuracy_after": float(acc[1]),
                "accuracy_random": float(acc[2:].mean()) if n_random else float("nan"),
                "accuracy_random_sd": float(acc[2:].std()) if n_random else float("nan"),
                "note": f"{dropped} untokenizable dropped" if dropped else "",
            }
        )
        i = next((i for i in range(len(ps)) if bool(ro.correct[0, i])), 0)
        for label, j in (("before", 0), ("after", 1)):
            top = ro.logits[j, i].softmax(-1).topk(5)
            examples.append(
                {
                    "format": name,
                    "prompt": ps.records[i].text,
                    "answer": ps.records[i].answer_text,
                    "knockout": label,
                    "next_token": tokenizer.decode([int(top.indices[0])]),
                    "top5": ", ".join(
                        f"{tokenizer.decode([int(t)])!r} {float(p):.0%}" for t, p in zip(top.indices, top.values)
                    ),
                }
            )
    table = pd.DataFrame(rows)
    if "accuracy_before" in table:
        before = table["accuracy_before"].where(table["accuracy_before"] > 0)
        table["relative_drop"] = 1 - table["accuracy_after"] / before
        table["relative_drop_random"] = 1 - table["accuracy_random"] / before
    per = pd.DataFrame(per_prompt, columns=["format", "prompt", "condition", "n_heads", "correct"])
    return table, pd.DataFrame(examples), per
