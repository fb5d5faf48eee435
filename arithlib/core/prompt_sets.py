"""Prompt sets: prompt records (:mod:`arithlib.core.datasets`) bound to one tokenizer.

A :class:`PromptSet` holds the token ids of each prompt (few-shot prefix included), of
its answer and of its counterfactual, and yields length-bucketed batches, so no prompt
is ever padded and the answer position is always the last one. :func:`split_answer`
tokenizes a prompt apart from its answer; :func:`single_token_max` and
:func:`single_token_numbers` give a tokenizer's single-token numbers (Nikankin's operand
grids need them, :func:`require_single_token_operands` checks a set);
:func:`expand_answer_tokens` gives Yu & Ananiadou's per-token "memorize" / "change-one"
cases (Table 3).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import pandas as pd
import torch

from .datasets import PromptRecord, carry_flags


def single_token_max(tokenizer, limit: int = 999) -> int:
    """Largest N such that every integer 0..N (written without a leading space) is a
    single token: 9 for per-digit tokenizers (Qwen, SmolLM2, Llama-2), 999 for Llama-3."""
    n = -1
    for k in range(limit + 1):
        if len(tokenizer(str(k), add_special_tokens=False)["input_ids"]) != 1:
            break
        n = k
    return n


def single_token_numbers(tokenizer, max_value: int) -> dict[int, int]:
    """``{n: token id}`` for the integers 0..``max_value`` that are one token each
    (written without a leading space): 0..9 for per-digit tokenizers, up to 999 for
    the toy model; raises when none is."""
    if max_value < 0:
        raise ValueError("max_value must be >= 0")
    out = {}
    for n in range(max_value + 1):
        ids = tokenizer(str(n), add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            out[n] = int(ids[0])
    if not out:
        raise ValueError("no integer in 0..max_value is a single token for this tokenizer")
    return out


def _is_blank(tokenizer, token_id: int) -> bool:
    return tokenizer.decode([token_id]).strip() == ""


class UnsplittableError(ValueError):
    """A prompt that does not tokenize as a prefix of prompt + answer."""


class AnswerSplit(NamedTuple):
    """Token ids of a prompt and its answer (:func:`split_answer`)."""

    prompt: list[int]  # the prompt's tokens, ending with ``moved``
    answer: list[int]  # the answer's tokens, the first one not blank
    moved: list[int]  # blank tokens that began the answer, moved to the prompt's end


def split_answer(tokenizer, text: str, answer_text: str) -> AnswerSplit:
    """Token ids of the prompt ``text`` and of its answer, as one tokenization of
    ``text + answer_text`` splits them. The prompt is tokenized without its trailing
    blanks, since tokenizers differ in whether " 8" is one token (Llama-3) or a blank then
    "8" (Qwen, Llama-2); a blank token that starts the answer moves to the prompt's end,
    and a final EOS is dropped. Raises :class:`UnsplittableError` when the prompt does
    not tokenize as a prefix of prompt + answer (``"... to the year 197"`` + ``"8"`` under
    whole-number tokens), ValueError when the answer has no non-blank token."""
    stem = tokenizer(text.rstrip(" "))["input_ids"]
    full = tokenizer(text + answer_text)["input_ids"]
    if full[: len(stem)] != stem:
        raise UnsplittableError(
            f"prompt {text!r} does not tokenize as a prefix of prompt + answer "
            f"{answer_text!r}; end the template at a token boundary"
        )
    answer = full[len(stem) :]
    eos = tokenizer.eos_token_id
    if answer and eos is not None and answer[-1] == eos:
        answer = answer[:-1]
    moved = []
    while answer and _is_blank(tokenizer, answer[0]):
        moved.append(answer.pop(0))
    if not answer:
        raise ValueError(f"answer {answer_text!r} of {text!r} has no non-blank token")
    return AnswerSplit(stem + moved, answer, moved)


@dataclass
class Batch:
    """Same-length prompts: ``tokens`` [B, T] (answer position is T-1), the index of
    each row in its PromptSet, first answer tokens, and counterfactual tokens if any."""

    index: torch.Tensor
    tokens: torch.Tensor
    answer_ids: torch.Tensor
    cf_tokens: torch.Tensor | None


@dataclass
class PromptSet:
    """Records bound to a tokenizer, with prompt / answer / counterfactual token ids.

    Built with :meth:`build`, which checks that prompt and answer tokenize apart
    (a blank token that starts the answer, such as Qwen's lone space before a digit,
    is moved to the end of the prompt) and that each counterfactual has as many
    tokens as its prompt (patching aligns positions).
    """

    records: list[PromptRecord]
    input_ids: list[list[int]]
    answer_ids: list[list[int]]
    cf_input_ids: list[list[int] | None]
    tokenizer: object = field(repr=False)

    @classmethod
    def build(
        cls, records: Sequence[PromptRecord], tokenizer, drop_misaligned: bool = True, drop_unsplittable: bool = False
    ) -> PromptSet:
        """Tokenize ``records``. Records whose counterfactual length differs from the
        prompt's are dropped (``drop_misaligned``) or raise a ValueError. A prompt that
        does not tokenize as a prefix of prompt + answer (``"... to the year 197"`` + ``"8"``
        under a tokenizer with whole-number tokens) raises a ValueError, or is dropped
        with a warning when ``drop_unsplittable`` (for sets whose format a tokenizer
        cannot express, such as dates under the toy model's number tokens)."""
        keep, inputs, answers, cfs = [], [], [], []
        dropped = unsplittable = 0
        for r in records:
            try:
                prompt, answer, moved = split_answer(tokenizer, r.full_text, r.answer_text)
            except UnsplittableError:
                if drop_unsplittable:
                    unsplittable += 1
                    continue
                raise
            cf = None
            if r.counterfactual is not None:
                cf = tokenizer(r.counterfactual.rstrip(" "))["input_ids"]
                cf = cf + moved  # the same moved blank
                if len(cf) != len(prompt):
                    if drop_misaligned:
                        dropped += 1
                        continue
                    raise ValueError(
                        f"counterfactual {r.counterfactual!r} has {len(cf)} tokens, prompt has {len(prompt)}"
                    )
            keep.append(r)
            inputs.append(prompt)
            answers.append(answer)
            cfs.append(cf)
        if dropped:
            warnings.warn(
                f"PromptSet.build dropped {dropped} of {len(records)} prompts whose counterfactual "
                "has a different token count than the prompt",
                stacklevel=2,
            )
        if unsplittable:
            warnings.warn(
                f"PromptSet.build dropped {unsplittable} of {len(records)} prompts that do not tokenize "
                "apart from their answer under this tokenizer",
                stacklevel=2,
            )
        return cls(keep, inputs, answers, cfs, tokenizer)

    def __len__(self) -> int:
        return len(self.records)

    def subset(self, index: Sequence[int] | torch.Tensor) -> PromptSet:
        """The records at ``index`` (a list of ints or a bool mask), in that order."""
        if isinstance(index, torch.Tensor):
            index = index.nonzero().flatten().tolist() if index.dtype == torch.bool else index.tolist()
        index = list(index)
        return PromptSet(
            [self.records[i] for i in index],
            [self.input_ids[i] for i in index],
            [self.answer_ids[i] for i in index],
            [self.cf_input_ids[i] for i in index],
            self.tokenizer,
        )

    def where(self, **conditions) -> PromptSet:
        """Records whose fields equal the given values, e.g. ``where(op="+", template_id=3)``."""
        idx = [i for i, r in enumerate(self.records) if all(getattr(r, k) == v for k, v in conditions.items())]
        return self.subset(idx)

    def __add__(self, other: PromptSet) -> PromptSet:
        return PromptSet(
            self.records + other.records,
            self.input_ids + other.input_ids,
            self.answer_ids + other.answer_ids,
            self.cf_input_ids + other.cf_input_ids,
            self.tokenizer,
        )

    @property
    def first_answer_ids(self) -> torch.Tensor:
        """The first answer token of each prompt, [N]."""
        return torch.tensor([a[0] for a in self.answer_ids], dtype=torch.long)

    @property
    def has_counterfactuals(self) -> bool:
        return bool(self.records) and all(c is not None for c in self.cf_input_ids)

    def to_frame(self) -> pd.DataFrame:
        """One row per prompt: the record's fields plus token counts (meta expanded)."""
        rows = []
        for r, ids, ans in zip(self.records, self.input_ids, self.answer_ids):
            row = {k: v for k, v in asdict(r).items() if k != "meta"}
            row.update(dict(r.meta))
            row["n_prompt_tokens"] = len(ids)
            row["n_answer_tokens"] = len(ans)
            row["first_answer_token"] = self.tokenizer.decode([ans[0]])
            rows.append(row)
        return pd.DataFrame(rows)

    def length_groups(self) -> dict[int, list[int]]:
        """Indices of the prompts grouped by token length (sorted by length)."""
        groups: dict[int, list[int]] = {}
        for i, ids in enumerate(self.input_ids):
            groups.setdefault(len(ids), []).append(i)
        return dict(sorted(groups.items()))

    def batches(
        self, batch_size: int = 64, device: str | torch.device = "cpu", by_prefix: bool = False
    ) -> Iterator[Batch]:
        """Same-length batches (no padding), covering every prompt once. With
        ``by_prefix`` a batch also holds one few-shot prefix (``record.prefix``) only, so
        that a runner sharing the batch's common prefix shares the whole of it."""
        groups = list(self.length_groups().values())
        if by_prefix:
            groups = [
                [i for i in idx if self.records[i].prefix == q]
                for idx in groups
                for q in dict.fromkeys(self.records[i].prefix for i in idx)
            ]
        for idx in groups:
            for start in range(0, len(idx), batch_size):
                chunk = idx[start : start + batch_size]
                tokens = torch.tensor([self.input_ids[i] for i in chunk], dtype=torch.long, device=device)
                cf = None
                if all(self.cf_input_ids[i] is not None for i in chunk):
                    cf = torch.tensor([self.cf_input_ids[i] for i in chunk], dtype=torch.long, device=device)
                yield Batch(
                    torch.tensor(chunk), tokens, torch.tensor([self.answer_ids[i][0] for i in chunk], device=device), cf
                )


def require_single_token_operands(prompts: PromptSet) -> None:
    """Raise a ValueError naming the first prompt whose operands are not one token each
    (Nikankin's operand-grid analyses need that); says which range is safe."""
    tok = prompts.tokenizer
    for r in prompts.records:
        for x in (r.a, r.b):
            if len(tok(str(x), add_special_tokens=False)["input_ids"]) != 1:
                limit = single_token_max(tok)
                how = f"nikankin_prompts(max_operand={limit})" + (", yu_prompts(n_digits=1)" if limit >= 9 else "")
                raise ValueError(
                    f"operand {x} of {r.text!r} is not a single token for this tokenizer; "
                    f"use operands 0..{limit} ({how})"
                )


def expand_answer_tokens(prompts: PromptSet) -> PromptSet:
    """Yu's per-token cases: an answer of k tokens becomes k prompts, the i-th reading
    the first i answer tokens and predicting token i (teacher forcing). Each case
    gets ``meta['case']`` = "memorize" or "change-one" (Table 3; :func:`carry_flags`),
    which needs one token per answer digit; otherwise a ValueError says so.
    """
    records, inputs, answers, cfs = [], [], [], []
    tok = prompts.tokenizer
    for r, ids, ans in zip(prompts.records, prompts.input_ids, prompts.answer_ids):
        digits = r.answer_text.lstrip("-")
        pieces = [tok.decode([t]).strip() for t in ans]
        if r.answer < 0 or pieces != list(digits):
            raise ValueError(
                f"answer {r.answer_text!r} of {r.text!r} is not one token per digit ({pieces}); "
                "per-token memorize/change-one cases need a per-digit tokenizer and a non-negative answer"
            )
        flags = carry_flags(r.a, r.b, r.op)
        for i, token in enumerate(ans):
            meta = r.meta + (("case", "change-one" if flags[i] else "memorize"), ("answer_token_index", i))
            records.append(replace(r, text=r.text + digits[:i], answer_text=digits[i], carry=flags[i], meta=meta))
            inputs.append(ids + ans[:i])
            answers.append([token])
            cfs.append(None)
    return PromptSet(records, inputs, answers, cfs, tok)
