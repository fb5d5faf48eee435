"""Activation patching, Zhang's path patching and head ablations, with a fast path
for interventions at the answer position.

Papers: Zhang et al. 2024 (Alg. 1, App. B: path patching of each head and MLP at the
END position; mean-ablation knockout), Yu & Ananiadou 2024 (Sec. 3.2: zeroing a head's
slice of W_O), Nikankin et al. 2025 (activation patching of heads and MLPs per position
with an operand-changing counterfactual; circuit faithfulness under mean ablation).

Two ways to run an intervention, tested equal (fp32, 1e-4):

* **Full forward** (:func:`run_edits_full`, :func:`path_patch_full`,
  :func:`activation_patch_full`): one forward pass of the whole prompt per patched
  component, with hooks. This is what TransformerLens' ``transformer_lens.patching``
  does (one ``run_with_hooks`` per index); it is the reference and the benchmark
  baseline.
* **Fast path** (:func:`clean_run` + :func:`run_variants`): an intervention at
  position p leaves positions < p untouched, so the clean run's keys and values for
  those positions are reused and only positions p..T-1 are recomputed, for many
  variants at once (one batch of ``variants x prompts`` rows over an expanded KV
  cache). An intervention in layer L also leaves everything below L untouched, so
  each variant joins its chunk's batch at its lowest edited layer from the clean
  residual stream (Llama/Mistral/Qwen2-style models; others start at layer 0). At the answer
  position a variant costs one token through the layers above the edit.
  TransformerLens has no such batched path (its patchers loop over components with
  a full forward each), hence this module.
* Zhang's path patching freezes every other head at its clean value and lets the
  MLPs recompute (App. B). At the END position the attention outputs above the
  sender are then exactly the clean ones, so :func:`path_patch_answer` recomputes only
  MLPs and norms for each sender (sequential-residual models), and reads out only the
  answer token's logit.

Components are :class:`Component` (head, MLP, attention output, residual stream,
neuron); an intervention is a list of :class:`Edit` (set a component at a position to
a value: a counterfactual activation, a mean, or zero). Readouts at the answer
position go through :class:`Unembed`, whose :meth:`Unembed.top1` finds the exact
argmax and maximum logit without unembedding the whole vocabulary (a Cauchy-Schwarz
bound prunes tokens that cannot win).

The model everywhere is a TransformerLens ``TransformerBridge`` (``arithlib.models``).
Prompt sets are :class:`arithlib.datasets.PromptSet`; batches are same-length, so the
answer position is the last one.
"""

from __future__ import annotations

import re
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from . import datasets as ds
from .components import Head, Hook
from .datasets import PromptRecord, PromptSet
from .engine import (MIN_SHARED_PREFIX, filled_cache_layers, common_prefix, decoder_norm, decoder_pass, empty_cache,
                     hf_module as _hf, input_device, last_position_logits, layer_device, module_device, repeat_rows_, resumable, run_blocks)
from .metrics import relative_logit_change
from .models import model_dtype as _dtype
from .papers import KEY_HEAD_THRESHOLD


# --------------------------------------------------------------------------- components

_HOOKS = {
    "head": "blocks.{layer}.attn.hook_z",          # [B, T, H, d_head] (input of W_O)
    "mlp": "blocks.{layer}.hook_mlp_out",          # [B, T, d_model]
    "attn": "blocks.{layer}.hook_attn_out",        # [B, T, d_model]
    "resid_pre": "blocks.{layer}.hook_resid_pre",  # [B, T, d_model]
    "resid_mid": "blocks.{layer}.hook_resid_mid",  # [B, T, d_model]
    "neuron": "blocks.{layer}.mlp.hook_post",      # [B, T, d_mlp]
}
COMPONENT_KINDS: tuple[str, ...] = tuple(_HOOKS)


@dataclass(frozen=True, order=True)
class Component:
    """A model component: ``kind`` in :data:`COMPONENT_KINDS`, its ``layer``, and for heads and
    neurons their ``index`` (``None`` = all heads / all neurons of the layer)."""

    kind: str
    layer: int
    index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _HOOKS:
            raise ValueError(f"unknown component kind {self.kind!r}; choose one of {COMPONENT_KINDS}")
        if self.index is not None and self.kind not in ("head", "neuron"):
            raise ValueError(f"a {self.kind} component has no index (got {self.index})")

    @property
    def hook_name(self) -> str:
        return _HOOKS[self.kind].format(layer=self.layer)

    @property
    def label(self) -> str:
        """Short name: ``L12H3``, ``MLP12``, ``ATTN12``, ``RESID12``, ``L12N345``."""
        if self.kind == "head":
            return f"L{self.layer}H{'*' if self.index is None else self.index}"
        if self.kind == "neuron":
            return f"L{self.layer}N{'*' if self.index is None else self.index}"
        return {"mlp": "MLP", "attn": "ATTN", "resid_pre": "RESID", "resid_mid": "RESIDMID"}[self.kind] + str(self.layer)

    def unit_shape(self, cfg) -> tuple[int, ...]:
        """Shape of one unit's activation at one position (for a bridge ``cfg``)."""
        if self.kind == "head":
            return (cfg.d_head,) if self.index is not None else (cfg.n_heads, cfg.d_head)
        if self.kind == "neuron":
            return () if self.index is not None else (cfg.d_mlp,)
        return (cfg.d_model,)


def head_components(n_layers: int, n_heads: int) -> list[Component]:
    """Every attention head, layer-major."""
    return [Component("head", l, h) for l in range(n_layers) for h in range(n_heads)]


def mlp_components(n_layers: int) -> list[Component]:
    """Every MLP block."""
    return [Component("mlp", l) for l in range(n_layers)]


def heads_and_mlps(model) -> list[Component]:
    """All heads then all MLPs of ``model`` (Zhang's senders: Fig. 2 heatmap + MLP column)."""
    cfg = model.cfg
    return head_components(cfg.n_layers, cfg.n_heads) + mlp_components(cfg.n_layers)


@dataclass(frozen=True)
class Edit:
    """Set ``component`` at ``position`` to ``value`` during a forward pass.

    ``position``: absolute (>= 0), from the end (< 0; -1 is the answer position) or
    ``None`` for every position. ``value``: a tensor of the component's unit shape
    (shared by all prompts, e.g. a mean or zeros) or with a leading prompt dimension
    (per prompt, e.g. the counterfactual activation), or a float (filled).
    """

    component: Component
    position: int | None
    value: torch.Tensor | float


Variant = Sequence[Edit]


# --------------------------------------------------------------------------- model access


def _resolve_position(pos: int, T: int) -> int:
    p = pos + T if pos < 0 else pos
    if not 0 <= p < T:
        raise ValueError(f"position {pos} is outside prompts of {T} tokens")
    return p


# --------------------------------------------------------------------------- hooks


def _value_tensor(edit: Edit, B: int, unit: tuple[int, ...], dtype, device) -> tuple[torch.Tensor, bool]:
    """The edit's value as ``[B or 1, *unit]`` and whether it is per prompt."""
    v = edit.value
    if not isinstance(v, torch.Tensor):
        return torch.full((1, *unit), float(v), dtype=dtype, device=device), False
    v = v.to(device=device, dtype=dtype)
    if tuple(v.shape) == unit:
        return v.unsqueeze(0), False
    if tuple(v.shape) == (B, *unit):
        return v, True
    raise ValueError(f"value of shape {tuple(v.shape)} for {edit.component.label}: expected {unit} "
                     f"(shared) or {(B, *unit)} (per prompt)")


def variant_hooks(model, variants: Sequence[Variant], batch_size: int, start: int, length: int) -> list[Hook]:
    """Forward hooks applying every variant's edits to a batch of ``len(variants) x
    batch_size`` rows (variant-major) that covers positions ``start..length-1``.

    Edits are grouped per hook into index tensors, so one assignment per hook and
    group applies all variants. A layer's batch may hold only the first variants
    (those that have joined by that layer, see :func:`run_variants`); a variant's
    edits are in layers where it is present. Raises ValueError for an edit before ``start``.
    """
    cfg = model.cfg
    dtype = _dtype(model)
    devices: dict[int, torch.device] = {}  # per layer: an edit's tensors live where its activation does
    t = length - start
    groups: dict[tuple[str, bool, bool], dict[str, list]] = {}
    for vi, edits in enumerate(variants):
        for e in edits:
            positions = range(start, length) if e.position is None else [_resolve_position(e.position, length)]
            if e.position is None and start != 0:
                raise ValueError("an edit at every position (position=None) needs start=0")
            unit = e.component.unit_shape(cfg)
            layer = e.component.layer
            if layer not in devices:
                devices[layer] = layer_device(model, layer)
            value, per_prompt = _value_tensor(e, batch_size, unit, dtype, devices[layer])
            indexed = e.component.index is not None
            key = (e.component.hook_name, indexed, per_prompt)
            g = groups.setdefault(key, {"v": [], "p": [], "u": [], "x": [], "device": devices[layer]})
            for p in positions:
                if p < start:
                    raise ValueError(f"edit of {e.component.label} at position {p} lies before the recomputed "
                                     f"positions {start}..{length - 1}")
                g["v"].append(vi)
                g["p"].append(p - start)
                g["u"].append(e.component.index if indexed else 0)
                g["x"].append(value)
    by_hook: dict[str, list] = {}
    for (name, indexed, _), g in groups.items():
        device = g["device"]
        by_hook.setdefault(name, []).append((
            indexed,
            torch.tensor(g["v"], device=device),
            torch.tensor(g["p"], device=device),
            torch.tensor(g["u"], device=device),
            torch.stack(g["x"]),  # [E, B or 1, *unit]
        ))
    n_var = len(variants)

    def make(entries):
        def fn(act, hook):
            shape = act.shape
            if shape[0] % batch_size or not 0 < shape[0] <= n_var * batch_size or shape[1] != t:
                raise RuntimeError(f"{hook.name}: got activation {tuple(shape)}, expected "
                                   f"[at most {n_var}x{batch_size}, {t}, ...]")
            a = act.reshape(-1, batch_size, *shape[1:])
            for indexed, v, p, u, x in entries:
                if indexed:
                    a[v, :, p, u] = x.to(a.dtype)
                else:
                    a[v, :, p] = x.to(a.dtype)
            return a.reshape(shape)
        return fn

    return [(name, make(entries)) for name, entries in by_hook.items()]


def _capture_hooks(store: dict, spec: Mapping[str, Callable | None]) -> list[Hook]:
    hooks = []
    for name, reduce in spec.items():
        def fn(act, hook, name=name, reduce=reduce):
            store[name] = (reduce(act) if reduce is not None else act).detach().clone()
            return act
        hooks.append((name, fn))
    return hooks


# --------------------------------------------------------------------------- full-forward reference


@torch.no_grad()
def run_edits_full(model, tokens: torch.Tensor, edits: Variant) -> torch.Tensor:
    """Reference: one full forward pass of ``tokens`` [B, T] with ``edits`` applied by
    hooks; returns the final logits at the last position [B, vocab] (float32)."""
    hooks = variant_hooks(model, [edits], tokens.shape[0], 0, tokens.shape[1]) if edits else []
    ctx = model.hooks(fwd_hooks=hooks) if hooks else nullcontext()
    with ctx:
        return last_position_logits(model, tokens)


