"""Interventions on components, and the fast path that runs many of them at the answer
position: the machinery under the three papers' patching methods, which sit in their own
modules (:mod:`arithlib.zhang.path_patching`, Zhang et al. 2024; :mod:`arithlib.methods.knockouts`,
Zhang's knockouts and Yu & Ananiadou's head sweep; :mod:`arithlib.nikankin.activation_patching`,
Nikankin et al. 2025).

Components are :class:`Component` (head, MLP, attention output, residual stream,
neuron); an intervention is a list of :class:`Edit` (set a component at a position to
a value: a counterfactual activation, a mean, or zero).

Two ways to run an intervention, tested equal (fp32, 1e-4):

* **Full forward** (:func:`run_edits_full`, :func:`activation_patch_full`): one forward
  pass of the whole prompt per patched component, with hooks. This is what
  TransformerLens' ``transformer_lens.patching`` does (one ``run_with_hooks`` per index);
  it is the reference and the benchmark baseline.
* **Fast path** (:func:`arithlib.engine.clean_run` + :func:`run_variants`): an
  intervention at position p leaves positions < p untouched, so the clean run's keys and
  values for those positions are reused and only positions p..T-1 are recomputed, for
  many variants at once (one batch of ``variants x prompts`` rows over an expanded KV
  cache). An intervention in layer L also leaves everything below L untouched, so
  each variant joins its chunk's batch at its lowest edited layer from the clean
  residual stream (Llama/Mistral/Qwen2-style models; others start at layer 0). At the answer
  position a variant costs one token through the layers above the edit. The recorded run
  and the resumed passes are :mod:`arithlib.engine.recorded`'s; this module builds the
  variants' hooks. TransformerLens has no such batched path (its patchers loop over
  components with a full forward each).

Readouts at the answer position go through :class:`Unembed`, whose :meth:`Unembed.top1`
finds the exact argmax and maximum logit without unembedding the whole vocabulary (a
Cauchy-Schwarz bound prunes tokens that cannot win). :func:`run_interventions` runs a list
of variants over a prompt set and reads them out.

The model everywhere is a TransformerLens ``TransformerBridge`` (``arithlib.core.models``).
Prompt sets are :class:`arithlib.core.prompt_sets.PromptSet`; batches are same-length, so the
answer position is the last one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..core.components import Head, Hook
from ..core.models import model_dtype as _dtype
from ..core.prompt_sets import PromptSet
from ..engine import (
    CleanRun,
    RunCache,
    capture_hooks,
    grouped_clean_run,
    input_device,
    last_position_logits,
    layer_device,
    module_device,
    prefix_groups,
    resume,
)
from ..engine import (
    hf_module as _hf,
)

# --------------------------------------------------------------------------- components

_HOOKS = {
    "head": "blocks.{layer}.attn.hook_z",  # [B, T, H, d_head] (input of W_O)
    "mlp": "blocks.{layer}.hook_mlp_out",  # [B, T, d_model]
    "attn": "blocks.{layer}.hook_attn_out",  # [B, T, d_model]
    "resid_pre": "blocks.{layer}.hook_resid_pre",  # [B, T, d_model]
    "resid_mid": "blocks.{layer}.hook_resid_mid",  # [B, T, d_model]
    "neuron": "blocks.{layer}.mlp.hook_post",  # [B, T, d_mlp]
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
        return {"mlp": "MLP", "attn": "ATTN", "resid_pre": "RESID", "resid_mid": "RESIDMID"}[self.kind] + str(
            self.layer
        )

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


# --------------------------------------------------------------------------- positions


def resolve_position(pos: int, T: int) -> int:
    """Position ``pos`` (negative: from the end) in prompts of ``T`` tokens, checked."""
    p = pos + T if pos < 0 else pos
    if not 0 <= p < T:
        raise ValueError(f"position {pos} is outside prompts of {T} tokens")
    return p


# --------------------------------------------------------------------------- hooks


def _is_per_prompt(edit: Edit, B: int, unit: tuple[int, ...]) -> bool:
    """Whether the edit's value has a leading prompt dimension (``[B, *unit]``) rather than
    being shared (``unit``-shaped, or a float); raises ValueError for any other shape."""
    v = edit.value
    if not isinstance(v, torch.Tensor) or tuple(v.shape) == unit:
        return False
    if tuple(v.shape) == (B, *unit):
        return True
    raise ValueError(
        f"value of shape {tuple(v.shape)} for {edit.component.label}: expected {unit} "
        f"(shared) or {(B, *unit)} (per prompt)"
    )


def _stacked_values(values: list, unit: tuple[int, ...], per_prompt: bool, dtype, device) -> torch.Tensor:
    """A group's values as ``[E, B or 1, *unit]`` in ``dtype`` on ``device``: one stack for
    the whole group (a circuit ablates tens of thousands of neurons one edit each, and a
    conversion per edit costs a dispatch each); floats are filled to the unit's shape."""
    vals = [v if isinstance(v, torch.Tensor) else torch.full(unit, float(v), dtype=dtype) for v in values]
    if len({(v.dtype, v.device) for v in vals}) > 1:
        vals = [v.to(device=device, dtype=dtype) for v in vals]
    x = torch.stack(vals).to(device=device, dtype=dtype)
    return x if per_prompt else x.unsqueeze(1)


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
            positions = range(start, length) if e.position is None else [resolve_position(e.position, length)]
            if e.position is None and start != 0:
                raise ValueError("an edit at every position (position=None) needs start=0")
            unit = e.component.unit_shape(cfg)
            layer = e.component.layer
            if layer not in devices:
                devices[layer] = layer_device(model, layer)
            per_prompt = _is_per_prompt(e, batch_size, unit)
            indexed = e.component.index is not None
            key = (e.component.hook_name, indexed, per_prompt)
            g = groups.setdefault(key, {"v": [], "p": [], "u": [], "x": [], "device": devices[layer], "unit": unit})
            for p in positions:
                if p < start:
                    raise ValueError(
                        f"edit of {e.component.label} at position {p} lies before the recomputed "
                        f"positions {start}..{length - 1}"
                    )
                g["v"].append(vi)
                g["p"].append(p - start)
                g["u"].append(e.component.index if indexed else 0)
                g["x"].append(e.value)
    by_hook: dict[str, list] = {}
    for (name, indexed, per_prompt), g in groups.items():
        device = g["device"]
        by_hook.setdefault(name, []).append(
            (
                indexed,
                torch.tensor(g["v"], device=device),
                torch.tensor(g["p"], device=device),
                torch.tensor(g["u"], device=device),
                _stacked_values(g["x"], g["unit"], per_prompt, dtype, device),  # [E, B or 1, *unit]
            )
        )
    n_var = len(variants)

    def make(entries):
        def fn(act, hook):
            shape = act.shape
            if shape[0] % batch_size or not 0 < shape[0] <= n_var * batch_size or shape[1] != t:
                raise RuntimeError(
                    f"{hook.name}: got activation {tuple(shape)}, expected [at most {n_var}x{batch_size}, {t}, ...]"
                )
            a = act.reshape(-1, batch_size, *shape[1:])
            for indexed, v, p, u, x in entries:
                if indexed:
                    a[v, :, p, u] = x.to(a.dtype)
                else:
                    a[v, :, p] = x.to(a.dtype)
            return a.reshape(shape)

        return fn

    return [(name, make(entries)) for name, entries in by_hook.items()]


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
    with model.hooks(fwd_hooks=capture_hooks(store, {n: None for n in hook_names})):
        last_position_logits(model, tokens)
    return store


