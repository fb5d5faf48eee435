"""The vocabulary-sized weight gradients of a training step, added into buffers kept for
the whole training.

Two weights of a language model are a row per vocabulary token: the input embedding
``E`` and the unembedding ``W_U`` (``V x d``; one tensor when they are tied). Their
gradients are:

* input embedding: ``dL/dE[v] = sum_{t: x_t = v} dL/dh_t``, non-zero only in the rows
  of the batch's tokens (the embedding's output at position ``t`` is ``E[x_t]``);
* unembedding: ``dL/dW_U = g^T x`` for the logits' gradient ``g`` and the final stream
  ``x`` at the positions the loss reads (a dense ``V x d`` product).

torch builds each as a new ``V x d`` matrix per step (the embedding's as zeros with the
rows added in): for Qwen2.5's 151,936 tokens 544 MB of fresh memory each, which the
kernel faults in and zeroes page by page (on the 2-core machine about 1 s a step each
when its page faults are slow: ``benchmarks/embedding_grad.py``).

:func:`kept_gradients` gives each such trained weight one dense ``.grad`` buffer for the
training, zeroed in place before each step (:meth:`KeptGradients.zero_`, resident
memory): the input embedding sends its rows into it (torch's own ``sparse=True`` backward
of ``nn.Embedding``, the same row sums), and the unembedding adds ``g^T x`` into it with
one ``addmm`` into the buffer (its backward otherwise as ``F.linear``'s). The optimizer, clipping and
gradient masks read the same dense gradient as before, equal up to the order in which a
repeated token's rows are summed (tested against torch's own backward in
``tests/equivalence/test_embedding_grad.py``).

Only for weights whose modules run in every step: a pass that starts above the embedding
leaves its gradient None, which the optimizer reads as "skip this weight", and a zeroed
buffer would not; :func:`~arithlib.methods.finetune.train_parameters` passes its trained
weights only when its passes start at block 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .adapter import hf_module, wrapped


@dataclass
class KeptGradients:
    """The vocabulary-sized trained weights, each with the dense buffer its gradient goes to."""

    buffers: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=dict)

    def zero_(self) -> None:
        """Each weight's ``.grad`` set to its buffer, zeroed in place (resident memory:
        no fresh pages), ready for the next backward pass to add into."""
        for weight, buffer in self.buffers.values():
            weight.grad = buffer.zero_()

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        return [w for w, _ in self.buffers.values()]


class _LinearIntoBuffer(torch.autograd.Function):
    """``F.linear(x, weight)`` whose backward adds the weight's gradient ``g^T x`` into
    ``buffer`` in place (and returns none for it) instead of a new matrix."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.buffer = buffer
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        buffer = ctx.buffer  # torch.addmm with out=, not addmm_: the FLOP counter reads the product
        torch.addmm(buffer, grad.reshape(-1, grad.shape[-1]).T, x.reshape(-1, x.shape[-1]), out=buffer)
        return (grad @ weight if ctx.needs_input_grad[0] else None), None, None


def _modules(model) -> tuple[list[torch.nn.Embedding], list[torch.nn.Linear]]:
    """The ``nn.Embedding`` modules of the HF model's input embedding and the bias-free
    ``nn.Linear`` of its output embedding (under a bridge's wrappers where there are)."""
    hf = hf_module(model)
    embeddings = [m for m in hf.get_input_embeddings().modules() if isinstance(m, torch.nn.Embedding)]
    out = hf.get_output_embeddings()
    head = wrapped(out) if out is not None else None
    linears = [head] if isinstance(head, torch.nn.Linear) and head.bias is None else []
    return embeddings, linears


@contextmanager
def kept_gradients(model, trained: Iterable[torch.nn.Parameter]) -> Iterator[KeptGradients]:
    """Within the block, the input and output embeddings of ``model`` whose weight is among
    ``trained`` add their gradients into one dense buffer per weight (see the module
    docstring); call :meth:`KeptGradients.zero_` after the optimizer's ``zero_grad`` and
    before each backward pass. The modules are as before on exit, an exception included;
    the weights' ``.grad`` is the caller's to restore."""
    ids = {id(p) for p in trained}
    embeddings, linears = _modules(model)
    embeddings = [m for m in embeddings if id(m.weight) in ids and m.weight.layout == torch.strided]
    linears = [m for m in linears if id(m.weight) in ids and m.weight.layout == torch.strided]
    kept = KeptGradients({id(m.weight): (m.weight, torch.zeros_like(m.weight)) for m in [*embeddings, *linears]})
    sparse = [(m, m.sparse) for m in embeddings]
    try:
        for m in embeddings:
            m.sparse = True
        for m in linears:
            buffer = kept.buffers[id(m.weight)][1]
            m.forward = lambda x, m=m, buffer=buffer: _LinearIntoBuffer.apply(x, m.weight, buffer)
        yield kept
    finally:
        for m, flag in sparse:
            m.sparse = flag
        for m in linears:
            m.__dict__.pop("forward", None)  # the class's forward again
