"""Batched evaluation at the answer position: logits, accuracy, the correct subset.

Every prompt set is run in same-length batches of prompts that share a few-shot
prefix (:func:`prefix_batches`), so no padding is needed and the answer position is
the last token; the shared prefix is computed once per group when no hook is attached. Only the last
position is unembedded (``logits_to_keep=1``): on the CPU the unembedding of every
position is a large part of a forward pass for these vocabularies.

Hooks attached to the bridge (``with bridge.hooks(fwd_hooks=...)``) stay active in
every function here, so an intervention is evaluated by wrapping the call.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformer_lens.hook_points import HookPoint

from .datasets import PromptSet
from .hf_compat import cache_kwargs, filled_cache_layers, input_device, new_cache, output_cache
from .models import hf_module as _hf_model


def last_position_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits at the last position, [B, vocab], in float32, from one forward pass."""
    out = model(tokens, logits_to_keep=1)
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, -1, :].float()


def hooks_attached(model) -> bool:
    """Whether an intervention hook is attached: a hook on one of the bridge's HookPoints
    (the bridge's own capture hooks on the HF modules do not count), or for a plain
    torch model any forward (pre-)hook."""
    points = [m for m in model.modules() if isinstance(m, HookPoint)]
    mods = points if points else list(model.modules())
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


#: Shared prefixes shorter than this are recomputed with each batch (not worth a cache).
MIN_SHARED_PREFIX = 4


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """Length of the token prefix shared by every row (0 for no rows)."""
    if not rows:
        return 0
    first, n = rows[0], min(map(len, rows))
    for j in range(n):
        if any(r[j] != first[j] for r in rows[1:]):
            return j
    return n


