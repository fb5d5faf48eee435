"""The one adapter between arithlib and the internals of transformers and TransformerLens.

Everything arithlib does with a key/value cache, a causal mask or a decoder block called
on its own goes through these functions, so that a release of either library that
renames an argument or changes a cache's layout is met here, in one small module with
its own tests (``tests/unit/test_engine_adapter.py``), and nowhere else.

What differs between the releases this module supports:

* transformers 5.24 renamed the cache argument of every forward (model, decoder, block,
  attention, ``create_causal_mask``) from ``past_key_values`` to ``cache``, and the
  output field likewise; the old names still work there, with a deprecation warning,
  until 5.40. :func:`cache_arg` is the name the installed release uses.
* TransformerLens 4.3's attention bridges read the cache from ``past_key_values`` (or
  ``layer_past``) only. Under transformers >= 5.24 the decoder blocks pass ``cache``,
  so the bridge never writes the cache: every prefix-cached pass silently attends to
  its own tokens only. :func:`fix_bridge_cache` hands the cache to the bridge's
  attention under the name it reads.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch


@functools.cache
def cache_arg() -> str:
    """The keyword the installed transformers' forwards take the key/value cache by:
    ``"cache"`` (5.24 on) or ``"past_key_values"``, read from the signature of
    ``create_causal_mask``, which every decoder calls."""
    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(inspect.unwrap(create_causal_mask)).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise RuntimeError(
        "transformers.masking_utils.create_causal_mask takes neither `cache` nor `past_key_values`: "
        "this transformers release is not supported; install the locked versions (scripts/setup.sh)"
    )


def hf_module(model) -> torch.nn.Module:
    """The Hugging Face module under a TransformerBridge (``original_model``), or the
    model itself when it is one already."""
    return model.original_model if hasattr(model, "original_model") else model


def wrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The torch module a bridge component wraps (``_original_component``), or
    ``module`` itself when it wraps none: where a norm's weight and epsilon live."""
    return getattr(module, "_original_component", module)


