"""Weight variants of one model, each differing from it in the linear layers of one
decoder block, run together from a recorded clean run (Yu & Ananiadou's LoRA models, one
per attention layer, Sec. 5).

A variant that changes block L computes, below L, exactly what the original does: its
rows join the pass at block L from the clean run's recorded stream (:func:`run_blocks`'s
``join``), and from there on every present variant's rows share each block's products
(one product many variants tall instead of one per variant). In its own block a
variant's rows are computed with its own weights: a forward hook on each changed linear
layer recomputes the variant's rows of the layer's output from their inputs with the
variant's weight (and bias), the product a pass of the variant alone makes there.

Positions: every position changes from block L on, so a variant's keys and values are its
own there. The batch's shared few-shot prefix runs once per variant (one row each, all
variants stacked: :func:`variant_prefix_cache`), and the rest of every prompt on top of
its variant's prefix keys and values. Tested equal, up to float rounding, to one full
pass per variant with its weights swapped in (``tests/equivalence/test_engine_variants.py``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from ..core.components import Hook
from .adapter import (
    cache_layers,
    cache_with_room,
    clean_param_name,
    decoder_layers,
    hf_module,
    layer_device,
    module_device,
    send,
)
from .passes import decoder_norm, empty_cache, resumable, run_blocks
from .prefix import MIN_SHARED_PREFIX, common_prefix
from .recorded import CleanRun

#: A variant: the block it changes and its new weights (clean HF parameter names of
#: linear layers in that block: ``model.layers.L.self_attn.q_proj.weight``, biases too).
WeightVariant = tuple[int, Mapping[str, torch.Tensor]]


def _linear_modules(hf) -> dict[str, torch.nn.Linear]:
    """Every linear layer of ``hf`` by the clean name of its weight."""
    return {
        clean_param_name(f"{name}.weight"): mod for name, mod in hf.named_modules() if isinstance(mod, torch.nn.Linear)
    }


def check_variants(model, variants: Sequence[WeightVariant]) -> None:
    """A ValueError unless every variant's weights are linear layers' weights or biases
    in its own block, with their shapes, and the blocks are non-decreasing."""
    hf = hf_module(model)
    if not resumable(hf):
        raise ValueError("weight variants run from a recorded stream: this model's blocks cannot start late")
    n_layers = len(decoder_layers(hf))
    linears = _linear_modules(hf)
    layers = [int(l) for l, _ in variants]
    if any(a > b for a, b in zip(layers, layers[1:])):
        raise ValueError(f"variants must be ordered by block, got blocks {layers}")
    for layer, weights in variants:
        if not 0 <= layer < n_layers:
            raise ValueError(f"variant block {layer} out of range 0..{n_layers - 1}")
        for name, w in weights.items():
            base = name.removesuffix(".bias") + ".weight" if name.endswith(".bias") else name
            mod = linears.get(base)
            if mod is None or not base.startswith(f"model.layers.{layer}."):
                raise ValueError(f"{name}: not a linear layer's weight in block {layer}")
            ref = mod.weight if name == base else mod.bias
            if ref is None or tuple(w.shape) != tuple(ref.shape):
                raise ValueError(f"{name}: shape {tuple(w.shape)} does not match the model's")


@contextmanager
def _own_weights(hf, variants: Sequence[WeightVariant], rows_per: int) -> Iterator[None]:
    """Forward hooks on the changed linear layers: variant ``j``'s rows
    (``j * rows_per .. (j + 1) * rows_per - 1`` of the pass) of each output recomputed with
    its weights. A block's hook only sees the variants present there, which lead the pass."""
    linears = _linear_modules(hf)
    by_module: dict[str, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = {}
    for j, (_, weights) in enumerate(variants):
        for base in sorted({n.removesuffix(".bias") + ".weight" if n.endswith(".bias") else n for n in weights}):
            mod = linears[base]
            w = weights.get(base, mod.weight)
            b = weights.get(base.removesuffix(".weight") + ".bias", mod.bias)
            dev = mod.weight.device
            by_module.setdefault(base, []).append(
                (j, w.to(dev, mod.weight.dtype), None if b is None else b.to(dev, mod.weight.dtype))
            )

    def hook_for(entries):
        def hook(mod, args, out):
            x = args[0]
            for j, w, b in entries:
                lo, hi = j * rows_per, (j + 1) * rows_per
                if hi <= x.shape[0]:
                    out[lo:hi] = F.linear(x[lo:hi], w, b)
            return out

        return hook

    handles = [linears[base].register_forward_hook(hook_for(entries)) for base, entries in by_module.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _present(variants: Sequence[WeightVariant], n_layers: int) -> list[int]:
    """Variants in the pass at each block: those whose block is at or below it."""
    layers = [int(l) for l, _ in variants]
    return [bisect_right(layers, l) for l in range(n_layers)]


def variant_prefix_cache(model, run: CleanRun, prefix: int, variants: Sequence[WeightVariant]):
    """Each variant's keys and values of the clean run's first ``prefix`` positions (common
    to every row of ``run``): one row per variant joining at its block from row 0's
    recorded stream; layer ``l`` of the cache holds the variants present there, in order."""
    hf = hf_module(model)
    present = _present(variants, len(run.keys))
    first = int(variants[0][0])
    cache = empty_cache(model)
    position_ids = torch.arange(prefix, device=run.resid.device).unsqueeze(0)

    def stream(l: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        return run.resid[l][:1, :prefix].to(device).expand(hi - lo, -1, -1)

    def join(l: int, device: torch.device) -> torch.Tensor | None:
        lo = present[l - 1] if l > first else 0
        return stream(l, lo, present[l], device) if present[l] > lo and l > first else None

    with _own_weights(hf, variants, 1):
        hidden = stream(first, 0, present[first], layer_device(hf, first))
        run_blocks(model, hidden.contiguous(), first=first, position_ids=position_ids, cache=cache, join=join)
    return cache


@torch.no_grad()
def variant_passes(
    model, run: CleanRun, variants: Sequence[WeightVariant], hooks: Sequence[Hook] = (), share_prefix: bool = True
) -> torch.Tensor:
    """Logits at the last position, [len(variants) * B, vocab] (variant-major), of every variant run on ``run``'s prompts (a :func:`clean_run` of the
    original model: its recorded stream and tokens). ``hooks`` (bridge hooks) act in the
    pass over the prompts' positions after the shared prefix; at block ``l`` it holds the
    rows of the variants whose block is at or below ``l``, in order (``B`` rows each).
    ``share_prefix``: the prefix common to every row runs once per variant."""
    check_variants(model, variants)
    if run.resid is None:
        raise ValueError("the clean run recorded no residual stream (run it with clean_run on a resumable model)")
    hf = hf_module(model)
    B, T = run.tokens.shape
    n_layers = len(run.keys)
    n = min(common_prefix(run.tokens.tolist()), T - 1) if share_prefix and B > 1 else 0
    if n < MIN_SHARED_PREFIX:
        n = 0
    present = _present(variants, n_layers)
    first = int(variants[0][0])
    if n:
        pre = cache_layers(variant_prefix_cache(model, run, n, variants))
        layers = []
        for l in range(n_layers):
            if present[l] == 0 or pre[l] is None:
                layers.append(None)
                continue
            k, v = pre[l]
            rows = present[l] * B

            def room(x: torch.Tensor) -> torch.Tensor:
                buf = torch.empty(rows, x.shape[1], T, x.shape[3], dtype=x.dtype, device=x.device)
                buf[:, :, :n] = x.repeat_interleave(B, 0)
                return buf

            layers.append((room(k), room(v), n))
        cache = cache_with_room(hf.config, layers)
    else:
        cache = empty_cache(model)

    def stream(l: int, count: int, device: torch.device) -> torch.Tensor:
        x = run.resid[l][:, n:].to(device)
        return x.repeat(count, 1, 1) if count > 1 else x

    def join(l: int, device: torch.device) -> torch.Tensor | None:
        lo = present[l - 1] if l > first else present[l]
        return stream(l, present[l] - lo, device) if present[l] > lo else None

    position_ids = torch.arange(n, T, device=run.resid.device).unsqueeze(0)
    attached = model.hooks(fwd_hooks=list(hooks)) if hooks else nullcontext()
    with _own_weights(hf, variants, B), attached:
        hidden = stream(first, present[first], layer_device(hf, first))
        hidden, _ = run_blocks(model, hidden, first=first, position_ids=position_ids, cache=cache, join=join)
    head = hf.get_output_embeddings()
    return head(send(decoder_norm(model, hidden[:, -1:]), module_device(hf, head)))[:, 0]
