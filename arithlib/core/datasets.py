"""Prompt records for every experiment of the three papers.

A :class:`PromptRecord` is tokenizer-free: operands, operator, template, the prompt
text, the answer string and the counterfactual text. :mod:`arithlib.core.prompt_sets`
binds records to a tokenizer.

Builders, one per paper's data:

* :func:`nikankin_prompts`: "{x}{op}{y}=" with single-token operands and results.
* :func:`yu_prompts`: Yu & Ananiadou's 16 templates (Table 14), 1-3 digit operands,
  digits or number words; :func:`carry_flags` gives Yu's per-token "memorize" /
  "change-one" cases (Table 3).
* :func:`zhang_prompts`: Zhang et al.'s templates (Fig. 8) with counterfactuals
  (operator word/symbol replaced); :func:`zhang_word_problems` (Fig. 10);
  :func:`power_prompts` (App. D, Table 3).
* :func:`load_gender_data`: Yu's App. D prompts and profession lists.

Templates and word lists are data in ``data/``; nothing here depends on a tokenizer.
"""

from __future__ import annotations

import bisect
import collections.abc
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

from ..run.paths import data_path
from .papers import YU_OPERAND_RANGES

OPS: tuple[str, ...] = ("+", "-", "*", "/")
OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "/": "div", "^": "pow"}