@torch.no_grad()
def cache_activations(model, tokens: torch.Tensor, hook_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Activations of ``hook_names`` over all positions for one forward pass of ``tokens``."""
    store: dict[str, torch.Tensor] = {}
    with model.hooks(fwd_hooks=_capture_hooks(store, {n: None for n in hook_names})):
        last_position_logits(model, tokens)
    return store


@torch.no_grad()
def activation_patch_full(model, tokens: torch.Tensor, cf_tokens: torch.Tensor, components: Sequence[Component],
                          position: int | None = -1, progress: bool = False) -> torch.Tensor:
    """Reference activation patching: for each component, one full forward pass of the
    clean ``tokens`` with the component set at ``position`` (None: every position) to its
    value on ``cf_tokens``. Returns last-position logits [n_components, B, vocab]."""
    source = cache_activations(model, cf_tokens, {c.hook_name for c in components})
    T = tokens.shape[1]
    out = []
    for c in tqdm(components, desc="full-forward patching", disable=not progress, leave=False):
        act = source[c.hook_name]
        if c.index is not None:
            act = act[:, :, c.index]
        if position is None:
            edits = [Edit(c, p, act[:, p]) for p in range(T)]
        else:
            edits = [Edit(c, position, act[:, _resolve_position(position, T)])]
        out.append(run_edits_full(model, tokens, edits))
    return torch.stack(out)


# --------------------------------------------------------------------------- fast path


@dataclass
class CleanRun:
    """One clean forward pass kept for the fast path: tokens, every layer's keys and
    values, every block's input (residual stream) at every position (when
    :func:`resumable`), the final-normed hidden state at the last position, and any
    captured activations."""

    tokens: torch.Tensor                 # [B, T]
    keys: list[torch.Tensor]             # per layer [B, kv_heads, T, d_head]
    values: list[torch.Tensor]
    resid: torch.Tensor | None           # [n_layers, B, T, d_model]
    final: torch.Tensor                  # [B, d_model]
    captured: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


def _is_attention_map(hook_name: str) -> bool:
    """Hooks whose activations are [B, heads, query, key] rather than [B, pos, ...]."""
    return hook_name.endswith(("hook_pattern", "hook_attn_scores"))


@torch.no_grad()
def clean_run(model, tokens: torch.Tensor, capture: Mapping[str, Callable | None] | Iterable[str] = (),
              share_prefix: bool = True) -> CleanRun:
    """One forward pass of ``tokens`` [B, T] that keeps what :func:`run_variants` needs,
    plus the activations named in ``capture`` (a list of hook names, or a mapping from
    hook name to a function that reduces the activation before it is stored).

    With ``share_prefix`` the leading tokens common to every row (a few-shot prefix,
    when the batch holds one) run once at batch 1 and the rest on top of their keys and
    values; per-position activations are the
    prefix's (expanded) followed by the rest's, so everything kept equals one full pass
    up to float rounding. An attention map (``hook_pattern``) is then only seen for the
    rest's queries: its reducer must read those (e.g. the last query), and without one
    the prefix is not shared. A batch of several prefixes: :func:`grouped_clean_run`."""
    n_layers = model.cfg.n_layers
    spec = dict(capture) if isinstance(capture, Mapping) else {n: None for n in capture}
    resid_names = {f"blocks.{l}.hook_resid_pre": None for l in range(n_layers)} if resumable(model) else {}
    B, T = tokens.shape
    n = min(common_prefix(tokens.tolist()), T - 1) if share_prefix and B > 1 else 0
    if n < MIN_SHARED_PREFIX or any(_is_attention_map(k) and r is None for k, r in spec.items()):
        store: dict[str, torch.Tensor] = {}
        internal: dict[str, torch.Tensor] = {}
        with model.hooks(fwd_hooks=_capture_hooks(store, spec) + _capture_hooks(internal, resid_names)):
            last_hidden, cache = decoder_pass(model, tokens)
        resid = _stack_streams([internal[x] for x in resid_names], model) if resid_names else None
    else:
        raw = {k: None for k in spec if not _is_attention_map(k)} | resid_names
        first: dict[str, torch.Tensor] = {}
        with model.hooks(fwd_hooks=_capture_hooks(first, raw)):
            prefix = repeat_rows_(decoder_pass(model, tokens[:1, :n])[1], B)
        rest: dict[str, torch.Tensor] = {}
        maps = {k: r for k, r in spec.items() if _is_attention_map(k)}
        with model.hooks(fwd_hooks=_capture_hooks(rest, raw) + _capture_hooks(rest, maps)):
            last_hidden, cache = decoder_pass(model, tokens[:, n:], cache=prefix)
        whole = {k: torch.cat([first[k].expand(B, *first[k].shape[1:]), rest[k]], 1) for k in raw}
        store = {k: rest[k] if k in maps else (whole[k] if r is None else r(whole[k]).detach().clone())
                 for k, r in spec.items()}
        resid = _stack_streams([whole[x] for x in resid_names], model) if resid_names else None
    layers = filled_cache_layers(cache)
    keys = [k for k, _ in layers]
    values = [v for _, v in layers]
    return CleanRun(tokens, keys, values, resid, last_hidden[:, -1].clone(), store)


def _stack_streams(streams: Sequence[torch.Tensor], model) -> torch.Tensor:
    """Every block's recorded input stream stacked ``[n_layers, ...]`` on the input
    embedding's device (on a split model each was recorded on its own block's device;
    :func:`_forward_suffix` moves a layer's slice back to that layer's device)."""
    device = input_device(model)
    return torch.stack([x.to(device) for x in streams])


#: A prefix group of a batch runs on its own (:func:`prefix_groups`) when the positions it
#: saves, (rows - 1) x prefix length, reach this: a group adds two passes (its prefix and
#: its rest), and on a CPU a pass with few rows costs about what 32 token positions do
#: (reading every weight once), so smaller savings would make the run slower.
MIN_SAVED_POSITIONS = 64


def prefix_groups(prompts: PromptSet, index: Sequence[int]) -> list[list[int]]:
    """Rows of a batch (positions in ``index``) grouped by few-shot prefix
    (``record.prefix``), for :func:`grouped_clean_run`: a group of its own for each prefix
    whose sharing saves at least :data:`MIN_SAVED_POSITIONS` token positions, the other
    rows together in one group."""
    index = [int(x) for x in index]
    by: dict[str, list[int]] = {}
    for row, i in enumerate(index):
        by.setdefault(prompts.records[i].prefix, []).append(row)

    def saved(rows: list[int]) -> int:
        return (len(rows) - 1) * common_prefix([prompts.input_ids[index[r]] for r in rows])

    shared = [g for g in by.values() if saved(g) >= MIN_SAVED_POSITIONS]
    rest = sorted(r for g in by.values() if saved(g) < MIN_SAVED_POSITIONS for r in g)
    return shared + ([rest] if rest else [])


def _rows(run: CleanRun, rows: torch.Tensor) -> CleanRun:
    """Rows ``rows`` of ``run``, each tensor indexed on its own device (a split model's
    keys and values stay on their layers' devices)."""
    def take(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x.index_select(dim, rows.to(x.device))

    return CleanRun(take(run.tokens), [take(k) for k in run.keys], [take(v) for v in run.values],
                    None if run.resid is None else take(run.resid, 1), take(run.final),
                    {k: take(v) for k, v in run.captured.items()})


def grouped_clean_run(model, tokens: torch.Tensor, groups: Sequence[Sequence[int]] | None,
                      capture: Mapping[str, Callable | None] | Iterable[str] = ()) -> CleanRun:
    """:func:`clean_run` of a same-length batch whose rows hold several few-shot prefixes:
    one run per group of rows (``groups``, e.g. :func:`prefix_groups`), each sharing its
    own prefix, joined back in row order. Batches stay as large as the prompt lengths
    allow (the interventions that follow run on all of them at once) while each prefix
    runs once. ``groups`` None: one group."""
    if groups is None or len(groups) <= 1:
        return clean_run(model, tokens, capture)
    runs = [clean_run(model, tokens[list(g)], capture) for g in groups]
    order = torch.tensor([r for g in groups for r in g])
    joined = CleanRun(torch.cat([r.tokens for r in runs]),
                      [torch.cat([r.keys[l] for r in runs]) for l in range(len(runs[0].keys))],
                      [torch.cat([r.values[l] for r in runs]) for l in range(len(runs[0].values))],
                      None if runs[0].resid is None else torch.cat([r.resid for r in runs], 1),
                      torch.cat([r.final for r in runs]),
                      {k: torch.cat([r.captured[k] for r in runs]) for k in runs[0].captured})
    return _rows(joined, torch.argsort(order).to(joined.final.device))


class RunCache:
    """Clean runs kept per prompt (keyed by its token ids), so that later interventions
    on the same prompts skip the clean forward pass: pass one to :func:`run_interventions`
    (and the functions built on it) and :func:`path_patching`. Holds every layer's keys,
    values and residual stream of each prompt."""

    def __init__(self) -> None:
        self._store: dict[tuple[int, ...], tuple] = {}

    def __len__(self) -> int:
        return len(self._store)

    def add(self, run: CleanRun) -> None:
        """Store every prompt of a batch run."""
        for i, t in enumerate(run.tokens):
            self._store[tuple(t.tolist())] = (
                [k[i:i + 1] for k in run.keys], [v[i:i + 1] for v in run.values],
                None if run.resid is None else run.resid[:, i:i + 1], run.final[i:i + 1])

    def get(self, model, tokens: torch.Tensor, groups: Sequence[Sequence[int]] | None = None) -> CleanRun:
        """The clean run of a same-length batch, from the cache where possible; rows not
        cached yet run by ``groups`` (:func:`grouped_clean_run`)."""
        keys = [tuple(t.tolist()) for t in tokens]
        missing = [i for i, k in enumerate(keys) if k not in self._store]
        if missing:
            pos = {r: j for j, r in enumerate(missing)}
            todo = None if groups is None else [[pos[r] for r in g if r in pos] for g in groups]
            self.add(grouped_clean_run(model, tokens[missing], [g for g in todo if g] if todo else None))
        parts = [self._store[k] for k in keys]
        n_layers = len(parts[0][0])
        ks = [torch.cat([p[0][l] for p in parts]) for l in range(n_layers)]
        vs = [torch.cat([p[1][l] for p in parts]) for l in range(n_layers)]
        resid = None if parts[0][2] is None else torch.cat([p[2] for p in parts], 1)
        return CleanRun(tokens, ks, vs, resid, torch.cat([p[3] for p in parts]))


def _make_cache(model, run: CleanRun, start: int, copies: Sequence[int]):
    """KV cache of the clean positions ``< start`` with ``copies[l]`` copies of the batch
    in layer ``l`` (layers with 0 copies are left empty)."""
    if start == 0:
        return empty_cache(model)
    devices = [layer_device(model, l) for l in range(len(run.keys))]  # a split model's cache: each layer on its own
    return empty_cache(model, (None if n == 0 else (k[:, :, :start].to(d).repeat(n, 1, 1, 1),
                                                      v[:, :, :start].to(d).repeat(n, 1, 1, 1))
                                 for n, k, v, d in zip(copies, run.keys, run.values, devices)))


def _forward_suffix(model, run: CleanRun, start: int, entry: Sequence[int]) -> torch.Tensor:
    """Final-normed hidden state at the last position for ``len(entry)`` copies of the
    batch (variant-major), recomputing positions ``start..T-1``. Copy ``j`` is recomputed
    from layer ``entry[j]`` on (non-decreasing); until then it is the clean run, so its
    rows join the batch at that layer from the clean residual stream. Not resumable
    models recompute every copy from layer 0."""
    B, T = run.tokens.shape
    n_layers = model.cfg.n_layers
    n_var = len(entry)
    if run.resid is not None:
        if any(a > b for a, b in zip(entry, entry[1:])) or entry[-1] >= n_layers:
            raise ValueError(f"entry layers must be non-decreasing and below {n_layers}, got {list(entry)}")
        first = entry[0]
        present = [sum(e <= l for e in entry) for l in range(n_layers)]  # copies in the batch at layer l
        cache = _make_cache(model, run, start, present)
        hidden = run.resid[first][:, start:].to(layer_device(model, first)).repeat(present[first], 1, 1)
        position_ids = torch.arange(start, T, device=hidden.device).unsqueeze(0)

        def join(l: int, device: torch.device) -> torch.Tensor | None:
            """Rows of the copies that join at layer ``l``, from the clean stream."""
            joining = present[l] - present[max(l - 1, first)] if l > first else 0
            return run.resid[l][:, start:].to(device).repeat(joining, 1, 1) if joining else None

        hidden, _ = run_blocks(model, hidden, first=first, position_ids=position_ids, cache=cache, join=join)
        return decoder_norm(model, hidden[:, -1:])[:, 0]
    cache = _make_cache(model, run, start, [n_var] * n_layers)
    hidden, _ = decoder_pass(model, run.tokens[:, start:].to(input_device(model)).repeat(n_var, 1), cache=cache)
    return hidden[:, -1]


def _edit_span(edits: Variant, T: int) -> tuple[int, int]:
    """(first recomputed position, first edited layer) a variant needs."""
    if not edits:
        return T - 1, 10**9
    positions = [0 if e.position is None else _resolve_position(e.position, T) for e in edits]
    return min(positions), min(e.component.layer for e in edits)


@torch.no_grad()
def run_variants(model, run: CleanRun, variants: Sequence[Variant], max_rows: int = 1024,
                 progress: bool = False, desc: str = "variants") -> torch.Tensor:
    """The fast path: final-normed hidden state at the last position for every variant
    (a list of :class:`Edit`) applied to the clean batch, ``[n_variants, B, d_model]``.

    Variants are sorted by the position and layer of their first edit and run in
    chunks of at most ``max_rows`` rows (variants x prompts); each chunk reuses the
    clean keys/values before its first edited position, and each variant of a chunk
    joins the batch at its own lowest edited layer from the clean residual stream
    (:func:`resumable` models; others recompute every layer). A variant without edits
    returns the clean state.
    """
    B, T = run.tokens.shape
    n_layers = model.cfg.n_layers
    spans = [_edit_span(v, T) for v in variants]
    order = sorted(range(len(variants)), key=lambda i: (spans[i][0], spans[i][1]))
    per_chunk = max(1, max_rows // B)
    out = torch.empty(len(variants), B, run.final.shape[-1], dtype=run.final.dtype, device=run.final.device)
    chunks = [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]
    for chunk in tqdm(chunks, desc=desc, disable=not progress, leave=False):
        clean = [i for i in chunk if spans[i][1] >= n_layers]
        if clean:
            out[clean] = run.final
        chunk = sorted((i for i in chunk if spans[i][1] < n_layers), key=lambda i: spans[i][1])
        if not chunk:
            continue
        start = min(spans[i][0] for i in chunk)
        entry = [spans[i][1] if run.resid is not None else 0 for i in chunk]
        hooks = variant_hooks(model, [variants[i] for i in chunk], B, start, T)
        with model.hooks(fwd_hooks=hooks):
            h = _forward_suffix(model, run, start, entry)
        out[chunk] = h.view(len(chunk), B, -1)
    return out


# --------------------------------------------------------------------------- readout


class Unembed:
    """The unembedding of ``model`` applied to final-normed hidden states ``[..., d_model]``.

    :meth:`top1` returns the exact argmax and maximum logit of perturbed states
    without computing every logit: for a state h = h0 + delta, logit_j(h) <=
    logit_j(h0) + ||delta|| ||w_j|| (Cauchy-Schwarz), so only tokens whose bound
    reaches the best exactly computed logit can win; their logits are computed exactly.
    """

    def __init__(self, model):
        hf = _hf(model)
        if getattr(hf.config, "final_logit_softcapping", None):
            raise NotImplementedError("models with final logit soft-capping are not supported")
        emb = hf.get_output_embeddings()
        self.device = module_device(model, emb)  # states are moved here (a split model's last device)
        self.weight = emb.weight
        bias = getattr(emb, "bias", None)
        self.bias = bias if isinstance(bias, torch.Tensor) else None
        self._norms: torch.Tensor | None = None

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def norms(self) -> torch.Tensor:
        if self._norms is None:
            self._norms = self.weight.float().norm(dim=-1)
        return self._norms

    @torch.no_grad()
    def logits(self, h: torch.Tensor, chunk: int = 32768) -> torch.Tensor:
        """All logits, float32, ``[..., vocab]`` (computed in vocabulary chunks in fp32,
        on the unembedding's device)."""
        hf32 = h.to(self.device).float()
        parts = []
        for s in range(0, self.vocab, chunk):
            w = self.weight[s:s + chunk].float()
            b = self.bias[s:s + chunk].float() if self.bias is not None else None
            parts.append(F.linear(hf32, w, b))
        return torch.cat(parts, -1)

    @torch.no_grad()
    def token_logits(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logit of token ``ids[..., b]`` for state ``h[..., b, :]`` (ids broadcast), float32."""
        h = h.to(self.device)
        ids = torch.as_tensor(ids, device=h.device).expand(h.shape[:-1])
        out = (h.float() * self.weight[ids].float()).sum(-1)
        if self.bias is not None:
            out = out + self.bias[ids].float()
        return out

    @torch.no_grad()
    def top1(self, h: torch.Tensor, h_clean: torch.Tensor, clean_logits: torch.Tensor | None = None,
             hint_ids: torch.Tensor | None = None, chunk: int = 256, max_candidates: int = 8192,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact (argmax id, max logit) of ``h`` ``[..., B, d]`` given the clean states
        ``h_clean`` ``[B, d]`` and their logits (computed if None).

        For a row with delta = h - h_clean, every token satisfies logit_j(h) <=
        clean_logit_j + ||delta|| * max_j ||w_j||, so only tokens whose clean logit is at
        least ``lb - ||delta|| * max_norm`` can beat ``lb``, the best exactly computed logit
        among the clean argmax and ``hint_ids`` [B]. Those tokens are a prefix of the
        prompt's clean logits sorted in descending order; their logits are computed
        exactly (rows needing more than ``max_candidates`` get the full unembedding)."""
        h, h_clean = h.to(self.device), h_clean.to(self.device)
        lead = h.shape[:-2]
        B, d = h_clean.shape
        if clean_logits is None:
            clean_logits = self.logits(h_clean)
        clean_logits = clean_logits.to(self.device).float()
        sorted_vals, sorted_idx = clean_logits.sort(-1, descending=True)          # [B, V]
        asc = sorted_vals.flip(-1).contiguous()
        flat = h.reshape(-1, B, d)
        ids_out = torch.empty(flat.shape[:2], dtype=torch.long, device=h.device)
        max_out = torch.empty(flat.shape[:2], dtype=torch.float32, device=h.device)
        rows = flat.reshape(-1, d)
        prompt = torch.arange(B, device=h.device).repeat(flat.shape[0])
        eps = 1e-4 * float(clean_logits.abs().max()) + 1e-4
        max_norm = float(self.norms.max())
        V = self.vocab
        for s in range(0, rows.shape[0], chunk):
            r = rows[s:s + chunk].float()
            b = prompt[s:s + chunk]
            radius = (r - h_clean[b].float()).norm(dim=-1)
            cands = [sorted_idx[b, 0]] + ([hint_ids.to(h.device)[b]] if hint_ids is not None else [])
            cand = torch.stack(cands, -1)
            lb = self.token_logits(r[:, None, :].expand(-1, cand.shape[1], -1), cand).max(-1).values
            thr = lb - radius * max_norm - eps
            # number of tokens with clean logit >= thr, per row
            count = V - torch.searchsorted(asc[b], thr[:, None], right=False)[:, 0]
            count = count.clamp(min=1)
            a = torch.empty(r.shape[0], dtype=torch.long, device=h.device)
            m = torch.empty(r.shape[0], dtype=torch.float32, device=h.device)
            big = count > max_candidates
            if big.any():
                lg = self.logits(r[big])
                m[big], a[big] = lg.max(-1)
            small = (~big).nonzero().flatten()
            if small.numel():
                k = int(count[small].max())
                union = sorted_idx[b[small], :k].unique()
                w = self.weight[union].float()
                lg = r[small] @ w.T
                if self.bias is not None:
                    lg = lg + self.bias[union].float()
                mm, j = lg.max(-1)
                m[small], a[small] = mm, union[j]
            flat_idx = torch.arange(s, s + r.shape[0], device=h.device)
            ids_out.view(-1)[flat_idx] = a
            max_out.view(-1)[flat_idx] = m
        return ids_out.reshape(*lead, B), max_out.reshape(*lead, B)


# --------------------------------------------------------------------------- Zhang's path patching


def _z(l: int) -> str:
    return f"blocks.{l}.attn.hook_z"


def _mlp_out(l: int) -> str:
    return f"blocks.{l}.hook_mlp_out"


def _attn_out(l: int) -> str:
    return f"blocks.{l}.hook_attn_out"


def _check_senders(senders: Sequence[Component]) -> None:
    for s in senders:
        if s.kind not in ("head", "mlp") or (s.kind == "head" and s.index is None):
            raise ValueError(f"path patching senders are single heads or MLPs, got {s.label}")


@torch.no_grad()
def path_patch_full(model, tokens: torch.Tensor, cf_tokens: torch.Tensor, senders: Sequence[Component],
                    answer_ids: torch.Tensor, progress: bool = False) -> torch.Tensor:
    """Reference for Zhang et al.'s path patching (Alg. 1, App. B), one full forward
    pass per sender: the sender's output at the END position is set to its value on
    ``cf_tokens``, every other head is frozen at its clean value (all positions), MLPs
    recompute. Returns the answer-token logits ``[n_senders, B]``."""
    _check_senders(senders)
    n_layers = model.cfg.n_layers
    clean = cache_activations(model, tokens, [_z(l) for l in range(n_layers)])
    cf = cache_activations(model, cf_tokens, [_z(l) for l in range(n_layers)] + [_mlp_out(l) for l in range(n_layers)])
    out = []
    T = tokens.shape[1]
    for s in tqdm(senders, desc="path patching (full)", disable=not progress, leave=False):
        edits = []
        for l in range(n_layers):
            for p in range(T):
                z = clean[_z(l)][:, p].clone()
                if s.kind == "head" and l == s.layer and p == T - 1:
                    z[:, s.index] = cf[_z(l)][:, p, s.index]
                edits.append(Edit(Component("head", l), p, z))
        if s.kind == "mlp":
            edits.append(Edit(Component("mlp", s.layer), T - 1, cf[_mlp_out(s.layer)][:, -1]))
        logits = run_edits_full(model, tokens, edits)
        out.append(logits.gather(1, answer_ids[:, None].to(logits.device)).squeeze(1))
    return torch.stack(out)


@torch.no_grad()
def path_patch_answer(model, clean: CleanRun, clean_end: Mapping[str, torch.Tensor], cf_end: Mapping[str, torch.Tensor],
                      senders: Sequence[Component], answer_ids: torch.Tensor, unembed: Unembed | None = None) -> torch.Tensor:
    """Fast Zhang path patching at the END position: answer-token logits ``[n_senders, B]``.

    ``clean`` is the clean :class:`CleanRun`; ``clean_end`` holds, at the last position,
    ``blocks.L.attn.hook_z`` ``[B, H, d_head]`` and ``blocks.L.hook_attn_out`` ``[B, d]`` of
    every layer; ``cf_end`` ``hook_z`` and ``hook_mlp_out`` of the counterfactual run.
    With all other heads frozen, the attention output at END in every layer is the
    clean one except in the sender's layer, where it is W_O applied to the clean z with
    the sender's slice replaced; so each sender costs only the MLPs (and norms) of the
    layers from its own up, on one token. Models with parallel attention/MLP blocks
    (or not :func:`resumable`) fall back to :func:`run_variants` with explicit
    freezing edits.
    """
    _check_senders(senders)
    cfg = model.cfg
    n_layers = cfg.n_layers
    unembed = unembed or Unembed(model)
    answer_ids = answer_ids.to(unembed.device)
    z_clean = {l: clean_end[_z(l)] for l in range(n_layers)}
    z_cf = {l: cf_end[_z(l)] for l in range(n_layers)}
    if getattr(cfg, "parallel_attn_mlp", False) or clean.resid is None:
        variants = []
        for s in senders:
            edits = []
            for l in range(s.layer, n_layers):
                z = z_clean[l].clone()
                if s.kind == "head" and l == s.layer:
                    z[:, s.index] = z_cf[l][:, s.index]
                edits.append(Edit(Component("head", l), -1, z))
            if s.kind == "mlp":
                edits.append(Edit(Component("mlp", s.layer), -1, cf_end[_mlp_out(s.layer)]))
            variants.append(edits)
        h = run_variants(model, clean, variants)
        return unembed.token_logits(h, answer_ids)

    resid = clean.resid[:, :, -1]                                    # [L, B, d]
    dev = resid.device

    def stack(xs: Iterable[torch.Tensor]) -> torch.Tensor:
        return torch.stack([x.to(dev) for x in xs])

    return path_patch_end(model, resid, stack(clean_end[_attn_out(l)] for l in range(n_layers)),
                          stack(z_clean[l] for l in range(n_layers)), stack(z_cf[l] for l in range(n_layers)),
                          stack(cf_end[_mlp_out(l)] for l in range(n_layers)), senders, answer_ids, unembed)


@torch.no_grad()
def path_patch_end(model, resid: torch.Tensor, attn_out: torch.Tensor, z_clean: torch.Tensor, z_cf: torch.Tensor,
                   mlp_cf: torch.Tensor, senders: Sequence[Component], answer_ids: torch.Tensor,
                   unembed: Unembed | None = None, max_rows: int = 4096) -> torch.Tensor:
    """The MLP-only recomputation of :func:`path_patch_answer` from END vectors alone, so
    prompts of any lengths are processed together: ``resid`` ``[L, N, d]`` (input of each
    block), ``attn_out`` ``[L, N, d]``, ``z_clean`` / ``z_cf`` ``[L, N, H, d_head]``, ``mlp_cf``
    ``[L, N, d]`` (counterfactual MLP outputs), ``answer_ids`` ``[N]``. Sequential-residual
    models only. Returns answer-token logits ``[n_senders, N]``."""
    _check_senders(senders)
    if getattr(model.cfg, "parallel_attn_mlp", False):
        raise ValueError("path_patch_end needs sequential attention -> MLP blocks; use path_patch_answer")
    n_layers = model.cfg.n_layers
    unembed = unembed or Unembed(model)
    N = resid.shape[1]
    out = torch.empty(len(senders), N, device=unembed.device)
    blocks = model.blocks
    devices = [layer_device(model, l) for l in range(n_layers)]  # a split model: x follows the blocks
    final_device = module_device(model, model.ln_final)

    def mlp(l: int, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 1, x.shape[-1])
        return blocks[l].mlp(blocks[l].ln2(flat)).reshape(x.shape)

    def at(t: torch.Tensor, l: int) -> torch.Tensor:
        return t.to(devices[l])

    by_layer: dict[int, list[int]] = {}
    for i, s in enumerate(senders):
        by_layer.setdefault(s.layer, []).append(i)
    step = max(1, max_rows // max(1, N))
    for layer, idx_all in sorted(by_layer.items()):
        for c0 in range(0, len(idx_all), step):
            idx = idx_all[c0:c0 + step]
            heads = [i for i in idx if senders[i].kind == "head"]
            mlps = [i for i in idx if senders[i].kind == "mlp"]
            xs = []
            if heads:
                z = at(z_clean[layer], layer).unsqueeze(0).repeat(len(heads), 1, 1, 1)       # [v, N, H, dh]
                for j, i in enumerate(heads):
                    z[j, :, senders[i].index] = at(z_cf[layer][:, senders[i].index], layer)
                attn = blocks[layer].attn.o(z.reshape(len(heads) * N, 1, -1)).reshape(len(heads), N, -1)
                x = at(resid[layer], layer).unsqueeze(0) + attn
                xs.append(x + mlp(layer, x))
            if mlps:
                x = at(resid[layer] + attn_out[layer] + mlp_cf[layer], layer)
                xs.append(x.unsqueeze(0).expand(len(mlps), -1, -1))
            x = torch.cat(xs)
            for l in range(layer + 1, n_layers):
                x = at(x, l) + at(attn_out[l], l)
                x = x + mlp(l, x)
            x = x.to(final_device)
            h = model.ln_final(x.reshape(-1, 1, x.shape[-1])).reshape(x.shape)
            out[heads + mlps] = unembed.token_logits(h, answer_ids)
    return out


def path_end_captures(n_layers: int, attention: bool = False) -> dict[str, Callable]:
    """Capture spec for :func:`clean_run` of the clean prompts in path patching: z and
    attention output of every layer at the last position (and the END query's
    attention pattern ``[B, H, T]`` when ``attention``)."""
    spec: dict[str, Callable] = {}
    for l in range(n_layers):
        spec[_z(l)] = lambda a: a[:, -1]
        spec[_attn_out(l)] = lambda a: a[:, -1]
        if attention:
            spec[f"blocks.{l}.attn.hook_pattern"] = lambda a: a[:, :, -1, :]
    return spec


@dataclass
class PathPatchingResult:
    """What :func:`path_patching` returns.

    ``effects``: one row per prompt and sender (``prompt``, ``op``, ``template_id``,
    ``component``, ``kind``, ``layer``, ``head``, ``clean_logit``, ``patched_logit``,
    ``effect`` = Zhang's relative logit change). ``attention``: per prompt, the END
    query's attention pattern ``[n_layers, n_heads, T]``. ``cf_means``: mean ``hook_z``
    over the counterfactual prompts per prompt length (``{hook: {length: [T, H, d_head]}}``,
    the format of :mod:`arithlib.ablation`), ``cf_counts``: prompts per length.
    """

    effects: pd.DataFrame
    attention: dict[int, torch.Tensor]
    cf_means: dict[str, dict[int, torch.Tensor]]
    cf_counts: dict[int, int]

    def end_means(self) -> dict[int, torch.Tensor]:
        """Mean ``z`` at the END position over all counterfactual prompts, pooled over
        lengths: ``{layer: [H, d_head]}`` (Zhang's knockout value at END)."""
        out = {}
        total = sum(self.cf_counts.values())
        for name, per in self.cf_means.items():
            layer = int(name.split(".")[1])
            out[layer] = sum(per[n][-1] * c for n, c in self.cf_counts.items()) / total
        return out


@torch.no_grad()
def path_patching(model, prompts: PromptSet, senders: Sequence[Component] | None = None, method: str = "fast",
                  batch_size: int = 16, capture_attention: bool = True, progress: bool = True,
                  cache: RunCache | None = None) -> PathPatchingResult:
    """Zhang et al. 2024 Alg. 1: path patching of every sender (default: all heads and
    MLPs) at the END position, reference X_r = ``prompts`` (keep only correctly
    answered ones), counterfactual X_c = their ``counterfactual`` texts.
    ``method="fast"`` uses :func:`path_patch_answer`, ``"full"`` :func:`path_patch_full`.
    The clean runs are added to ``cache`` when one is given.
    """
    if method not in ("fast", "full"):
        raise ValueError("method must be 'fast' or 'full'")
    if not prompts.has_counterfactuals:
        raise ValueError("path patching needs a counterfactual for every prompt")
    if len(prompts) == 0:
        raise ValueError("no prompts to patch")
    senders = list(senders) if senders is not None else heads_and_mlps(model)
    n_layers = model.cfg.n_layers
    unembed = Unembed(model)
    device = input_device(model)
    rows = []
    attention: dict[int, torch.Tensor] = {}
    sums: dict[str, dict[int, torch.Tensor]] = {_z(l): {} for l in range(n_layers)}
    counts: dict[int, int] = {}
    batches = list(prompts.batches(batch_size, device))
    fast = method == "fast" and not getattr(model.cfg, "parallel_attn_mlp", False) and resumable(model)
    pooled: dict[str, list[torch.Tensor]] = {k: [] for k in ("resid", "attn", "zc", "zf", "mlpf", "ans", "idx")}
    per_batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []   # (index, clean logit, patched)
    for batch in tqdm(batches, desc="path patching (runs)", disable=not progress, leave=False):
        groups = prefix_groups(prompts, batch.index)
        clean = grouped_clean_run(model, batch.tokens, groups, path_end_captures(n_layers, capture_attention))
        if cache is not None:
            cache.add(clean)
        cf = grouped_clean_run(model, batch.cf_tokens, groups,
                               [_z(l) for l in range(n_layers)] + [_mlp_out(l) for l in range(n_layers)])
        T = batch.tokens.shape[1]
        counts[T] = counts.get(T, 0) + batch.tokens.shape[0]
        for l in range(n_layers):
            s = cf.captured[_z(l)].float().sum(0)  # fp32 sums: the means of Zhang's knockout
            sums[_z(l)][T] = sums[_z(l)][T] + s if T in sums[_z(l)] else s
        if capture_attention:
            pat = torch.stack([clean.captured[f"blocks.{l}.attn.hook_pattern"].to(device) for l in range(n_layers)], 1)
            for row, i in enumerate(batch.index.tolist()):
                attention[i] = pat[row].float().cpu().clone()  # its own storage, not a view of the batch
        clean_logit = unembed.token_logits(clean.final, batch.answer_ids)
        cf_end = {k: v[:, -1] for k, v in cf.captured.items()}
        if fast:
            # END vectors of every layer, stacked on the input device (path_patch_end moves each
            # layer's slice to that layer's device)
            pooled["resid"].append(clean.resid[:, :, -1])
            pooled["attn"].append(torch.stack([clean.captured[_attn_out(l)].to(device) for l in range(n_layers)]))
            pooled["zc"].append(torch.stack([clean.captured[_z(l)].to(device) for l in range(n_layers)]))
            pooled["zf"].append(torch.stack([cf_end[_z(l)].to(device) for l in range(n_layers)]))
            pooled["mlpf"].append(torch.stack([cf_end[_mlp_out(l)].to(device) for l in range(n_layers)]))
            pooled["ans"].append(batch.answer_ids)
            pooled["idx"].append(batch.index)
            per_batch.append((batch.index, clean_logit, None))
        elif method == "fast":
            patched = path_patch_answer(model, clean, clean.captured, cf_end, senders, batch.answer_ids, unembed)
            per_batch.append((batch.index, clean_logit, patched))
        else:
            patched = path_patch_full(model, batch.tokens, batch.cf_tokens, senders, batch.answer_ids)
            per_batch.append((batch.index, clean_logit, patched))
    if fast:
        cat = {k: torch.cat(v, dim=1 if k in ("resid", "attn", "zc", "zf", "mlpf") else 0) for k, v in pooled.items()}
        patched_all = path_patch_end(model, cat["resid"], cat["attn"], cat["zc"], cat["zf"], cat["mlpf"], senders,
                                     cat["ans"], unembed)
        offsets = np.cumsum([0] + [len(b[0]) for b in per_batch])
        per_batch = [(ix, cl, patched_all[:, offsets[j]:offsets[j + 1]]) for j, (ix, cl, _) in enumerate(per_batch)]
    if any(bool((cl <= 0).any()) for _, cl, _ in per_batch):
        warnings.warn("some prompts have a non-positive clean answer logit; their relative logit change is NaN "
                      "(keep only correctly answered prompts in X_r)", stacklevel=2)
    for index, clean_logit, patched in per_batch:
        effect = relative_logit_change(patched, clean_logit, strict=False)
        for row, i in enumerate(index.tolist()):
            r = prompts.records[i]
            for j, s in enumerate(senders):
                rows.append((i, r.op, r.template_id, s.label, s.kind, s.layer, s.index if s.index is not None else -1,
                             float(clean_logit[row]), float(patched[j, row]), float(effect[j, row])))
    effects = pd.DataFrame(rows, columns=["prompt", "op", "template_id", "component", "kind", "layer", "head",
                                         "clean_logit", "patched_logit", "effect"])
    means = {h: {n: s / counts[n] for n, s in per.items()} for h, per in sums.items()}
    return PathPatchingResult(effects, attention, means, counts)


def mean_effects(effects: pd.DataFrame, by: Sequence[str] = ("op",)) -> pd.DataFrame:
    """Zhang's averaged effect per sender (mean of ``effect`` over prompts), grouped by
    ``by`` columns, with the prompt count and the standard error."""
    keys = list(by) + ["component", "kind", "layer", "head"]
    g = effects.groupby(keys)["effect"]
    out = g.agg(["mean", "std", "count"]).reset_index().rename(columns={"mean": "effect", "count": "n"})
    out["sem"] = out["std"] / np.sqrt(out["n"].clip(lower=1))
    return out.drop(columns="std")


def key_heads(mean_frame: pd.DataFrame, threshold: float = KEY_HEAD_THRESHOLD) -> pd.DataFrame:
    """Zhang's key heads: heads whose mean effect is below ``threshold`` (-5 %),
    sorted by effect (most negative first)."""
    heads = mean_frame[mean_frame["kind"] == "head"]
    return heads[heads["effect"] < threshold].sort_values("effect").reset_index(drop=True)


# --------------------------------------------------------------------------- interventions over prompt sets


@dataclass
class InterventionReadout:
    """Per variant and prompt: argmax token, maximum logit and answer-token logit at the
    answer position (exact, via :meth:`Unembed.top1`), plus the clean values."""

    pred: torch.Tensor          # [V, N]
    max_logit: torch.Tensor     # [V, N]
    answer_logit: torch.Tensor  # [V, N]
    answer_ids: torch.Tensor    # [N]
    clean_pred: torch.Tensor    # [N]
    clean_max: torch.Tensor     # [N]
    clean_answer_logit: torch.Tensor  # [N]
    logits: torch.Tensor | None = None  # [V, N, vocab] when asked for

    @property
    def correct(self) -> torch.Tensor:
        """[V, N] bool: the answer token is the argmax."""
        return self.pred == self.answer_ids

    @property
    def accuracy(self) -> torch.Tensor:
        """[V] first-token accuracy per variant."""
        return self.correct.float().mean(-1)

    @property
    def clean_accuracy(self) -> float:
        return float((self.clean_pred == self.answer_ids).float().mean())

    @property
    def normalized_logit(self) -> torch.Tensor:
        """[V, N] Nikankin's answer logit / max logit."""
        return self.answer_logit / self.max_logit


@torch.no_grad()
def run_interventions(model, prompts: PromptSet,
                      variants: Sequence[Variant] | Callable[[object, CleanRun], Sequence[Variant]],
                      batch_size: int = 16, max_rows: int = 1024, full_logits: bool = False,
                      progress: bool = True, desc: str = "interventions", cache: RunCache | None = None,
                      ) -> InterventionReadout:
    """Apply each variant (a list of :class:`Edit`; positions may count from the end,
    -1 = answer position, None = every position) to every prompt with the fast path and
    read out the answer position. ``variants`` may be a function ``(batch, clean_run) ->
    variants`` for per-batch values (e.g. counterfactual activations); it must return
    the same number of variants for every batch. ``full_logits`` also returns
    ``[V, N, vocab]`` logits (memory!). ``cache`` reuses (and fills) clean runs."""
    device = input_device(model)
    unembed = Unembed(model)
    N = len(prompts)
    answer_ids = prompts.first_answer_ids
    outs: dict[str, torch.Tensor] = {}
    batches = list(prompts.batches(batch_size, device))
    for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
        groups = prefix_groups(prompts, batch.index)
        run = (cache.get(model, batch.tokens, groups) if cache is not None
               else grouped_clean_run(model, batch.tokens, groups))
        vs = variants(batch, run) if callable(variants) else variants
        V = len(vs)
        if not outs:
            outs = {"pred": torch.empty(V, N, dtype=torch.long), "max": torch.empty(V, N), "ans": torch.empty(V, N),
                    "cpred": torch.empty(N, dtype=torch.long), "cmax": torch.empty(N), "cans": torch.empty(N)}
            if full_logits:
                outs["logits"] = torch.empty(V, N, unembed.vocab)
        h = run_variants(model, run, vs, max_rows=max_rows)
        clean_logits = unembed.logits(run.final)
        idx = batch.index
        ans = batch.answer_ids.to(unembed.device)
        if full_logits:
            lg = unembed.logits(h)
            outs["logits"][:, idx] = lg.cpu()
            m, a = lg.max(-1)
        else:
            a, m = unembed.top1(h, run.final, clean_logits, hint_ids=ans)
        outs["pred"][:, idx] = a.cpu()
        outs["max"][:, idx] = m.cpu()
        outs["ans"][:, idx] = unembed.token_logits(h, ans).cpu()
        cm, ca = clean_logits.max(-1)
        outs["cpred"][idx] = ca.cpu()
        outs["cmax"][idx] = cm.cpu()
        outs["cans"][idx] = clean_logits.gather(1, ans[:, None]).squeeze(1).cpu()
    return InterventionReadout(outs["pred"], outs["max"], outs["ans"], answer_ids.cpu(), outs["cpred"], outs["cmax"],
                               outs["cans"], outs.get("logits"))


def ablation_edits(heads: Iterable[Head], value: Mapping[int, torch.Tensor] | float = 0.0,
                   position: int | None = -1) -> list[Edit]:
    """Edits that ablate ``heads`` at ``position`` (-1: answer position, None: all):
    ``value`` 0.0 zeroes them (Yu's W_O-slice intervention), a ``{layer: [H, d_head]}``
    mapping sets each head to its mean (Zhang's knockout at END)."""
    edits = []
    for layer, head in heads:
        if isinstance(value, Mapping):
            v = value[layer][head]
        else:
            v = float(value)
        edits.append(Edit(Component("head", int(layer), int(head)), position, v))
    return edits


def head_sweep(model, prompts: PromptSet, heads: Sequence[Head] | None = None,
               value: Mapping[int, torch.Tensor] | float = 0.0, position: int | None = -1,
               batch_size: int = 16, max_rows: int = 1024, progress: bool = True,
               cache: RunCache | None = None) -> pd.DataFrame:
    """Ablate one head at a time (``value=0``: zero its W_O slice, Yu & Ananiadou Sec. 3.2;
    a mean mapping: Zhang's knockout) at ``position`` (-1: answer position only; None:
    every position, Yu's intervention, recomputing every position of every prompt: the
    reference of :func:`arithlib.head_sweep.exact_head_sweep`) and record first-token
    correctness. Returns one row per head and
    prompt: ``prompt``, ``layer``, ``head``, ``correct``, ``clean_correct`` plus the
    prompt's ``op``, ``n_digits``, ``template_id``, ``carry`` and ``case``."""
    cfg = model.cfg
    heads = list(heads) if heads is not None else [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    variants = [ablation_edits([hd], value, position) for hd in heads]
    ro = run_interventions(model, prompts, variants, batch_size, max_rows, progress=progress, desc="head sweep",
                           cache=cache)
    correct = ro.correct.numpy()
    clean = (ro.clean_pred == ro.answer_ids).numpy()
    meta = pd.DataFrame({"prompt": range(len(prompts)),
                         "op": [r.op for r in prompts.records],
                         "n_digits": [r.n_digits for r in prompts.records],
                         "template_id": [r.template_id for r in prompts.records],
                         "carry": [r.carry for r in prompts.records],
                         "case": [r.get("case", "") for r in prompts.records]})
    frames = []
    for j, (layer, head) in enumerate(heads):
        f = meta.copy()
        f["layer"], f["head"], f["correct"], f["clean_correct"] = layer, head, correct[j], clean
        frames.append(f)
    return pd.concat(frames, ignore_index=True)


def sweep_accuracy(sweep: pd.DataFrame, by: Sequence[str] = ("op", "n_digits")) -> pd.DataFrame:
    """Accuracy per head (and ``by`` groups) from :func:`head_sweep` rows, with the clean
    baseline and the drop: ``accuracy``, ``baseline_accuracy``, ``accuracy_drop``."""
    keys = list(by) + ["layer", "head"]
    g = sweep.groupby(keys).agg(accuracy=("correct", "mean"), baseline_accuracy=("clean_correct", "mean"),
                                n=("correct", "size")).reset_index()
    g["accuracy_drop"] = g["baseline_accuracy"] - g["accuracy"]
    return g


def mean_ablation_edits(heads: Iterable[Head], means: Mapping[str, Mapping[int, torch.Tensor]], length: int,
                        position: int | None = None, start: int = 0) -> list[Edit]:
    """Edits replacing each head's output by its mean over a reference set at the same
    position, for prompts of ``length`` tokens; ``means`` is an
    :func:`arithlib.ablation.mean_activations` cache (``{hook_z: {length: [T, H, d_head]}}``).
    ``position`` None ablates every position from ``start`` on (``start`` 0: all of them,
    = :func:`arithlib.ablation.mean_heads_hooks`; the query's first token: the query only)."""
    edits = []
    for layer, head in heads:
        name = _z(int(layer))
        try:
            m = means[name][length]
        except KeyError:
            raise KeyError(f"no mean of {name} for prompts of length {length}") from None
        ps = range(start, length) if position is None else [_resolve_position(position, length)]
        edits += [Edit(Component("head", int(layer), int(head)), p, m[p, int(head)]) for p in ps]
    return edits


def random_orders(n_layers: int, n_heads: int, n_random: int, seed: int) -> dict[str, list[Head]]:
    """``{"random0": [...], ...}``: ``n_random`` seeded permutations of all heads (Zhang's
    "random-rank" orders; the first k of each is a random set of k heads)."""
    all_heads = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n_random):
        perm = rng.permutation(len(all_heads))
        out[f"random{i}"] = [all_heads[j] for j in perm]
    return out


def _knockout_variants(sets: Sequence[Sequence[Head]], means: Mapping, position: int | None, start: int = 0):
    """Variants mean-ablating each head set: at ``position`` with ``{layer: [H, d_head]}``
    means, or at every position from ``start`` on (``position=None``) with a per-length cache."""
    if position is None:
        def variants(batch, run):
            T = batch.tokens.shape[1]
            return [mean_ablation_edits(hs, means, T, None, start) for hs in sets]
        return variants
    return [ablation_edits(hs, means, position) for hs in sets]


def knockout_curves(model, prompts: PromptSet, ranking: Sequence[Head], ks: Sequence[int],
                    means: Mapping, n_random: int = 5, seed: int = 0, position: int | None = -1,
                    by: str | None = "op", batch_size: int = 16, max_rows: int = 1024,
                    orders: Sequence[str] | None = None, progress: bool = True,
                    cache: RunCache | None = None) -> pd.DataFrame:
    """Zhang et al. Fig. 3: mean-ablate the first k heads of ``ranking`` ("effect-rank")
    and of ``n_random`` random permutations of all heads ("random-rank", seeded,
    :func:`random_orders`), for each k in ``ks``; first-token accuracy on ``prompts``.

    ``position=-1``: ablate at the answer position only, ``means`` ``{layer: [H, d_head]}``
    (e.g. :meth:`PathPatchingResult.end_means`, Zhang's mean over X_c). ``position=None``:
    ablate at every position, ``means`` a per-length cache (``{hook_z: {length: [T, H, d_head]}}``,
    e.g. :attr:`PathPatchingResult.cf_means`). ``orders`` restricts which orders run
    (names "effect", "random0", ...). Returns rows ``order`` ("effect"/"random"),
    ``order_name``, ``k``, ``group`` (``by`` value or "all"), ``accuracy``, ``n``."""
    cfg = model.cfg
    named = {"effect": list(ranking), **random_orders(cfg.n_layers, cfg.n_heads, n_random, seed)}
    if orders is not None:
        named = {k: v for k, v in named.items() if k in orders}
    labels, sets = [], []
    for name, order in named.items():
        for k in ks:
            if k <= len(order):
                labels.append((name, k))
                sets.append(order[:k])
    ro = run_interventions(model, prompts, _knockout_variants(sets, means, position), batch_size, max_rows,
                           progress=progress, desc="knockout", cache=cache)
    correct = ro.correct.float()
    groups = {"all": torch.arange(len(prompts))}
    if by is not None:
        values = [getattr(r, by) for r in prompts.records]
        for v in dict.fromkeys(values):
            groups[str(v)] = torch.tensor([i for i, x in enumerate(values) if x == v])
    rows = []
    for j, (name, k) in enumerate(labels):
        for g, idx in groups.items():
            rows.append({"order": "effect" if name == "effect" else "random", "order_name": name, "k": k,
                         "group": g, "accuracy": float(correct[j, idx].mean()), "n": len(idx)})
    return pd.DataFrame(rows)


def query_starts(prompts: PromptSet) -> list[int]:
    """Position of each prompt's first query token: the first token after its few-shot
    prefix (:func:`locate_operands`' ``prefix`` positions; 0 without a prefix)."""
    return [max(loc["prefix"]) + 1 if loc["prefix"] else 0 for loc in locate_operands(prompts)]


def knockout_screen_agreement(query: pd.DataFrame, end: pd.DataFrame) -> pd.DataFrame:
    """The END-only knockout screen against the judged knockout at every query position,
    per condition, from two :func:`knockout_per_prompt` tables: ``n``, both accuracies,
    per-prompt ``agreement``, ``broken_by_query`` (prompts the judged knockout breaks) and
    ``recall_of_end`` (the share of those the screen also breaks)."""
    both = query.merge(end, on=["prompt", "condition"], suffixes=("_query", "_end"))
    rows = []
    for condition, g in both.groupby("condition"):
        broken = ~g["correct_query"].astype(bool)
        rows.append({"condition": condition, "n": len(g), "accuracy_query": g["correct_query"].mean(),
                     "accuracy_end": g["correct_end"].mean(),
                     "agreement": (g["correct_query"] == g["correct_end"]).mean(),
                     "broken_by_query": int(broken.sum()),
                     "recall_of_end": float((broken & ~g["correct_end"].astype(bool)).sum()) / max(int(broken.sum()), 1)})
    return pd.DataFrame(rows)


def knockout_per_prompt(model, prompts: PromptSet, head_sets: Mapping[str, Sequence[Head]], means: Mapping,
                        position: int | None = None, query_only: bool = True, batch_size: int = 16,
                        max_rows: int = 1024, progress: bool = True, cache: RunCache | None = None) -> pd.DataFrame:
    """Zhang et al. Sec. 4.1 / Fig. 3 knockout, one row per prompt and condition: each
    named head set of ``head_sets`` mean-ablated (means over X_c), plus the condition
    "none" (nothing ablated). ``position`` None: at every position of the query (the
    prompt the paper uses; with ``query_only`` the few-shot prefix is left intact, so its
    cached keys and values are reused; :func:`query_starts`) with a per-length cache such
    as :attr:`PathPatchingResult.cf_means`; -1: at the answer position with
    ``{layer: [H, d_head]}`` means. Columns ``prompt, op, template_id, condition,
    n_heads, position`` ("every" / "query" / "end"), ``correct`` (first answer token is
    the argmax), for the report's bootstrap over prompts."""
    names = ["none"] + list(head_sets)
    sets = [[]] + [list(head_sets[n]) for n in head_sets]
    correct = np.zeros((len(sets), len(prompts)), dtype=bool)
    if position is None:
        starts = query_starts(prompts) if query_only else [0] * len(prompts)
        parts = {}
        for i, s0 in enumerate(starts):
            parts.setdefault(s0, []).append(i)
    else:
        parts = {None: list(range(len(prompts)))}
    for s0, idx in parts.items():
        sub = prompts.subset(idx)
        if position is None:
            inner = _knockout_variants(sets[1:], means, None, s0)

            def variants(batch, run, inner=inner):
                return [[]] + inner(batch, run)
        else:
            variants = _knockout_variants(sets, means, position)
        ro = run_interventions(model, sub, variants, batch_size, max_rows, progress=progress,
                               desc="knockout per prompt", cache=cache)
        correct[:, idx] = ro.correct.numpy()
    where = ("query" if query_only else "every") if position is None else "end" if position == -1 else str(position)
    rows = []
    for j, (name, hs) in enumerate(zip(names, sets)):
        for i, r in enumerate(prompts.records):
            rows.append((i, r.op, r.template_id, name, len(hs), where, bool(correct[j, i])))
    return pd.DataFrame(rows, columns=["prompt", "op", "template_id", "condition", "n_heads", "position", "correct"])


@torch.no_grad()
def counterfactual_answer_rate(model, prompts: PromptSet, seed: int = 0, batch_size: int = 64) -> pd.DataFrame:
    """How much of the calculation X_c still carries (Zhang Sec. 3 asks for none): per
    prompt of X_r, whether the model's top-1 token after X_c is the first token of the
    true answer C (``answer_on_xc``), and the reference a model without the operation
    gives: whether it is the first token of a decoy C', the answer of another prompt of
    the same operator whose first token differs from C's (seeded draw; ``decoy_on_xc``).
    Columns ``prompt, op, template_id, answer, decoy, answer_on_xc, decoy_on_xc``."""
    from .evaluate import answer_logits

    if not prompts.has_counterfactuals:
        raise ValueError("counterfactual_answer_rate needs a counterfactual for every prompt")
    xc = PromptSet(prompts.records, [list(c) for c in prompts.cf_input_ids], prompts.answer_ids,
                   [None] * len(prompts), prompts.tokenizer)
    top1 = answer_logits(model, xc, batch_size, False).argmax(-1)
    first = prompts.first_answer_ids
    rng = np.random.default_rng(seed)
    decoys = []
    for i, r in enumerate(prompts.records):
        pool = [j for j, q in enumerate(prompts.records) if q.op == r.op and int(first[j]) != int(first[i])]
        decoys.append(int(rng.choice(pool)) if pool else -1)
    rows = []
    for i, r in enumerate(prompts.records):
        d = decoys[i]
        rows.append((i, r.op, r.template_id, r.answer, prompts.records[d].answer if d >= 0 else None,
                     bool(top1[i] == first[i]), bool(d >= 0 and top1[i] == first[d])))
    return pd.DataFrame(rows, columns=["prompt", "op", "template_id", "answer", "decoy", "answer_on_xc", "decoy_on_xc"])


def answer_rate_table(rates: pd.DataFrame, by: Sequence[str] = ("op",)) -> pd.DataFrame:
    """Per group (and "all"): the share of prompts whose X_c top-1 is C and the decoy
    reference share, each with its exact binomial 95 % interval (:func:`arithlib.stats.binomial_ci`)."""
    from .stats import binomial_ci

    rows = []
    groups = [(dict(zip(by, k if isinstance(k, tuple) else (k,))), g) for k, g in rates.groupby(list(by))]
    for keys, g in groups + [({b: "all" for b in by}, rates)]:
        row = dict(keys, n=len(g))
        for col, name in (("answer_on_xc", "answer_rate"), ("decoy_on_xc", "decoy_rate")):
            ci = binomial_ci(int(g[col].sum()), len(g))
            row.update({name: ci.estimate, f"{name}_low": ci.low, f"{name}_high": ci.high})
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- activation patching per position


def counterfactual_answer_ids(prompts: PromptSet) -> torch.Tensor:
    """First token of each record's counterfactual answer (``meta['cf_answer_text']``, as
    :func:`arithlib.datasets.nikankin_prompts` writes it), tokenized like the answers
    (:func:`arithlib.datasets.split_answer`, which refuses a prompt that does not end at a
    token boundary)."""
    out = []
    for r in prompts.records:
        cf_text = r.get("cf_answer_text")
        if cf_text is None or r.counterfactual is None:
            raise ValueError(f"prompt {r.text!r} has no counterfactual answer (meta cf_answer_text)")
        out.append(ds.split_answer(prompts.tokenizer, r.counterfactual, str(cf_text)).answer[0])
    return torch.tensor(out, dtype=torch.long)


@torch.no_grad()
def activation_patching(model, prompts: PromptSet, components: Sequence[Component],
                        positions: Mapping[str, Sequence[int]] | None = None, batch_size: int = 16,
                        max_rows: int = 1024, progress: bool = True, cache: RunCache | None = None) -> pd.DataFrame:
    """Activation patching (Nikankin et al. 2025 Sec. 2; Stolfo et al. 2023): each
    component's output at each named position is set to its value on the prompt's
    counterfactual; the indirect effect (:func:`arithlib.metrics.indirect_effect`) and
    the answer-logit change are recorded. ``positions`` maps a name to each prompt's
    absolute position (default: ``{"last": T-1}``; see :func:`locate_operands`).
    Fast path: prompts are grouped by length and positions, each position's patches
    recompute only the positions from it on. Returns one row per prompt, position and
    component: ``prompt``, ``op``, ``position``, ``component``, ``kind``, ``layer``,
    ``head``, ``ie``, ``logit_diff_change``, ``answer_logit_change``."""
    from .metrics import indirect_effect

    if not prompts.has_counterfactuals:
        raise ValueError("activation patching needs a counterfactual for every prompt")
    device = input_device(model)
    unembed = Unembed(model)
    if positions is None:
        positions = {"last": [len(ids) - 1 for ids in prompts.input_ids]}
    names = list(positions)
    cf_ids_all = counterfactual_answer_ids(prompts)
    hook_names = sorted({c.hook_name for c in components})
    keys: dict[tuple, list[int]] = {}
    for i, ids in enumerate(prompts.input_ids):
        keys.setdefault((len(ids),) + tuple(positions[n][i] for n in names), []).append(i)
    rows = []
    groups = [(k, idx[s:s + batch_size]) for k, idx in keys.items() for s in range(0, len(idx), batch_size)]
    for key, idx in tqdm(groups, desc="activation patching", disable=not progress, leave=False):
        sub = prompts.subset(idx)
        batch = next(sub.batches(len(idx), device))
        by_prefix = prefix_groups(sub, batch.index)
        run = (cache.get(model, batch.tokens, by_prefix) if cache is not None
               else grouped_clean_run(model, batch.tokens, by_prefix))
        src = grouped_clean_run(model, batch.cf_tokens, by_prefix, hook_names).captured
        ans = batch.answer_ids.to(unembed.device)
        cf_ans = cf_ids_all[idx].to(unembed.device)
        clean_logits = unembed.logits(run.final)
        variants, labels = [], []
        for n, pos in zip(names, key[1:]):
            for c in components:
                act = src[c.hook_name][:, pos]
                if c.index is not None:
                    act = act[:, c.index]
                variants.append([Edit(c, pos, act)])
                labels.append((n, c))
        h = run_variants(model, run, variants, max_rows=max_rows)     # [V, B, d]
        step = max(1, 256 // len(idx))
        ie_parts, a_parts, c_parts = [], [], []
        for s in range(0, len(variants), step):
            logits = unembed.logits(h[s:s + step])                      # [v, B, vocab]
            ie_parts.append(indirect_effect(clean_logits, logits, ans, cf_ans))
            a_parts.append(logits.gather(-1, ans.expand(logits.shape[0], -1)[..., None]).squeeze(-1))
            c_parts.append(logits.gather(-1, cf_ans.expand(logits.shape[0], -1)[..., None]).squeeze(-1))
        ie, a_p, c_p = torch.cat(ie_parts), torch.cat(a_parts), torch.cat(c_parts)
        a_c = clean_logits.gather(1, ans[:, None]).squeeze(1)
        c_c = clean_logits.gather(1, cf_ans[:, None]).squeeze(1)
        ld_change = (a_p - c_p) - (a_c - c_c)
        for j, (n, c) in enumerate(labels):
            for row, i in enumerate(idx):
                rows.append((i, prompts.records[i].op, n, c.label, c.kind, c.layer,
                             c.index if c.index is not None else -1, float(ie[j, row]),
                             float(ld_change[j, row]), float(a_p[j, row] - a_c[row])))
    return pd.DataFrame(rows, columns=["prompt", "op", "position", "component", "kind", "layer", "head", "ie",
                                       "logit_diff_change", "answer_logit_change"])


@torch.no_grad()
def circuit_faithfulness(model, prompts: PromptSet, circuits: Mapping[str, Iterable[tuple[Component, str]]],
                         positions: Mapping[str, Sequence[int]], means: Mapping[str, Mapping[int, torch.Tensor]],
                         components: Sequence[Component] | None = None, batch_size: int = 16,
                         max_rows: int = 1024, progress: bool = True, cache: RunCache | None = None) -> pd.DataFrame:
    """Nikankin et al. 2025 faithfulness: for each named circuit (a set of
    ``(component, position name)`` pairs), mean-ablate every component of
    ``components`` (default: all heads and MLPs) at every named position that is not
    in the circuit, and record the normalized logit. Positions outside ``positions``
    (e.g. a few-shot prefix) stay clean. ``means`` is ``{hook: {length: [T, ...]}}``
    (:func:`arithlib.ablation.mean_activations`). Also scores the full model
    (``"full"``) and the fully ablated one (``"ablated"``). Returns one row per circuit:
    ``circuit``, ``size``, ``normalized_logit``, ``accuracy``, ``faithfulness``."""
    from .metrics import faithfulness

    components = list(components) if components is not None else heads_and_mlps(model)
    names = list(positions)
    keep_sets = {"full": None, "ablated": set()}
    keep_sets.update({k: set(v) for k, v in circuits.items()})

    def variants_for(batch, run):
        T = batch.tokens.shape[1]
        i0 = int(batch.index[0])
        pos = {n: positions[n][i0] for n in names}
        for n in names:
            if any(positions[n][int(i)] != pos[n] for i in batch.index):
                raise ValueError("prompts of one length must share the named positions; "
                                 "group them with locate_operands first")
        out = []
        for keep in keep_sets.values():
            if keep is None:
                out.append([])
                continue
            edits = []
            for c in components:
                for n in names:
                    if (c, n) in keep:
                        continue
                    mean = means[c.hook_name][T][pos[n]]
                    if c.index is not None:
                        mean = mean[c.index]
                    edits.append(Edit(c, pos[n], mean))
            out.append(edits)
        return out

    ro = run_interventions(model, prompts, variants_for, batch_size, max_rows, progress=progress, desc="faithfulness",
                           cache=cache)
    nl = ro.normalized_logit.mean(-1)
    full, abl = float(nl[0]), float(nl[1])
    rows = []
    for j, (name, keep) in enumerate(keep_sets.items()):
        rows.append({"circuit": name, "size": -1 if keep is None else len(keep),
                     "normalized_logit": float(nl[j]), "accuracy": float(ro.accuracy[j]),
                     "faithfulness": faithfulness(float(nl[j]), full, abl)})
    return pd.DataFrame(rows)


@torch.no_grad()
def full_circuit_faithfulness(model, prompts: PromptSet,
                              circuits: Mapping[str, tuple[Iterable[tuple[Component, str]], Iterable[tuple[int, int]]]],
                              positions: Mapping[str, Sequence[int]], means: Mapping[str, Mapping[int, torch.Tensor]],
                              neuron_layers: Sequence[int], last: str = "=", batch_size: int = 16,
                              max_rows: int = 1024, progress: bool = True, cache: RunCache | None = None
                              ) -> pd.DataFrame:
    """Nikankin et al. 2025 faithfulness of a whole circuit (heads and MLP neurons), per
    prompt. A circuit is ``(heads, neurons)``: ``(head component, position name)`` pairs
    and ``(layer, neuron)`` pairs of the ``neuron_layers`` MLPs at the ``last`` position.
    Every component outside it is mean-ablated at every named position: every head not in
    ``heads``; at ``last`` every neuron of a ``neuron_layers`` MLP not in ``neurons`` (the
    MLP's neurons, hook ``mlp.hook_post``); the other MLPs (earlier layers, and every MLP at
    the operand and operator positions) stay whole, as in Nikankin's circuit, whose MLPs at
    those positions are kept. ``"ablated"`` mean-ablates every head and MLP at every named
    position, ``"full"`` nothing; both are added. Positions outside ``positions`` (the
    few-shot prefix) stay clean. ``means`` (:func:`arithlib.ablation.mean_activations`)
    needs every head hook ``attn.hook_z``, ``hook_mlp_out`` and the ``neuron_layers``'
    ``mlp.hook_post``. Returns one row per circuit and prompt: ``circuit``, ``prompt``,
    ``op``, ``normalized_logit`` (answer logit / max logit, Nikankin's y), ``correct``;
    :func:`faithfulness_from_prompts` turns it into F = (y_circuit - y_ablated) /
    (y_full - y_ablated) (means over prompts first, Eq. 2 as in
    :func:`arithlib.metrics.faithfulness`)."""
    if last not in positions:
        raise ValueError(f"positions need the neuron position {last!r} (got {sorted(positions)})")
    cfg = model.cfg
    names = list(positions)
    nl = sorted(set(int(x) for x in neuron_layers))
    heads = head_components(cfg.n_layers, cfg.n_heads)
    specs: dict[str, tuple[set, dict[int, set[int]]] | None] = {"full": None, "ablated": None}
    for name, (hs, ns) in circuits.items():
        if name in specs:
            raise ValueError(f"circuit name {name!r} is reserved")
        keep_n: dict[int, set[int]] = {l: set() for l in nl}
        for l, k in ns:
            if int(l) not in keep_n:
                raise ValueError(f"neuron ({l}, {k}) is not in a neuron layer {nl}")
            keep_n[int(l)].add(int(k))
        specs[name] = (set(hs), keep_n)

    built: dict[tuple, list] = {}  # the edits depend only on the length and the positions

    def variants_for(batch, run):
        T = batch.tokens.shape[1]
        i0 = int(batch.index[0])
        pos = {n: positions[n][i0] for n in names}
        if any(positions[n][int(i)] != pos[n] for n in names for i in batch.index):
            raise ValueError("prompts of one length must share the named positions; group them with locate_operands")
        key = (T, *pos.values())
        if key not in built:
            built[key] = build(T, pos)
        return built[key]

    def build(T: int, pos: dict[str, int]) -> list:
        def mean(c: Component, n: str) -> torch.Tensor:
            m = means[c.hook_name][T][pos[n]]
            return m[c.index] if c.index is not None else m

        out = []
        for name, spec in specs.items():
            if name == "full":
                out.append([])
                continue
            if spec is None:  # ablated: every head and MLP at every named position
                out.append([Edit(c, pos[n], mean(c, n)) for n in names
                            for c in heads + mlp_components(cfg.n_layers)])
                continue
            keep_h, keep_n = spec
            edits = [Edit(c, pos[n], mean(c, n)) for n in names for c in heads if (c, n) not in keep_h]
            for l in nl:
                m = means[_HOOKS["neuron"].format(layer=l)][T][pos[last]]
                edits += [Edit(Component("neuron", l, k), pos[last], m[k])
                          for k in range(m.shape[0]) if k not in keep_n[l]]
            out.append(edits)
        return out

    ro = run_interventions(model, prompts, variants_for, batch_size, max_rows, progress=progress,
                           desc="circuit faithfulness", cache=cache)
    y, ok = ro.normalized_logit, ro.correct
    ops = [r.op for r in prompts.records]
    rows = [{"circuit": name, "prompt": i, "op": ops[i], "normalized_logit": float(y[j, i]), "correct": bool(ok[j, i])}
            for j, name in enumerate(specs) for i in range(len(prompts))]
    return pd.DataFrame(rows)


def faithfulness_from_prompts(frame: pd.DataFrame, circuit: str) -> float:
    """Nikankin's F of ``circuit`` from :func:`full_circuit_faithfulness`'s rows:
    (mean y_circuit - mean y_ablated) / (mean y_full - mean y_ablated) over the prompts
    (:func:`arithlib.metrics.faithfulness`)."""
    from .metrics import faithfulness

    y = {c: frame.loc[frame.circuit == c, "normalized_logit"].to_numpy() for c in (circuit, "full", "ablated")}
    return faithfulness(torch.tensor(y[circuit]), torch.tensor(y["full"]), torch.tensor(y["ablated"]))


def faithfulness_by_operator(y_circuit: np.ndarray, y_full: np.ndarray, y_ablated: np.ndarray,
                             op: np.ndarray) -> float:
    """Mean over operators (integer codes ``op``, one per prompt) of Nikankin's F =
    (mean y_circuit - mean y_ablated) / (mean y_full - mean y_ablated), the means over that
    operator's prompts (Eq. 2, as :func:`arithlib.metrics.faithfulness`); an operator whose
    full and ablated means coincide has no F and is left out (NaN if none has one). Written
    for :func:`arithlib.stats.bootstrap_ci` (resampled prompts, stratified by ``op``)."""
    op = np.asarray(op, dtype=int)
    n = np.bincount(op)
    keep = n > 0
    m = [np.bincount(op, weights=np.asarray(y, dtype=float))[keep] / n[keep] for y in (y_circuit, y_full, y_ablated)]
    den = m[1] - m[2]
    ok = np.abs(den) > 1e-12
    return float(np.mean((m[0][ok] - m[2][ok]) / den[ok])) if ok.any() else float("nan")


def topk_recall(screen: Sequence[float] | np.ndarray, exact: Sequence[float] | np.ndarray, k: int) -> float:
    """Recall of a screen: the share of the ``k`` items of largest ``exact`` score that are
    also among the ``k`` items of largest ``screen`` score (same items, same order in both
    arrays). Ties are broken by position (stable sort), so the result is deterministic."""
    s, e = np.asarray(screen, dtype=float), np.asarray(exact, dtype=float)
    if s.shape != e.shape:
        raise ValueError(f"screen and exact scores differ in shape: {s.shape} vs {e.shape}")
    k = min(int(k), len(s))
    if k <= 0:
        return float("nan")
    top = lambda x: set(np.argsort(-x, kind="stable")[:k].tolist())  # noqa: E731
    return len(top(s) & top(e)) / k


def coarse_to_fine_patching(model, prompts: PromptSet, positions: Mapping[str, Sequence[int]], refine: int,
                            batch_size: int = 16, max_rows: int = 1024, cache: RunCache | None = None) -> pd.DataFrame:
    """Nikankin et al. 2025 Sec. 2's activation patching within a CPU budget, coarse to
    fine: every MLP and every whole attention layer at each named position, every single
    head at the last position ``"="``, then the heads of the ``refine`` attention layers of
    largest median indirect effect at the other positions. Returns the
    :func:`activation_patching` rows of all three passes."""
    if "=" not in positions:
        raise ValueError(f"positions need the last position '=' (got {sorted(positions)})")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    blocks = [Component("attn", l) for l in range(n_layers)] + [Component("mlp", l) for l in range(n_layers)]
    heads = head_components(n_layers, n_heads)
    ie_blocks = activation_patching(model, prompts, blocks, positions, batch_size=batch_size, max_rows=max_rows,
                                    cache=cache)
    ie_heads = activation_patching(model, prompts, heads, {"=": positions["="]}, batch_size=batch_size,
                                   max_rows=max_rows, cache=cache)
    median = ie_blocks.groupby(["position", "component", "kind", "layer"])["ie"].median().reset_index()
    candidates = (median[(median.kind == "attn") & (median.position != "=")]
                  .sort_values("ie", ascending=False).head(refine))
    refined = [ie_heads]
    for name, g in candidates.groupby("position"):
        layers = set(g.layer)
        comps = [c for c in heads if c.layer in layers]
        refined.append(activation_patching(model, prompts, comps, {name: positions[name]}, batch_size=batch_size,
                                           max_rows=max_rows, progress=False, cache=cache))
    return pd.concat([ie_blocks] + refined, ignore_index=True)


def summarise_indirect_effects(ie: pd.DataFrame) -> pd.DataFrame:
    """Per position and component: the **median** indirect effect over prompts (``ie``;
    the effect is heavy-tailed, one confidently answered prompt can dominate a mean),
    the mean (``ie_mean``), the mean logit-difference and answer-logit changes and ``n``."""
    return (ie.groupby(["position", "component", "kind", "layer", "head"])
            .agg(ie=("ie", "median"), ie_mean=("ie", "mean"), logit_diff_change=("logit_diff_change", "mean"),
                 answer_logit_change=("answer_logit_change", "mean"), n=("ie", "size")).reset_index())


def ranked_head_positions(summary: pd.DataFrame) -> list[tuple[Component, str]]:
    """(head, position name) pairs of :func:`summarise_indirect_effects` rows, largest
    median indirect effect first."""
    rows = summary[summary.kind == "head"].sort_values("ie", ascending=False)
    return [(Component("head", int(r.layer), int(r.head)), r.position) for r in rows.itertuples()]


def head_count_circuits(ranked: Sequence[tuple[Component, str]], n_layers: int, position_names: Iterable[str],
                        ks: Iterable[int]) -> dict[str, set[tuple[Component, str]]]:
    """Circuits for :func:`circuit_faithfulness`: every MLP at every named position plus
    the top ``k`` of ``ranked`` heads, named ``"k={k}"`` (each ``k`` no larger than
    ``ranked``)."""
    names = list(position_names)
    mlps = {(Component("mlp", l), n) for l in range(n_layers) for n in names}
    return {f"k={k}": mlps | set(ranked[:k]) for k in ks if k <= len(ranked)}


def circuit_head_counts(faith: pd.DataFrame) -> pd.Series:
    """The k of each :func:`head_count_circuits` row of :func:`circuit_faithfulness`'s
    frame (NaN for "full", "ablated" and other circuits)."""
    return faith["circuit"].str.extract(r"k=(\d+)")[0].astype(float)


def heads_needed(faith: pd.DataFrame, target: float) -> int | None:
    """The smallest k of :func:`head_count_circuits` whose faithfulness reaches
    ``target`` in :func:`circuit_faithfulness`'s rows, or None."""
    k = circuit_head_counts(faith)
    reach = k[(faith["faithfulness"] >= target) & k.notna()]
    return int(reach.min()) if len(reach) else None


def _top_pairs(ie: pd.DataFrame, k: int) -> list[tuple[str, str]]:
    """The ``k`` (component label, position) head pairs of largest median indirect effect
    over the rows' prompts (ties: the stable order of layer, head, position)."""
    heads = ie[ie.kind == "head"]
    med = (heads.groupby(["layer", "head", "position", "component"])["ie"].median().reset_index()
           .sort_values("ie", ascending=False, kind="stable"))
    return list(zip(med.component, med.position))[:k]


def screen_recall(screen: pd.DataFrame, exact: pd.DataFrame, ks: Iterable[int]) -> pd.DataFrame:
    """Recall of a patching screen (:func:`coarse_to_fine_patching`) against the exact
    per-head per-position activation patching (:func:`activation_patching` of every head
    at every position), both as rows of :func:`activation_patching` on the same prompts:
    for each k, the share of the exact top-k (head, position) pairs (median indirect
    effect) that are in the screen's top k (pairs the screen did not patch cannot be in it).
    Columns: k, recall, n_prompts."""
    n = exact["prompt"].nunique()
    rows, seen = [], set()
    for k in ks:
        top_e = _top_pairs(exact, int(k))
        if not top_e or len(top_e) in seen:  # k beyond the number of pairs: counted once
            continue
        seen.add(len(top_e))
        top_s = set(_top_pairs(screen, len(top_e)))
        rows.append({"k": len(top_e), "recall": sum(p in top_s for p in top_e) / len(top_e), "n_prompts": n})
    return pd.DataFrame(rows, columns=["k", "recall", "n_prompts"])


def split_half_agreement(ie: pd.DataFrame, k: int, n_splits: int = 20, seed: int = 0) -> pd.DataFrame:
    """Stability of the top-k (head, position) set of activation patching under the choice of
    prompts: the prompts are split at random into two halves (within each operator), each
    half ranks the heads by median indirect effect, and the agreement of the two top-k
    sets is their Jaccard index |A & B| / |A | B| (1: the same heads). Columns: split, k,
    jaccard, n_prompts."""
    rng = np.random.default_rng(seed)
    by_op = {op: sorted(g["prompt"].unique()) for op, g in ie.groupby("op")}
    rows = []
    for s in range(n_splits):
        half_a = []
        for prompts in by_op.values():
            perm = rng.permutation(prompts)
            half_a += perm[: len(perm) // 2].tolist()
        in_a = ie["prompt"].isin(half_a)
        a, b = set(_top_pairs(ie[in_a], k)), set(_top_pairs(ie[~in_a], k))
        union = a | b
        rows.append({"split": s, "k": k, "jaccard": len(a & b) / len(union) if union else float("nan"),
                     "n_prompts": ie["prompt"].nunique()})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- locating tokens


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
        lit = template[last:m.start()]
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


def named_positions(located: Sequence[Mapping[str, list[int]]], names: Mapping[str, str] | None = None) -> dict[str, list[int]]:
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


def attention_by_class(attention: Mapping[int, torch.Tensor], located: Sequence[Mapping[str, list[int]]],
                       prompts: PromptSet, heads: Sequence[Head] | None = None) -> pd.DataFrame:
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
    rows = [{"op": k[0], "layer": k[1], "head": k[2], **dict(zip(classes, (v / cnt[k]).tolist())), "n": cnt[k]}
            for k, v in acc.items()]
    return pd.DataFrame(rows)


def classify_heads(attn: pd.DataFrame) -> pd.DataFrame:
    """Zhang's head types from :func:`attention_by_class` rows (averaged over operators):
    the token class with the highest mean attention among operands (A + B), operator and
    everything else (rest of query + prefix) names the head: "operand", "operator" or
    "other"; ``task_type`` compares only operands vs operator."""
    g = attn.groupby(["layer", "head"])[["A", "B", "operator", "other", "prefix"]].mean().reset_index()
    g["operands"] = g["A"] + g["B"]
    g["rest"] = g["other"] + g["prefix"]
    g["type"] = np.select([(g.operands >= g.operator) & (g.operands >= g.rest), g.operator >= g.rest],
                          ["operand", "operator"], "other")
    g["task_type"] = np.where(g.operands >= g.operator, "operand", "operator")
    return g


# --------------------------------------------------------------------------- prompt selection


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
