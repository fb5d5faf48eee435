"""Pruning FFN neurons out of a model (Yu & Ananiadou 2024, Sec. 6.1): the MLP layout of
each architecture, a smaller HF model that keeps the chosen neurons of each pruned layer
and shares every other tensor, the same pruning as a mask on the full-size weights, and
its cost (parameter counts, forward time)."""

from __future__ import annotations

import copy
import hashlib
import itertools
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.prompt_sets import PromptSet
from ..engine import decoder_layers, forward, hf_module, input_device, shared_hf_model
from ..methods import model_weights as MW

Keep = Mapping[int, Sequence[int] | torch.Tensor]  # pruned layer -> indices of the neurons kept

# --------------------------------------------------------------------------- MLP layouts


@dataclass(frozen=True)
class FFNLayout:
    """Where an architecture keeps an MLP's neurons: ``inputs`` are the projections whose
    output units are the neurons (gate/up, fc_in), ``output`` the one whose input
    units are (down, fc_out); paths relative to the block."""

    inputs: tuple[str, ...]
    output: str


FFN_LAYOUTS: dict[str, FFNLayout] = {
    **{
        arch: FFNLayout(("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")
        for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite")
    },
    "gptj": FFNLayout(("mlp.fc_in",), "mlp.fc_out"),
    "gpt_neox": FFNLayout(("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h"),
    "gpt2": FFNLayout(("mlp.c_fc",), "mlp.c_proj"),
}


def ffn_layout(model) -> FFNLayout:
    """The :class:`FFNLayout` of an HF model (or a bridge's)."""
    arch = str(hf_module(model).config.model_type)
    if arch not in FFN_LAYOUTS:
        raise NotImplementedError(f"no FFN layout known for {arch!r} (known: {sorted(FFN_LAYOUTS)})")
    return FFN_LAYOUTS[arch]


def _neuron_dim(module: torch.nn.Module, role: str) -> int:
    """The weight dimension indexed by neurons: nn.Linear stores [out, in], GPT-2's
    Conv1D [in, out]."""
    conv1d = type(module).__name__ == "Conv1D"
    if role == "input":
        return 1 if conv1d else 0
    return 0 if conv1d else 1


def ffn_width(model, layer: int) -> int:
    """Number of FFN neurons of block ``layer`` (read from its weights)."""
    hf = shared_hf_model(model)
    lay = ffn_layout(hf)
    mod = MW.submodule(decoder_layers(hf)[layer], lay.output)
    return int(mod.weight.shape[_neuron_dim(mod, "output")])


def ffn_widths(model) -> list[int]:
    """FFN neurons per block."""
    hf = shared_hf_model(model)
    return [ffn_width(hf, l) for l in range(len(decoder_layers(hf)))]


def _as_index(idx, width: int) -> torch.Tensor:
    t = torch.as_tensor(list(idx) if not isinstance(idx, torch.Tensor) else idx, dtype=torch.long).flatten()
    t = torch.unique(t)  # sorted, no repeats
    if t.numel() and (t.min() < 0 or t.max() >= width):
        raise IndexError(f"neuron index out of range 0..{width - 1}")
    return t


def keep_digest(keep: Keep) -> str:
    """A short hash of a keep set (layer -> kept neuron indices)."""
    h = hashlib.sha256()
    for layer in sorted(keep):
        h.update(f"{int(layer)}:".encode())
        h.update(
            np.asarray(
                sorted(int(i) for i in torch.as_tensor(keep[layer]).flatten().tolist()), dtype=np.int64
            ).tobytes()
        )
    return h.hexdigest()[:16]


def _sliced(module: torch.nn.Module, idx: torch.Tensor, role: str) -> torch.nn.Module:
    """Projection ``module`` (nn.Linear, or GPT-2's Conv1D) keeping neurons ``idx``, as a
    new nn.Linear (a Conv1D becomes the equivalent nn.Linear, which, unlike Conv1D,
    also runs with no neurons at all)."""
    dim = _neuron_dim(module, role)
    w = module.weight.detach().index_select(dim, idx.to(module.weight.device))
    if type(module).__name__ == "Conv1D":
        w = w.T
    bias = getattr(module, "bias", None)
    if bias is not None and role == "input":
        bias = bias.detach().index_select(0, idx.to(bias.device))
    with warnings.catch_warnings():  # "initializing zero-element tensors is a no-op" (a layer with none kept)
        warnings.simplefilter("ignore", UserWarning)
        new = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    new.weight = torch.nn.Parameter(w.contiguous().clone(), requires_grad=False)
    if bias is not None:
        new.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return new


def prune_ffn(model, keep: Keep, share_weights: bool = True) -> torch.nn.Module:
    """Yu Sec. 6.1's pruned model: a plain HF model in which every layer named in ``keep``
    has only the FFN neurons ``keep[layer]`` (possibly none); the neurons' weights are
    removed, not zeroed (smaller gate/up/down or fc_in/fc_out matrices). Layers not in
    ``keep`` are untouched.

    ``share_weights`` (default): every unchanged tensor is the original's (the module
    tree is copied, the parameters are not), so a pruned copy of a 0.5B model costs
    only its new MLP matrices; ``lora.train_lora`` leaves base weights untouched,
    and the shared tensors keep their ``requires_grad`` (the copy's own are frozen).
    ``False``: a fully independent copy. The config records the widths and a digest
    of the keep set (``config.arithlib_pruned_ffn``), so ``finetune``'s cache keys
    tell pruned models apart."""
    hf = shared_hf_model(model)
    lay = ffn_layout(hf)
    n_layers = len(decoder_layers(hf))
    bad = [l for l in keep if not 0 <= int(l) < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range 0..{n_layers - 1}")
    memo = {}
    if share_weights:
        memo = {id(t): t for t in itertools.chain(hf.parameters(), hf.buffers())}
    pruned = copy.deepcopy(hf, memo)
    blocks = decoder_layers(pruned)
    widths = {}
    for layer, idx in keep.items():
        block = blocks[int(layer)]
        width = ffn_width(hf, int(layer))
        index = _as_index(idx, width)
        for path, role in [*[(p, "input") for p in lay.inputs], (lay.output, "output")]:
            parent_path, _, leaf = path.rpartition(".")
            parent = MW.submodule(block, parent_path) if parent_path else block
            setattr(parent, leaf, _sliced(getattr(parent, leaf), index, role))
        widths[int(layer)] = int(index.numel())
    pruned.config.arithlib_pruned_ffn = {
        "widths": {str(l): w for l, w in sorted(widths.items())},
        "keep_digest": keep_digest(keep),
    }
    for p in pruned.parameters():
        if id(p) not in memo:  # a shared tensor is the original's: its flag is the original model's to keep
            p.requires_grad_(False)
    pruned.eval()
    return pruned


def mask_weights(model, keep: Keep) -> dict[str, torch.Tensor]:
    """The masking form of :func:`prune_ffn`: for each layer in ``keep``, the output
    projection's weight (clean HF name) with the columns of every neuron NOT kept set
    to zero; pass to ``model_weights.use_weights``. The model keeps its size; each removed
    neuron still computes its coefficient but writes nothing."""
    hf = shared_hf_model(model)
    lay = ffn_layout(hf)
    out = {}
    for layer, idx in keep.items():
        prefix = MW.layer_prefix(hf, int(layer))
        mod = MW.submodule(decoder_layers(hf)[int(layer)], lay.output)
        dim = _neuron_dim(mod, "output")
        width = mod.weight.shape[dim]
        drop = torch.ones(width, dtype=torch.bool)
        drop[_as_index(idx, width)] = False
        w = mod.weight.detach().clone()
        shape = [1, 1]
        shape[dim] = width
        w.masked_fill_(drop.view(shape).to(w.device), 0.0)
        out[f"{prefix}{lay.output}.weight"] = w.cpu()
    return out


def keep_pairs(keep: Keep) -> list[tuple[int, int]]:
    """(layer, neuron) pairs of a keep set (for ``ablation.keep_neurons_hooks``)."""
    return [(int(l), int(i)) for l, idx in sorted(keep.items()) for i in torch.as_tensor(idx).flatten().tolist()]


# --------------------------------------------------------------------------- cost


def parameter_counts(model, layers: Sequence[int]) -> dict[str, int]:
    """``n_params`` (distinct entries, tied counted once), ``n_ffn_params`` (all MLP
    weights and biases) and ``n_deep_ffn_params`` (those of ``layers``), and
    ``n_deep_neurons`` (FFN width summed over ``layers``)."""
    hf = shared_hf_model(model)
    blocks = decoder_layers(hf)
    lay = ffn_layout(hf)

    def mlp_params(block) -> int:
        return sum(
            MW.submodule(block, p).weight.numel()
            + (MW.submodule(block, p).bias.numel() if getattr(MW.submodule(block, p), "bias", None) is not None else 0)
            for p in (*lay.inputs, lay.output)
        )

    return {
        "n_params": MW.count_parameters(hf),
        "n_ffn_params": sum(mlp_params(b) for b in blocks),
        "n_deep_ffn_params": sum(mlp_params(blocks[l]) for l in layers),
        "n_deep_neurons": sum(ffn_width(hf, l) for l in layers),
    }


def timing_tokens(prompts: PromptSet, n: int = 8) -> torch.Tensor:
    """A [B, T] block of prompt tokens for timing: up to ``n`` prompts of the most common
    length (no padding)."""
    groups = prompts.length_groups()
    if not groups:
        raise ValueError("no prompts to time")
    length = max(groups, key=lambda k: (len(groups[k]), k))
    idx = groups[length][:n]
    return torch.tensor([prompts.input_ids[i] for i in idx], dtype=torch.long)


@torch.no_grad()
def forward_seconds(model, tokens: torch.Tensor, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Wall time of one forward pass over ``tokens`` [B, T] (no KV cache, logits of the
    last position only, as in generation's prefill): median and minimum of ``repeats``
    passes after ``warmup`` untimed ones, in seconds. Comparisons use the minimum
    (``timeit``'s advice): other work on the machine (run_all.sh runs two notebooks at
    a time) can only slow a pass down."""
    hf = shared_hf_model(model)
    dev = input_device(hf)
    tokens = tokens.to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        forward(hf, tokens, keep=1)
    times = []
    for _ in range(max(1, repeats)):
        sync()
        t0 = time.perf_counter()
        forward(hf, tokens, keep=1)
        sync()
        times.append(time.perf_counter() - t0)
    return {
        "forward_s": statistics.median(times),
        "forward_min_s": min(times),
        "timing_repeats": len(times),
        "timing_tokens": int(tokens.numel()),
    }
