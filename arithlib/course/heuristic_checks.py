"""Checks for exercise 03, Nikankin et al.'s bag of heuristics (``notebooks/exercises/03_*``),
on the toy model's addition grid: a neuron's match score with a rule (Sec. 4.1), a prompt's
associated heuristic neurons (Sec. 4.2) and the layer-matched, disjoint random control of the
prompt knockout (Fig. 8). As in :mod:`arithlib.course.exercises`, a check prints one line when
the student's function agrees with arithlib's and raises :class:`CheckFailed` saying what
differs (naming the usual mistake where it recognises one) when it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from ..core.prompt_sets import PromptSet
from ..methods import neurons as N
from ..nikankin import heuristic_grids as HG
from ..nikankin import operator_analysis as OA
from ..nikankin import prompt_knockout as PK
from ..nikankin.heuristics import match_scores, prompt_heuristic_neurons
from .exercises import CheckFailed, check_model, passed

#: The toy model's addition grid the checks use: every pair of operands in this range.
OPERANDS = (0, 29)
#: Circuit neurons per analysed layer, and the match-score threshold (Nikankin's t).
K_PER_LAYER, T = 20, 0.6


@dataclass(frozen=True)
class HeuristicData:
    """The toy model's addition grid analysed as notebook 03 does, small: the grid's
    ``analysis`` (:class:`arithlib.nikankin.operator_analysis.OperatorAnalysis`, its circuit
    of :data:`K_PER_LAYER` neurons per layer chosen by attribution on 60 prompts and classified
    at :data:`T`, and 60 held-out prompts), the analysed ``layers`` and the circuit neurons'
    grid activations ``acts`` [grid prompts, circuit neurons]."""

    analysis: OA.OperatorAnalysis
    layers: list[int]
    acts: np.ndarray


@lru_cache(maxsize=1)
def heuristic_data() -> HeuristicData:
    """The grid, circuit and labels every notebook-03 check uses (:class:`HeuristicData`)."""
    model = check_model()
    bridge = model.bridge
    layers = N.default_layers(bridge.cfg.n_layers)
    grid = PromptSet.build(HG.grid_records("+", OPERANDS, fewshot=2), model.tokenizer)
    an = OA.prepare_operator(bridge, grid, layers, 60, "first", 0, 64, n_heldout=60)
    OA.attribute(an, layers, OA.reference_means({"+": an}))
    OA.classify_circuit(an, layers, K_PER_LAYER, T, 0.5, 0)
    return HeuristicData(an, layers, OA.neuron_matrix(an.grid_acts, an.circuit, layers))


def _wrong_match_scores(acts: np.ndarray, sat: np.ndarray) -> dict[str, float]:
    """What the usual mistakes compute, for the message of :func:`check_match_score`."""
    s, n = int(sat.sum()), len(sat)
    order = np.argsort(-acts, kind="stable")
    return {
        "the share of the 10 top-activating prompts (the top set must have the rule's size s_h, "
        "the number of prompts that satisfy it)": float(sat[order[:10]].mean()),
        "divided by the number of prompts N instead of by s_h": float(sat[order[:s]].sum() / n),
        "the lowest-activating prompts instead of the highest": float(sat[order[::-1][:s]].mean()),
        "the rule's base rate s_h / N": s / n,
    }


def check_match_score(fn: Callable) -> None:
    """``fn(acts, satisfies)`` (``acts`` [N] one neuron's activations over the grid, ``satisfies``
    [N] bool, which prompts satisfy one rule): the share of the neuron's s_h top-activating
    prompts that satisfy the rule, s_h = ``satisfies.sum()``; checked on every circuit neuron
    against its best rule and three others, against
    :func:`arithlib.nikankin.heuristics.match_scores`."""
    data = heuristic_data()
    an, rng = data.analysis, np.random.default_rng(0)
    checked = 0
    for j in range(data.acts.shape[1]):
        acts = data.acts[:, j]
        top = np.sort(acts)[::-1]
        best = int(np.argmax(an.circuit_scores[j]))
        for h in [best, *rng.choice(len(an.heuristics), 3, replace=False).tolist()]:
            sat = an.assoc[h].astype(bool)
            s = int(sat.sum())
            if s < len(acts) and np.isclose(top[s - 1], top[s]):
                continue  # a tie at the edge of the top set: the reference breaks it at random
            ref = float(match_scores(acts[:, None], sat[None])[0, 0])
            mine = fn(acts.copy(), sat.copy())
            if not np.isscalar(mine) and np.asarray(mine).shape != ():
                raise CheckFailed(f"match_score should return one number, got {type(mine).__name__}")
            if abs(float(mine) - ref) > 1e-9:
                why = [w for w, v in _wrong_match_scores(acts, sat).items() if abs(v - float(mine)) < 1e-9]
                raise CheckFailed(
                    f"match_score of neuron {an.circuit[j]} with '{an.heuristics[h].name}' is {float(mine):.4f}, "
                    f"expected {ref:.4f}" + (f": your value is {why[0]}" if why else "")
                )
            checked += 1
    passed(f"match_score matches arithlib.nikankin.heuristics.match_scores on {checked} (neuron, rule) pairs")


def check_associated_neurons(fn: Callable) -> None:
    """``fn(matches, heuristics, record)``: the circuit neurons labelled (in ``matches``, one
    row per neuron and rule, with the rule's index ``h_index`` into ``heuristics``) with a rule
    the prompt ``record`` satisfies, as a sorted list of (layer, neuron), each once; against
    :func:`arithlib.nikankin.heuristics.prompt_heuristic_neurons` on 100 grid prompts."""
    an = heuristic_data().analysis
    records = an.grid.records[:: max(1, len(an.grid) // 100)]
    refs = prompt_heuristic_neurons(an.matches, an.heuristics, records)
    every = sorted({(int(a), int(b)) for a, b in zip(an.matches["layer"], an.matches["neuron"])})
    for rec, ref in zip(records, refs):
        mine = fn(an.matches.copy(), list(an.heuristics), rec)
        try:
            mine_list = [(int(a), int(b)) for a, b in mine]
        except (TypeError, ValueError):
            raise CheckFailed("associated_neurons should return a list of (layer, neuron) pairs") from None
        if mine_list == ref:
            continue
        where = f"for {rec.a} + {rec.b} = {rec.answer}"
        if sorted(set(mine_list)) == ref:
            raise CheckFailed(f"associated_neurons {where}: the right neurons, but return them sorted and each once")
        if sorted(set(mine_list)) == every and ref != every:
            raise CheckFailed(
                f"associated_neurons {where}: you return every labelled neuron; keep those whose rule the "
                "prompt satisfies (heuristics[h].mask(a, b, result))"
            )
        extra, missing = sorted(set(mine_list) - set(ref)), sorted(set(ref) - set(mine_list))
        raise CheckFailed(
            f"associated_neurons {where}: {len(extra)} neurons too many {extra[:5]}, {len(missing)} missing {missing[:5]}"
        )
    passed(
        f"associated_neurons matches arithlib.nikankin.heuristics.prompt_heuristic_neurons on {len(records)} prompts"
    )


def _control_cases() -> list[tuple[dict[int, list[int]], list[tuple[int, int]], bool]]:
    """(ablated, circuit, testable) cases for :func:`check_draw_control`."""
    circuit = [(0, k) for k in range(0, 20, 2)] + [(1, k) for k in range(5, 13)] + [(2, k) for k in (1, 2, 3)]
    return [
        ({0: [0, 2, 4], 1: [5]}, circuit, True),
        ({0: [6], 1: [5, 6, 7, 8], 2: [1]}, circuit, True),
        ({0: [], 1: [9], 2: []}, circuit, True),
        ({2: [1, 2]}, circuit, False),  # layer 2 has 3 circuit neurons: 1 left for a control of 2
        ({1: [5, 6, 7, 8, 9]}, circuit, False),
    ]


def check_draw_control(fn: Callable) -> None:
    """``fn(ablated, circuit, rng)``: per layer of ``ablated`` ({layer: [neuron, ...]}), as many
    neurons drawn at random (with ``rng``, a numpy Generator) from that layer's circuit neurons
    minus the ablated ones, sorted; None when some layer has too few (the prompt is not
    testable). Checked by its properties (layer-matched, disjoint, the right sizes, None when it
    must be) and by its randomness (every eligible neuron drawn, about equally often), as
    :func:`arithlib.nikankin.prompt_knockout.draw_control` draws."""
    for ablated, circuit, testable in _control_cases():
        control = fn({k: list(v) for k, v in ablated.items()}, list(circuit), np.random.default_rng(0))
        if not testable:
            if control is not None:
                raise CheckFailed(
                    f"draw_control({ablated}) should return None: a layer has fewer eligible neurons than "
                    "it ablates, so no disjoint, layer-matched control exists (do not fill it from the ablated set)"
                )
            continue
        if control is None:
            raise CheckFailed(f"draw_control({ablated}) returned None, but every layer has enough eligible neurons")
        if set(control) != set(ablated):
            raise CheckFailed(f"draw_control({ablated}): return the same layers as ablated, got {sorted(control)}")
        pools = PK.control_pools(ablated, circuit)
        for layer, ks in ablated.items():
            mine = [int(k) for k in control[layer]]
            if len(mine) != len(ks):
                raise CheckFailed(f"draw_control: layer {layer} ablates {len(ks)} neurons, its control has {len(mine)}")
            if len(set(mine)) != len(mine):
                raise CheckFailed(f"draw_control: layer {layer}'s control repeats a neuron: draw without replacement")
            if set(mine) & set(ks):
                raise CheckFailed(
                    f"draw_control: layer {layer}'s control overlaps the ablated neurons: it must be disjoint"
                )
            if not set(mine) <= set(pools[layer]):
                raise CheckFailed(
                    f"draw_control: layer {layer}'s control has neurons that are not that layer's circuit neurons "
                    f"{sorted(set(mine) - set(pools[layer]))}: draw each layer's control from its own layer"
                )
            if mine != sorted(mine):
                raise CheckFailed(f"draw_control: sort each layer's control (layer {layer}: {mine})")
    # randomness: over many draws every eligible neuron comes up, about equally often
    ablated, circuit, _ = _control_cases()[0]
    rng = np.random.default_rng(1)
    counts: dict[int, int] = {}
    for _ in range(400):
        for k in fn({0: [0, 2, 4]}, list(circuit), rng)[0]:
            counts[int(k)] = counts.get(int(k), 0) + 1
    pool = PK.control_pools({0: [0, 2, 4]}, circuit)[0]
    if sorted(counts) != pool:
        raise CheckFailed(
            f"draw_control: over 400 draws only {sorted(counts)} came up of the eligible {pool}: draw at random"
        )
    share = np.array([counts[k] for k in pool]) / (400 * 3)
    if np.abs(share - 1 / len(pool)).max() > 0.06:
        raise CheckFailed(
            f"draw_control: the eligible neurons are not drawn about equally often ({np.round(share, 3)})"
        )
    passed("draw_control gives layer-matched, disjoint random controls and None when none exists")


def knockout_accuracy(associated: Callable, draw_control: Callable, cap: int = 5, seed: int = 0) -> pd.DataFrame:
    """Fig. 8 in small with the student's functions: on the held-out prompts, zero each prompt's
    associated neurons (at most ``cap`` per layer, those labelled with the most of its rules
    first) or as many from a random control (``draw_control``), at the answer position; the
    first-token accuracy of each condition, over the prompts that are testable."""
    data = heuristic_data()
    an = data.analysis
    runner = an.heldout_runner
    records = runner.prompts.records
    counts = PK.prompt_rule_counts(an.matches, an.heuristics, records)
    rng = np.random.default_rng(seed)
    ablated, control, testable = [], [], []
    for rec, c in zip(records, counts):
        mine = set(associated(an.matches, list(an.heuristics), rec))
        tested = PK.ranked_per_layer({n: v for n, v in c.items() if n in mine}, data.layers, cap)
        drawn = draw_control(tested, list(an.circuit), rng)
        testable.append(drawn is not None)
        ablated.append([(layer, k) for layer, ks in tested.items() for k in ks])
        control.append([(layer, k) for layer, ks in (drawn or {}).items() for k in ks])
    d_mlp = an.grid_acts.shape[-1]
    full, abl, ctl = runner.logits_many(
        [None, PK.zero_hooks(ablated, data.layers, d_mlp), PK.zero_hooks(control, data.layers, d_mlp)]
    )
    ok = np.array(testable)
    rows = []
    for name, logits in (("no knockout", full), ("associated neurons zeroed", abl), ("random control zeroed", ctl)):
        correct = N.correct_first(logits, runner.answers).numpy()[ok]
        rows.append({"condition": name, "accuracy": float(correct.mean()), "prompts": int(ok.sum())})
    return pd.DataFrame(rows)
