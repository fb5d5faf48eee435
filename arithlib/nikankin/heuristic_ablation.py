"""The heuristic ablation of Nikankin et al. 2025 (Sec. 4.2, Fig. 7; Sec. 4.3): what
ablating a heuristic's neurons does to the prompts associated with it and to the others,
and the associated neurons' contribution on correct and incorrect prompts.

* :func:`heuristic_ablation_prompts`: per heuristic with classified neurons, mean-ablate
  those neurons at the answer position and record, per prompt, whether it satisfies the
  heuristic and whether it is still answered; :func:`summarise_heuristic_ablation` (and
  :func:`heuristic_ablation`, the two in one) gives the accuracy of each group;
* :func:`correct_vs_incorrect` (Sec. 4.3): per grid prompt, its associated heuristic
  neurons (:func:`arithlib.nikankin.heuristics.prompt_heuristic_neurons`) and their summed
  direct logit contribution to the correct answer (:func:`associated_contributions`).

The neurons and their labels come from :mod:`arithlib.nikankin.operator_analysis` and
:mod:`arithlib.nikankin.heuristics`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ..core.components import Neuron
from ..engine import AnswerPositionRunner
from ..methods import neurons as N
from ..methods.neuron_zeroing import zeroing_runs
from .heuristics import Heuristic, association_matrix, prompt_heuristic_neurons
from .operator_analysis import OperatorAnalysis


def heuristic_ablation_prompts(
    runner: AnswerPositionRunner,
    matches: pd.DataFrame,
    heuristics: Sequence[Heuristic],
    layers: Sequence[int],
    means: torch.Tensor,
    min_prompts: int = 3,
    max_heuristics: int | None = None,
    progress: bool = False,
    clean_runs: dict | None = None,
) -> pd.DataFrame:
    """Nikankin Fig. 7, per prompt: for each heuristic with classified neurons (every
    neuron of ``matches`` labelled with it: pass all matches at t for the paper's
    association), mean-ablate those neurons at the answer position and record, for every
    prompt of the runner, whether it satisfies the heuristic (``associated``) and whether
    its first answer token is still the argmax (``correct``; ``correct_base`` unablated).
    Heuristics with fewer than ``min_prompts`` prompts in either group are skipped;
    ``max_heuristics`` keeps those with the most neurons (then the highest mean match
    score, then the name). One row per heuristic and prompt: heuristic, kind, n_neurons,
    prompt (index into the runner's prompts), associated, correct, correct_base. The
    ablations run together through :func:`arithlib.methods.neuron_zeroing.zeroing_runs`
    (the neurons set to ``means``, [len(layers), d_mlp]; ``clean_runs``: a dict kept across
    calls on the same prompts)."""
    records = runner.prompts.records
    assoc = association_matrix(heuristics, records)
    groups = []
    if matches is not None and not matches.empty:
        for h, sub in matches.groupby("h_index"):
            inside = assoc[int(h)]
            if inside.sum() >= min_prompts and (~inside).sum() >= min_prompts:
                groups.append((h, sub))
    groups.sort(key=lambda g: (-len(g[1]), -g[1]["score"].mean(), heuristics[int(g[0])].name))
    if max_heuristics is not None:
        groups = groups[:max_heuristics]
    cols = ["heuristic", "kind", "n_neurons", "prompt", "associated", "correct", "correct_base"]
    if not groups:
        return pd.DataFrame(columns=cols)
    neuron_sets = [sorted({(int(a), int(b)) for a, b in zip(sub["layer"], sub["neuron"])}) for _, sub in groups]
    fill = {int(x): means[i] for i, x in enumerate(layers)}
    conditions = {"base": {}} | {
        str(j): N.prompt_neuron_masks([ns] * len(records), layers, means.shape[-1]) for j, ns in enumerate(neuron_sets)
    }
    runs = zeroing_runs(
        runner.model,
        runner.prompts,
        conditions,
        targets=runner.answers,
        fill=fill,
        progress=progress,
        clean_runs=clean_runs,
    )
    base_ok = runs["base"].correct.numpy()
    frames = []
    for j, ((h, _), neurons) in enumerate(zip(groups, neuron_sets)):
        frames.append(
            pd.DataFrame(
                {
                    "heuristic": heuristics[int(h)].name,
                    "kind": heuristics[int(h)].kind,
                    "n_neurons": len(neurons),
                    "prompt": np.arange(len(records)),
                    "associated": assoc[int(h)],
                    "correct": runs[str(j)].correct.numpy(),
                    "correct_base": base_ok,
                }
            )
        )
    return pd.concat(frames, ignore_index=True)[cols]


def heuristic_ablation(
    runner: AnswerPositionRunner,
    matches: pd.DataFrame,
    heuristics: Sequence[Heuristic],
    layers: Sequence[int],
    means: torch.Tensor,
    min_prompts: int = 3,
    max_heuristics: int | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Nikankin Fig. 7 per heuristic: :func:`summarise_heuristic_ablation` of
    :func:`heuristic_ablation_prompts`."""
    return summarise_heuristic_ablation(
        heuristic_ablation_prompts(runner, matches, heuristics, layers, means, min_prompts, max_heuristics, progress)
    )


def summarise_heuristic_ablation(rows: pd.DataFrame) -> pd.DataFrame:
    """Per heuristic (and ``op`` when present) of :func:`heuristic_ablation_prompts`' rows:
    first-token accuracy after the ablation on the associated prompts (``acc_assoc``) and
    on the others (``acc_other``), the same without ablation (``base_acc_*``), the group
    sizes and ``n_neurons``."""
    keys = [c for c in ("op", "heuristic", "kind", "n_neurons") if c in rows.columns]
    cols = keys + ["n_assoc", "n_other", "acc_assoc", "acc_other", "base_acc_assoc", "base_acc_other"]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    out = []
    for key, g in rows.groupby(keys, sort=False):
        a = g["associated"].astype(bool).to_numpy()
        c, b = g["correct"].astype(float).to_numpy(), g["correct_base"].astype(float).to_numpy()
        out.append(
            dict(
                zip(keys, key),
                n_assoc=int(a.sum()),
                n_other=int((~a).sum()),
                acc_assoc=float(c[a].mean()),
                acc_other=float(c[~a].mean()),
                base_acc_assoc=float(b[a].mean()),
                base_acc_other=float(b[~a].mean()),
            )
        )
    return pd.DataFrame(out, columns=cols)


def associated_contributions(
    contrib: torch.Tensor, per_prompt: Sequence[Sequence[Neuron]], layers: Sequence[int]
) -> np.ndarray:
    """Sum over each prompt's associated heuristic neurons of their direct logit
    contribution to the correct answer (``contrib`` [N, L, d_mlp] from
    :func:`arithlib.methods.neurons.neuron_logit_contributions`)."""
    if len(per_prompt) != contrib.shape[0]:
        raise ValueError(
            f"one neuron list per prompt of contrib: got {len(per_prompt)} lists for {contrib.shape[0]} prompts"
        )
    pos = {int(x): i for i, x in enumerate(layers)}
    outside = sorted({int(layer) for neurons in per_prompt for layer, _ in neurons} - set(pos))
    if outside:
        raise ValueError(
            f"neurons in layers {outside}, which contrib does not hold (layers {list(pos)}): "
            "compute contrib over every layer the heuristic neurons come from"
        )
    # one gather and one bincount: np.bincount adds each bin's weights in input order, in
    # float64, so every prompt's sum is the sequential sum over its (sorted) neurons
    counts = [len(neurons) for neurons in per_prompt]
    flat = [(pos[int(layer)], int(k)) for neurons in per_prompt for layer, k in neurons]
    if not flat:
        return np.zeros(len(per_prompt))
    where = torch.tensor(flat, dtype=torch.long)
    prompt = torch.repeat_interleave(torch.arange(len(per_prompt)), torch.tensor(counts))
    values = contrib[prompt, where[:, 0], where[:, 1]].double().numpy()
    return np.bincount(prompt.numpy(), weights=values, minlength=len(per_prompt))


def correct_vs_incorrect(
    model, an: OperatorAnalysis, layers: Sequence[int], labels: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Nikankin Sec. 4.3, per grid prompt: whether the first answer token is correct, the
    number of its associated heuristic neurons (by ``labels``, default the circuit's
    matches) and their summed direct logit contribution to the correct answer
    (activation x logit lens of the value vector / final-norm scale,
    :func:`arithlib.methods.neurons.neuron_logit_contributions`)."""
    labels = an.matches if labels is None else labels
    per_prompt = prompt_heuristic_neurons(labels, an.heuristics, an.grid.records)
    contrib = N.neuron_logit_contributions(model, an.grid_acts, layers, an.grid.first_answer_ids, an.grid_scale)
    frame = an.grid.to_frame()[["op", "a", "b", "answer"]]
    return frame.assign(
        correct=an.grid_correct_first,
        correct_full=an.grid_correct_full,
        n_assoc_neurons=[len(x) for x in per_prompt],
        assoc_contribution=associated_contributions(contrib, per_prompt, layers),
    )
