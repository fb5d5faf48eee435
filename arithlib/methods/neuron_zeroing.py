"""Answer-position runs under per-prompt neuron zeroing, each row from its lowest zeroed
layer: the fast path under Yu & Ananiadou's mask / keep and lowest-neuron tests (Sec.
4.2-4.3, :mod:`arithlib.yu.mask_keep`) and Nikankin et al.'s heuristic ablations (Sec.
4.2, :mod:`arithlib.nikankin.heuristic_ablation`, :mod:`arithlib.nikankin.prompt_knockout`).

A *condition* zeroes, for every prompt, its own set of MLP neurons at the answer
position: bool masks ``{layer: [N, d_mlp]}`` over the prompt set (True = zero it). With
``fill`` ``{layer: [d_mlp]}`` the masked neurons are set to those values instead (mean
ablation: each neuron's mean over a reference set). In a
causal model the earlier positions do not see the answer position, and below the lowest
layer a (condition, prompt) row zeroes, the row is the clean run. So each row joins a
pass of answer-position tokens at that layer from the clean run's residual stream, over
the clean keys and values of the earlier positions
(:func:`arithlib.engine.resume_rows`); rows of every condition share the passes, sorted
by their entry layer. A row's prediction is the argmax over every logit, taken chunk by
chunk of the vocabulary (:meth:`arithlib.methods.patching.Unembed.argmax`) so that the
full logits are never held; the exact top-1 of
:meth:`arithlib.methods.patching.Unembed.top1`, whose bound needs few tokens only while
the final state stays close to the clean one, was tried here and cost more than the
plain product on Qwen-0.5B, the zeroed rows' states being too far from it.

The literal path (every row through every layer from the embeddings, the full logits) is
:func:`zeroing_runs_literal` (:func:`arithlib.methods.answer_runs.run_answer_conditions`
with :func:`rowwise_neuron_hooks`); the two are tested equal
(``tests/unit/test_neuron_zeroing.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..core.components import Hook, RowHooks
from ..core.prompt_sets import PromptSet
from ..engine import clean_run, input_device, resume_rows
from .answer_runs import answer_targets, run_answer_conditions
from .patching import Unembed

#: Masks of one condition: ``{layer: bool [N, d_mlp]}`` over the prompt set.
Masks = Mapping[int, torch.Tensor]


@dataclass
class ZeroingRun:
    """One condition's answer position: each prompt's argmax token (exact) and, when
    captured, its MLP coefficients after the zeroing (float32): all of them ``[N, L,
    d_mlp]`` (``coef``), or a few named per prompt (``coef_at``)."""

    targets: torch.Tensor
    pred: torch.Tensor
    coef: torch.Tensor | None = None
    coef_at: torch.Tensor | None = None  # [N, J]: the coefficients asked for per prompt, NaN-padded

    @property
    def correct(self) -> torch.Tensor:
        return self.pred == self.targets

    @property
    def accuracy(self) -> float:
        return float(self.correct.float().mean()) if len(self.targets) else float("nan")


def _set_masked(x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
    """``x`` with the entries of ``mask`` set to 0 (``value`` None) or to ``value`` (broadcast
    along the last dimension)."""
    if value is None:
        return x.masked_fill(mask, 0.0)
    return torch.where(mask, value.to(x.device, x.dtype), x)


def _check_fill(conditions: Mapping[str, Masks], fill: Mapping[int, torch.Tensor] | None) -> None:
    missing = sorted({int(l) for m in conditions.values() for l in m} - {int(l) for l in fill or {}})
    if fill is not None and missing:
        raise ValueError(f"fill has no values for layers {missing}: give one [d_mlp] tensor per masked layer")


def rowwise_neuron_hooks(
    masks: Masks, position: int | None = -1, fill: Mapping[int, torch.Tensor] | None = None
) -> RowHooks:
    """Per-prompt neuron zeroing: ``masks[layer]`` is a bool [N, d_mlp] over the whole
    PromptSet (True = zero that neuron for that prompt; with ``fill``, set it to
    ``fill[layer]``'s entry). Returns a function of a batch's row indices giving the hooks
    (``ablation.zero_neurons_hooks`` zeroes the same neurons for every prompt)."""

    def make(index: torch.Tensor) -> list[Hook]:
        hooks = []
        for layer, mask in masks.items():

            def fn(act, hook, m=mask[index.cpu()], v=None if fill is None else fill[layer]):
                m = m.to(act.device)
                if position is None:
                    return _set_masked(act, m[:, None, :], v)
                act[:, position] = _set_masked(act[:, position], m, v)
                return act

            hooks.append((f"blocks.{layer}.mlp.hook_post", fn))
        return hooks

    return make


def zeroing_runs_literal(
    model,
    prompts: PromptSet,
    conditions: Mapping[str, Masks],
    *,
    capture_coef: bool = False,
    targets: torch.Tensor | None = None,
    batch_size: int = 64,
    fill: Mapping[int, torch.Tensor] | None = None,
    coef_at: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> dict[str, ZeroingRun]:
    """The reference of :func:`zeroing_runs`: every row through every layer at the answer
    position (the earlier positions once, from their keys and values), the masks as
    row-wise hooks, the argmax of the full logits; ``coef_at`` read off the full
    coefficients, one entry at a time."""
    _check_fill(conditions, fill)
    runs = run_answer_conditions(
        model,
        prompts,
        {name: rowwise_neuron_hooks(m, fill=fill) for name, m in conditions.items()},
        capture=("coef",) if capture_coef or coef_at is not None else (),
        targets=targets,
        batch_size=batch_size,
    )
    out = {}
    for name, r in runs.items():
        at = None
        if coef_at is not None:
            at = torch.full((len(coef_at), max((len(x) for x in coef_at), default=0)), torch.nan)
            for i, pairs in enumerate(coef_at):
                for j, (layer, neuron) in enumerate(pairs):
                    at[i, j] = r.coef[i, layer, neuron]
        out[name] = ZeroingRun(r.targets, r.pred, r.coef if capture_coef else None, at)
    return out


def entry_layers(masks: Masks, index: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Per prompt of ``index``: the lowest layer where ``masks`` zero a neuron
    (``n_layers``: none, the clean run)."""
    entry = torch.full((len(index),), n_layers, dtype=torch.long)
    for layer in sorted(masks, reverse=True):
        entry[masks[layer][index].any(-1)] = int(layer)
    return entry


def _zeroing_hooks(
    conditions: list[Masks],
    cond: torch.Tensor,
    prompt: torch.Tensor,
    d_mlp: int,
    coef: dict[int, torch.Tensor] | None,
    fill: Mapping[int, torch.Tensor] | None = None,
) -> list[Hook]:
    """Hooks of one pass of rows (condition ``cond[r]``, prompt ``prompt[r]``), which hold
    at each layer a leading part of the rows (:func:`arithlib.engine.resume_rows`): zero
    each row's masked neurons at the answer position (or set them to ``fill[layer]``),
    then (``coef``) record the coefficients there."""
    layers = sorted({int(l) for m in conditions for l in m})
    hooks: list[Hook] = []
    for layer in layers:
        mask = torch.zeros(len(cond), d_mlp, dtype=torch.bool)
        for c, masks in enumerate(conditions):
            if layer in masks:
                rows = (cond == c).nonzero().flatten()
                mask[rows] = masks[layer][prompt[rows]]

        def zero(act, hook, mask=mask, value=None if fill is None else fill[layer]):
            n = act.shape[0]
            act[:, -1] = _set_masked(act[:, -1], mask[:n].to(act.device), value)
            return act

        hooks.append((f"blocks.{layer}.mlp.hook_post", zero))
    if coef is not None:
        for layer in coef:

            def record(act, hook, layer=layer):
                coef[layer] = act[:, -1].detach().float()
                return act

            hooks.append((f"blocks.{layer}.mlp.hook_post", record))
    return hooks


@torch.no_grad()
def zeroing_runs(
    model,
    prompts: PromptSet,
    conditions: Mapping[str, Masks],
    *,
    capture_coef: bool = False,
    targets: torch.Tensor | None = None,
    batch_size: int = 64,
    max_rows: int = 512,
    progress: bool = False,
    desc: str = "neuron zeroing",
    clean_runs: dict | None = None,
    fill: Mapping[int, torch.Tensor] | None = None,
    coef_at: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> dict[str, ZeroingRun]:
    """Each condition's answer-position run of ``prompts`` (see the module docstring):
    per prompt the exact argmax and (``capture_coef``) the coefficients of every layer,
    the clean ones below the row's entry layer; ``coef_at``: only the coefficients of
    these (layer, neuron) per prompt, the same for every condition (``ZeroingRun.coef_at``
    [N, J], row i's first ``len(coef_at[i])`` entries in that order, NaN after), the
    same values as ``coef`` without holding every condition's ``[N, L, d_mlp]``. Rows of
    all conditions share passes of at most ``max_rows`` rows. Equal to :func:`zeroing_runs_literal` up to float rounding.
    ``clean_runs``: a dict the caller keeps across calls on the same model, prompts and
    ``batch_size``, holding each batch's clean run, so that later calls skip it. ``fill``:
    the values written into the masked neurons per layer (None: zero)."""
    _check_fill(conditions, fill)
    device = input_device(model)
    targets = answer_targets(prompts, targets)
    n_layers, d_mlp, N = int(model.cfg.n_layers), int(model.cfg.d_mlp), len(prompts)
    names = list(conditions)
    conds = [conditions[n] for n in names]
    unembed = Unembed(model)
    pred = torch.empty(len(names), N, dtype=torch.long)
    # every condition's coefficients, row c * N + prompt: filled by index_copy_ (a broadcast
    # index_put over [C, N, L, d_mlp] runs at a fraction of the memory bandwidth)
    coef = torch.empty(len(names) * N, n_layers, d_mlp) if capture_coef else None
    read = _Reader(coef_at, N, len(names)) if coef_at is not None else None
    kept = range(n_layers) if capture_coef else (read.layers if read is not None else [])  # resumed rows' layers
    # the clean run keeps every layer's coefficients whenever any are read, so that calls asking
    # for other neurons (the lowest-neuron test's K's) share it through ``clean_runs``
    post = [f"blocks.{l}.mlp.hook_post" for l in range(n_layers)] if kept else []
    for batch in tqdm(
        list(prompts.batches(batch_size, device, by_prefix=True)), desc=desc, disable=not progress, leave=False
    ):
        index = batch.index.cpu()
        B, T = batch.tokens.shape
        key = (tuple(index.tolist()), bool(post))
        if clean_runs is not None and key in clean_runs:
            run, clean_pred = clean_runs[key]
        else:
            run = clean_run(model, batch.tokens, last=post)
            clean_pred = unembed.argmax(run.final)[0].cpu()
            if clean_runs is not None:
                clean_runs[key] = run, clean_pred
        entry = torch.stack([entry_layers(m, index, n_layers) for m in conds])  # [C, B]
        pred[:, index] = clean_pred
        if coef is not None:
            clean_coef = torch.stack([run.captured[name].float().cpu() for name in post], 1)
            for c in range(len(names)):
                coef.index_copy_(0, c * N + index, clean_coef)
        if read is not None:
            for layer in read.layers:
                read.clean(layer, index, run.captured[post[layer]].float().cpu())
        cond, row = (entry < n_layers).nonzero(as_tuple=True)
        if not len(cond):
            continue
        order = torch.argsort(entry[cond, row], stable=True)
        cond, row = cond[order], row[order]
        for s in range(0, len(cond), max_rows):
            c, r = cond[s : s + max_rows], row[s : s + max_rows]
            e = entry[c, r]
            got: dict[int, torch.Tensor] | None = {l: None for l in kept if l >= int(e[0])} if kept else None
            hooks = _zeroing_hooks(conds, c, index[r], d_mlp, got, fill)
            with model.hooks(fwd_hooks=hooks):
                h = resume_rows(model, run, T - 1, r, e.tolist())
            pred[c, index[r]] = unembed.argmax(h)[0].cpu()
            for layer, x in (got or {}).items():
                n = x.shape[0]  # the rows present at this layer: a leading part
                if coef is not None:
                    coef[:, layer].index_copy_(0, c[:n] * N + index[r[:n]], x.cpu())
                if read is not None:
                    read.resumed(layer, c[:n], index[r[:n]], x.cpu())
    return {
        name: ZeroingRun(
            targets,
            pred[i],
            None if coef is None else coef[i * N : (i + 1) * N],
            None if read is None else read.values[i * N : (i + 1) * N],
        )
        for i, name in enumerate(names)
    }


class _Reader:
    """The coefficients ``coef_at`` of :func:`zeroing_runs` asks for: per prompt a list of
    (layer, neuron), padded to [N, J]; :attr:`values` [C * N, J] (row c * N + prompt),
    written from the clean run's coefficients and then from each resumed row's."""

    def __init__(self, coef_at: Sequence[Sequence[tuple[int, int]]], N: int, C: int) -> None:
        if len(coef_at) != N:
            raise ValueError(f"coef_at names neurons for {len(coef_at)} prompts, the prompt set has {N}")
        J = max((len(x) for x in coef_at), default=0)
        self.layer = torch.full((N, J), -1, dtype=torch.long)
        self.neuron = torch.zeros(N, J, dtype=torch.long)
        for i, pairs in enumerate(coef_at):
            if pairs:
                self.layer[i, : len(pairs)] = torch.tensor([int(l) for l, _ in pairs])
                self.neuron[i, : len(pairs)] = torch.tensor([int(n) for _, n in pairs])
        self.layers = sorted({int(l) for l in self.layer[self.layer >= 0].tolist()})
        self.N = N
        self.values = torch.full((C * N, J), torch.nan)

    def _write(self, layer: int, rows: torch.Tensor, prompt: torch.Tensor, x: torch.Tensor) -> None:
        here = self.layer[prompt] == layer  # [n, J]
        picked = x.gather(1, self.neuron[prompt])
        self.values[rows] = torch.where(here, picked, self.values[rows])

    def clean(self, layer: int, index: torch.Tensor, x: torch.Tensor) -> None:
        """The clean run's coefficients of ``layer`` [B, d_mlp] for prompts ``index``, in
        every condition (the resumed rows overwrite theirs later)."""
        C = self.values.shape[0] // self.N
        for c in range(C):
            self._write(layer, c * self.N + index, index, x)

    def resumed(self, layer: int, cond: torch.Tensor, prompt: torch.Tensor, x: torch.Tensor) -> None:
        """Resumed rows' coefficients of ``layer`` [n, d_mlp] (condition ``cond``, prompt ``prompt``)."""
        self._write(layer, cond * self.N + prompt, prompt, x)