@torch.no_grad()
def activation_patch_full(
    model,
    tokens: torch.Tensor,
    cf_tokens: torch.Tensor,
    components: Sequence[Component],
    position: int | None = -1,
    progress: bool = False,
) -> torch.Tensor:
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
            edits = [Edit(c, position, act[:, resolve_position(position, T)])]
        out.append(run_edits_full(model, tokens, edits))
    return torch.stack(out)


# --------------------------------------------------------------------------- fast path


def _edit_span(edits: Variant, T: int) -> tuple[int, int]:
    """(first recomputed position, first edited layer) a variant needs."""
    if not edits:
        return T - 1, 10**9
    positions = [0 if e.position is None else resolve_position(e.position, T) for e in edits]
    return min(positions), min(e.component.layer for e in edits)


@torch.no_grad()
def run_variants(
    model,
    run: CleanRun,
    variants: Sequence[Variant],
    max_rows: int = 1024,
    progress: bool = False,
    desc: str = "variants",
) -> torch.Tensor:
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
    chunks = [order[i : i + per_chunk] for i in range(0, len(order), per_chunk)]
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
            h = resume(model, run, start, entry)
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
        # a bias of zeros (TransformerLens adds one where the model has none) is left out:
        # adding it changes no logit, and its broadcast costs a copy of every logit
        self.bias = bias if isinstance(bias, torch.Tensor) and bool(bias.detach().any()) else None
        self._norms: torch.Tensor | None = None

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def norms(self) -> torch.Tensor:
        if self._norms is None:
            self._norms = self.weight.float().norm(dim=-1)
        return self._norms

    def _chunk_logits(self, flat: torch.Tensor, start: int, out: torch.Tensor) -> torch.Tensor:
        """The logits of states ``flat`` [n, d] for tokens ``start..start+out.shape[1]-1``,
        float32, written into ``out`` [n, chunk] (returned)."""
        end = start + out.shape[1]
        torch.matmul(flat, self.weight[start:end].float().T, out=out)
        if self.bias is not None:
            out += self.bias[start:end].float()
        return out

    @torch.no_grad()
    def logits(self, h: torch.Tensor, chunk: int = 32768) -> torch.Tensor:
        """All logits, float32, ``[..., vocab]`` (computed in vocabulary chunks in fp32,
        on the unembedding's device, each written into its slice of the output: no
        concatenation of the chunks)."""
        hf32 = h.to(self.device).float()
        flat = hf32.reshape(-1, hf32.shape[-1])
        out = torch.empty(flat.shape[0], self.vocab, device=flat.device)
        for s in range(0, self.vocab, chunk):
            self._chunk_logits(flat, s, out[:, s : s + chunk])
        return out.reshape(*hf32.shape[:-1], self.vocab)

    @torch.no_grad()
    def argmax(self, h: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax id, max logit) of every state ``h`` ``[..., d]``, exactly as
        ``logits(h).max(-1)`` (the first of tied maxima), without holding every logit: a
        running maximum over vocabulary chunks of ``chunk`` tokens. It saves memory (the
        full logits of a few hundred states are a few hundred MB), not time
        (``benchmarks/readout.py``)."""
        hf32 = h.to(self.device).float()
        flat = hf32.reshape(-1, hf32.shape[-1])
        n = flat.shape[0]
        buf = torch.empty(n, min(chunk, self.vocab), device=flat.device)
        best = torch.full((n,), -math.inf, device=flat.device)
        ids = torch.zeros(n, dtype=torch.long, device=flat.device)
        for s in range(0, self.vocab, chunk):
            m, j = self._chunk_logits(flat, s, buf[:, : min(chunk, self.vocab - s)]).max(-1)
            better = m > best  # strict: an earlier chunk keeps a tie, as argmax over all logits
            best = torch.where(better, m, best)
            ids = torch.where(better, j + s, ids)
        lead = hf32.shape[:-1]
        return ids.reshape(lead), best.reshape(lead)

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
    def top1(
        self,
        h: torch.Tensor,
        h_clean: torch.Tensor,
        clean_logits: torch.Tensor | None = None,
        hint_ids: torch.Tensor | None = None,
        max_candidates: int = 8192,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact (argmax id, max logit) of ``h`` ``[..., B, d]`` given the clean states
        ``h_clean`` ``[B, d]`` and their logits (computed if None).

        For a row with delta = h - h_clean, every token satisfies logit_j(h) <=
        clean_logit_j + ||delta|| * max_j ||w_j||, so only tokens whose clean logit is at
        least ``lb - ||delta|| * max_norm`` can beat ``lb``, the best exactly computed logit
        among the clean argmax and ``hint_ids`` [B]. Those tokens are a prefix of the
        prompt's clean logits sorted in descending order; the rows of one prompt share its
        longest such prefix, whose logits are computed exactly (in token order, so that
        ties go to the first token, as an argmax over every logit). Rows needing more than
        ``max_candidates`` tokens take :meth:`argmax` over the whole vocabulary."""
        h, h_clean = h.to(self.device), h_clean.to(self.device)
        lead = h.shape[:-2]
        B, d = h_clean.shape
        if clean_logits is None:
            clean_logits = self.logits(h_clean)
        clean_logits = clean_logits.to(self.device).float()
        sorted_vals, sorted_idx = clean_logits.sort(-1, descending=True)  # [B, V]
        flat = h.reshape(-1, B, d).float()  # [n, B, d]
        eps = 1e-4 * float(clean_logits.abs().max()) + 1e-4
        cand = torch.stack([sorted_idx[:, 0]] + ([hint_ids.to(h.device)] if hint_ids is not None else []), -1)  # [B, c]
        lb = torch.einsum("nbd,bcd->nbc", flat, self.weight[cand].float())  # [n, B, c]
        if self.bias is not None:
            lb = lb + self.bias[cand].float()
        radius = (flat - h_clean.float()).norm(dim=-1)  # [n, B]
        thr = lb.max(-1).values - radius * float(self.norms.max()) - eps
        # per row, the number of tokens whose clean logit reaches thr: one search per prompt
        asc = sorted_vals.flip(-1).contiguous()
        count = (self.vocab - torch.searchsorted(asc, thr.T.contiguous(), right=False)).T.clamp(min=1)  # [n, B]
        ids = torch.empty(count.shape, dtype=torch.long, device=h.device)
        best = torch.empty(count.shape, dtype=torch.float32, device=h.device)
        big = count > max_candidates
        if big.any():
            ids[big], best[big] = self.argmax(flat[big])
        for p in range(B):
            rows = (~big[:, p]).nonzero()[:, 0]
            if not len(rows):
                continue
            tokens = sorted_idx[p, : int(count[rows, p].max())].sort().values
            lg = flat[rows, p] @ self.weight[tokens].float().T
            if self.bias is not None:
                lg = lg + self.bias[tokens].float()
            m, j = lg.max(-1)
            ids[rows, p], best[rows, p] = tokens[j], m
        return ids.reshape(*lead, B), best.reshape(*lead, B)