def mlp_activation(model, layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function of block ``layer``'s MLP, as its Hugging Face module applies
    it (``act_fn`` of Llama/Qwen/Mistral, ``act`` of GPT-2/GPT-J/GPT-NeoX): for computing
    chosen neurons' coefficients from their own weight rows."""
    mlp = wrapped(model.blocks[layer].mlp)
    for name in ("act_fn", "act"):
        fn = getattr(mlp, name, None)
        if callable(fn):
            return fn
    raise NotImplementedError(f"{type(mlp).__name__} has no act_fn or act: its activation is not known here")


def clean_param_name(name: str) -> str:
    """An HF parameter name without the bridge's ``._original_component`` segments."""
    return name.replace("._original_component", "")


# --------------------------------------------------------------------------- caches


def _config(model_or_config):
    """The HF config of a model (a bridge or an HF model), or the config itself."""
    if isinstance(model_or_config, torch.nn.Module):
        return hf_module(model_or_config).config
    return model_or_config


def new_cache(config, layers: Iterable[tuple[torch.Tensor, torch.Tensor] | None] = ()):
    """A dynamic key/value cache for a model of ``config`` (or the model), holding ``layers[l]`` =
    ``(keys, values)`` ([B, kv_heads, T, d_head] each) in layer ``l``; a ``None`` entry
    leaves that layer empty (a block that will not run, or runs later)."""
    from transformers import DynamicCache

    past = DynamicCache(config=_config(config))
    for layer, kv in enumerate(layers):
        if kv is not None:
            past.update(kv[0], kv[1], layer)
    return past


@functools.cache
def _room_layer_class() -> type:
    """:class:`transformers.cache_utils.DynamicLayer` with room reserved after its positions
    (the class is made on first use, so that importing this module imports no transformers)."""
    from transformers.cache_utils import DynamicLayer

    class RoomLayer(DynamicLayer):
        """A dynamic cache layer whose keys and values are the first ``filled`` positions of
        buffers [B, kv, capacity, d]: :meth:`update` writes new positions into the room
        after them, where DynamicLayer concatenates (a fresh copy of the whole layer). The
        same keys and values; it concatenates as DynamicLayer does once the room is used
        up, the layer was changed from outside (crop, row selection), or under grad mode
        (autograd may have saved the keys a later write would change)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
            super().__init__()
            self.dtype, self.device = keys.dtype, keys.device
            self._room = (keys, values)
            self._filled = filled
            self.keys, self.values = keys[..., :filled, :], values[..., :filled, :]
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            kb, vb = self._room
            n, t = self._filled, key_states.shape[-2]
            fits = (
                n >= 0
                and n + t <= kb.shape[-2]
                and key_states.shape[0] == kb.shape[0]
                and not torch.is_grad_enabled()
                and self.keys.data_ptr() == kb.data_ptr()
                and self.keys.shape[-2] == n
                and self.values.data_ptr() == vb.data_ptr()
                and self.values.shape[-2] == n
            )
            if not fits:
                self._filled = -1  # an ordinary DynamicLayer from here on
                return super().update(key_states, value_states, *args, **kwargs)
            kb[..., n : n + t, :].copy_(key_states)
            vb[..., n : n + t, :].copy_(value_states)
            self._filled = n + t
            self.keys, self.values = kb[..., : n + t, :], vb[..., : n + t, :]
            return self.keys, self.values

    return RoomLayer


def cache_with_room(config, layers: Iterable[tuple[torch.Tensor, torch.Tensor, int] | None]):
    """A dynamic key/value cache whose layer ``l`` holds the first ``filled`` positions of
    ``layers[l] = (keys, values, filled)`` (buffers [B, kv_heads, capacity, d_head]) and
    writes the positions a pass adds into the buffers' room after them, without the copy
    of the whole layer a concatenation makes; None leaves a layer empty. A layer of
    another kind than DynamicLayer (sliding window) gets the filled positions as in
    :func:`new_cache`."""
    room = _room_layer_class()
    from transformers.cache_utils import DynamicLayer

    past = new_cache(config)
    for l, entry in enumerate(layers):
        if entry is None:
            continue
        keys, values, filled = entry
        if type(past.layers[l]) is DynamicLayer:
            past.layers[l] = room(keys, values, filled)
        else:
            past.update(keys[..., :filled, :], values[..., :filled, :], l)
    return past


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer of ``cache``, its ``(keys, values)`` [B, kv_heads, T, d_head], or None
    for a layer that holds nothing."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        out.append(None if keys is None or keys.numel() == 0 else (keys, layer.values))
    return out


def filled_cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`cache_layers` for a cache every layer of which is filled (a full forward
    pass's); a ValueError names the first empty layer."""
    layers = cache_layers(cache)
    empty = [l for l, kv in enumerate(layers) if kv is None]
    if empty:
        raise ValueError(
            f"layer {empty[0]} of the cache holds no keys: the forward pass did not write the "
            "cache (a transformers/TransformerLens mismatch? see arithlib.engine.adapter)"
        )
    return layers  # type: ignore[return-value]


def repeat_cache(config, cache, n: int):
    """A new cache holding ``n`` copies of ``cache``'s rows, copy-major (rows
    ``c*B .. (c+1)*B - 1`` are copy ``c``); ``cache`` is left as it was."""
    return new_cache(
        config,
        (None if kv is None else (kv[0].repeat(n, 1, 1, 1), kv[1].repeat(n, 1, 1, 1)) for kv in cache_layers(cache)),
    )


def repeat_rows_(cache, n: int):
    """``cache`` with each row repeated ``n`` times in a row (row ``b`` becomes rows
    ``b*n .. (b+1)*n - 1``), in place, without a copy of the result; returns ``cache``.
    For a one-row cache (a shared prefix) this is ``n`` copies of it."""
    cache.batch_repeat_interleave(n)
    return cache


def select_cache_rows(config, cache, rows: torch.Tensor):
    """A new cache holding rows ``rows`` of ``cache``'s filled layers (empty layers stay
    empty)."""
    return new_cache(
        config,
        (
            None if kv is None else (kv[0].index_select(0, rows), kv[1].index_select(0, rows))
            for kv in cache_layers(cache)
        ),
    )


def truncate_cache(cache, length: int) -> None:
    """Cut ``cache`` back, in place, to its first ``length`` positions (what a KV-cached
    step appended is dropped) and detach it from any autograd graph a gradient pass left
    on it (the cut tensors are views of the concatenated ones)."""
    if cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())
    for layer in cache.layers:
        for name in ("keys", "values"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(layer, name, value.detach())


def cache_kwargs(cache) -> dict[str, Any]:
    """``{cache_arg(): cache}``: the keyword argument passing ``cache`` to a forward."""
    return {cache_arg(): cache}


def output_cache(out):
    """The key/value cache a forward pass returned (``out.cache`` or, on releases
    before 5.24, ``out.past_key_values``)."""
    if cache_arg() == "cache":
        return out.cache
    return out.past_key_values


# --------------------------------------------------------------------------- single blocks


def causal_mask(
    config,
    hidden: torch.Tensor,
    cache,
    position_ids: torch.Tensor,
    layer: int,
    attention_mask: torch.Tensor | None = None,
):
    """The attention mask a decoder block ``layer`` gets for the stream ``hidden``
    [B, T, d] at ``position_ids`` after ``cache``'s positions (transformers'
    ``create_causal_mask``; None where the attention implementation needs none)."""
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        layer_idx=layer,
        **cache_kwargs(cache),
    )


