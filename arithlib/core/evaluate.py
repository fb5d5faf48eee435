"""Batched evaluation at the answer position: logits, accuracy, the correct subset.

Every prompt set is run in same-length batches of prompts that share a few-shot
prefix (:func:`arithlib.engine.prefix_batches`), so no padding is needed and the answer position is
the last token; the shared prefix is computed once per group when no hook is attached. Only the last
position is unembedded (``logits_to_keep=1``): on the CPU the unembedding of every
position is a large part of a forward pass for these vocabularies.

Hooks attached to the bridge (``with bridge.hooks(fwd_hooks=...)``) stay active in
every function here, so an intervention is evaluated by wrapping the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..engine import PrefixRunner, hooks_attached
from .prompt_sets import PromptSet

#: One batch of a plan: ``(runner, p, index) -> (answer-position logits [B, vocab], tokens per row)``.
Step = Callable[["PrefixRunner", int, list[int]], tuple[torch.Tensor, list[list[int]]]]


def _first_only(run: PrefixRunner, p: int, index: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    return run.first_step(p, index)[0], [[] for _ in index]


def _run_plan(
    model, prompts: PromptSet, batch_size: int, progress: bool, desc: str, step: Step = _first_only
) -> tuple[torch.Tensor, list[list[int]]]:
    """Every batch of :class:`PrefixRunner`'s plan through ``step``: the answer-position
    logits [N, vocab] (float32, CPU) and the step's tokens per prompt."""
    runner = PrefixRunner(model, prompts, batch_size)
    result: list[list[int]] = [[] for _ in range(len(prompts))]
    logits = None
    for p, index in tqdm(runner.plan, desc=desc, disable=not progress, leave=False):
        first, tokens = step(runner, p, index)
        if logits is None:
            logits = torch.empty(len(prompts), first.shape[-1])
        logits[index] = first.cpu()
        for row, gen in zip(index, tokens):
            result[row] = gen
    return (logits if logits is not None else torch.empty(0, 0)), result


