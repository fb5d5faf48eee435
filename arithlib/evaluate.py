"""Batched evaluation at the answer position: logits, accuracy, the correct subset.

Every prompt set is run in same-length batches (:meth:`PromptSet.batches`), so no
padding is needed and the answer position is the last token. Only the last
position is unembedded (``logits_to_keep=1``): on the CPU the unembedding of every
position is a large part of a forward pass for these vocabularies.

Hooks attached to the bridge (``with bridge.hooks(fwd_hooks=...)``) stay active in
every function here, so an intervention is evaluated by wrapping the call.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from .datasets import PromptSet


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def last_position_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits at the last position, [B, vocab], in float32, from one forward pass."""
    out = model(tokens, logits_to_keep=1)
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, -1, :].float()


@torch.no_grad()
def answer_logits(model, prompts: PromptSet, batch_size: int = 64, progress: bool = False,
                  desc: str = "answer logits") -> torch.Tensor:
    """Logits at the answer position for every prompt, [N, vocab] (float32, CPU)."""
    device = _device_of(model)
    chunks = []
    for batch in tqdm(list(prompts.batches(batch_size, device)), desc=desc, disable=not progress, leave=False):
        chunks.append((batch.index, last_position_logits(model, batch.tokens).cpu()))
    vocab = chunks[0][1].shape[-1] if chunks else 0
    out = torch.empty(len(prompts), vocab)
    for index, logits in chunks:
        out[index] = logits
    return out


@torch.no_grad()
def greedy_answers(model, prompts: PromptSet, extra_tokens: int = 1, batch_size: int = 64,
                   progress: bool = False) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy continuation of each prompt: as many tokens as its answer has, plus
    ``extra_tokens`` (to see whether the model stops or keeps writing digits).

    Returns ``(first_logits [N, vocab], generated token ids)``; the logits are those
    of the first step, i.e. :func:`answer_logits`, so one pass gives both. A manual
    KV-cached loop over the bridge's model, so bridge hooks apply at every step."""
    device = _device_of(model)
    result: list[list[int]] = [[] for _ in range(len(prompts))]
    chunks = []
    hf = model.original_model if hasattr(model, "original_model") else model
    for batch in tqdm(list(prompts.batches(batch_size, device)), desc="greedy", disable=not progress, leave=False):
        n_new = max(len(prompts.answer_ids[i]) for i in batch.index.tolist()) + extra_tokens
        out = hf(batch.tokens, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].float()
        chunks.append((batch.index, first.cpu()))
        past = out.past_key_values
        nxt = first.argmax(-1)
        generated = [nxt]
        for _ in range(n_new - 1):
            out = hf(nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            generated.append(nxt)
        gen = torch.stack(generated, 1).cpu().tolist()
        for row, i in enumerate(batch.index.tolist()):
            result[i] = gen[row]
    logits = torch.empty(len(prompts), chunks[0][1].shape[-1] if chunks else 0)
    for index, chunk in chunks:
        logits[index] = chunk
    return logits, result


def _continues_number(tokenizer, token_id: int) -> bool:
    text = tokenizer.decode([token_id])
    return bool(text) and (text[0].isdigit() or text[0] == ".")


@torch.no_grad()
def evaluate(model, prompts: PromptSet, full_answer: bool = True, batch_size: int = 64,
             progress: bool = False) -> pd.DataFrame:
    """Per-prompt evaluation at the answer position.

    Columns: the prompt's fields, ``pred_token`` (greedy first token), ``correct_first``
    (first answer token is the argmax), ``answer_logit``, ``answer_prob``,
    ``answer_logprob``, ``rank`` of the answer token, and with ``full_answer`` also
    ``generated`` and ``correct_full``: the greedy continuation spells the whole answer
    and then stops (its next token does not continue the number).
    """
    tok = prompts.tokenizer
    if full_answer:
        logits, generated = greedy_answers(model, prompts, 1, batch_size, progress)
    else:
        logits = answer_logits(model, prompts, batch_size, progress)
    answers = prompts.first_answer_ids
    logprobs = logits.log_softmax(-1)
    ans_logit = logits.gather(1, answers[:, None]).squeeze(1)
    frame = prompts.to_frame()
    frame["pred_token"] = [tok.decode([t]) for t in logits.argmax(-1).tolist()]
    frame["correct_first"] = (logits.argmax(-1) == answers).numpy()
    frame["answer_logit"] = ans_logit.numpy()
    frame["answer_logprob"] = logprobs.gather(1, answers[:, None]).squeeze(1).numpy()
    frame["answer_prob"] = frame["answer_logprob"].map(lambda x: float(torch.tensor(x).exp()))
    frame["rank"] = (logits > ans_logit[:, None]).sum(-1).numpy()
    if full_answer:
        full_ok = []
        for gen, ans in zip(generated, prompts.answer_ids):
            ok = gen[: len(ans)] == ans and not _continues_number(tok, gen[len(ans)])
            full_ok.append(ok)
        frame["generated"] = [tok.decode(g) for g in generated]
        frame["correct_full"] = full_ok
    return frame


def accuracy(frame: pd.DataFrame, by: Sequence[str] | str | None = None, column: str | None = None) -> pd.DataFrame | float:
    """Mean of ``correct_full`` (or ``correct_first`` when full answers were not
    checked), overall or grouped ``by`` columns."""
    column = column or ("correct_full" if "correct_full" in frame else "correct_first")
    if by is None:
        return float(frame[column].mean())
    return frame.groupby(list([by] if isinstance(by, str) else by))[column].agg(["mean", "count"]).rename(
        columns={"mean": "accuracy", "count": "n"}).reset_index()


def correct_subset(model, prompts: PromptSet, criterion: str = "full", batch_size: int = 64,
                   frame: pd.DataFrame | None = None) -> PromptSet:
    """The prompts the model answers correctly (the papers' reference set X_r).
    ``criterion`` "full" (whole answer, then stop) or "first" (first answer token)."""
    if criterion not in ("full", "first"):
        raise ValueError("criterion must be 'full' or 'first'")
    if frame is None:
        frame = evaluate(model, prompts, full_answer=criterion == "full", batch_size=batch_size)
    mask = frame["correct_full" if criterion == "full" else "correct_first"].to_numpy()
    return prompts.subset([i for i, ok in enumerate(mask) if ok])


@torch.no_grad()
def intervention_accuracy(model, prompts: PromptSet, hooks: list[tuple[str, Callable]] | None = None,
                          batch_size: int = 64) -> float:
    """First-token accuracy with forward ``hooks`` active (None: the plain model)."""
    ctx = model.hooks(fwd_hooks=hooks) if hooks else nullcontext()
    with ctx:
        logits = answer_logits(model, prompts, batch_size)
    return float((logits.argmax(-1) == prompts.first_answer_ids).float().mean())


def evaluate_sets(model, sets: dict[str, PromptSet], full_answer: bool = True, batch_size: int = 64,
                  progress: bool = True) -> pd.DataFrame:
    """:func:`evaluate` on several named prompt sets, concatenated with a ``set`` column."""
    frames = []
    for name, prompts in tqdm(sets.items(), desc="prompt sets", disable=not progress):
        if len(prompts) == 0:
            continue
        frames.append(evaluate(model, prompts, full_answer, batch_size).assign(set=name))
    return pd.concat(frames, ignore_index=True)
