"""The neuron-circuit analysis of one operator (Nikankin et al. 2025, Sec. 3-4): its operand
grid run once, the analysed and held-out prompts, the circuit of top-attributed MLP neurons,
and the classification of those neurons against the heuristic catalogue.

* :func:`grid_pass` runs an operator's grid (:func:`arithlib.nikankin.heuristic_grids.grid_records`)
  once and keeps the answer-position neuron activations, the final-norm scale and whether
  each prompt is answered (:class:`GridPass`, small enough to store);
  :func:`prepare_operator` draws the analysed and held-out prompts from the correct ones
  into an :class:`OperatorAnalysis`;
* :func:`reference_means`: the mean activations that mean ablation writes in;
* :func:`attribute`: attribution patching against the mean on the analysed prompts;
  :func:`classify_circuit` keeps the top neurons per layer and scores and classifies them
  against the catalogue of :mod:`arithlib.nikankin.heuristics` (and against shuffled
  activations for the chance level); :func:`matched_share` is the share that matches;
* :func:`faithfulness_curves`: the circuit's faithfulness as it grows (Sec. 3).

The heuristic ablation of Sec. 4.2-4.3 on these analyses is in
:mod:`arithlib.nikankin.heuristic_ablation`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ..core.components import Neuron
from ..core.prompt_sets import PromptSet
from ..engine import AnswerPositionRunner
from ..methods import neurons as N
from .heuristics import (
    Heuristic,
    association_matrix,
    classify_neurons,
    heuristic_catalogue,
    match_scores,
    null_match_scores,
    usable_heuristics,
)


def sample_indices(n: int, k: int | None, seed: int) -> list[int]:
    """``k`` indices of range(n) drawn without replacement (all when k is None or >= n), sorted."""
    if k is None or k >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), k))


@dataclass
class OperatorAnalysis:
    """Everything the neuron-circuit analysis computes for one operator. ``grid_*`` arrays
    are over every operand pair; ``runner`` and ``attribution`` over the analysed prompts
    (``analysis_index`` into the grid)."""

    op: str
    grid: PromptSet
    grid_acts: torch.Tensor  # [N_grid, L, d_mlp] answer-position activations
    grid_scale: torch.Tensor  # [N_grid] final-norm scale at the answer position
    grid_correct_first: np.ndarray  # first answer token is the argmax
    grid_correct_full: np.ndarray  # greedy decoding writes the whole answer
    analysis_index: list[int]
    runner: AnswerPositionRunner | None = None
    #: correct prompts disjoint from the analysed ones: the circuit is chosen on the
    #: analysed prompts and scored (ablations) on these
    heldout_index: list[int] = field(default_factory=list)
    heldout_runner: AnswerPositionRunner | None = None
    attribution: torch.Tensor | None = None  # [N_analysis, L, d_mlp]
    scores: torch.Tensor | None = None  # [L, d_mlp] mean |attribution|
    circuit: list[Neuron] | None = None
    heuristics: list[Heuristic] | None = None  # usable heuristics on this grid
    assoc: np.ndarray | None = None  # [H, N_grid]
    circuit_scores: np.ndarray | None = None  # [n_circuit, H] match scores
    circuit_null: np.ndarray | None = None  # [n_circuit, H] chance-level match scores
    matches: pd.DataFrame | None = None  # classify_neurons on the circuit

    @property
    def analysis(self) -> PromptSet:
        return self.grid.subset(self.analysis_index)


def neuron_matrix(acts: torch.Tensor, neurons: Sequence[Neuron], layers: Sequence[int]) -> np.ndarray:
    """Columns of ``acts`` [N, L, d_mlp] for ``neurons``: [N, len(neurons)]."""
    pos = {int(x): i for i, x in enumerate(layers)}
    if not neurons:
        return np.zeros((acts.shape[0], 0))
    li = torch.tensor([pos[int(a)] for a, _ in neurons])
    ki = torch.tensor([int(b) for _, b in neurons])
    return acts[:, li, ki].numpy()


@dataclass
class GridPass:
    """What one clean pass over an operator's grid records at the answer position: the
    analysed layers' neuron activations, the final-norm scale, and whether the first
    answer token is the argmax and greedy decoding writes the whole answer. Small enough
    to store (:class:`arithlib.run.stored.Store`), unlike the grid's KV cache."""

    acts: torch.Tensor  # [N_grid, L, d_mlp]
    scale: torch.Tensor  # [N_grid]
    correct_first: np.ndarray  # [N_grid] bool
    correct_full: np.ndarray  # [N_grid] bool


