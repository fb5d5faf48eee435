"""Prompts that share a few-shot prefix, run with the prefix's keys and values computed
once: the batching plan (:func:`prefix_batches`), the runner of greedy decoding and
teacher forcing on top of it (:class:`PrefixRunner`), and the differentiable packed
run of token rows on their distinct prefixes that fine-tuning trains through
(:func:`rows_on_prefixes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from transformer_lens.hook_points import HookPoint

from ..core.prompt_sets import PromptSet
from .adapter import (
    cache_kwargs,
    filled_cache_layers,
    hf_module,
    input_device,
    new_cache,
    output_cache,
)
from .passes import can_start_late, decoder_pass, run_decoder


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
    return [
        (p, same[k : k + batch_size]) for (p, _), same in sorted(keyed.items()) for k in range(0, len(same), batch_size)
    ]


class PrefixRunner:
    """Runs batches of one PromptSet through the HF model, computing each shared few-shot
    prefix once and reusing its keys and values for every prompt that starts with it.

    Why not TransformerLens: its generation utilities recompute the whole prompt for
    every row. ``share`` (default: only when no hook is attached to the model) decides
    whether prefixes are shared: a hook that edits "the last position" would otherwise
    see the prefix's last token, so with intervention hooks every batch runs in full.
    A caller whose hooks only *record* the suffix's last position may share anyway and
    switch its hooks on through ``suffix_context`` (:func:`arithlib.zhang.answer_cache.cache_answer_position`).
    Equal to the full forward pass up to float rounding (tested)."""

    def __init__(self, model, prompts: PromptSet, batch_size: int, share: bool | None = None):
        self.hf = hf_module(model)
        self.device = input_device(model)  # token ids go to the input embedding's device
        self.prompts = prompts
        self.batch_size = batch_size
        self.plan = prefix_batches(prompts, batch_size, share=not hooks_attached(model) if share is None else share)
        self._kv: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _prefix_kv(self, prefixes: list[tuple[int, ...]]) -> None:
        """Compute (and keep) per-layer keys and values of the prefixes not seen yet."""
        todo = list(dict.fromkeys(q for q in prefixes if q not in self._kv))
        for k in range(0, len(todo), self.batch_size):
            chunk = todo[k : k + self.batch_size]
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            layers = filled_cache_layers(decoder_pass(self.hf, ids)[1])  # the decoder only: no logits wanted
            for row, q in enumerate(chunk):
                self._kv[q] = [(keys[row], values[row]) for keys, values in layers]

    def first_step(self, p: int, index: list[int], suffix_context: Callable[[], AbstractContextManager] = nullcontext):
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
        past = new_cache(
            self.hf.config,
            (
                (
                    torch.stack([self._kv[q][layer][0] for q in prefixes]),
                    torch.stack([self._kv[q][layer][1] for q in prefixes]),
                )
                for layer in range(len(self._kv[prefixes[0]]))
            ),
        )
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
        logits = self.hf(
            torch.cat([tokens, chunk], 1), use_cache=past is not None, logits_to_keep=width + 1, **cache_kwargs(past)
        ).logits
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


#: Tokens per packed pass of :func:`rows_on_prefixes`. Attention in a packed pass runs
#: over every pair of its tokens and the mask discards the pairs of different rows, so
#: its cost grows with the square of the length: at 512 tokens it is 7 % of the block's
#: matrix products (Qwen2.5-Coder-0.5B), at 256 tokens 3.5 %. A training batch of 16
#: prompts (notebook 05) is about 220 tokens, an evaluation batch of 32 about 400.
PACK_TOKENS = 512


def _pack_groups(seqs: Sequence[Sequence[int]], plen: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows ``0..B-1`` cut, in order, into groups whose packed length (each distinct
    prefix once, plus every row's remaining tokens) stays within ``max_tokens``
    (a group holds at least one row)."""
    groups: list[list[int]] = [[]]
    seen: set[tuple[int, ...]] = set()
    size = 0
    for r, (s, p) in enumerate(zip(seqs, plen)):
        q = tuple(s[:p])
        need = len(s) - p + (len(q) if q not in seen else 0)
        if groups[-1] and size + need > max_tokens:  # a new pack: the row's prefix runs in it again
            groups.append([])
            seen, size = set(), 0
            need = len(s)
        groups[-1].append(r)
        seen.add(q)
        size += need
    return groups


