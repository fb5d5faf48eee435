"""The input embedding's gradient as the rows the batch used, added into one dense buffer.

The gradient of a token-embedding matrix ``E`` (``V x d``) is non-zero only in the rows
of the tokens a batch contains: ``dL/dE[v] = sum_{t: x_t = v} dL/dh_t`` (the embedding's
output at position ``t`` is ``E[x_t]``). torch's dense embedding backward builds it as a
new ``V x d`` zero matrix each step and adds the rows into it; for Qwen2.5's
151,936-token vocabulary that is 544 MB of fresh memory per step, which the kernel must
fault in and zero page by page (on the 2-core machine 1.7 s a step when its page faults
are slow, a quarter of a full-SFT step: ``benchmarks/embedding_grad.py``).

:func:`row_gradients` turns the embedding's backward into its rows (torch's own
``sparse=True`` path of ``nn.Embedding``, the same row sums) and gives every trained
embedding weight one dense ``.grad`` buffer, zeroed in place before each step by
:meth:`RowGradients.zero_`: autograd then adds the rows into it, and the optimizer,
gradient clipping and masks see the same dense gradient as before (equal up to the
order in which a repeated token's rows are summed; tested in
``tests/equivalence/test_embedding_grad.py``).

Only for a weight whose embedding runs in every step (a pass that starts above the
embedding leaves its gradient None, which the optimizer reads as "skip this weight",
and a zeroed buffer would not): the caller passes the weights it trains from the first
block (:func:`~arithlib.methods.finetune.train_parameters` does so when its passes start
at block 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .adapter import hf_module


@dataclass
class RowGradients:
    """The embedding weights whose gradients arrive as rows, each with its dense buffer."""

    buffers: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=dict)

    def zero_(self) -> None:
        """Each weight's ``.grad`` set to its buffer, zeroed in place (resident memory:
        no fresh pages), ready for the next backward pass to add its rows into."""
        for weight, buffer in self.buffers.values():
            weight.grad = buffer.zero_()

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        return [w for w, _ in self.buffers.values()]


def _input_embeddings(model) -> list[torch.nn.Embedding]:
    """The ``nn.Embedding`` modules of the HF model's input embedding (under a bridge's
    wrapper where there is one)."""
    hf = hf_module(model)
    found = hf.get_input_embeddings()
    return [m for m in found.modules() if isinstance(m, torch.nn.Embedding)]


@contextmanager
def row_gradients(model, trained: Iterable[torch.nn.Parameter]) -> Iterator[RowGradients]:
    """Within the block, the input embeddings of ``model`` whose weight is among
    ``trained`` send their gradient as rows into a dense buffer per weight (see the module
    docstring); call :meth:`RowGradients.zero_` after the optimizer's ``zero_grad`` and
    before each backward pass. Each embedding's ``sparse`` flag is restored on exit, an
    exception included; the weights' ``.grad`` is the caller's to restore."""
    ids = {id(p) for p in trained}
    chosen = [m for m in _input_embeddings(model) if id(m.weight) in ids and m.weight.layout == torch.strided]
    rows = RowGradients({id(m.weight): (m.weight, torch.zeros_like(m.weight)) for m in chosen})
    before = [(m, m.sparse) for m in chosen]
    try:
        for m in chosen:
            m.sparse = True
        yield rows
    finally:
        for m, flag in before:
            m.sparse = flag
