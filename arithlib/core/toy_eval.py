"""How well the toy model does arithmetic: greedy answers to few-shot prompts and the
accuracy per operator on the training and held-out operand pairs (the numbers in
``toy_info.json`` and the slow test's comparison with the shipped weights)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from ..engine import input_device
from .datasets import load_json
from .toy_data import NEWLINE, ToyConfig, format_answer, format_example, split_pairs, toy_answer

# --------------------------------------------------------------------------- evaluation


def eval_prefix(op: str) -> str:
    """The two-example prefix used for few-shot evaluation, e.g. ``"3+4=7\\n8+1=9\\n"``.

    Operands as in data/templates.json (``fewshot_operands``).
    """
    operands = load_json("templates.json")["fewshot_operands"][op]
    return "".join(format_example(op, a, b) + NEWLINE for a, b in operands)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Last-position logits of an HF causal LM or a TransformerBridge."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, -1]


@torch.no_grad()
def toy_generate_answers(
    model: Any,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 1024,
) -> list[list[int]]:
    """Greedy continuation ids of each prompt, cut at the first newline/EOS (not included).

    Prompts are encoded with ``<bos>`` and grouped by token length, so no padding is
    needed; works with an HF causal LM and with a TransformerBridge.
    """
    stop = {tokenizer.convert_tokens_to_ids(NEWLINE), tokenizer.eos_token_id}
    encoded = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    device = input_device(model)
    by_len: dict[int, list[int]] = {}
    for i, e in enumerate(encoded):
        by_len.setdefault(len(e), []).append(i)
    result: list[list[int]] = [[] for _ in prompts]
    for idx in by_len.values():
        for c in range(0, len(idx), batch_size):
            chunk = idx[c : c + batch_size]
            ids = torch.tensor([encoded[i] for i in chunk], device=device)
            new = []
            for _ in range(max_new_tokens):
                nxt = _logits(model, ids).argmax(-1)
                new.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
            gen = torch.stack(new, 1).tolist()
            for i, g in zip(chunk, gen):
                cut = next((j for j, t in enumerate(g) if t in stop), len(g))
                result[i] = g[:cut] if cut < len(g) else g + [-1]  # -1: no terminator seen
    return result


def toy_accuracy(
    model: Any,
    tokenizer: PreTrainedTokenizerFast,
    op: str,
    pairs: list[tuple[int, int]],
    prefix: str = "",
    template: str | None = None,
    batch_size: int = 1024,
) -> float:
    """Greedy exact-match accuracy on ``prefix + "{a}{op}{b}="`` (or ``template``).

    A prompt counts as right when greedy decoding gives exactly the answer's tokens
    followed by a newline. Computed in one teacher-forced pass per prompt: greedy
    decoding yields the answer iff the argmax at every answer position (and at the
    newline) is the next answer token. ``template`` has ``{A}``/``{B}`` slots, e.g.
    ``"Q: What is {A} plus {B}? A:"``. Works on HF models and on TransformerBridge.
    """
    if not pairs:
        return float("nan")
    template = template or f"{{A}}{op}{{B}}="
    newline = tokenizer.convert_tokens_to_ids(NEWLINE)
    prompts = tokenizer([prefix + template.format(A=a, B=b) for a, b in pairs], add_special_tokens=True)
    answers = tokenizer([format_answer(toy_answer(op, a, b)) for a, b in pairs], add_special_tokens=False)
    seqs = [p + a + [newline] for p, a in zip(prompts["input_ids"], answers["input_ids"])]
    n_prompt = [len(p) for p in prompts["input_ids"]]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (seq, n) in enumerate(zip(seqs, n_prompt)):
        groups.setdefault((len(seq), n), []).append(i)
    device = input_device(model)
    correct = 0
    with torch.no_grad():
        for (length, n), idx in groups.items():
            for c in range(0, len(idx), batch_size):
                ids = torch.tensor([seqs[i] for i in idx[c : c + batch_size]], device=device)
                keep = {"logits_to_keep": length - n} if isinstance(model, PreTrainedModel) else {}
                out = model(ids[:, :-1], **keep)
                logits = out.logits if hasattr(out, "logits") else out
                pred = logits[:, -(length - n) :].argmax(-1)
                correct += int((pred == ids[:, n:]).all(dim=1).sum())
    return correct / len(pairs)


def toy_accuracy_table(model: Any, tokenizer: PreTrainedTokenizerFast, cfg: ToyConfig) -> dict[str, dict[str, float]]:
    """Accuracy per operator on train and held-out pairs, bare and after :func:`eval_prefix`.

    Keys ``"+"`` ... ``"/"``; values ``{"train", "heldout", "all", "train_fewshot",
    "heldout_fewshot", "all_fewshot"}``.
    """
    table: dict[str, dict[str, float]] = {}
    for op, (train, held) in split_pairs(cfg).items():
        row: dict[str, float] = {}
        for suffix, prefix in (("", ""), ("_fewshot", eval_prefix(op))):
            tr = toy_accuracy(model, tokenizer, op, train, prefix)
            he = toy_accuracy(model, tokenizer, op, held, prefix)
            row["train" + suffix] = round(tr, 4)
            row["heldout" + suffix] = round(he, 4)
            row["all" + suffix] = round((tr * len(train) + he * len(held)) / (len(train) + len(held)), 4)
        table[op] = row
    return table
