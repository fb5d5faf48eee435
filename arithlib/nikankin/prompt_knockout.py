"""Nikankin et al. 2025, Sec. 4.2 and Fig. 8: knocking out a prompt's heuristic neurons
against a layer-matched, disjoint random control.

For each prompt (following the authors' ``heuristics_analysis.prompt_knockout_experiment``):

1. its associated neurons are the circuit neurons labelled with a rule the prompt
   satisfies (:func:`arithlib.nikankin.heuristics.prompt_heuristic_neurons`, here from the labels
   that beat the shuffled-operand null, :mod:`arithlib.nikankin.heuristic_nulls`);
2. in each analysed layer, at most ``cap`` of them are knocked out: those labelled with
   the most of the prompt's rules first (the authors' ranking); ties, which the authors
   leave to the order of their rule dictionary, go to the larger summed match score (the
   paper's text: "the neurons with the highest classification scores"), then to the
   lower neuron index;
3. the control knocks out, in each layer, as many neurons drawn at random (seeded) from
   that layer's circuit neurons minus the knocked-out ones: disjoint from the tested set
   and matched to it layer by layer. When some layer has fewer such neurons than it
   knocks out, the prompt is *not testable* at that cap (the authors' draw would fail);
   it is counted as such and never filled from the tested set;
4. both sets are zeroed (the authors set the post-activation to zero), at the answer
   position (the authors zero every position; the circuit neurons are chosen at the
   answer position), and the first answer token is read (the exact argmax, each row run
   from its lowest zeroed layer: :func:`arithlib.methods.neuron_zeroing.zeroing_runs`).

A prompt without associated neurons knocks out nothing in both conditions (as in the
authors' code). With ``cap`` at most half the circuit's neurons per layer a disjoint
control always exists (the authors sweep the cap from 0 to half their 200-neuron layers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..core.components import Neuron
from ..core.datasets import PromptRecord
from ..engine import AnswerPositionRunner
from ..methods import neurons as N
from ..methods.neuron_zeroing import zeroing_runs
from .heuristics import Heuristic, association_matrix

#: Columns of :func:`prompt_knockout`'s table (one row per prompt and cap).
COLUMNS = (
    "op",
    "a",
    "b",
    "answer",
    "cap",
    "k_per_layer",
    "n_assoc_neurons",
    "n_ablated",
    "n_control",
    "testable",
    "correct_full",
    "correct_heuristic_ablated",
    "correct_random_ablated",
)


@dataclass(frozen=True)
class KnockoutSet:
    """One prompt's knockout at one cap: the tested (ablated) neurons and the control,
    each {layer: [neuron, ...]}; ``control`` is None when the prompt is not testable."""

    ablated: dict[int, list[int]]
    control: dict[int, list[int]] | None

    @property
    def testable(self) -> bool:
        return self.control is not None

    def neurons(self, which: str) -> list[Neuron]:
        sets = self.ablated if which == "ablated" else (self.control or {})
        return [(layer, k) for layer, ks in sets.items() for k in ks]


def knockout_caps(k_per_layer: int, shares: Sequence[float]) -> list[int]:
    """Caps (neurons knocked out per layer) at ``shares`` of a ``k_per_layer`` circuit, each
    rounded and at least 1, kept at most half the layer (so a disjoint control exists);
    sorted, without repeats."""
    half = max(1, k_per_layer // 2)
    return sorted({min(half, max(1, int(round(s * k_per_layer)))) for s in shares})


def verdict_cap(k_per_layer: int, share: float) -> int:
    """The cap the report reads: :func:`knockout_caps` of the one share ``share``."""
    return knockout_caps(k_per_layer, [share])[0]


def prompt_rule_counts(
    matches: pd.DataFrame, heuristics: Sequence[Heuristic], records: Sequence[PromptRecord]
) -> list[dict[Neuron, tuple[int, float]]]:
    """For each prompt, its associated neurons -> (number of the prompt's rules the neuron is
    labelled with, summed match score of those labels). ``matches``: labels with columns
    layer, neuron, h_index, score."""
    if matches is None or matches.empty:
        return [{} for _ in records]
    neurons = sorted({(int(a), int(b)) for a, b in zip(matches["layer"], matches["neuron"])})
    row = {n: i for i, n in enumerate(neurons)}
    used = sorted(set(matches["h_index"].astype(int)))
    col = {h: j for j, h in enumerate(used)}
    count = np.zeros((len(neurons), len(used)))
    score = np.zeros((len(neurons), len(used)))
    for a, b, h, s in zip(matches["layer"], matches["neuron"], matches["h_index"], matches["score"]):
        count[row[(int(a), int(b))], col[int(h)]] = 1.0
        score[row[(int(a), int(b))], col[int(h)]] = float(s)
    assoc = association_matrix([heuristics[h] for h in used], records).astype(float)  # [H_used, N]
    n_rules, s_rules = count @ assoc, score @ assoc  # [n_neurons, N]
    out = []
    for p in range(len(records)):
        hit = np.nonzero(n_rules[:, p] > 0)[0]
        out.append({neurons[i]: (int(round(n_rules[i, p])), float(s_rules[i, p])) for i in hit})
    return out


def ranked_per_layer(counts: dict[Neuron, tuple[int, float]], layers: Sequence[int], cap: int) -> dict[int, list[int]]:
    """Step 2: per layer of ``layers``, the first ``cap`` associated neurons by (rules matched,
    summed score) descending, then neuron index."""
    order = sorted(counts.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0][0], kv[0][1]))
    return {int(layer): [k for (lay, k), _ in order if lay == int(layer)][: max(0, int(cap))] for layer in layers}


def control_pools(ablated: dict[int, list[int]], circuit: Sequence[Neuron]) -> dict[int, list[int]]:
    """Step 3's pools: per layer, the layer's circuit neurons minus the knocked-out ones (sorted)."""
    by_layer: dict[int, set[int]] = {}
    for layer, k in circuit:
        by_layer.setdefault(int(layer), set()).add(int(k))
    return {layer: sorted(by_layer.get(layer, set()) - set(ks)) for layer, ks in ablated.items()}


def draw_control(
    ablated: dict[int, list[int]], circuit: Sequence[Neuron], rng: np.random.Generator
) -> dict[int, list[int]] | None:
    """Step 3: per layer, as many neurons as are knocked out, drawn without replacement from
    :func:`control_pools`; None (not testable) when a layer's pool is too small."""
    pools = control_pools(ablated, circuit)
    if any(len(pools[layer]) < len(ks) for layer, ks in ablated.items()):
        return None
    return {
        layer: sorted(rng.choice(pools[layer], size=len(ks), replace=False).tolist()) if ks else []
        for layer, ks in ablated.items()
    }