# --------------------------------------------------------------------------- interventions over prompt sets


@dataclass
class InterventionReadout:
    """Per variant and prompt: argmax token, maximum logit and answer-token logit at the
    answer position (exact, via :meth:`Unembed.top1`), plus the clean values."""

    pred: torch.Tensor  # [V, N]
    max_logit: torch.Tensor  # [V, N]
    answer_logit: torch.Tensor  # [V, N]
    answer_ids: torch.Tensor  # [N]
    clean_pred: torch.Tensor  # [N]
    clean_max: torch.Tensor  # [N]
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
def run_interventions(
    model,
    prompts: PromptSet,
    variants: Sequence[Variant] | Callable[[object, CleanRun], Sequence[Variant]],
    batch_size: int = 16,
    max_rows: int = 1024,
    full_logits: bool = False,
    progress: bool = True,
    desc: str = "interventions",
    cache: RunCache | None = None,
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
        run = (
            cache.get(model, batch.tokens, groups)
            if cache is not None
            else grouped_clean_run(model, batch.tokens, groups)
        )
        vs = variants(batch, run) if callable(variants) else variants
        V = len(vs)
        if not outs:
            outs = {
                "pred": torch.empty(V, N, dtype=torch.long),
                "max": torch.empty(V, N),
                "ans": torch.empty(V, N),
                "cpred": torch.empty(N, dtype=torch.long),
                "cmax": torch.empty(N),
                "cans": torch.empty(N),
            }
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
    return InterventionReadout(
        outs["pred"],
        outs["max"],
        outs["ans"],
        answer_ids.cpu(),
        outs["cpred"],
        outs["cmax"],
        outs["cans"],
        outs.get("logits"),
    )


def ablation_edits(
    heads: Iterable[Head], value: Mapping[int, torch.Tensor] | float = 0.0, position: int | None = -1
) -> list[Edit]:
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
