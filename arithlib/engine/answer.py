"""Runs that re-read the answer (last) position under interventions: the prompts'
earlier positions run once and are kept as keys and values, and each intervention costs
one token per prompt. In a causal model nothing before the last position depends on it,
so this equals a full pass with the intervention at the last position (tested:
``tests/equivalence/test_engine_passes.py``, ``tests/unit/test_neurons.py``,
``tests/unit/test_cna.py``).

Several interventions (*conditions*) share one pass: the batch is repeated once per
condition (condition-major rows, :func:`stacked_hooks`), so the weights are read once
for all of them (a pass of few rows is bound by reading the weights on a CPU).

* :class:`AnswerPositionRunner`: every prompt's prefix once, kept per batch, for many
  later passes (Nikankin's neuron ablations and circuits, notebook 03);
* :func:`shared_prefix_cache`, :func:`answer_pass`, :func:`condition_pass`: the passes of
  :mod:`arithlib.methods.answer_runs` (CNA's runs under many conditions, Yu & Ananiadou Sec. 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core.components import Hook
from ..core.prompt_sets import PromptSet
from .adapter import (
    cache_layers,
    input_device,
    new_cache,
    repeat_cache,
    repeat_rows_,
    select_cache_rows,
    truncate_cache,
)
from .passes import decoder_pass, forward, prefix_cache
from .prefix import common_prefix

#: Hooks for a batch, given the indices (in the runner's PromptSet) of its prompts.
HookFactory = Callable[[torch.Tensor], list[Hook]]


def stacked_hooks(per_condition: Sequence[list[Hook]], batch_size: int) -> list[Hook]:
    """Several interventions in one batch: condition ``c`` holds rows
    ``c*batch_size .. (c+1)*batch_size - 1`` (condition-major) and its hooks see, and
    edit, only those rows. One hook per hook point."""
    by_name: dict[str, list[tuple[int, Callable]]] = {}
    for c, hooks in enumerate(per_condition):
        for name, fn in hooks:
            by_name.setdefault(name, []).append((c, fn))

    def make(entries):
        def fn(act, hook):
            act = act if act.is_contiguous() else act.contiguous()
            blocks = act.view(-1, batch_size, *act.shape[1:])
            for c, f in entries:
                part = blocks[c]
                res = f(part, hook)
                if res is not None and res.data_ptr() != part.data_ptr():
                    blocks[c] = res
            return act

        return fn

    return [(name, make(entries)) for name, entries in by_name.items()]


def _recorders(store: dict[str, list], position: int) -> list[Hook]:
    """Hooks appending each named activation at ``position`` (float32, CPU) to ``store[name]``,
    one entry per batch."""

    def rec(name):
        def fn(act, hook):
            store[name].append(act[:, position].detach().float().cpu())
            return act

        return fn

    return [(h, rec(h)) for h in store]


def _in_prompt_order(order: list[torch.Tensor], parts: dict[str, list]) -> dict[str, torch.Tensor]:
    """Each entry's per-batch rows (batches holding the prompts ``order``) concatenated in the
    prompt set's order."""
    index = torch.cat(order)
    inv = torch.empty_like(index)
    inv[index] = torch.arange(len(index))
    return {k: torch.cat(v)[inv] for k, v in parts.items()}


def _ends_answer(text: str) -> bool:
    """Whether a generated token after the answer ends it (does not go on writing the
    number: no digit, no decimal point)."""
    return not (text[:1].isdigit() or text[:1] == ".")


@dataclass
class AnswerCheck:
    """:meth:`AnswerPositionRunner.check_answers`: activations at the answer position
    ({hook name: [N, ...]}, float32) and, per prompt, whether the first answer token is the
    argmax and whether greedy decoding writes the whole answer and then stops."""

    acts: dict[str, torch.Tensor]
    correct_first: np.ndarray
    correct_full: np.ndarray


