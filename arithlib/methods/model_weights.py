"""A model's weights as the fine-tuning methods handle them: parameters by clean HF name,
a set of weights swapped in and restored exactly (:func:`use_weights`), the training
state kept and given back, a trained HF model booted as a bridge, and the names of each
architecture's attention projections and LoRA targets."""

import contextlib
from collections.abc import Iterator, Mapping

import torch

from ..engine import (
    clean_param_name,
    decoder_layers,
    input_device,
)
from ..engine import (
    hf_module as _hf,
)

# --------------------------------------------------------------------------- model plumbing


def params_by_clean_name(model) -> dict[str, torch.nn.Parameter]:
    """``model``'s parameters by clean HF name (no bridge segments)."""
    return {clean_param_name(n): p for n, p in _hf(model).named_parameters()}


@contextlib.contextmanager
def use_weights(model, weights: Mapping[str, torch.Tensor] | None) -> Iterator[None]:
    """Within the block, the parameters named in ``weights`` (clean HF names) hold those
    values (copied in place, so a bridge and a :func:`shared_hf_model` both see them);
    the original values are restored exactly on exit. ``None`` or ``{}``: no change."""
    if not weights:
        yield
        return
    params = params_by_clean_name(model)
    unknown = set(weights) - set(params)
    if unknown:
        raise KeyError(f"unknown parameter(s) {sorted(unknown)[:5]}")
    saved = {}
    try:
        with torch.no_grad():
            for name, value in weights.items():
                p = params[name]
                if p.shape != value.shape:
                    raise ValueError(
                        f"{name}: weight of shape {tuple(value.shape)} for a parameter of {tuple(p.shape)}"
                    )
                saved[name] = p.detach().clone()
                p.copy_(value.to(p.device, p.dtype))
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)


@contextlib.contextmanager
def training_state(model) -> Iterator[None]:
    """Within the block the HF model behind ``model`` may change its parameters'
    ``requires_grad`` and ``.grad`` and its modules' train/eval modes; on exit (an
    exception included) every parameter and module present on entry gets them back.
    Kept per object, not per name: a module added in between (peft's LoRA layers,
    removed again by ``unload``) is not tracked, and the base weights it wrapped are the
    same objects, restored like the rest."""
    hf = _hf(model)
    params = [(p, p.requires_grad, p.grad) for p in hf.parameters()]
    modes = [(m, m.training) for m in hf.modules()]
    try:
        yield
    finally:
        for p, flag, grad in params:
            p.grad = grad
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training


def to_loaded_model(hf_model, tokenizer, name: str = "finetuned", device: str | None = None):
    """Boot a TransformerBridge on a trained HF model (e.g. ``merge_and_unload()``'s
    result) and return it as an :class:`arithlib.core.models.LoadedModel`, the way
    ``models.load_model`` boots a directory (BOS handled like the tokenizer). The
    bridge wraps ``hf_model``'s modules in place: pass a model you hand over (not one
    from :func:`shared_hf_model`)."""
    from transformer_lens.model_bridge import TransformerBridge

    from ..core.models import LoadedModel, model_info, tokenizer_adds_bos

    hf_model = _hf(hf_model)
    device = device or str(input_device(hf_model))
    dtype = next(hf_model.parameters()).dtype
    source = getattr(hf_model.config, "_name_or_path", "") or ""
    bridge = TransformerBridge.boot_transformers(
        source or name, hf_model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype
    )
    bridge.eval()
    bridge.cfg.default_prepend_bos = tokenizer_adds_bos(tokenizer)
    tokenizer.padding_side = bridge.tokenizer.padding_side
    info = model_info(hf_model.config, name=name, source="local", model=hf_model)
    return LoadedModel(bridge=bridge, tokenizer=tokenizer, info=info, device=device, dtype=dtype)


#: Attention projection module names per architecture (q, k, v, o).
ATTENTION_PROJECTIONS: dict[str, tuple[str, str, str, str]] = {
    "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "mistral": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "qwen2": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "qwen3": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "gptj": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"),
}
#: LoRA target modules (suffixes) per architecture, fused projections included.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    **{arch: names for arch, names in ATTENTION_PROJECTIONS.items()},
    "gpt2": ("attn.c_attn", "attn.c_proj"),
    "gpt_neox": ("attention.query_key_value", "attention.dense"),
}


def architecture(model) -> str:
    """The HF ``model_type`` (``"qwen2"``, ``"llama"``): the key of the projection tables."""
    return str(_hf(model).config.model_type)


def submodule(module: torch.nn.Module, path: str) -> torch.nn.Module:
    """``module``'s submodule at the dotted ``path`` (``"mlp.down_proj"``)."""
    for part in path.split("."):
        module = getattr(module, part)
    return module


def layer_prefix(model, layer: int) -> str:
    """Clean parameter-name prefix of block ``layer`` (e.g. ``model.layers.3.``)."""
    hf = _hf(model)
    block = decoder_layers(hf)[layer]
    for name, module in hf.named_modules():
        if module is block:
            return clean_param_name(name) + "."
    raise RuntimeError("block not found")


def model_shape(model) -> dict[str, int]:
    """n_layers, n_heads, n_kv_heads, d_model, d_head of an HF config."""
    from ..core.models import model_info

    info = model_info(_hf(model).config, name="", source="local")
    return dict(
        n_layers=info.n_layers,
        n_heads=info.n_heads,
        n_kv_heads=info.n_kv_heads,
        d_model=info.d_model,
        d_head=info.d_head,
    )


def count_parameters(model, trainable_only: bool = False) -> int:
    """Number of distinct parameter entries (tied tensors counted once)."""
    seen, total = set(), 0
    for p in _hf(model).parameters():
        if trainable_only and not p.requires_grad:
            continue
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel()
    return total