def apply_op(a: int, b: int, op: str) -> int:
    """a op b for the integer operators; division must be exact (raises otherwise)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0 or a % b:
            raise ValueError(f"{a}/{b} is not an exact integer division")
        return a // b
    if op == "^":
        return a**b
    raise ValueError(f"unknown operator {op!r}; expected one of + - * / ^")


@cache
def load_json(name: str) -> dict:
    """A JSON file of ``data/`` (templates, word lists, gender prompts), parsed once."""
    with open(data_path(name), encoding="utf-8") as f:
        return json.load(f)


def number_to_words(n: int) -> str:
    """English words for 0 <= n <= 999999 ("forty-two", "one hundred and five")."""
    words = load_json("number_words.json")
    if not 0 <= n <= 999_999:
        raise ValueError(f"number_to_words handles 0..999999, got {n}")
    if n >= 1000:
        thousands, rest = divmod(n, 1000)
        head = f"{number_to_words(thousands)} thousand"
        return head if rest == 0 else f"{head} {'and ' if rest < 100 else ''}{number_to_words(rest)}"
    if n < 20:
        return words["units"][n]
    if n < 100:
        tens, unit = divmod(n, 10)
        return words["tens"][tens] + ("" if unit == 0 else "-" + words["units"][unit])
    hundreds, rest = divmod(n, 100)
    head = f"{words['units'][hundreds]} {words['hundred']}"
    return head if rest == 0 else f"{head} and {number_to_words(rest)}"


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class PromptRecord:
    """One arithmetic prompt, independent of any tokenizer.

    ``prefix + text`` is what the model reads; ``answer_text`` is what should follow.
    ``counterfactual`` (Zhang's X_c) has the operation replaced, prefix included.
    ``carry`` is Yu's "change-one" flag for the first answer digit (a carry or borrow
    reaches it); ``meta`` holds family-specific fields (slot fillers, case type).
    """

    family: str
    op: str
    a: int
    b: int
    answer: int
    template_id: int
    template: str
    text: str
    answer_text: str
    prefix: str = ""
    counterfactual: str | None = None
    n_digits: int = 1
    carry: bool = False
    meta: tuple[tuple[str, object], ...] = ()

    @property
    def full_text(self) -> str:
        return self.prefix + self.text

    def get(self, key: str, default: object = None) -> object:
        return dict(self.meta).get(key, default)


def _render(template: str, a: str, b: str, op_word: str | None = None) -> str:
    """Fill {A}, {B}; keep the [bracketed] operator word, or replace it by ``op_word``."""
    text = template.replace("{A}", a).replace("{B}", b)
    return re.sub(r"\[([^\]]+)\]", lambda m: op_word if op_word is not None else m.group(1), text)


#: How numbers are written: Arabic digits ("42") or English words ("forty-two").
NUMERALS: tuple[str, ...] = ("digits", "words")


def _format_number(n: int, numerals: str) -> str:
    """``n`` as ``numerals`` says (one of :data:`NUMERALS`); anything else raises a ValueError."""
    if numerals not in NUMERALS:
        raise ValueError(f"numerals must be one of {NUMERALS} (yu_prompts also takes 'both'), got {numerals!r}")
    return number_to_words(n) if numerals == "words" else str(n)


def fewshot_prefix(
    template: str,
    op: str,
    sep: str,
    k: int,
    numerals: str = "digits",
    op_word: str | None = None,
    answers: Sequence[int] | None = None,
) -> str:
    """k solved examples of the query's own template, one per line (operands from
    ``data/templates.json``'s ``fewshot_operands``); ``op_word`` renders the
    counterfactual version of the same prefix. ``answers`` replaces the k results
    (X_c's prefix: :func:`no_operation_answers`); by default each line shows a op b."""
    if k <= 0:
        return ""
    pairs = fewshot_operands(op, k)
    if answers is not None and len(answers) != k:
        raise ValueError(f"fewshot_prefix needs {k} answers, got {len(answers)}")
    lines = []
    for i, (a, b) in enumerate(pairs):
        c = apply_op(a, b, op) if answers is None else int(answers[i])
        lines.append(
            _render(template, _format_number(a, numerals), _format_number(b, numerals), op_word)
            + sep
            + _format_number(c, numerals)
            + "\n"
        )
    return "".join(lines)


def fewshot_operands(op: str, k: int) -> list[tuple[int, int]]:
    """The operand pairs of the first k few-shot lines of ``op`` (``data/templates.json``)."""
    pairs = load_json("templates.json")["fewshot_operands"][op]
    if k > len(pairs):
        raise ValueError(f"at most {len(pairs)} few-shot examples are defined for {op!r}, asked for {k}")
    return [(int(a), int(b)) for a, b in pairs[:k]]


#: Operators whose results an X_c prefix answer must avoid (:func:`no_operation_answers`).
_ALL_OPS: tuple[str, ...] = ("+", "-", "*", "/", "^")


def operation_results(a: int, b: int) -> set[int]:
    """Every value an arithmetic reading of "a ? b" could give: a, b (copying an operand)
    and a + b, a - b, b - a, a * b, a / b, b / a, a ^ b, b ^ a where they are integers."""
    out = {a, b, a + b, a - b, b - a, a * b}
    if b and a % b == 0:
        out.add(a // b)
    if a and b % a == 0:
        out.add(b // a)
    if 0 <= b <= 9 and abs(a) <= 99:
        out.add(a**b)
    if 0 <= a <= 9 and abs(b) <= 99:
        out.add(b**a)
    return out


def no_operation_answers(
    pairs: Sequence[tuple[int, int]], true_answers: Sequence[int], rng: random.Random
) -> list[int]:
    """Answers for the solved lines of X_c's few-shot prefix that follow no operation
    (Zhang Sec. 3: X_c carries no calculation logic). For each line (a, b) with true
    result c: a seeded uniform draw among the non-negative numbers with as many digits
    as c (so the line tokenizes to as many tokens as in X_r's prefix) that are none of
    :func:`operation_results` (a, b). The old prefix kept c, so the two in-context
    examples taught the model what the nonsense operator means."""
    out = []
    for (a, b), c in zip(pairs, true_answers):
        digits = len(str(abs(int(c))))
        lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
        banned = operation_results(a, b)
        pool = [x for x in range(lo, hi + 1) if x not in banned]
        if not pool:
            raise ValueError(f"no {digits}-digit number avoids every operation on ({a}, {b})")
        out.append(rng.choice(pool))
    return out


#: How X_c's few-shot prefix is built: "no-operation" (answers by :func:`no_operation_answers`,
#: the default) or "true-answers" (the prefix of X_r with the operator replaced; the
#: older construction, kept to measure how much it leaks).
XC_PREFIXES: tuple[str, ...] = ("no-operation", "true-answers")


def carry_flags(a: int, b: int, op: str) -> list[bool]:
    """Per answer digit, most significant first: does a carry (+) or borrow (-) reach it?

    This is Yu & Ananiadou's "change-one" case (Sec. 3.4, Table 3): "15+37=" -> "5"
    needs 1+3+1. For * and / every digit but the last is "change-one" (their rule).
    Only defined for non-negative answers.
    """
    c = apply_op(a, b, op)
    if c < 0:
        raise ValueError("carry_flags is defined for non-negative answers only")
    digits = len(str(c))
    if op in ("*", "/", "^"):
        return [True] * (digits - 1) + [False]
    flags = []
    carry = 0
    x, y = a, b
    for _ in range(digits):  # least significant first
        flags.append(carry != 0)
        da, db = x % 10, y % 10
        if op == "+":
            carry = 1 if da + db + carry >= 10 else 0
        else:
            carry = 1 if da - db - carry < 0 else 0
        x, y = x // 10, y // 10
    return flags[::-1]


def _operand_pairs(op: str, lo: int, hi: int, max_result: int | None, allow_negative: bool) -> list[tuple[int, int]]:
    """All (a, b) with lo <= a, b <= hi whose result is an integer in range."""
    pairs = []
    for a in range(lo, hi + 1):
        for b in range(lo, hi + 1):
            if op == "/" and (b == 0 or a % b):
                continue
            c = apply_op(a, b, op)
            if c < 0 and not allow_negative:
                continue
            if max_result is not None and abs(c) > max_result:
                continue
            pairs.append((a, b))
    return pairs


def _sample(items: list, n: int | None, rng: random.Random) -> list:
    if n is None or n >= len(items):
        return list(items)
    return rng.sample(items, n)


# --------------------------------------------------------------------------- builders


def _records_from_templates(
    family: str,
    templates: dict,
    ops: Sequence[str],
    pairs_by_op: dict,
    numerals: str,
    fewshot: int,
    n_digits: int,
    cf_pool: dict | None,
    rng: random.Random,
    xc_prefix: str = "no-operation",
    xc_rng: random.Random | None = None,
) -> list[PromptRecord]:
    if xc_prefix not in XC_PREFIXES:
        raise ValueError(f"xc_prefix must be one of {XC_PREFIXES}, got {xc_prefix!r}")
    sep = templates["sep"]
    xc_rng = xc_rng if xc_rng is not None else random.Random(0)
    xc_answers: dict[tuple[str, int], list[int]] = {}
    records = []
    for op in ops:
        for t_id, template in enumerate(templates[op]):
            if cf_pool is not None and fewshot > 0 and xc_prefix == "no-operation":
                # one draw per template: X_c prompts of a template share their prefix (and its cached keys)
                shots = fewshot_operands(op, fewshot)
                xc_answers[(op, t_id)] = no_operation_answers(shots, [apply_op(x, y, op) for x, y in shots], xc_rng)
            for a, b in pairs_by_op[op]:
                c = apply_op(a, b, op)
                sa, sb = _format_number(a, numerals), _format_number(b, numerals)
                text = _render(template, sa, sb)
                prefix = fewshot_prefix(template, op, sep, fewshot, numerals)
                cf = None
                if cf_pool is not None:
                    op_slot = re.search(r"\[([^\]]+)\]", template).group(1)
                    pool = cf_pool["symbols"] if not op_slot.isalpha() else cf_pool["words"]
                    word = rng.choice(pool)
                    answers = xc_answers.get((op, t_id))
                    cf = fewshot_prefix(template, op, sep, fewshot, numerals, op_word=word, answers=answers) + _render(
                        template, sa, sb, word
                    )
                records.append(
                    PromptRecord(
                        family=family,
                        op=op,
                        a=a,
                        b=b,
                        answer=c,
                        template_id=t_id,
                        template=template,
                        text=text + sep,
                        answer_text=_format_number(c, numerals) if c >= 0 else "-" + _format_number(-c, numerals),
                        prefix=prefix,
                        counterfactual=None if cf is None else cf + sep,
                        n_digits=n_digits,
                        carry=bool(c >= 0 and carry_flags(a, b, op)[0]),
                        meta=(("numerals", numerals),),
                    )
                )
    return records


def nikankin_prompts(
    ops: Sequence[str] = OPS,
    max_operand: int = 9,
    max_result: int | None = None,
    n_per_op: int | None = 50,
    seed: int = 0,
    fewshot: int = 0,
) -> list[PromptRecord]:
    """Nikankin et al.'s "{x}{op}{y}=" prompts (no spaces), operands 0..max_operand,
    integer results 0..max_result (default max_operand: a single token when the
    operand range is the tokenizer's single-token range; see
    :func:`arithlib.core.prompt_sets.single_token_max`).
    Each record's counterfactual is another prompt of the same operator with a
    different answer (the operand-changing counterfactual of their activation patching).
    """
    rng = random.Random(seed)
    max_result = max_operand if max_result is None else max_result
    templates = load_json("templates.json")["nikankin"]
    pairs = {op: _sample(_operand_pairs(op, 0, max_operand, max_result, False), n_per_op, rng) for op in ops}
    records = _records_from_templates("nikankin", templates, ops, pairs, "digits", fewshot, 1, None, rng)
    return _pair_operand_counterfactuals(records, rng)


class _Excluding(collections.abc.Sequence):
    """``group`` without the items at the sorted positions ``skip``, as a read-only
    sequence: ``rng.choice`` on it draws exactly what it would on the filtered list,
    without building that list (O(log n) per item instead of O(n))."""

    def __init__(self, group: list, skip: list[int]):
        self.group, self.skip = group, skip

    def __len__(self) -> int:
        return len(self.group) - len(self.skip)

    def __getitem__(self, k: int):  # type: ignore[override]
        # the k-th kept item is at position j = k + (number of skipped positions <= j)
        lo, hi = k, k + len(self.skip)
        while lo < hi:
            mid = (lo + hi) // 2
            if mid - bisect.bisect_right(self.skip, mid) >= k:
                hi = mid
            else:
                lo = mid + 1
        return self.group[lo]


def _pair_operand_counterfactuals(records: list[PromptRecord], rng: random.Random) -> list[PromptRecord]:
    """Give each record the full text of a random same-operator, same-template record
    with a different answer as its counterfactual.

    Linear in the number of records (grouped by operator and template; each record's
    pool is its group minus the records of its own answer), so all operand pairs up to
    300 (Nikankin et al.'s setting for a tokenizer with one token per number, ~10^5
    prompts) pair in a second; the draws are those of ``rng.choice`` on the filtered list.
    """
    groups: dict[tuple[str, int], list[PromptRecord]] = {}
    same: dict[tuple[str, int, object], list[int]] = {}
    for r in records:
        g = groups.setdefault((r.op, r.template_id), [])
        same.setdefault((r.op, r.template_id, r.answer), []).append(len(g))
        g.append(r)
    out = []
    for r in records:
        pool = _Excluding(groups[(r.op, r.template_id)], same[(r.op, r.template_id, r.answer)])
        if not len(pool):
            out.append(r)
            continue
        partner = rng.choice(pool)
        out.append(
            replace(
                r,
                counterfactual=partner.full_text,
                meta=r.meta + (("cf_answer", partner.answer), ("cf_answer_text", partner.answer_text)),
            )
        )
    return out


def yu_prompts(
    ops: Sequence[str] = OPS,
    n_digits: int = 1,
    numerals: str = "digits",
    n_per_template: int | None = 100,
    allow_negative: bool = False,
    seed: int = 0,
    fewshot: int = 0,
    templates: Sequence[int] | None = None,
) -> list[PromptRecord]:
    """Yu & Ananiadou's arithmetic prompts (Table 14: 4 templates per operator).

    ``n_digits`` operands: 1 -> 0..9 (1..9 for /), 2 -> 10..99, 3 -> 100..999. With the
    defaults the 2-digit set has 4 ops x 4 templates x 100 pairs = 1,600 sentences, as
    in the paper. ``numerals="words"`` writes operands and answers as number words
    ("both" gives the union). ``templates`` selects template indices (the paper's
    App. E sweep uses the last one, index 3). Any other ``n_digits`` or ``numerals``
    raises a ValueError listing the allowed values.
    """
    if numerals not in (*NUMERALS, "both"):
        raise ValueError(f"numerals must be one of {(*NUMERALS, 'both')}, got {numerals!r}")
    if n_digits not in YU_OPERAND_RANGES:
        raise ValueError(
            f"n_digits must be one of {sorted(YU_OPERAND_RANGES)} (operands "
            f"{', '.join(f'{lo}..{hi}' for lo, hi in YU_OPERAND_RANGES.values())}), got {n_digits!r}"
        )
    if numerals == "both":
        return yu_prompts(
            ops, n_digits, "digits", n_per_template, allow_negative, seed, fewshot, templates
        ) + yu_prompts(ops, n_digits, "words", n_per_template, allow_negative, seed, fewshot, templates)
    lo, hi = YU_OPERAND_RANGES[n_digits]
    rng = random.Random(seed)
    base = load_json("templates.json")["yu"]
    chosen = {op: [base[op][i] for i in (templates if templates is not None else range(len(base[op])))] for op in ops}
    chosen["sep"] = base["sep"]
    pairs = {}
    for op in ops:
        lo_b = max(lo, 1) if op == "/" else lo
        if op == "/" and n_digits > 1:
            # exact divisions with an n-digit dividend and an n-digit or shorter divisor
            cand = [(a, b) for b in range(1, hi + 1) for a in range(lo, hi + 1) if a % b == 0 and b < a]
        else:
            cand = _operand_pairs(op, lo_b if op == "/" else lo, hi, None, allow_negative)
        pairs[op] = _sample(cand, n_per_template, rng)
    return _records_from_templates("yu", chosen, ops, pairs, numerals, fewshot, n_digits, None, rng)


def zhang_prompts(
    ops: Sequence[str] = OPS,
    operand_range: tuple[int, int] = (1, 9),
    n_per_template: int | None = None,
    seed: int = 0,
    fewshot: int = 0,
    templates: Sequence[int] | None = None,
    xc_prefix: str = "no-operation",
) -> list[PromptRecord]:
    """Zhang et al.'s templates (Fig. 8) with operands in ``operand_range`` (1..9 in
    the paper) and a counterfactual X_c per prompt: the operator word replaced by a random
    term of {none, nothing, ...}, a symbol by one of {<, >, @, ...}, in the prefix too,
    and the prefix's solved lines answered by :func:`no_operation_answers` (``xc_prefix``,
    one of :data:`XC_PREFIXES`), so that X_c carries no calculation logic (Zhang Sec. 3).
    Results must be non-negative integers (a >= b for -, exact /). The X_c prefix answers
    are drawn once per operator and template from their own seeded stream, so X_r and the
    operator words do not change with them.
    """
    rng = random.Random(seed)
    base = load_json("templates.json")
    zt = base["zhang"]
    chosen = {op: [zt[op][i] for i in (templates if templates is not None else range(len(zt[op])))] for op in ops}
    chosen["sep"] = zt["sep"]
    lo, hi = operand_range
    pairs = {op: _sample(_operand_pairs(op, lo, hi, None, False), n_per_template, rng) for op in ops}
    return _records_from_templates(
        "zhang",
        chosen,
        ops,
        pairs,
        "digits",
        fewshot,
        len(str(hi)),
        base["zhang_counterfactual"],
        rng,
        xc_prefix,
        random.Random(f"xc-prefix/{seed}"),
    )


def power_prompts(
    max_operand: int = 9, max_result: int = 999, seed: int = 0, fewshot: int = 0, xc_prefix: str = "no-operation"
) -> list[PromptRecord]:
    """Exponentiation prompts of Zhang et al. App. D (Table 3) with counterfactuals
    (X_c prefix as in :func:`zhang_prompts`), operands 1..max_operand (exponent >= 1),
    results up to ``max_result``."""
    rng = random.Random(seed)
    base = load_json("templates.json")
    pt = base["zhang_power"]
    pairs = {"^": [(a, b) for a in range(1, max_operand + 1) for b in range(1, max_operand + 1) if a**b <= max_result]}
    return _records_from_templates(
        "power",
        pt,
        ["^"],
        pairs,
        "digits",
        fewshot,
        1,
        base["zhang_counterfactual"],
        rng,
        xc_prefix,
        random.Random(f"xc-prefix/{seed}"),
    )


def zhang_word_problems(n_per_template: int = 20, seed: int = 0) -> list[PromptRecord]:
    """Zhang et al.'s word-problem templates (Fig. 10): addition as time spans and
    object accumulation, A + B < 10, slots filled at random from ``data/word_problems.json``.
    The counterfactual changes the objects (as Fig. 9's third example): every object
    slot gets an unrelated object, so the question no longer adds anything."""
    rng = random.Random(seed)
    wp = load_json("word_problems.json")
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10) if a + b < 10]
    records = []
    for t_id, spec in enumerate(wp["templates"]):
        template = spec["text"]
        for a, b in _sample(pairs, n_per_template, rng):
            slots = {k: rng.choice(v) for k, v in wp.items() if isinstance(v, list) and k != "templates"}
            names = rng.sample(wp["NAME"], 2)
            slots["NAME"], slots["NAME2"] = names
            text = template.replace("{A}", str(a)).replace("{B}", str(b))
            cf = _render(text, str(a), str(b), rng.choice(load_json("templates.json")["zhang_counterfactual"]["words"]))
            text = _render(text, str(a), str(b))
            for key, value in slots.items():
                text = text.replace(f"<{key}>", value)
            others = [o for o in wp["OBJECT"] if o != slots["OBJECT"]]
            obj_iter = iter(rng.sample(others, len(others)))
            cf = re.sub(r"<OBJECT>", lambda m: next(obj_iter), cf)
            for key, value in slots.items():
                cf = cf.replace(f"<{key}>", value)
            records.append(
                PromptRecord(
                    family="word_problem",
                    op="+",
                    a=a,
                    b=b,
                    answer=a + b,
                    template_id=t_id,
                    template=template,
                    text=text + spec["sep"],
                    answer_text=str(a + b),
                    counterfactual=cf + spec["sep"],
                    n_digits=1,
                    meta=tuple(sorted(slots.items())),
                )
            )
    return records


def load_gender_data() -> dict:
    """Yu & Ananiadou App. D: the 8 prompts (with ``<gend>``), the two genders, and the
    paper's Table 23 professions (reference data, not results)."""
    return load_json("gender.json")


def gender_prompts(gender: str) -> list[str]:
    """The 8 Table-22 prompts with ``<gend>`` filled by ``gender``."""
    return [p.replace("<gend>", gender) for p in load_gender_data()["prompts"]]
