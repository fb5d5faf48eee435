"""Forward passes that start at a layer, from a recorded residual stream.

A model that differs from another only from block L on (a LoRA adapter in attention
layer L; FFN neurons pruned from layer L on) computes the same residual stream below L.
Notebooks 05 and 06 evaluate a dozen such models on one test set, each with a full
forward pass. :class:`LayerInputs` records the stream entering the layers asked for, per
batch, during a run of a model that is unchanged up to them (the original, or a variant
whose first change is above), and a later run whose model equals the original below
layer L starts at the highest recorded layer <= L instead of at the embeddings.

Why not TransformerLens: the passes here are :func:`arithlib.finetune.teacher_forced_logits`'s,
on the bare HF decoder with a KV cache shared between few-shot prefixes and rows; a
resumed pass loops over the decoder blocks as the decoder's own forward does (same
mask, rotary embeddings and block calls), so it equals the full pass bit for bit when
given the batch's recorded input (tested). Only Llama-style decoders without active
dropout start late (:func:`can_start_late`); others always run in full.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import torch

from .hf_compat import cache_kwargs, causal_mask, layer_device, module_device, new_cache, output_cache, run_block, send
from .patching import resumable


class LayerInputs:
    """The residual stream entering ``layers`` (block inputs, [rows, positions, d_model])
    per batch key, filled by the runs that use it. Valid for one prompt set, batching and
    reference model: the caller states for each run how far its model equals the
    reference (``same_below``). At most ``max_bytes`` are kept (on the model's device);
    batches beyond run in full, with the same results (a paper-scale training set over
    several epochs would otherwise hold gigabytes per layer)."""

    def __init__(self, layers: Iterable[int], max_bytes: int = 2**30):
        self.layers = sorted({int(layer) for layer in layers if int(layer) > 0})
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._store: dict[tuple[Hashable, int], dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._store)

    def start(self, key: Hashable, same_below: int) -> int:
        """The highest recorded layer <= ``same_below`` for batch ``key`` (0: none)."""
        return max((l for l in self.layers if l <= same_below and (key, l) in self._store), default=0)

    def wanted(self, key: Hashable, start: int, same_below: int) -> list[int]:
        """Layers to record in a run of batch ``key`` that starts at ``start`` and whose
        model equals the reference below ``same_below``."""
        return [l for l in self.layers if start < l <= same_below and (key, l) not in self._store]

    def get(self, key: Hashable, layer: int, part: str) -> torch.Tensor:
        """The stream entering ``layer`` in pass ``part`` of batch ``key``."""
        return self._store[(key, layer)][part]

    def put(self, key: Hashable, layer: int, parts: dict[str, torch.Tensor]) -> None:
        """Keep the streams entering ``layer`` in each pass of batch ``key`` (all of them,
        or none when they would pass ``max_bytes``)."""
        size = sum(h.numel() * h.element_size() for h in parts.values())
        if self.nbytes + size <= self.max_bytes:
            self._store[(key, layer)] = dict(parts)
            self.nbytes += size


def can_start_late(hf) -> bool:
    """Whether a pass of ``hf`` may start at a recorded block: a Llama-style decoder
    (:func:`arithlib.patching.resumable`) whose blocks are deterministic (in training
    mode, no dropout anywhere: a recorded stream would otherwise stand for one draw)."""
    if not resumable(hf):
        return False
    if not hf.training:
        return True
    drop = [m.p for m in hf.modules() if isinstance(m, torch.nn.Dropout)]
    return all(p == 0 for p in drop) and not getattr(hf.config, "attention_dropout", 0.0)


def run_decoder(hf, *, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past=None, use_cache: bool = False,
                start: int = 0, hidden: torch.Tensor | None = None, record: Sequence[int] = ()
                ) -> tuple[torch.Tensor, object | None, dict[int, torch.Tensor]]:
    """The HF decoder of ``hf`` on ``input_ids`` [B, T] (arguments as its forward's):
    returns (final-normed hidden states [B, T, d_model], the KV cache, the inputs of the
    blocks in ``record``). With ``start`` > 0 the blocks below ``start`` are skipped:
    ``hidden`` is the stream entering block ``start`` (recorded from a run of these
    tokens), and the cache holds layers >= ``start`` only (``past`` likewise)."""
    decoder = hf.get_decoder()
    captured: dict[int, torch.Tensor] = {}
    if start == 0:
        handles = [decoder.layers[l].register_forward_pre_hook(_recorder(captured, l), with_kwargs=True)
                   for l in record]
        try:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, **cache_kwargs(past))
        finally:
            for h in handles:
                h.remove()
        return out.last_hidden_state, output_cache(out) if use_cache else None, captured

    if hidden is None:
        raise ValueError("a run that starts at a later layer needs the stream entering it (hidden)")
    if use_cache and past is None:
        past = new_cache(hf.config)
    if position_ids is None:
        seen = past.get_seq_length(start) if past is not None else 0
        position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + seen).unsqueeze(0)
    mask = causal_mask(hf.config, hidden, past, position_ids, start, attention_mask=attention_mask)
    pos_emb = decoder.rotary_emb(hidden, position_ids)
    for l in range(start, len(decoder.layers)):
        d = layer_device(hf, l)  # a split model: stream, mask and positions follow the blocks
        hidden, mask, pos_emb, position_ids = send((hidden, mask, pos_emb, position_ids), d)
        if l in record:
            captured[l] = hidden
        hidden = run_block(decoder.layers[l], hidden, mask=mask, position_embeddings=pos_emb,
                           position_ids=position_ids, cache=past, use_cache=use_cache)
    return decoder.norm(send(hidden, module_device(hf, decoder.norm))), past if use_cache else None, captured


def _recorder(store: dict[int, torch.Tensor], layer: int):
    def hook(module, args, kwargs):
        store[layer] = (args[0] if args else kwargs["hidden_states"]).detach()
    return hook
