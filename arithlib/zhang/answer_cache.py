"""The answer-position cache: a prompt set run once, with the activations at the answer
position (the last token) kept, layer by layer.

It is what the MLP analysis of Zhang et al. 2024 (Sec. 5.2, Fig. 6, 13, 14) reads:
the unembedding cosines (:mod:`arithlib.zhang.mlp_curves`), the logit lens
(:mod:`arithlib.zhang.lens`) and the linear probes (:mod:`arithlib.zhang.probing`).

* :func:`cache_answer_position` keeps ``resid_pre``, ``resid_mid``, ``resid_post``,
  ``mlp_in``, ``mlp_out``, ``attn_out`` of every layer (:data:`ACT_HOOKS`), plus the
  final norm's scale (for direct logit attribution) and whether the model answers each
  prompt (first token, and the whole answer by greedy decoding), as an
  :class:`AnswerCache`.
* :func:`stratified_indices`: a seeded subsample with as many prompts of each operator
  (or other record field).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core.evaluate import continues_number
from ..core.prompt_sets import PromptSet
from ..engine import PrefixRunner

#: Activation kinds cached at the answer position and the bridge hook of each
#: (``{L}`` is the layer).
ACT_HOOKS: dict[str, str] = {
    "resid_pre": "blocks.{L}.hook_resid_pre",
    "resid_mid": "blocks.{L}.hook_resid_mid",
    "resid_post": "blocks.{L}.hook_resid_post",
    "mlp_in": "blocks.{L}.mlp.hook_in",
    "mlp_out": "blocks.{L}.hook_mlp_out",
    "attn_out": "blocks.{L}.hook_attn_out",
}
#: The final norm's per-position scale (RMS, or std for LayerNorm), for DLA.
FINAL_SCALE_HOOK = "ln_final.hook_scale"


# --------------------------------------------------------------------------- caching


@dataclass
class AnswerCache:
    """Answer-position activations of a prompt set, aligned with its prompts.

    ``acts[kind]`` is [N, n_layers, d_model] (float32, CPU); ``final_scale`` [N] is the
    final norm's scale at the answer position; ``answer_logit`` [N] and ``pred_ids`` [N]
    come from the model's own logits there; ``correct_first`` [N] is "the first answer
    token is the argmax"; ``correct_full`` [N] (or None) is "greedy decoding spells the
    whole answer and then stops", the criterion of :func:`arithlib.core.evaluate.evaluate`.
    """

    acts: dict[str, torch.Tensor]
    final_scale: torch.Tensor
    answer_logit: torch.Tensor
    pred_ids: torch.Tensor
    correct_first: torch.Tensor
    correct_full: torch.Tensor | None = None
    generated: list[list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.pred_ids)

    @property
    def n_layers(self) -> int:
        return next(iter(self.acts.values())).shape[1]

    @property
    def correct(self) -> torch.Tensor:
        """``correct_full`` where it was checked, else ``correct_first``."""
        return self.correct_full if self.correct_full is not None else self.correct_first

    def subset(self, index: Sequence[int] | torch.Tensor) -> AnswerCache:
        """The rows at ``index`` (ints or a bool mask), in that order."""
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            index = index.nonzero().flatten()
        idx = torch.as_tensor(list(index) if not isinstance(index, torch.Tensor) else index, dtype=torch.long)
        return AnswerCache(
            acts={k: v[idx] for k, v in self.acts.items()},
            final_scale=self.final_scale[idx],
            answer_logit=self.answer_logit[idx],
            pred_ids=self.pred_ids[idx],
            correct_first=self.correct_first[idx],
            correct_full=None if self.correct_full is None else self.correct_full[idx],
            generated=None if self.generated is None else [self.generated[i] for i in idx.tolist()],
        )


@torch.no_grad()
def cache_answer_position(
    bridge,
    prompts: PromptSet,
    kinds: Iterable[str] = tuple(ACT_HOOKS),
    batch_size: int = 32,
    share_prefix: bool = True,
    check_full_answer: bool = True,
    progress: bool = True,
) -> AnswerCache:
    """Run every prompt once and keep the answer-position activations of ``kinds``.

    Why not ``bridge.run_with_cache``: it stores every position of every hook and
    unembeds every position; here hooks copy only the last position and the model
    is asked for the last position's logits only (``logits_to_keep=1``).

    The batches are those of :class:`arithlib.engine.PrefixRunner`: with
    ``share_prefix`` each few-shot prefix runs once and the rest of every prompt on top
    of its key/value cache (the recording hooks are off during the prefix, so the last
    position's activations are those of a full forward pass, tested to float
    tolerance). With ``check_full_answer`` the same key/value cache checks greedy
    decoding of the whole answer in one teacher-forced pass
    (:meth:`~arithlib.engine.PrefixRunner.forced_continuation`; hooks record nothing
    then) to set ``correct_full``, as :func:`arithlib.core.evaluate.evaluate` does.
    """
    kinds = list(kinds)
    unknown = [k for k in kinds if k not in ACT_HOOKS]
    if unknown:
        raise ValueError(f"unknown activation kind(s) {unknown}; choose from {list(ACT_HOOKS)}")
    if len(prompts) == 0:
        raise ValueError("cache_answer_position got an empty prompt set")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    n_layers, d_model, n = int(bridge.cfg.n_layers), int(bridge.cfg.d_model), len(prompts)
    acts = {k: torch.zeros(n, n_layers, d_model) for k in kinds}
    final_scale = torch.zeros(n)
    answer_logit = torch.zeros(n)
    pred_ids = torch.zeros(n, dtype=torch.long)
    generated: list[list[int]] = [[] for _ in range(n)]

    state: dict = {"on": False, "rows": None}

    @contextmanager
    def recording():
        state["on"] = True
        try:
            yield
        finally:
            state["on"] = False

    def make_hook(kind: str, layer: int):
        def hook(x, hook=None):
            if state["on"]:
                acts[kind][state["rows"], layer] = x[:, -1].detach().float().cpu()
            return x

        return hook

    def scale_hook(x, hook=None):
        if state["on"]:
            final_scale[state["rows"]] = x[:, -1].detach().float().reshape(-1).cpu()
        return x

    fwd_hooks = [(ACT_HOOKS[k].format(L=layer), make_hook(k, layer)) for k in kinds for layer in range(n_layers)]
    fwd_hooks.append((FINAL_SCALE_HOOK, scale_hook))
    runner = PrefixRunner(bridge, prompts, batch_size, share=share_prefix)

    with bridge.hooks(fwd_hooks=fwd_hooks):
        for p, index in tqdm(runner.plan, desc="answer-position cache", disable=not progress, leave=False):
            state["rows"] = torch.tensor(index)
            logits, past = runner.first_step(p, index, suffix_context=recording)
            answers = torch.tensor([prompts.answer_ids[i][0] for i in index], device=logits.device)
            answer_logit[index] = logits.gather(1, answers[:, None]).squeeze(1).cpu()
            pred_ids[index] = logits.argmax(-1).cpu()
            if check_full_answer:
                for i, gen in zip(index, runner.forced_continuation(logits, past, index)):
                    generated[i] = gen

    first = torch.tensor([a[0] for a in prompts.answer_ids])
    correct_full = None
    if check_full_answer:
        tok = prompts.tokenizer
        correct_full = torch.tensor(
            [g[: len(a)] == a and not continues_number(tok, g[len(a)]) for g, a in zip(generated, prompts.answer_ids)],
            dtype=torch.bool,
        )
    return AnswerCache(
        acts,
        final_scale,
        answer_logit,
        pred_ids,
        pred_ids == first,
        correct_full,
        generated if check_full_answer else None,
    )


def stratified_indices(prompts: PromptSet, n_total: int, by: str = "op", seed: int = 0) -> list[int]:
    """At most ``n_total`` prompt indices, the same number (n_total // groups) drawn at
    random (seeded) from each value of the record field ``by``; sorted."""
    if n_total < 1:
        raise ValueError("n_total must be at least 1")
    groups: dict = {}
    for i, r in enumerate(prompts.records):
        groups.setdefault(getattr(r, by), []).append(i)
    if not groups:
        return []
    per = max(1, n_total // len(groups))
    rng = np.random.default_rng(seed)
    out = []
    for key in sorted(groups, key=str):
        idx = groups[key]
        out += rng.choice(idx, size=min(per, len(idx)), replace=False).tolist() if len(idx) > per else list(idx)
    return sorted(int(i) for i in out)
