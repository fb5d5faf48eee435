"""How CNA reads a vector through the final norm (Yu & Ananiadou 2024, Sec. 4.1), and how
much the choice moves its neuron rankings.

CNA's importance is log p(w | x^{l-1} + A^l + m_k fc2_k) - log p(w | x^{l-1} + A^l): a
residual-stream vector of layer l read as if it were the final hidden state. The final
norm rescales it, and the paper's text does not say by what. The authors' public code
(``get_bsvalues(vector, model, final_var)``) uses ONE fixed scale per case, the variance of
the original run's final hidden state at the answer position, for every layer and for the
compared run:

    p(. | x) = softmax(W_U (g * x / s) + b_U),   s = sqrt(mean(h_final^2) + eps).

That reading, ``"final"``, is what every verdict uses. ``"own"`` normalises each vector by
its own RMS, as if the layer-l vector were itself the final state; in early layers, where
the residual stream is small, it inflates a neuron's effect by the ratio of the final scale
to the layer's (a sensitivity variant: :func:`reading_sensitivity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..core.readout import FinalNorm

if TYPE_CHECKING:
    from ..methods.answer_runs import LastPosition
    from .cna import CNAResult

#: The two readings: "final" (the authors'; verdicts read it) and "own" (a sensitivity variant).
NORM_READINGS = ("final", "own")


def check_norm_reading(norm_reading: str) -> str:
    """``norm_reading`` if it is one of :data:`NORM_READINGS`, else a ValueError naming them."""
    if norm_reading not in NORM_READINGS:
        raise ValueError(f"norm_reading must be one of {NORM_READINGS}, not {norm_reading!r}")
    return norm_reading


def final_scale(final_resid: torch.Tensor, norm: FinalNorm) -> torch.Tensor:
    """The fixed norm scale of each row, [R]: s = sqrt(mean(h^2) + eps) of the final hidden
    state h [R, d] (centred first for a LayerNorm), the authors' ``rsqrt(final_var + eps)``
    with the model's own eps."""
    h = final_resid.float()
    if norm.kind == "layer":
        h = h - h.mean(-1, keepdim=True)
    return torch.sqrt(h.pow(2).mean(-1) + norm.eps)


def run_scales(
    runs: Sequence[LastPosition], norm: FinalNorm, norm_reading: str, scale_from: int | None = 0
) -> list[torch.Tensor | None]:
    """The fixed scale of each run's rows (:func:`final_scale`) under ``norm_reading``:
    None for every run in the ``"own"`` reading; else run ``scale_from``'s final scale for
    every run (the unintervened run of the same inputs), or each run's own with
    ``scale_from=None`` (runs of different inputs, each its own original run). ValueError
    when a run lacks ``final_resid``."""
    if check_norm_reading(norm_reading) == "own":
        return [None] * len(runs)
    src = list(runs) if scale_from is None else [runs[scale_from]] * len(runs)
    if any(r.final_resid is None for r in src):
        raise ValueError(
            "the 'final' norm reading needs each run's final hidden state (LastPosition.final_resid): capture resid_mid"
        )
    return [final_scale(r.final_resid, norm) for r in src]


def reading_sensitivity(
    primary: CNAResult, variant: CNAResult, ks: Sequence[int], n_layers: int, cases: Sequence[int] | None = None
) -> pd.DataFrame:
    """How the top-k CNA neurons move between two readings of the same cases (rows of both
    results): per case and k, the share of ``primary``'s top-k that ``variant`` also ranks
    top-k (``overlap``), and for each reading the share of its top-k in layer 0 and their
    mean layer / ``n_layers``. Columns: case, k, overlap, layer0_<reading>,
    depth_<reading>."""
    cases = range(len(primary)) if cases is None else cases
    rows = []
    for i in cases:
        for k in ks:
            top = {r.norm_reading: r.top(i, k) for r in (primary, variant)}
            a, b = top[primary.norm_reading], top[variant.norm_reading]
            row = {"case": i, "k": k, "overlap": len(set(a) & set(b)) / max(1, len(a))}
            for name, neurons in top.items():
                layers = [layer for layer, _ in neurons]
                row[f"layer0_{name}"] = sum(layer == 0 for layer in layers) / max(1, len(layers))
                row[f"depth_{name}"] = sum(layers) / max(1, len(layers)) / n_layers
            rows.append(row)
    return pd.DataFrame(rows)
