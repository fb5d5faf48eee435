"""How the heuristic neurons emerge over training (Nikankin et al. 2025, ICLR, Sec. 5, Fig. 10).

At every saved checkpoint the analysis of Sec. 3-4 is repeated from scratch: the circuit is
re-discovered (top ``k_per_layer`` neurons per layer by attribution), its faithfulness is
measured, and its neurons are labelled with heuristics. A label is counted only when it
passes the match threshold t *and* beats the shuffled-operand null at the stated false
discovery rate (:mod:`arithlib.nikankin.heuristic_nulls`), exactly as in the final model's analysis;
the share passing t alone is kept beside it, with its shuffled-activation level, as a
sensitivity column. "Heuristics appear early" (Fig. 10) is then read on the labels that beat
the null: the share of the final checkpoint's labelled heuristics already labelled at a step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.prompt_sets import PromptSet
from ..methods import neurons as N
from . import heuristic_nulls as HN
from .heuristics import neuron_labels
from .operator_analysis import (
    attribute,
    classify_circuit,
    matched_share,
    neuron_matrix,
    prepare_operator,
    reference_means,
)


def checkpoint_summary(
    model,
    grids: dict[str, PromptSet],
    layers: Sequence[int],
    k_per_layer: int,
    n_analysis: int | None = None,
    t: float = 0.6,
    max_base_rate: float = 0.5,
    candidates: torch.Tensor | None = None,
    seed: int = 0,
    batch_size: int = 64,
    labels: str = "best",
    label_fdr: float = HN.LABEL_FDR,
    n_permutations: int | None = None,
) -> pd.DataFrame:
    """Sec. 5 / Fig. 10 at one checkpoint, per operator: first-token accuracy on the grid, the
    circuit (top ``k_per_layer`` per layer by attribution on ``n_analysis`` sampled grid
    prompts, correct or not, since early checkpoints answer few), its faithfulness on them,
    the share of its neurons labelled with a heuristic that beats the null
    (``labelled_share``, and ``labelled_share_null``: the same procedure on shuffled
    activations), the share passing t alone (``matched_share`` / ``matched_share_null``,
    sensitivity), the share whose best surviving rule is a result rule
    (``result_label_share``), and the heuristics its neurons are labelled with
    (``heuristic_set``, :func:`arithlib.nikankin.heuristics.neuron_labels` mode ``labels`` over the
    labels that beat the null)."""
    analyses = {op: prepare_operator(model, g, layers, n_analysis, None, seed, batch_size) for op, g in grids.items()}
    means = reference_means(analyses)
    rows = []
    for op, an in analyses.items():
        attribute(an, layers, means, candidates)
        classify_circuit(an, layers, k_per_layer, t, max_base_rate, seed)
        faith = N.neuron_circuit_faithfulness(an.runner, an.circuit, layers, means)
        acts = neuron_matrix(an.grid_acts, an.circuit, layers)
        test = HN.label_test(acts, an.assoc, t, label_fdr, n_permutations, seed=seed, rank_seed=seed)
        null = HN.null_label_test(acts, an.assoc, t, label_fdr, n_permutations, seed=seed)
        kept = HN.beating_null(HN.annotate_matches(an.matches, an.circuit, test))
        lab = neuron_labels(kept, labels)
        hset = sorted(set(lab["heuristic"])) if lab is not None and not lab.empty else []
        best = neuron_labels(kept, "best")
        n_result = int((best["family"] == "result").sum()) if best is not None and not best.empty else 0
        rows.append(
            {
                "op": op,
                "accuracy": float(an.grid_correct_first.mean()),
                "n_circuit": len(an.circuit),
                "faithfulness": faith["faithfulness"],
                "faithfulness_per_prompt": faith["faithfulness_per_prompt"],
                "circuit_accuracy": faith["accuracy"],
                "labelled_share": test.labelled_share,
                "labelled_share_null": null.labelled_share,
                "matched_share": matched_share(an, t),
                "matched_share_null": matched_share(an, t, null=True),
                "result_label_share": n_result / len(an.circuit) if an.circuit else float("nan"),
                "n_heuristics_matched": len(hset),
                "heuristic_set": "|".join(hset),
                "label_fdr": label_fdr,
                "n_permutations": test.n_permutations,
            }
        )
        an.runner = None  # free the KV cache
    return pd.DataFrame(rows)


def heuristic_overlap(dynamics: pd.DataFrame, final_step: int | None = None) -> pd.DataFrame:
    """Per step and operator: the share of the final checkpoint's labelled heuristics (by
    name, labels that beat the null) that are labelled at that step (Fig. 10's "heuristics
    appear early")."""
    final_step = dynamics["step"].max() if final_step is None else final_step

    def names(x) -> set:
        return set(filter(None, x.split("|"))) if isinstance(x, str) else set()

    final = {r.op: names(r.heuristic_set) for r in dynamics[dynamics.step == final_step].itertuples()}
    rows = []
    for r in dynamics.itertuples():
        ref = final.get(r.op, set())
        rows.append(
            {
                "step": r.step,
                "op": r.op,
                "final_heuristics_present": len(names(r.heuristic_set) & ref) / len(ref) if ref else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def training_dynamics(
    load: Callable[[int], object],
    steps: Sequence[int],
    grids: dict[str, PromptSet],
    layers: Sequence[int],
    k_per_layer: int,
    n_analysis: int | None = None,
    t: float = 0.6,
    candidates: torch.Tensor | None = None,
    seed: int = 0,
    progress: bool = True,
    max_base_rate: float = 0.5,
    labels: str = "best",
    label_fdr: float = HN.LABEL_FDR,
    n_permutations: int | None = None,
) -> pd.DataFrame:
    """:func:`checkpoint_summary` at every training step; ``load(step)`` returns the model
    (a bridge) of that checkpoint, which must share the grids' tokenizer. One row per
    (step, operator)."""
    frames = []
    for step in tqdm(list(steps), desc="checkpoints", disable=not progress):
        model = load(step)
        frames.append(
            checkpoint_summary(
                model,
                grids,
                layers,
                k_per_layer,
                n_analysis,
                t,
                max_base_rate,
                candidates=candidates,
                seed=seed,
                labels=labels,
                label_fdr=label_fdr,
                n_permutations=n_permutations,
            ).assign(step=step)
        )
        del model
    out = pd.concat(frames, ignore_index=True)
    return out[["step"] + [c for c in out.columns if c != "step"]]