def prefix_batches(prompts: PromptSet, batch_size: int = 64, share: bool = True) -> list[tuple[int, list[int]]]:
    """Batches ``(p, indices)`` covering every prompt once, all rows of a batch of one
    token length (no padding). Within the prompts that have the same few-shot prefix
    (``record.prefix``), the first ``p`` tokens are common to all; a batch's rows have
    the same ``p`` (0 when ``share`` is False or fewer than :data:`MIN_SHARED_PREFIX`
    tokens are common), though not necessarily the same prefix. At least one token
    of each prompt is left after the prefix."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(prompts.records):
        groups.setdefault(r.prefix, []).append(i)
    keyed: dict[tuple[int, int], list[int]] = {}
    for idx in groups.values():
        rows = [prompts.input_ids[i] for i in idx]
        p = min(common_prefix(rows), min(map(len, rows)) - 1) if share else 0
        p = p if p >= MIN_SHARED_PREFIX else 0
        for i in idx:
            keyed.setdefault((p, len(prompts.input_ids[i])), []).append(i)
    return [(p, same[k:k + batch_size]) for (p, _), same in sorted(keyed.items())
            for k in range(0, len(same), batch_size)]


class PrefixRunner:
    """Runs batches of one PromptSet through the HF model, computing each shared few-shot
    prefix once and reusing its keys and values for every prompt that starts with it.

    Why not TransformerLens: its generation utilities recompute the whole prompt for
    every row. ``share`` (default: only when no hook is attached to the model) decides
    whether prefixes are shared: a hook that edits "the last position" would otherwise
    see the prefix's last token, so with intervention hooks every batch runs in full.
    A caller whose hooks only *record* the suffix's last position may share anyway and
    switch its hooks on through ``suffix_context`` (:func:`arithlib.probing.cache_answer_position`).
    Equal to the full forward pass up to float rounding (tested)."""

    def __init__(self, model, prompts: PromptSet, batch_size: int, share: bool | None = None):
        self.hf = _hf_model(model)
        self.device = input_device(model)  # token ids go to the input embedding's device
        self.prompts = prompts
        self.batch_size = batch_size
        self.plan = prefix_batches(prompts, batch_size, share=not hooks_attached(model) if share is None else share)
        self._kv: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _prefix_kv(self, prefixes: list[tuple[int, ...]]) -> None:
        """Compute (and keep) per-layer keys and values of the prefixes not seen yet."""
        todo = list(dict.fromkeys(q for q in prefixes if q not in self._kv))
        for k in range(0, len(todo), self.batch_size):
            chunk = todo[k:k + self.batch_size]
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            layers = filled_cache_layers(output_cache(self.hf(ids, use_cache=True, logits_to_keep=1)))
            for row, q in enumerate(chunk):
                self._kv[q] = [(keys[row], values[row]) for keys, values in layers]

    def first_step(self, p: int, index: list[int], suffix_context: Callable[[], ContextManager] = nullcontext):
        """Run the batch's prompts (the part after the shared ``p`` tokens inside
        ``suffix_context()``); returns ``(last-position logits [B, vocab] float32, past)``."""
        tokens, past = self._suffix_and_past(p, index)
        with suffix_context():
            out = self.hf(tokens, use_cache=True, logits_to_keep=1, **cache_kwargs(past))
        return out.logits[:, -1].float(), output_cache(out)

    def _suffix_and_past(self, p: int, index: list[int]) -> tuple[torch.Tensor, object | None]:
        """The batch's tokens after the shared ``p`` and the prefixes' keys and values
        stacked over its rows (None when ``p`` is 0)."""
        tokens = torch.tensor([self.prompts.input_ids[i] for i in index], dtype=torch.long, device=self.device)
        if not p:
            return tokens, None
        prefixes = [tuple(self.prompts.input_ids[i][:p]) for i in index]
        self._prefix_kv(prefixes)
        past = new_cache(self.hf.config, ((torch.stack([self._kv[q][layer][0] for q in prefixes]),
                                          torch.stack([self._kv[q][layer][1] for q in prefixes]))
                                         for layer in range(len(self._kv[prefixes[0]]))))
        return tokens[:, p:], past

    def checked_step(self, p: int, index: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
        """:meth:`first_step` and :meth:`forced_continuation` in one forward pass: the
        prompt's rest and its answer (right-padded) together, logits kept at the last
        prompt position and the answer's. Returns ``(last-prompt-position logits
        [B, vocab] float32, greedy decoding's tokens up to its first wrong one)``. One
        call with more rows per matrix product instead of two (no hooks act here)."""
        tokens, past = self._suffix_and_past(p, index)
        answers = [self.prompts.answer_ids[i] for i in index]
        width = max(map(len, answers))
        chunk = torch.tensor([a + [a[-1]] * (width - len(a)) for a in answers], dtype=torch.long, device=self.device)
        logits = self.hf(torch.cat([tokens, chunk], 1), use_cache=past is not None,
                         logits_to_keep=width + 1, **cache_kwargs(past)).logits
        return logits[:, 0].float(), self._until_wrong(logits.argmax(-1).cpu().tolist(), answers)

    @staticmethod
    def _until_wrong(pred: list[list[int]], answers: list[list[int]]) -> list[list[int]]:
        """Per row, the predicted tokens up to and including the first one that differs
        from the answer (all of them and the next one when none does)."""
        out = []
        for row, a in zip(pred, answers):
            wrong = next((j for j, t in enumerate(a) if row[j] != t), len(a))
            out.append(row[: wrong + 1])
        return out

    def continue_greedy(self, first: torch.Tensor, past, n_new: int) -> list[list[int]]:
        """Greedy tokens from the first step's logits ``first`` on: ``n_new`` per row,
        the first being ``first.argmax(-1)`` (a KV-cached loop; bridge hooks apply)."""
        nxt = first.argmax(-1)
        generated = [nxt]
        for _ in range(n_new - 1):
            out = self.hf(nxt[:, None].to(self.device), use_cache=True, **cache_kwargs(past))
            past = output_cache(out)
            nxt = out.logits[:, -1].argmax(-1)
            generated.append(nxt)
        return torch.stack(generated, 1).cpu().tolist()

    def forced_continuation(self, first: torch.Tensor, past, index: list[int]) -> list[list[int]]:
        """Greedy decoding's tokens up to its first wrong token, from one forward pass.

        Until greedy decoding leaves the answer it feeds the answer's own tokens, so
        feeding the whole answer at once (teacher forcing; rows right-padded, which a
        causal model never sees) gives the same argmax at every step: per row the
        answer's tokens as far as the model predicts them, then the first wrong token,
        or, when all are right, the token after the answer (does it stop?). One call
        instead of one per answer token: on the CPU each call reads every weight once.
        Only for hooks that do not act on the continuation (none, or recording off)."""
        answers = [self.prompts.answer_ids[i] for i in index]
        width = max(map(len, answers))
        chunk = torch.tensor([a + [a[-1]] * (width - len(a)) for a in answers], dtype=torch.long, device=self.device)
        logits = self.hf(chunk, use_cache=True, logits_to_keep=width, **cache_kwargs(past)).logits
        pred = torch.cat([first.argmax(-1)[:, None], logits.argmax(-1)], 1).cpu().tolist()
        return self._until_wrong(pred, answers)

    def n_new(self, index: list[int], extra_tokens: int = 1) -> int:
        """Greedy steps that spell the longest answer of the batch, plus ``extra_tokens``."""
        return max(len(self.prompts.answer_ids[i]) for i in index) + extra_tokens


#: One batch of a plan: ``(runner, p, index) -> (answer-position logits [B, vocab], tokens per row)``.
Step = Callable[["PrefixRunner", int, list[int]], tuple[torch.Tensor, list[list[int]]]]


def _first_only(run: PrefixRunner, p: int, index: list[int]) -> tuple[torch.Tensor, list[list[int]]]:
    return run.first_step(p, index)[0], [[] for _ in index]


def _run_plan(model, prompts: PromptSet, batch_size: int, progress: bool, desc: str,
              step: Step = _first_only) -> tuple[torch.Tensor, list[list[int]]]:
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
def answer_logits(model, prompts: PromptSet, batch_size: int = 64, progress: bool = False,
                  desc: str = "answer logits") -> torch.Tensor:
    """Logits at the answer position for every prompt, [N, vocab] (float32, CPU).
    Hooks attached to ``model`` apply; shared few-shot prefixes are computed once
    when there are none (:class:`PrefixRunner`)."""
    return _run_plan(model, prompts, batch_size, progress, desc)[0]


@torch.no_grad()
def greedy_answers(model, prompts: PromptSet, extra_tokens: int = 1, batch_size: int = 64,
                   progress: bool = False) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy continuation of each prompt: as many tokens as its answer has, plus
    ``extra_tokens`` (to see whether the model stops or keeps writing digits).

    Returns ``(first_logits [N, vocab], generated token ids)``; the logits are those
    of the first step, i.e. :func:`answer_logits`, so one pass gives both. A manual
    KV-cached loop over the bridge's HF model, so bridge hooks apply at every step."""
    return _run_plan(model, prompts, batch_size, progress, "greedy", _greedy_step(extra_tokens))


@torch.no_grad()
def checked_answers(model, prompts: PromptSet, batch_size: int = 64,
                    progress: bool = False) -> tuple[torch.Tensor, list[list[int]]]:
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
def evaluate(model, prompts: PromptSet, full_answer: bool = True, batch_size: int = 64,
             progress: bool = False) -> pd.DataFrame:
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
