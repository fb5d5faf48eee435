"""Where the operands, the operator and the END token sit in a prompt (the few-shot prefix
included), the attention of key heads by token class (Zhang et al. 2024, Fig. 4), and
stratified prompt samples.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from .components import Head
from .datasets import PromptRecord
from .prompt_sets import PromptSet

_SLOT = re.compile(r"\{A\}|\{B\}|\[([^\]]+)\]")


def _format_operand(n: int, numerals: str) -> str:
    from .datasets import number_to_words

    return number_to_words(n) if numerals == "words" else str(n)


def query_spans(record: PromptRecord) -> dict[str, tuple[int, int]]:
    """Character spans of operand A, operand B and the operator word/symbol in the
    record's query text (``record.text``, without the few-shot prefix), found by
    re-rendering its template (``<SLOT>`` fillers of word problems from ``meta``); for
    texts that do not re-render, the first two occurrences of the operands' digits. The operator is absent when the
    template has no ``[operator]`` slot."""
    numerals = record.get("numerals", "digits")
    sa, sb = _format_operand(record.a, numerals), _format_operand(record.b, numerals)
    meta = dict(record.meta)
    # fill <SLOT> placeholders (word problems) from the record's meta
    template = re.sub(r"<([A-Z][A-Z_0-9]*)>", lambda m: str(meta.get(m.group(1), m.group(0))), record.template)
    out: dict[str, tuple[int, int]] = {}
    text, pos = [], 0
    last = 0
    for m in _SLOT.finditer(template):
        lit = template[last : m.start()]
        text.append(lit)
        pos += len(lit)
        piece = sa if m.group(0) == "{A}" else sb if m.group(0) == "{B}" else m.group(1)
        key = "A" if m.group(0) == "{A}" else "B" if m.group(0) == "{B}" else "operator"
        out[key] = (pos, pos + len(piece))
        text.append(piece)
        pos += len(piece)
        last = m.end()
    text.append(template[last:])
    rendered = "".join(text)
    if record.text.startswith(rendered) and "A" in out and "B" in out:
        return out
    # fallback: operands as digit runs, in order
    spans: dict[str, tuple[int, int]] = {}
    start = 0
    for key, s in (("A", str(record.a)), ("B", str(record.b))):
        m = re.compile(rf"(?<!\d){re.escape(s)}(?!\d)").search(record.text, start)
        if m is None:
            raise ValueError(f"cannot find operand {key}={s!r} in {record.text!r}")
        spans[key] = (m.start(), m.end())
        start = m.end()
    return spans


def locate_operands(prompts: PromptSet) -> list[dict[str, list[int]]]:
    """Token positions of operand A, operand B and the operator in each prompt's final
    query line (not in the few-shot prefix), from the tokenizer's character offsets;
    plus ``prefix`` (positions of the few-shot prefix), ``other`` (remaining query
    positions) and ``last`` ([T-1], the answer position). Every position is in exactly
    one of A, B, operator, prefix, other. Raises ValueError if a slot maps to no token
    or the tokenizer does not reproduce the prompt's ids."""
    tok = prompts.tokenizer
    out = []
    for r, ids in zip(prompts.records, prompts.input_ids):
        stem = r.full_text.rstrip(" ")
        enc = tok(stem, return_offsets_mapping=True)
        n = len(enc["input_ids"])
        if enc["input_ids"] != ids[:n]:
            raise ValueError(f"tokenizer does not reproduce the ids of {stem!r}")
        offsets = list(enc["offset_mapping"]) + [(len(stem), len(r.full_text))] * (len(ids) - n)
        base = len(r.prefix)
        spans = {k: (s + base, e + base) for k, (s, e) in query_spans(r).items()}
        found: dict[str, list[int]] = {"A": [], "B": [], "operator": [], "prefix": [], "other": []}
        for i, (a, b) in enumerate(offsets):
            slot = None
            for key, (s, e) in spans.items():
                if b > s and a < e and b > a:
                    slot = key
                    break
            if slot is None:
                slot = "prefix" if b <= base and (b > a or a < base) and i < len(ids) - 1 else "other"
            found[slot].append(i)
        for key in spans:
            if not found[key]:
                raise ValueError(f"slot {key} of {r.text!r} maps to no token")
        found["last"] = [len(ids) - 1]
        out.append(found)
    return out