def _greedy_step(extra_tokens: int) -> Step:
    def step(run: PrefixRunner, p: int, index: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        first, past = run.first_step(p, index)
        return first, run.continue_greedy(first, past, run.n_new(index, extra_tokens))

    return step


@torch.no_grad()
def answer_logits(
    model, prompts: PromptSet, batch_size: int = 64, progress: bool = False, desc: str = "answer logits"
) -> torch.Tensor:
    """Logits at the answer position for every prompt, [N, vocab] (float32, CPU).
    Hooks attached to ``model`` apply; shared few-shot prefixes are computed once
    when there are none (:class:`PrefixRunner`)."""
    return _run_plan(model, prompts, batch_size, progress, desc)[0]


@torch.no_grad()
def greedy_answers(
    model, prompts: PromptSet, extra_tokens: int = 1, batch_size: int = 64, progress: bool = False
) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy continuation of each prompt: as many tokens as its answer has, plus
    ``extra_tokens`` (to see whether the model stops or keeps writing digits).

    Returns ``(first_logits [N, vocab], generated token ids)``; the logits are those
    of the first step, i.e. :func:`answer_logits`, so one pass gives both. A manual
    KV-cached loop over the bridge's HF model, so bridge hooks apply at every step."""
    return _run_plan(model, prompts, batch_size, progress, "greedy", _greedy_step(extra_tokens))


@torch.no_grad()
def checked_answers(
    model, prompts: PromptSet, batch_size: int = 64, progress: bool = False
) -> tuple[torch.Tensor, list[list[int]]]:
    """Like :func:`greedy_answers` with one extra token, from one forward pass per batch
    (:meth:`PrefixRunner.checked_step`): ``(first_logits [N, vocab], tokens)``
    where the tokens are greedy decoding's up to its first wrong token (the answer and
    the next token when the answer is right). Whole-answer correctness is the same as
    from :func:`greedy_answers`. Raises when a hook is attached (it would act on the
    teacher-forced answer, not on greedy decoding)."""
    if hooks_attached(model):
        raise RuntimeError("checked_answers runs without hooks; with an intervention use greedy_answers")
    return _run_plan(model, prompts, batch_size, progress, "answers", PrefixRunner.checked_step)


def continues_number(tokenizer, token_id: int) -> bool:
    """Whether ``token_id`` would continue a number (starts with a digit or '.')."""
    text = tokenizer.decode([token_id])
    return bool(text) and (text[0].isdigit() or text[0] == ".")


@torch.no_grad()
def evaluate(
    model, prompts: PromptSet, full_answer: bool = True, batch_size: int = 64, progress: bool = False
) -> pd.DataFrame:
    """Per-prompt evaluation at the answer position.

    Columns: the prompt's fields, ``pred_token`` (greedy first token), ``correct_first``
    (first answer token is the argmax), ``answer_logit``, ``answer_prob``,
    ``answer_logprob``, ``rank`` of the answer token, and with ``full_answer`` also
    ``generated`` and ``correct_full``: the greedy continuation spells the whole answer
    and then stops (its next token does not continue the number). Without hooks the
    continuation is checked in one teacher-forced pass (:func:`checked_answers`) and
    ``generated`` ends at greedy decoding's first wrong token; with hooks it is decoded
    step by step (:func:`greedy_answers`, the answer's length plus one token).
    """
    tok = prompts.tokenizer
    if full_answer:
        if hooks_attached(model):  # the intervention acts at every decoding step, as in free generation
            logits, generated = greedy_answers(model, prompts, 1, batch_size, progress)
        else:
            logits, generated = checked_answers(model, prompts, batch_size, progress)
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
            ok = gen[: len(ans)] == ans and not continues_number(tok, gen[len(ans)])
            full_ok.append(ok)
        frame["generated"] = [tok.decode(g) for g in generated]
        frame["correct_full"] = full_ok
    return frame


def accuracy(
    frame: pd.DataFrame, by: Sequence[str] | str | None = None, column: str | None = None
) -> pd.DataFrame | float:
    """Mean of ``correct_full`` (or ``correct_first`` when full answers were not
    checked), overall or grouped ``by`` columns."""
    column = column or ("correct_full" if "correct_full" in frame else "correct_first")
    if by is None:
        return float(frame[column].mean())
    return (
        frame.groupby(list([by] if isinstance(by, str) else by))[column]
        .agg(["mean", "count"])
        .rename(columns={"mean": "accuracy", "count": "n"})
        .reset_index()
    )


def correct_subset(
    model, prompts: PromptSet, criterion: str = "full", batch_size: int = 64, frame: pd.DataFrame | None = None
) -> PromptSet:
    """The prompts the model answers correctly (the papers' reference set X_r).
    ``criterion`` "full" (whole answer, then stop) or "first" (first answer token)."""
    if criterion not in ("full", "first"):
        raise ValueError("criterion must be 'full' or 'first'")
    if frame is None:
        frame = evaluate(model, prompts, full_answer=criterion == "full", batch_size=batch_size)
    mask = frame["correct_full" if criterion == "full" else "correct_first"].to_numpy()
    return prompts.subset([i for i, ok in enumerate(mask) if ok])


@torch.no_grad()
def intervention_accuracy(
    model, prompts: PromptSet, hooks: list[tuple[str, Callable]] | None = None, batch_size: int = 64
) -> float:
    """First-token accuracy with forward ``hooks`` active (None: the plain model)."""
    ctx = model.hooks(fwd_hooks=hooks) if hooks else nullcontext()
    with ctx:
        logits = answer_logits(model, prompts, batch_size)
    return float((logits.argmax(-1) == prompts.first_answer_ids).float().mean())


def evaluate_sets(
    model, sets: dict[str, PromptSet], full_answer: bool = True, batch_size: int = 64, progress: bool = True
) -> pd.DataFrame:
    """:func:`evaluate` on several named prompt sets, concatenated with a ``set`` column."""
    frames = []
    for name, prompts in tqdm(sets.items(), desc="prompt sets", disable=not progress):
        if len(prompts) == 0:
            continue
        frames.append(evaluate(model, prompts, full_answer, batch_size).assign(set=name))
    return pd.concat(frames, ignore_index=True)
