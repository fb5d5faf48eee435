"""Forward passes that start at a layer, from a recorded residual stream.

A model that differs from another only from block L on (a LoRA adapter in attention
layer L; FFN neurons pruned from layer L on) computes the same residual stream below L.
Notebooks 05 and 06 evaluate a dozen such models on one test set, each with a full
forward pass. :class:`LayerInputs` records the stream entering the layers asked for, per
batch, during a run of a model that is unchanged up to them (the original, or a variant
whose first change is above), and a later run whose model equals the original below
layer L starts at the highest recorded layer <= L instead of at the embeddings.

Why not TransformerLens: the passes here are :func:`arithlib.methods.answer_loss.teacher_forced_logits`'s,
on the bare HF decoder with few-shot prefixes and rows packed into one sequence; a
resumed pass loops over the decoder blocks as the decoder's own forward does (same
mask, rotary embeddings and block calls), so it equals the full pass bit for bit when
given the batch's recorded input (tested). Only Llama-style decoders without active
dropout start late (:func:`can_start_late`); others always run in full.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch


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