def knockout_sets(
    counts: Sequence[dict[Neuron, tuple[int, float]]],
    circuit: Sequence[Neuron],
    layers: Sequence[int],
    cap: int,
    seed: int = 0,
) -> list[KnockoutSet]:
    """Steps 2-3 for every prompt at one cap; the control's draws come from one generator
    seeded by (``seed``, ``cap``), prompt after prompt."""
    rng = np.random.default_rng([int(seed), int(cap)])
    circuit = sorted({(int(a), int(b)) for a, b in circuit})
    out = []
    for c in counts:
        ablated = ranked_per_layer(c, layers, cap)
        out.append(KnockoutSet(ablated, draw_control(ablated, circuit, rng)))
    return out


def zero_hooks(per_prompt: Sequence[Sequence[Neuron]], layers: Sequence[int], d_mlp: int):
    """Hook factory for :class:`AnswerPositionRunner`: zero each prompt's neurons at the
    answer position (:func:`arithlib.methods.neurons.masked_mean_hooks` with zero means)."""
    return N.masked_mean_hooks(
        N.prompt_neuron_masks(per_prompt, layers, d_mlp), torch.zeros(len(layers), d_mlp), layers
    )


def prompt_knockout(
    runner: AnswerPositionRunner,
    matches: pd.DataFrame,
    heuristics: Sequence[Heuristic],
    circuit: Sequence[Neuron],
    layers: Sequence[int],
    caps: Sequence[int],
    d_mlp: int,
    k_per_layer: int,
    seed: int = 0,
    progress: bool = False,
    clean_runs: dict | None = None,
) -> pd.DataFrame:
    """Fig. 8 on the runner's prompts, one row per prompt and cap (:data:`COLUMNS`):
    ``n_assoc_neurons`` (before the cap), ``n_ablated`` / ``n_control`` (knocked out in each
    condition), ``testable`` and the first-token correctness unablated, with the tested
    neurons zeroed and with the control zeroed (NaN where not testable). The conditions
    run together through :func:`arithlib.methods.neuron_zeroing.zeroing_runs` (its
    ``clean_runs``: a dict kept across calls on the same prompts)."""
    records = runner.prompts.records
    counts = prompt_rule_counts(matches, heuristics, records)
    sets = {int(c): knockout_sets(counts, circuit, layers, int(c), seed) for c in caps}
    conditions: dict[str, dict[int, torch.Tensor]] = {"full": {}}
    for c in sets:
        for which in ("ablated", "control"):
            conditions[f"{c} {which}"] = N.prompt_neuron_masks([s.neurons(which) for s in sets[c]], layers, d_mlp)
    runs = zeroing_runs(
        runner.model, runner.prompts, conditions, targets=runner.answers, progress=progress, clean_runs=clean_runs
    )
    ok_full = runs["full"].correct.numpy()
    frame = runner.prompts.to_frame()[["op", "a", "b", "answer"]]
    out = []
    for c in sets:
        testable = np.array([s.testable for s in sets[c]])
        heur = runs[f"{c} ablated"].correct.numpy().astype(float)
        rand = runs[f"{c} control"].correct.numpy().astype(float)
        heur[~testable], rand[~testable] = math.nan, math.nan
        out.append(
            frame.assign(
                cap=c,
                k_per_layer=int(k_per_layer),
                n_assoc_neurons=[len(x) for x in counts],
                n_ablated=[len(s.neurons("ablated")) for s in sets[c]],
                n_control=[len(s.neurons("control")) for s in sets[c]],
                testable=testable,
                correct_full=ok_full,
                correct_heuristic_ablated=heur,
                correct_random_ablated=rand,
            )
        )
    return pd.concat(out, ignore_index=True)[list(COLUMNS)]


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    """Per operator and cap: prompts, testable prompts, mean neurons knocked out, and the
    accuracy unablated / tested set zeroed / control zeroed (over the testable prompts)."""
    t = rows[rows["testable"].astype(bool)]
    g = t.groupby(["op", "cap"])
    out = g.agg(
        n_testable=("a", "size"),
        mean_ablated=("n_ablated", "mean"),
        acc_full=("correct_full", "mean"),
        acc_heuristic_ablated=("correct_heuristic_ablated", "mean"),
        acc_random_ablated=("correct_random_ablated", "mean"),
    ).reset_index()
    n = rows.groupby(["op", "cap"]).size().rename("n_prompts").reset_index()
    return n.merge(out, on=["op", "cap"], how="left").fillna({"n_testable": 0}).astype({"n_testable": int})