class AnswerPositionRunner:
    """Re-run only the answer position of a prompt set under interventions.

    At construction every same-length batch's prefix (all tokens but the last) is run
    once and its key/value cache kept (the tokens every row of the batch shares, such as
    a few-shot prefix, at batch 1: :func:`shared_prefix_cache`, once per distinct shared
    prefix for all the batches that start with it); each later pass feeds only the last token
    through the HF model, whose bridge hook points fire as in a full pass (hooks see
    ``[B, 1, ...]`` activations). The cache is cropped back after every pass. With
    ``record`` (hook names) the clean pass is run once at construction and its
    answer-position activations and logits kept in ``clean``. Memory: the KV cache of
    every prompt.
    """

    def __init__(
        self,
        model,
        prompts: PromptSet,
        batch_size: int = 64,
        record: Sequence[str] = (),
        progress: bool = False,
        _batches: list | None = None,
    ):
        if len(prompts) == 0:
            raise ValueError("AnswerPositionRunner needs at least one prompt")
        self.model = model
        self.prompts = prompts
        self.answers = prompts.first_answer_ids
        self.clean: dict[str, torch.Tensor] | None = None
        if _batches is not None:
            self._batches = _batches
            return
        device = input_device(model)
        self._batches: list[tuple[torch.Tensor, object, torch.Tensor, int]] = []
        computed: dict[tuple[int, ...], list] = {}  # a shared prefix's batch-1 keys and values
        with torch.no_grad():
            for batch in tqdm(
                list(prompts.batches(batch_size, device)), desc="prefix cache", disable=not progress, leave=False
            ):
                past, prefix_len = None, batch.tokens.shape[1] - 1
                if prefix_len > 0:  # the rows' common prefix (a few-shot prefix) once, at batch 1
                    past = shared_prefix_cache(model, batch.tokens[:, :-1], computed)
                self._batches.append((batch.index, past, batch.tokens[:, -1:], prefix_len))
        if record:
            self.clean = self.collect(record)

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, index: Sequence[int]) -> AnswerPositionRunner:
        """A runner on the prompts at ``index`` (in that order), reusing this runner's KV
        cache (copied); ``clean`` is subset too."""
        index = [int(i) for i in index]
        if not index:
            raise ValueError("subset needs at least one prompt")
        new_pos = {old: new for new, old in enumerate(index)}
        batches = []
        for bidx, past, last, prefix_len in self._batches:
            rows = [r for r, i in enumerate(bidx.tolist()) if i in new_pos]
            if not rows:
                continue
            sel = torch.tensor(rows)
            sub_past = None if past is None else select_cache_rows(self.model, past, sel.to(last.device))
            batches.append((torch.tensor([new_pos[int(bidx[r])] for r in rows]), sub_past, last[sel], prefix_len))
        out = AnswerPositionRunner(self.model, self.prompts.subset(index), _batches=batches)
        if self.clean is not None:
            out.clean = {k: v[index] for k, v in self.clean.items()}
        return out

    @staticmethod
    def _restore(past, prefix_len: int) -> None:
        """Crop the cache back to the prefix and drop any autograd history a gradient
        pass left on it (the cropped tensors are views of the concatenated ones)."""
        if past is not None:
            truncate_cache(past, prefix_len)

    def _last(self, past, last: torch.Tensor, prefix_len: int) -> torch.Tensor:
        try:
            out = forward(self.model, last, cache=past, keep=1)
        finally:
            self._restore(past, prefix_len)
        return out.logits[:, -1].float()

    def passes(
        self,
        hooks: HookFactory | list[Hook] | None = None,
        grad: bool = False,
        progress: bool = False,
        desc: str = "answer position",
    ):
        """Yield ``(index, logits[B, vocab])`` per batch with ``hooks`` active (a list,
        or a factory called with the batch's prompt indices)."""
        for index, past, last, prefix_len in tqdm(self._batches, desc=desc, disable=not progress, leave=False):
            hk = hooks(index) if callable(hooks) else hooks
            ctx = self.model.hooks(fwd_hooks=hk) if hk else nullcontext()
            with ctx, torch.enable_grad() if grad else torch.no_grad():
                yield index, self._last(past, last, prefix_len)

    def logits(self, hooks: HookFactory | list[Hook] | None = None, progress: bool = False) -> torch.Tensor:
        """Answer-position logits of every prompt, [N, vocab] (float32, CPU)."""
        out = None
        for index, logits in self.passes(hooks, progress=progress):
            if out is None:
                out = torch.empty(len(self), logits.shape[-1])
            out[index] = logits.cpu()
        return out

    @torch.no_grad()
    def logits_many(
        self, conditions: Sequence[HookFactory | list[Hook] | None], max_rows: int = 512, progress: bool = False
    ) -> list[torch.Tensor]:
        """:meth:`logits` under each of several interventions (each as :meth:`logits`
        takes it): one [N, vocab] tensor per condition. Several conditions share one
        single-token pass: the batch is repeated once per condition (condition-major
        rows, at most ``max_rows`` per pass) over a copy of its key/value cache, and
        each condition's hooks see only their own rows. One pass of 10 x 50 rows instead
        of ten of 50: on the CPU a pass with few rows is bound by reading the weights.
        Equal to separate :meth:`logits` calls up to float rounding (tested)."""
        conditions = list(conditions)
        out = [torch.empty(len(self), 0) for _ in conditions]
        for index, past, last, prefix_len in tqdm(
            self._batches, desc="answer position", disable=not progress, leave=False
        ):
            B = len(index)
            step = max(1, max_rows // B)
            for c0 in range(0, len(conditions), step):
                chunk = conditions[c0 : c0 + step]
                C = len(chunk)
                hooks = stacked_hooks([hk(index) if callable(hk) else list(hk or []) for hk in chunk], B)
                with self.model.hooks(fwd_hooks=hooks) if hooks else nullcontext():
                    logits = answer_pass(self.model, last, past, C).float().cpu().view(C, B, -1)
                for j in range(C):
                    if out[c0 + j].shape[1] == 0:
                        out[c0 + j] = torch.empty(len(self), logits.shape[-1])
                    out[c0 + j][index] = logits[j]
        return out

    def collect(
        self, hook_names: Sequence[str], hooks: HookFactory | list[Hook] | None = None
    ) -> dict[str, torch.Tensor]:
        """Answer-position activations of ``hook_names`` for every prompt ({name: [N, ...]}),
        plus ``"logits"``."""
        store: dict[str, list] = {h: [] for h in hook_names}
        recorders = _recorders(store, -1)
        order, logit_chunks = [], []
        for index, logits in self.passes(
            lambda idx: (hooks(idx) if callable(hooks) else list(hooks or [])) + recorders
        ):
            order.append(index)
            logit_chunks.append(logits.cpu())
        return _in_prompt_order(order, store | {"logits": logit_chunks})

    @torch.no_grad()
    def check_answers(self, hook_names: Sequence[str] = (), decode: bool = True) -> AnswerCheck:
        """The clean answer position's activations (``hook_names``) and both correctness
        criteria in one pass per batch, by teacher forcing: the last prompt token followed by
        the answer's tokens (padded to the batch's longest answer). Greedy decoding writes
        the answer and stops exactly when the argmax after the prompt and after each prefix
        of the answer is the answer's next token and then a token that ends the number (up
        to the first wrong token the greedy run reads the same tokens), so this equals
        :meth:`collect` with :meth:`greedy_correct` up to float rounding (tested), without
        keeping any logits, and reading the weights once per batch instead of once per
        decoding step. ``decode`` False: the answer position only, ``correct_full`` = ``correct_first``."""
        tok = self.prompts.tokenizer
        n = len(self)
        first = np.zeros(n, dtype=bool)
        full = np.zeros(n, dtype=bool)
        store: dict[str, list] = {h: [] for h in hook_names}
        recorders = _recorders(store, 0)  # the pass's first position: the prompt's last token
        order = []
        ends: dict[int, bool] = {}
        for index, past, last, prefix_len in self._batches:
            answers = [self.prompts.answer_ids[i] for i in index.tolist()]
            width = max(len(a) for a in answers) if decode else 0
            feed = torch.tensor([(a + [a[-1]] * width)[:width] for a in answers], dtype=torch.long).view(
                len(answers), width
            )
            tokens = torch.cat([last, feed.to(last.device)], 1)
            with self.model.hooks(fwd_hooks=recorders) if recorders else nullcontext():
                try:
                    pred = forward(self.model, tokens, cache=past).logits.argmax(-1).cpu().tolist()
                finally:
                    self._restore(past, prefix_len)
            order.append(index)
            for row, (i, ans) in enumerate(zip(index.tolist(), answers)):
                p = pred[row]
                first[i] = p[0] == ans[0]
                if decode and p[: len(ans)] == ans:
                    after = p[len(ans)]
                    if after not in ends:
                        ends[after] = _ends_answer(tok.decode([after]))
                    full[i] = ends[after]
        if not decode:
            full = first.copy()
        return AnswerCheck(_in_prompt_order(order, store), first, full)

    @torch.no_grad()
    def greedy_correct(self) -> np.ndarray:
        """Per prompt: does greedy decoding write the whole answer and then stop writing
        digits (``arithlib.core.evaluate``'s ``correct_full``)? Decodes from the cache, which is
        cropped back afterwards. One pass per decoding step; :meth:`check_answers` gives the
        same in one pass."""
        tok = self.prompts.tokenizer
        out = np.zeros(len(self), dtype=bool)
        for index, past, last, prefix_len in self._batches:
            answers = [self.prompts.answer_ids[i] for i in index.tolist()]
            steps = max(len(a) for a in answers) + 1
            gen, nxt = [], last
            try:
                for _ in range(steps):
                    o = forward(self.model, nxt, cache=past, keep=1, keep_cache=True)
                    past = o.cache
                    nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                    gen.append(nxt[:, 0].cpu())
            finally:
                self._restore(past, prefix_len)
            g = torch.stack(gen, 1).tolist()
            for row, (i, ans) in enumerate(zip(index.tolist(), answers)):
                after = tok.decode([g[row][len(ans)]])
                out[i] = g[row][: len(ans)] == ans and _ends_answer(after)
        return out


def shared_prefix_cache(model, tokens: torch.Tensor, computed: dict[tuple[int, ...], list] | None = None):
    """KV cache of ``tokens`` [B, T] (bridge hooks active), computing the rows' common
    prefix once at batch 1 and expanding it; decoder passes only (no logits).
    ``computed``: the batch-1 keys and values of the common prefixes met so far (prefix
    tokens -> :func:`cache_layers`), filled and reused, so that batches starting with the
    same tokens (a few-shot prefix and the query's first tokens) run it once between them:
    a batch-1 pass reads every weight for a dozen tokens, so its cost is the weights'
    reading, whatever its length. The same values as running it per batch (the same
    pass on the same tokens); the hooks must be the same for every batch sharing ``computed``."""
    B, T = tokens.shape
    n = common_prefix(tokens.tolist()) if B > 1 else 0
    if n > 0:
        computed = {} if computed is None else computed
        key = tuple(tokens[0, :n].tolist())
        if key not in computed:
            computed[key] = cache_layers(decoder_pass(model, tokens[:1, :n])[1])
        # B > 1: repeating the rows copies them, so later passes never write into computed's tensors
        cache = repeat_rows_(new_cache(model, computed[key]), B)
        if n < T:
            decoder_pass(model, tokens[:, n:], cache=cache)
        return cache
    return decoder_pass(model, tokens)[1]


def answer_pass(model, last: torch.Tensor, cache, n: int) -> torch.Tensor:
    """Logits ``[n * B, vocab]`` of the last tokens ``last`` [B, 1] repeated for ``n``
    conditions (condition-major rows), each copy after a copy of ``cache`` (the rows'
    earlier positions; None: no earlier positions). ``cache`` is left as it was."""
    copies = None if cache is None else repeat_cache(model, cache, n)
    return forward(model, last.repeat(n, 1), cache=copies, keep=1).logits[:, -1]


def condition_pass(
    model, tokens: torch.Tensor, per_condition: Sequence[list[Hook]], shared: int, extra: Sequence[Hook] = ()
) -> torch.Tensor:
    """Last-position logits ``[C * B, vocab]`` of ``tokens`` [B, T] under each of ``C``
    conditions (``per_condition``, hook lists acting on their own condition-major block of
    rows), with ``extra`` hooks on every row. The first ``shared`` positions (common to
    every row; 0: none) run once per condition at batch 1 with that condition's hooks and
    are reused through the KV cache: valid for hooks that act on every position alike."""
    nc, B = len(per_condition), tokens.shape[0]
    if shared > 0:
        with model.hooks(fwd_hooks=stacked_hooks(per_condition, 1)):
            # condition-major: B copies of each condition's prefix
            cache = prefix_cache(model, tokens[:1, :shared].repeat(nc, 1), B)
        with model.hooks(fwd_hooks=stacked_hooks(per_condition, B) + list(extra)):
            out = forward(model, tokens[:, shared:].repeat(nc, 1), cache=cache, keep=1)
    else:
        with model.hooks(fwd_hooks=stacked_hooks(per_condition, B) + list(extra)):
            out = forward(model, tokens.repeat(nc, 1), keep=1)
    return out.logits[:, -1]
