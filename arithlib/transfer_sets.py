"""Small prompt builders for Zhang et al. 2024's transfer formats (Fig. 4, App. D-E)
that :mod:`arithlib.datasets` does not have: decimals ("4.2 plus 2.5 equals to" -> 6.7)
and dates ("The war lasted 5 years from 1723 to 172" -> 8).

Both return :class:`arithlib.datasets.PromptRecord` lists (tokenizer-free), with a
few-shot prefix in the query's own template like the other builders, so they go
through :meth:`arithlib.datasets.PromptSet.build`. They have no counterfactuals: in
notebook 01 they are only evaluated before and after knocking out the key heads.
"""

from __future__ import annotations

import random
from dataclasses import replace

import warnings

from .datasets import PromptRecord, PromptSet

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


def decimal_prompts(ops: tuple[str, ...] = ("+",), n_per_op: int = 20, seed: int = 0,
                    fewshot: int = 2) -> list[PromptRecord]:
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
        prefix = "".join(_decimal_line(template, a, b) + " " + _tenths(a + b if op == "+" else a - b) + "\n"
                         for a, b in DECIMAL_FEWSHOT[op][:fewshot])
        pairs = [(a, b) for a in range(1, 100) for b in range(1, 100) if a % 10 and b % 10
                 and (a + b < 100 if op == "+" else a > b)]
        for a, b in rng.sample(pairs, min(n_per_op, len(pairs))):
            c = a + b if op == "+" else a - b
            records.append(PromptRecord(
                family="decimal", op=op, a=a, b=b, answer=c, template_id=0, template=template,
                text=_decimal_line(template, a, b) + " ", answer_text=_tenths(c), prefix=prefix,
                meta=(("a_text", _tenths(a)), ("b_text", _tenths(b)), ("numerals", "decimals")),
            ))
    return records


def _date_line(event: str, span: int, year: int) -> str:
    return DATE_TEMPLATE.format(EVENT=event, A=span, YEAR=year, STEM=str(year + span)[:-1])


def date_prompts(n: int = 20, seed: int = 0, fewshot: int = 2, years: tuple[int, int] = (1500, 1999)) -> list[PromptRecord]:
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
        records.append(PromptRecord(
            family="date", op="+", a=span, b=year % 10, answer=span + year % 10, template_id=0,
            template=DATE_TEMPLATE, text=_date_line(event, span, year), answer_text=str((year + span) % 10),
            prefix=prefix, meta=(("year", year), ("event", event)),
        ))
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