def run_block(
    block: torch.nn.Module,
    hidden: torch.Tensor,
    *,
    mask,
    position_embeddings,
    position_ids: torch.Tensor,
    cache=None,
    use_cache: bool = False,
) -> torch.Tensor:
    """One decoder block on ``hidden`` [B, T, d] (its keys and values appended to
    ``cache``'s layer when ``use_cache``); the block's output stream [B, T, d]."""
    out = block(
        hidden,
        attention_mask=mask,
        position_embeddings=position_embeddings,
        position_ids=position_ids,
        use_cache=use_cache,
        **cache_kwargs(cache),
    )
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------- TransformerLens


def _attention_bridges(bridge) -> list[torch.nn.Module]:
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    return [m for m in hf_module(bridge).modules() if isinstance(m, AttentionBridge)]


def _cache_under_old_name(module, args, kwargs):
    """Forward pre-hook: the cache passed as ``cache`` is also passed as
    ``past_key_values``, the name TransformerLens 4.3's attention bridges read."""
    if kwargs.get("cache") is not None and kwargs.get("past_key_values") is None:
        kwargs = dict(kwargs)
        kwargs["past_key_values"] = kwargs["cache"]
        return args, kwargs
    return None


def fix_bridge_cache(bridge) -> int:
    """Make ``bridge``'s attention bridges write the key/value cache under a
    transformers that passes it as ``cache`` (>= 5.24); a no-op on earlier releases.
    Returns the number of attention modules hooked. Idempotent."""
    if cache_arg() != "cache":
        return 0
    n = 0
    for module in _attention_bridges(bridge):
        if getattr(module, "_arithlib_cache_fix", False):
            continue
        module.register_forward_pre_hook(_cache_under_old_name, with_kwargs=True)
        module._arithlib_cache_fix = True
        n += 1
    return n


# --------------------------------------------------------------------------- GQA keys and values
#
# A grouped-query attention expands its key and value heads to the query heads
# (transformers' ``repeat_kv``: [B, kv, T, d] -> [B, kv * n_rep, T, d]) on every call; the
# TransformerLens bridge takes it from ``transformers.models.llama.modeling_llama``. On the
# CPU each expansion is a fresh tensor, and one above glibc's mmap threshold (32 MB: the
# keys of a few hundred rows after a few-shot prefix) is fresh pages from the kernel, whose
# first touch costs several times the copy itself. :func:`reuse_gqa_buffers` has the
# expansion write into one of two buffers kept between calls.


_REPEAT_KV_ORIGINAL: Callable[[torch.Tensor, int], torch.Tensor] | None = None
_repeat_kv_buffers: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
_repeat_kv_turn = 0
#: the largest buffer kept, in elements (256 MB of float32): larger expansions take the
#: original path, so that the memory held between calls stays under 512 MB
REPEAT_KV_MAX_ELEMENTS = 64 * 2**20