def packed_tokens(
    seqs: Sequence[Sequence[int]], plen: Sequence[int], rows: Sequence[int], dtype: torch.dtype
) -> tuple[list[int], list[int], torch.Tensor, list[int]]:
    """One packed sequence for rows ``rows``: the distinct prefixes ``seqs[r][:plen[r]]``
    once each, then every row's remaining tokens. Returns (token ids, positions in their
    own text, additive attention mask [1, 1, N, N] in ``dtype`` (0 where a token may
    attend, the dtype's minimum elsewhere: causal within a prefix; a row's tokens see
    their prefix and their own earlier tokens), the packed index of each row's first
    remaining token)."""
    ids: list[int] = []
    pos: list[int] = []
    at: dict[tuple[int, ...], int] = {}
    for r in rows:
        q = tuple(seqs[r][: plen[r]])
        if q and q not in at:
            at[q] = len(ids)
            ids += q
            pos += range(len(q))
    starts = []
    for r in rows:
        starts.append(len(ids))
        ids += seqs[r][plen[r] :]
        pos += range(plen[r], len(seqs[r]))
    n = len(ids)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q, a in at.items():
        allowed[a : a + len(q), a : a + len(q)] = torch.ones(len(q), len(q), dtype=torch.bool).tril()
    for r, a in zip(rows, starts):
        k = len(seqs[r]) - plen[r]
        allowed[a : a + k, a : a + k] = torch.ones(k, k, dtype=torch.bool).tril()
        if plen[r]:
            b = at[tuple(seqs[r][: plen[r]])]
            allowed[a : a + k, b : b + plen[r]] = True
    mask = torch.zeros(n, n, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return ids, pos, mask[None, None], starts


def rows_on_prefixes(
    hf,
    seqs: Sequence[Sequence[int]],
    plen: Sequence[int],
    *,
    inputs=None,
    key=None,
    same_below: int = 0,
    max_tokens: int = PACK_TOKENS,
) -> torch.Tensor:
    """Final-normed hidden states [B, t, d_model] of token rows ``seqs`` (differentiable),
    row ``r``'s tokens from ``plen[r]`` on: ``hidden[r, j]`` is token ``plen[r] + j``
    (positions past a row's end repeat its last token's state). The rows run packed
    (:func:`packed_tokens`): each distinct prefix ``seqs[r][:plen[r]]`` once and every
    row's remaining tokens in one sequence, no padding, with a mask that lets each row's
    tokens see only their prefix and their own earlier tokens, at the positions of the
    unpadded text; so every matrix product of a block takes the prefixes' and the rows'
    tokens in one product. Rows are cut into packs of at most ``max_tokens`` tokens
    (:data:`PACK_TOKENS`). Equal to one plain forward per row up to float rounding
    (tested).

    ``inputs`` (a :class:`~arithlib.engine.LayerInputs`, rows keyed by ``key``) with
    ``same_below`` = L: the passes start at the highest block <= L recorded for this
    batch and record the blocks up to L they compute (Llama-style decoders only,
    :func:`~arithlib.engine.can_start_late`; others run in full)."""
    attention = getattr(hf.config, "_attn_implementation", None)
    if attention not in (None, "eager", "sdpa"):  # flash attention reads no mask: rows would see each other
        raise NotImplementedError(
            f"packed rows need a masked attention (eager or sdpa), not {attention!r}: load the model with "
            "attn_implementation='sdpa'"
        )
    device = input_device(hf)
    dtype = next(hf.parameters()).dtype
    late = inputs is not None and can_start_late(hf)
    start = inputs.start(key, same_below) if late else 0
    record = inputs.wanted(key, start, same_below) if late else []
    recorded: dict[int, dict[str, torch.Tensor]] = {}  # layer -> pack -> stream entering it
    width = max(len(s) - p for s, p in zip(seqs, plen))
    parts = []
    for k, rows in enumerate(_pack_groups(seqs, plen, max_tokens)):
        ids, pos, mask, starts = packed_tokens(seqs, plen, rows, dtype)
        part = f"pack {k}"
        hidden, _, rec = run_decoder(
            hf,
            input_ids=torch.tensor([ids], device=device),
            attention_mask=mask.to(device),
            position_ids=torch.tensor([pos], device=device),
            start=start,
            hidden=inputs.get(key, start, part) if start else None,
            record=record,
        )
        for layer, h in rec.items():
            recorded.setdefault(layer, {})[part] = h
        index = torch.tensor(
            [[a + min(j, len(seqs[r]) - plen[r] - 1) for j in range(width)] for r, a in zip(rows, starts)],
            device=hidden.device,
        )
        parts.append(hidden[0][index])
    for layer, packs in recorded.items():
        inputs.put(key, layer, packs)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