def grid_pass(model, grid: PromptSet, layers: Sequence[int], batch_size: int = 64, decode: bool = True) -> GridPass:
    """One clean pass over ``grid`` (:meth:`arithlib.engine.AnswerPositionRunner.check_answers`,
    teacher-forced over the answers: the layers' neuron activations and the final-norm scale
    at the answer position, first-token and greedy correctness; ``decode`` False:
    ``correct_full`` is the first-token correctness, nothing decoded)."""
    names = [N.post_hook(x) for x in layers]
    runner = AnswerPositionRunner(model, grid, batch_size=batch_size)
    check = runner.check_answers(names + ["ln_final.hook_scale"], decode=decode)
    return GridPass(
        acts=torch.stack([check.acts[n] for n in names], 1),
        scale=check.acts["ln_final.hook_scale"].reshape(len(grid), -1)[:, 0],
        correct_first=check.correct_first,
        correct_full=check.correct_full,
    )


def prepare_operator(
    model,
    grid: PromptSet,
    layers: Sequence[int],
    n_analysis: int | None = None,
    criterion: str | None = "full",
    seed: int = 0,
    batch_size: int = 64,
    n_heldout: int | None = 0,
    clean: GridPass | None = None,
) -> OperatorAnalysis:
    """The grid's clean pass (``clean``, e.g. a stored one; None: :func:`grid_pass`) and
    the analysed prompts: up to ``n_analysis`` (seeded sample) of those answered
    correctly (``criterion`` "full" or "first"; None: all prompts), with their own
    runner. ``runner`` is None when no prompt qualifies. ``n_heldout``: up to that many
    further qualifying prompts (seeded sample of those not analysed; None: all of them)
    in ``heldout_index`` / ``heldout_runner``, to score the circuit on prompts it was not
    chosen on; they are reserved before the analysed sample is drawn (at most half of the
    qualifying prompts). The two runners are built on their own prompts, so a run that
    loads a stored pass computes what one that did not computes."""
    if criterion not in ("full", "first", None):
        raise ValueError("criterion must be 'full', 'first' or None")
    clean = grid_pass(model, grid, layers, batch_size, decode=criterion == "full") if clean is None else clean
    if len(clean.correct_first) != len(grid):
        raise ValueError(f"the grid pass has {len(clean.correct_first)} prompts, the grid {len(grid)}")
    first, full = clean.correct_first, clean.correct_full
    ok = {"full": full, "first": first, None: np.ones(len(grid), dtype=bool)}[criterion]
    pool = np.nonzero(ok)[0].tolist()
    # held-out prompts are reserved first (up to n_heldout, at most half of the pool), so a
    # small grid (per-digit tokenizers) keeps prompts to score on
    reserve = 0 if n_heldout == 0 else min(len(pool) // 2, len(pool) if n_heldout is None else n_heldout)
    n_sel = len(pool) - reserve if n_analysis is None else min(n_analysis, len(pool) - reserve)
    index = [pool[i] for i in sample_indices(len(pool), n_sel, seed)]
    rest = sorted(set(pool) - set(index))
    held = [rest[i] for i in sample_indices(len(rest), n_heldout, seed + 1)] if n_heldout != 0 else []
    an = OperatorAnalysis(
        op=grid.records[0].op,
        grid=grid,
        grid_acts=clean.acts,
        grid_scale=clean.scale,
        grid_correct_first=first,
        grid_correct_full=full,
        analysis_index=index,
    )
    an.runner = AnswerPositionRunner(model, grid.subset(index), batch_size=batch_size) if index else None
    an.heldout_index = held
    an.heldout_runner = AnswerPositionRunner(model, grid.subset(held), batch_size=batch_size) if held else None
    return an


def reference_means(analyses: dict[str, OperatorAnalysis]) -> torch.Tensor:
    """Mean answer-position activation [L, d_mlp] over the analysed prompts of every operator
    (the values mean ablation writes in)."""
    parts = [an.grid_acts[an.analysis_index] for an in analyses.values() if an.analysis_index]
    if not parts:
        raise ValueError("no analysed prompts: no operator has a prompt the model answers correctly")
    return N.last_position_means(torch.cat(parts))


def attribute(
    an: OperatorAnalysis,
    layers: Sequence[int],
    means: torch.Tensor,
    candidates: torch.Tensor | None = None,
    progress: bool = False,
) -> OperatorAnalysis:
    """Attribution patching against the mean on the analysed prompts; sets ``attribution`` and
    ``scores`` (in place)."""
    if an.runner is None:
        raise ValueError(f"operator {an.op!r} has no analysed prompts")
    an.attribution = N.neuron_attribution(an.runner, layers, means=means, candidates=candidates, progress=progress)
    an.scores = N.neuron_scores(an.attribution)
    return an


def classify_circuit(
    an: OperatorAnalysis,
    layers: Sequence[int],
    k_per_layer: int,
    t: float = 0.6,
    max_base_rate: float = 0.5,
    seed: int = 0,
    catalogue_kwargs: dict | None = None,
) -> OperatorAnalysis:
    """Set the circuit to the top ``k_per_layer`` neurons per layer (by ``scores``), build the
    catalogue on this grid's operand and result ranges, and score and classify the circuit
    neurons against it (and against shuffled activations for the chance level). In place."""
    if an.scores is None:
        raise ValueError("run attribute() first")
    an.circuit = N.top_neurons_per_layer(an.scores, layers, k_per_layer)
    recs = an.grid.records
    ops = [r.a for r in recs] + [r.b for r in recs]
    res = [r.answer for r in recs]
    cat = heuristic_catalogue((min(ops), max(ops)), (min(res), max(res)), **(catalogue_kwargs or {}))
    an.heuristics, an.assoc = usable_heuristics(cat, association_matrix(cat, recs), max_base_rate)
    acts = neuron_matrix(an.grid_acts, an.circuit, layers)
    an.circuit_scores = match_scores(acts, an.assoc, seed=seed)
    an.circuit_null = null_match_scores(acts, an.assoc, seed=seed)
    an.matches = classify_neurons(an.circuit_scores, an.circuit, an.heuristics, an.assoc, t)
    return an


def matched_share(an: OperatorAnalysis, t: float = 0.6, null: bool = False) -> float:
    """Share of the circuit's neurons that match at least one heuristic at threshold t
    (with ``null``: the chance level from shuffled activations)."""
    s = an.circuit_null if null else an.circuit_scores
    if s is None or s.shape[0] == 0:
        return float("nan")
    if s.shape[1] == 0:
        return 0.0
    return float((s >= t).any(1).mean())


def faithfulness_curves(
    analyses: dict[str, OperatorAnalysis],
    layers: Sequence[int],
    means: torch.Tensor,
    ks: Sequence[int],
    progress: bool = False,
) -> pd.DataFrame:
    """:func:`arithlib.methods.neurons.faithfulness_curve` for every operator with analysed prompts
    (an ``op`` column added)."""
    frames = [
        N.faithfulness_curve(an.runner, an.scores, layers, means, ks, progress).assign(op=op)
        for op, an in analyses.items()
        if an.runner is not None
    ]
    return pd.concat(frames, ignore_index=True)