def repeat_kv_reusing(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``repeat_kv`` (each key/value head repeated ``n_rep`` times in a row, [B, kv, T, d]
    -> [B, kv * n_rep, T, d]) into one of two buffers kept between calls, taken in turn:
    a result stays valid through the next call and is overwritten by the one after, as an
    attention uses it (keys, then values, both read before the next attention's keys).
    The same values as transformers' copy. Under grad mode (autograd may save the result
    for a backward pass even when these states need no gradient: the queries may), off
    the CPU (where the caching allocator reuses memory already), and above
    :data:`REPEAT_KV_MAX_ELEMENTS`, the original path."""
    global _repeat_kv_turn
    original = _REPEAT_KV_ORIGINAL
    assert original is not None
    if n_rep == 1 or hidden_states.device.type != "cpu" or torch.is_grad_enabled():
        return original(hidden_states, n_rep)
    B, kv, T, d = hidden_states.shape
    n = B * kv * n_rep * T * d
    if n > REPEAT_KV_MAX_ELEMENTS:
        return original(hidden_states, n_rep)
    turn, _repeat_kv_turn = _repeat_kv_turn, 1 - _repeat_kv_turn
    buf = _repeat_kv_buffers[turn]
    if buf.numel() < n or buf.dtype != hidden_states.dtype:
        buf = _repeat_kv_buffers[turn] = torch.empty(n, dtype=hidden_states.dtype)
    out = buf[:n].view(B, kv, n_rep, T, d)
    out.copy_(hidden_states[:, :, None].expand(B, kv, n_rep, T, d))
    return out.view(B, kv * n_rep, T, d)


def reuse_gqa_buffers() -> bool:
    """Install :func:`repeat_kv_reusing` as ``transformers.models.llama.modeling_llama.repeat_kv``
    (read by TransformerLens's attention bridges at each call, and by Llama's own
    attention). Returns whether it was installed now (False: already). Idempotent."""
    global _REPEAT_KV_ORIGINAL
    from transformers.models.llama import modeling_llama

    if modeling_llama.repeat_kv is repeat_kv_reusing:
        return False
    _REPEAT_KV_ORIGINAL = modeling_llama.repeat_kv
    modeling_llama.repeat_kv = repeat_kv_reusing
    return True


def release_gqa_buffers() -> None:
    """Free the two buffers of :func:`repeat_kv_reusing` (they grow to the largest
    expansion seen; a later call allocates again)."""
    _repeat_kv_buffers[:] = [torch.empty(0), torch.empty(0)]


# --------------------------------------------------------------------------- devices
#
# A model split across devices by accelerate (``load_model(..., device_map=...)``) runs
# each decoder block on its own device; accelerate's hooks move a block's *inputs*
# there, but not tensors that arithlib adds to an activation inside a hook, a key/value
# cache (its hooks skip caches) or a submodule called on its own. Every such tensor goes
# to the device of the layer it joins, read with these helpers; on one device they all
# give that device.


def decoder_layers(model) -> torch.nn.ModuleList:
    """The list of transformer blocks of an HF causal LM or of a bridge's HF model
    (Llama/Qwen2/Mistral, GPT-J, GPT-2, GPT-NeoX layouts)."""
    hf = hf_module(model)
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = hf
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise NotImplementedError(f"cannot find the decoder layers of {type(hf).__name__}")


def as_device(value) -> torch.device:
    """A device-map value (``0``, ``"cuda:1"``, ``"cpu"``, ``"disk"``) as a torch device
    (disk-offloaded modules execute on the CPU)."""
    if isinstance(value, int):
        return torch.device("cuda", value)
    value = str(value)
    return torch.device("cpu" if value == "disk" else value)


def _module_name(hf: torch.nn.Module, module: torch.nn.Module) -> str | None:
    """``module``'s clean name in ``hf`` (the names are listed once per model)."""
    names = getattr(hf, "_arithlib_module_names", None)
    if names is None:
        names = {}
        for name, m in hf.named_modules():
            names.setdefault(id(m), (m, clean_param_name(name)))
        hf.__dict__["_arithlib_module_names"] = names
    entry = names.get(id(module))
    return entry[1] if entry is not None and entry[0] is module else None


def module_device(model, module: torch.nn.Module) -> torch.device:
    """The device ``module`` (a submodule of ``model``'s HF model) executes on: its entry
    in accelerate's ``hf_device_map`` (the longest key that is a prefix of its name),
    else the execution device of its accelerate hook, else its first parameter's."""
    hf = hf_module(model)
    device_map = getattr(hf, "hf_device_map", None)
    if device_map:
        name = _module_name(hf, module)
        if name is not None:
            best = None
            for key, value in device_map.items():
                if key == "" or name == key or name.startswith(key + "."):
                    if best is None or len(key) > len(best[0]):
                        best = (key, value)
            if best is not None:
                return as_device(best[1])
    for m in (module, getattr(module, "_original_component", None)):
        hook = getattr(m, "_hf_hook", None)
        if getattr(hook, "execution_device", None) is not None:
            return as_device(hook.execution_device)
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return next(hf.parameters()).device


def send(obj, device: torch.device):
    """``obj`` (a tensor, or a tuple/list of them, or None) on ``device``; the same
    objects where they are there already (a block's mask, rotary embeddings and position
    ids follow the stream from one device of a split model to the next)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(send(x, device) for x in obj)
    return obj


def layer_device(model, layer: int) -> torch.device:
    """The device decoder block ``layer`` of ``model`` (a bridge or HF model) runs on:
    where its input stream, hook tensors (means, counterfactual activations, masks) and
    key/value cache must be."""
    return module_device(model, decoder_layers(model)[layer])


def input_device(model) -> torch.device:
    """The device of ``model``'s input embedding: where token ids go."""
    hf = hf_module(model)
    return module_device(model, hf.get_input_embeddings())


def output_device(model) -> torch.device:
    """The device of ``model``'s unembedding (``lm_head``): where logits come out."""
    hf = hf_module(model)
    return module_device(model, hf.get_output_embeddings())


# --------------------------------------------------------------------------- a plain twin of a bridge


_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def shared_hf_model(model) -> torch.nn.Module:
    """A plain HF model (original module names, no bridge wrappers) whose parameters ARE
    the tensors of ``model`` (a bridge or an HF model): nothing is copied, and writes to
    one are seen by the other. Returns an HF model given one unchanged."""
    hf = hf_module(model)
    if not hasattr(model, "original_model") and not any("_original_component" in n for n, _ in hf.named_parameters()):
        return hf
    cached = _SHARED.get(hf)
    if cached is not None and not any("_original_component" in n for n, _ in cached.named_parameters()):
        return cached
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf.config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=next(hf.parameters()).dtype)
    state = {clean_param_name(n): p for n, p in hf.state_dict(keep_vars=True).items()}
    own = plain.state_dict()
    missing = set(own) - set(state)
    if missing:
        raise RuntimeError(f"could not map the bridge's parameters onto a plain model; missing {sorted(missing)[:5]}")
    plain.load_state_dict({k: state[k].data for k in own}, assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    # buffers (rotary inv_freq) are recomputed by from_config on meta; materialise them
    for mod_name, module in plain.named_modules():
        for buf_name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                src = dict(hf.named_buffers()).get(_bridge_buffer_name(hf, f"{mod_name}.{buf_name}"))
                if src is None:
                    raise RuntimeError(f"buffer {mod_name}.{buf_name} has no counterpart in the bridge's model")
                module._buffers[buf_name] = src
    plain.generation_config = hf.generation_config
    plain.eval()
    device_map = getattr(hf, "hf_device_map", None)
    if device_map and len({str(d) for d in device_map.values()}) > 1:
        # a model split across devices: the twin's modules hold the same tensors, on the same
        # devices; accelerate's hooks with the bridge's map move each module's inputs there
        from accelerate import dispatch_model

        plain = dispatch_model(plain, device_map=dict(device_map))
    _SHARED[hf] = plain
    return plain


def _bridge_buffer_name(hf, clean: str) -> str:
    for name, _ in hf.named_buffers():
        if clean_param_name(name) == clean:
            return name
    return clean