def named_positions(
    located: Sequence[Mapping[str, list[int]]], names: Mapping[str, str] | None = None
) -> dict[str, list[int]]:
    """One position per prompt for each name: the LAST token of operand A ("A"), of the
    operator ("operator"), of operand B ("B") and the answer position ("last").
    ``names`` renames them (e.g. {"A": "op1", "operator": "operator", "B": "op2", "last": "="})."""
    names = dict(names or {"A": "A", "operator": "operator", "B": "B", "last": "last"})
    out: dict[str, list[int]] = {v: [] for v in names.values()}
    for loc in located:
        for key, name in names.items():
            if not loc.get(key):
                raise ValueError(f"no {key} position in a prompt")
            out[name].append(loc[key][-1])
    return out


def attention_by_class(
    attention: Mapping[int, torch.Tensor],
    located: Sequence[Mapping[str, list[int]]],
    prompts: PromptSet,
    heads: Sequence[Head] | None = None,
) -> pd.DataFrame:
    """Zhang et al. Sec. 4.2 / Fig. 5: mean attention from the END query to operand A,
    operand B, the operator, the rest of the query and the few-shot prefix, per head
    and operator. ``attention`` is :attr:`PathPatchingResult.attention`. Returns rows
    ``op``, ``layer``, ``head``, ``A``, ``B``, ``operator``, ``other``, ``prefix``, ``n``."""
    classes = ["A", "B", "operator", "other", "prefix"]
    acc: dict[tuple, np.ndarray] = {}
    cnt: dict[tuple, int] = {}
    for i, pat in attention.items():
        loc = located[i]
        op = prompts.records[i].op
        L, H, T = pat.shape
        sel = heads if heads is not None else [(l, h) for l in range(L) for h in range(H)]
        mass = np.stack([pat[:, :, loc[c]].sum(-1).numpy() if loc[c] else np.zeros((L, H)) for c in classes], -1)
        for l, h in sel:
            key = (op, l, h)
            acc[key] = acc.get(key, 0) + mass[l, h]
            cnt[key] = cnt.get(key, 0) + 1
    rows = [
        {"op": k[0], "layer": k[1], "head": k[2], **dict(zip(classes, (v / cnt[k]).tolist())), "n": cnt[k]}
        for k, v in acc.items()
    ]
    return pd.DataFrame(rows)


def classify_heads(attn: pd.DataFrame) -> pd.DataFrame:
    """Zhang's head types from :func:`attention_by_class` rows (averaged over operators):
    the token class with the highest mean attention among operands (A + B), operator and
    everything else (rest of query + prefix) names the head: "operand", "operator" or
    "other"; ``task_type`` compares only operands vs operator."""
    g = attn.groupby(["layer", "head"])[["A", "B", "operator", "other", "prefix"]].mean().reset_index()
    g["operands"] = g["A"] + g["B"]
    g["rest"] = g["other"] + g["prefix"]
    g["type"] = np.select(
        [(g.operands >= g.operator) & (g.operands >= g.rest), g.operator >= g.rest], ["operand", "operator"], "other"
    )
    g["task_type"] = np.where(g.operands >= g.operator, "operand", "operator")
    return g


def sample_per_group(prompts: PromptSet, n: int, keys: Sequence[str] = ("op",), seed: int = 0) -> PromptSet:
    """At most ``n`` prompts per group of record fields ``keys`` (seeded), in index order."""
    rng = np.random.default_rng(seed)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(prompts.records):
        groups.setdefault(tuple(getattr(r, k) for k in keys), []).append(i)
    chosen: list[int] = []
    for _, idx in sorted(groups.items(), key=lambda kv: str(kv[0])):
        chosen += sorted(rng.choice(idx, size=min(n, len(idx)), replace=False).tolist())
    return prompts.subset(sorted(chosen))
