"""The controls of Nikankin's heuristic analysis: labels tested against a shuffled-operand
null with the FDR controlled (arithlib.nikankin.heuristic_nulls), the prompt knockout with a
disjoint, layer-matched control and zero ablation (arithlib.nikankin.prompt_knockout, checked
against a transcription of the authors' prompt_knockout_experiment), the operators whose
faithfulness has no denominator (arithlib.nikankin.faithfulness_checks), and the operand grids
(arithlib.nikankin.heuristic_grids)."""

from __future__ import annotations

import random
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch

import arithlib.methods.neurons as N
import arithlib.nikankin.faithfulness_checks as FC
import arithlib.nikankin.heuristic_grids as HG
import arithlib.nikankin.heuristic_nulls as HN
import arithlib.nikankin.heuristics as H
import arithlib.nikankin.operator_analysis as OA
import arithlib.nikankin.prompt_knockout as PK
from arithlib.core.evaluate import answer_logits
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir
from arithlib.engine import AnswerPositionRunner


def _grid_rules(op="+", hi=9):
    recs = HG.grid_records(op, (0, hi), fewshot=2)
    cat = H.heuristic_catalogue((0, hi), (0, 2 * hi))
    heur, assoc = H.usable_heuristics(cat, H.association_matrix(cat, recs))
    return recs, heur, assoc


# --------------------------------------------------------------------------- labels against a null


def test_labels_must_beat_a_shuffled_operand_null():
    """On the 1-digit + grid a third of pure-noise neurons pass t = 0.6 for some rule; with the
    permutation test and BH at 5 % none is labelled, while neurons built on a rule are."""
    recs, heur, assoc = _grid_rules()
    rng = np.random.default_rng(0)
    n = len(recs)
    a, c = np.array([r.a for r in recs]), np.array([r.answer for r in recs])
    planted = [(a <= 2) + 0.1 * rng.normal(size=n), (c % 2 == 0) + 0.1 * rng.normal(size=n)]
    noise = [rng.normal(size=n) for _ in range(60)]
    acts = np.stack(planted + noise, 1)
    test = HN.label_test(acts, assoc, t=0.6, fdr=0.05, seed=0)  # 1,240 permutations: 62 / 0.05
    assert test.n_permutations == 1240
    at_t = (test.scores >= 0.6).any(1)
    assert at_t[:2].all() and at_t[2:].mean() > 0.2  # matching at t alone: chance passes
    assert test.labelled[:2].all() and not test.labelled[2:].any()
    assert test.label_mask[0, [h.name for h in heur].index("op1 in [0, 2]")]
    null = HN.null_label_test(acts, assoc, t=0.6, fdr=0.05, seed=0)
    row = HN.share_row(test, null)
    assert row["labelled_share"] == pytest.approx(2 / 62) and row["labelled_share_null"] == 0.0
    assert row["matched_share"] > 0.2 and row["matched_share_null"] > 0.2


def test_null_scores_are_best_scores_on_shuffled_operand_grids():
    """The b-th null score is the best match score on the grid whose operand pairs are permuted
    by the b-th permutation, for any neuron whose activations fall along the prompts' order;
    a neuron's scores on shuffled grids have that distribution whatever its activations."""
    recs, heur, assoc = _grid_rules()
    n = len(recs)
    null = HN.null_best_scores(assoc, n_permutations=4, seed=4)
    rng = np.random.default_rng(4)
    falling = np.arange(n, 0, -1.0)[:, None]  # prompt 0 highest, no ties
    for b in range(4):
        p = rng.permutation(n)
        shuffled = [recs[i] for i in p]  # prompt j now carries the operands of prompt p[j]
        assert H.match_scores(falling, H.association_matrix(heur, shuffled)).max() == pytest.approx(null[b])
    # any neuron, shuffled over the grid: the same distribution (means of 600 draws within 0.01)
    x = np.random.default_rng(5).normal(size=n)
    draws = [H.match_scores(x[np.random.default_rng(100 + i).permutation(n)][:, None], assoc).max() for i in range(600)]
    assert abs(np.mean(draws) - HN.null_best_scores(assoc, 600, seed=9).mean()) < 0.01
    assert np.array_equal(HN.null_best_scores(assoc, 7, seed=1, chunk=2), HN.null_best_scores(assoc, 7, seed=1))


def test_label_p_values_and_benjamini_hochberg():
    """p(n, h) = (1 + #{b: best_b(n) >= S(n, h)}) / (B + 1); BH as scipy; labels at t of
    labelled neurons up to the BH cut-off."""
    from scipy.stats import false_discovery_control

    recs, heur, assoc = _grid_rules()
    rng = np.random.default_rng(2)
    a = np.array([r.a for r in recs])
    acts = np.stack(
        [(a <= 4) + 0.3 * rng.normal(size=len(recs)) for _ in range(3)]
        + [rng.normal(size=len(recs)) for _ in range(5)],
        1,
    )
    test = HN.label_test(acts, assoc, n_permutations=50, seed=3)
    null = HN.null_best_scores(assoc, 50, seed=3)
    for i in (0, 4):
        h = int(np.argmax(test.scores[i]))
        assert test.p_label[i, h] == pytest.approx((1 + (null >= test.scores[i, h] - 1e-9).sum()) / 51)
    assert np.allclose(test.q_neuron, false_discovery_control(test.p_neuron, method="bh"))
    assert np.array_equal(test.labelled, (test.q_neuron <= 0.05) & (test.scores.max(1) >= 0.6))
    matches = H.classify_neurons(test.scores, [(3, k) for k in range(8)], heur, assoc, 0.6)
    ann = HN.annotate_matches(matches, [(3, k) for k in range(8)], test)
    assert set(ann.columns) >= {"p_value", "q_value", "beats_null"}
    assert HN.beating_null(ann)["neuron"].isin(np.flatnonzero(test.labelled)).all()
    with pytest.raises(ValueError):
        HN.label_test(acts, assoc, fdr=0.0)


# --------------------------------------------------------------------------- prompt knockout (Fig. 8)


def _authors_knockout(relevant_neurons: dict, all_top_neurons: list, cap: int, rnd: random.Random):
    """Transcription of the selection and the control in the authors' prompt_knockout_experiment
    (heuristics_analysis.py): rank the prompt's neurons by how many of its heuristics they
    belong to, keep the first ``cap`` per layer, and per layer sample the control from the
    layer's top neurons minus the kept ones (random.sample raises when the pool is short)."""
    neurons_to_scores = {
        (layer, neuron): len([s for _, s in scores_list]) for (layer, neuron), scores_list in relevant_neurons.items()
    }
    neurons_to_scores = sorted(neurons_to_scores.items(), key=lambda ln_s: ln_s[1], reverse=True)
    layers = set([l for l, _ in all_top_neurons])  # noqa: E741
    relevant = {l: [neuron for ((layer, neuron), _) in neurons_to_scores if l == layer][:cap] for l in layers}  # noqa
    control, pools = {}, {}
    for layer in layers:
        layer_neurons = set([n for (l, n) in all_top_neurons if l == layer])  # noqa: E741
        pools[layer] = sorted(layer_neurons - set(relevant[layer]))
        control[layer] = rnd.sample(list(layer_neurons - set(relevant[layer])), k=len(relevant[layer]))
    return relevant, pools, control


def _saturated(seed=0, layers=(4, 5, 6), k=20, share=0.67):
    """A circuit of k neurons per layer and prompts associated with about ``share`` of it
    (as the 1-digit grids, where a prompt had 395 of 588 circuit neurons associated)."""
    rng = np.random.default_rng(seed)
    circuit = [(l, n) for l in layers for n in range(100, 100 + k)]  # noqa: E741
    prompts = []
    for _ in range(30):
        chosen = [circuit[i] for i in np.flatnonzero(rng.random(len(circuit)) < share)]
        prompts.append({nr: (int(rng.integers(1, 6)), float(rng.random())) for nr in chosen})
    return circuit, prompts


def test_knockout_follows_the_authors_selection_and_control():
    circuit, prompts = _saturated()
    layers = [4, 5, 6]
    for cap in (1, 3, 10):
        for counts in prompts:
            ours = PK.ranked_per_layer(counts, layers, cap)
            # the authors break ties by their dictionary's order: give it ours (score, then index)
            order = sorted(counts, key=lambda nr: (-counts[nr][1], nr))
            relevant = {nr: [("h", 0.7)] * counts[nr][0] for nr in order}
            theirs, pools, control = _authors_knockout(relevant, circuit, cap, random.Random(0))
            assert ours == {layer: theirs[layer] for layer in layers}
            assert PK.control_pools(ours, circuit) == pools
            got = PK.draw_control(ours, circuit, np.random.default_rng(0))
            for layer in layers:  # same size per layer, from the same pool: disjoint and layer-matched
                assert len(got[layer]) == len(control[layer]) == len(ours[layer])
                assert set(got[layer]) <= set(pools[layer]) and not set(got[layer]) & set(ours[layer])


def test_knockout_control_is_disjoint_and_prompts_without_a_pool_are_not_testable():
    circuit, prompts = _saturated(share=0.8)
    layers = [4, 5, 6]
    sets = PK.knockout_sets(prompts, circuit, layers, cap=10, seed=1)  # half of 20: always testable
    assert all(s.testable for s in sets)
    for s in sets:
        abl, ctl = s.neurons("ablated"), s.neurons("control")
        assert not set(abl) & set(ctl) and len(abl) == len(ctl) > 0
        assert sorted(x for x, _ in abl) == sorted(x for x, _ in ctl)  # layer by layer
    circuit, prompts = _saturated(share=0.5)
    big = PK.knockout_sets(prompts, circuit, layers, cap=15, seed=1)  # up to 15 of 20: pools of 5 or more
    testable = [s.testable for s in big]
    assert not all(testable) and any(testable)
    for s, counts in zip(big, prompts):
        relevant = {nr: [("h", 0.5)] * c for nr, (c, _) in sorted(counts.items(), key=lambda kv: (-kv[1][1], kv[0]))}
        try:
            _authors_knockout(relevant, circuit, 15, random.Random(0))
            authors_ok = True
        except ValueError:  # their random.sample fails where the pool is short
            authors_ok = False
        assert s.testable == authors_ok
        if not s.testable:
            assert s.control is None and s.neurons("control") == []
    assert PK.knockout_caps(20, [5 / 200, 25 / 200, 100 / 200, 0.9]) == [1, 2, 10]
    assert PK.verdict_cap(49, 25 / 200) == 6 and PK.verdict_cap(4, 25 / 200) == 1


def test_prompt_rule_counts():
    recs = HG.grid_records("+", (0, 9), fewshot=2)
    heur = [H.Heuristic("operand_range", "op1", (0, 1)), H.Heuristic("result_mod", "result", (2, 0))]
    matches = pd.DataFrame({"layer": [3, 3, 4], "neuron": [1, 1, 7], "h_index": [0, 1, 1], "score": [0.9, 0.7, 0.8]})
    counts = PK.prompt_rule_counts(matches, heur, recs)
    p = next(i for i, r in enumerate(recs) if (r.a, r.b) == (0, 2))  # both rules
    q = next(i for i, r in enumerate(recs) if (r.a, r.b) == (5, 2))  # neither
    assert counts[p] == {(3, 1): (2, pytest.approx(1.6)), (4, 7): (1, pytest.approx(0.8))} and counts[q] == {}
    assert PK.ranked_per_layer(counts[p], [3, 4], 1) == {3: [1], 4: [7]}


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(random_model_dir("llama")))


def test_zero_ablation_equals_the_authors_hook_at_the_answer_position(tiny):
    """The knockout zeroes the neurons' post-activation as the authors' hook does
    (value[:, :, idx] = 0), at the answer position only."""
    grid = PromptSet.build(HG.grid_records("+", (0, 3), fewshot=2), tiny.tokenizer)
    layers = [0, 1]
    runner = AnswerPositionRunner(tiny.bridge, grid, batch_size=8)
    per_prompt = [[(1, i % 5), (0, 3), (1, 40)] if i % 2 else [(0, 7)] for i in range(len(grid))]
    got = runner.logits(PK.zero_hooks(per_prompt, layers, tiny.info.d_mlp))

    def hook_ablate_neurons(value, hook, neuron_indices):  # theirs, restricted to the answer position
        value[:, -1, neuron_indices] = 0
        return value

    for i in (0, 1, 5):
        by_layer = {}
        for layer, k in per_prompt[i]:
            by_layer.setdefault(layer, []).append(k)
        hooks = [
            (N.post_hook(layer), partial(hook_ablate_neurons, neuron_indices=ks)) for layer, ks in by_layer.items()
        ]
        with torch.no_grad(), tiny.bridge.hooks(fwd_hooks=hooks):
            ref = answer_logits(tiny.bridge, grid.subset([i]))[0]
        assert torch.allclose(got[i], ref, atol=1e-4)
    assert not torch.allclose(got, runner.logits(), atol=1e-4)


def test_prompt_knockout_table_on_a_tiny_model(tiny):
    grid = PromptSet.build(HG.grid_records("+", (0, 5), fewshot=2), tiny.tokenizer)
    layers = [1]
    an = OA.prepare_operator(tiny.bridge, grid, layers, n_analysis=12, criterion=None, seed=0, batch_size=8)
    an.scores = torch.rand(1, tiny.info.d_mlp, generator=torch.Generator().manual_seed(0))
    OA.classify_circuit(an, layers, 8, t=0.6)
    matches = H.classify_neurons(an.circuit_scores, an.circuit, an.heuristics, an.assoc, t=0.01)  # many labels
    rows = PK.prompt_knockout(
        an.runner,
        matches,
        an.heuristics,
        an.circuit,
        layers,
        caps=[2, 4, 6],
        d_mlp=tiny.info.d_mlp,
        k_per_layer=8,
        seed=0,
    )
    assert list(rows.columns) == list(PK.COLUMNS) and len(rows) == 3 * 12
    assert (rows.n_ablated <= rows.cap).all() and (rows[rows.testable].n_control == rows[rows.testable].n_ablated).all()
    six = rows[rows.cap == 6]
    assert not six.testable.all()  # 6 of 8 zeroed leaves a pool of 2: not testable
    assert six[~six.testable].correct_random_ablated.isna().all()
    assert rows[rows.cap == 4].testable.all()  # half the layer: always testable
    nothing = PK.prompt_knockout(
        an.runner, matches.iloc[:0], an.heuristics, an.circuit, layers, [2], tiny.info.d_mlp, 8
    )
    assert (nothing.correct_heuristic_ablated == nothing.correct_full).all() and (nothing.n_ablated == 0).all()
    summary = PK.summarise(rows)
    assert set(summary.cap) == {2, 4, 6} and (summary.n_testable <= summary.n_prompts).all()


# --------------------------------------------------------------------------- faithfulness denominators


def test_operators_whose_ablation_changes_nothing_have_no_faithfulness():
    rng = np.random.default_rng(0)
    rows = []
    for op, n in (("+", 30), ("/", 4)):
        for i in range(n):
            abl = 1.0 if op == "/" else 0.8 + 0.05 * rng.random()
            circ = 0.99 + 1e-8 if op == "/" else 0.95
            rows.append(
                {"op": op, "prompt": i, "full": 1.0, "ablated": abl - (3e-8 if op == "/" else 0), "circuit": circ}
            )
    wide = pd.DataFrame(rows).set_index(["op", "prompt"])
    table = FC.denominators(wide)
    assert table.set_index("op").loc["/", "excluded"] and "undefined" in table.set_index("op").loc["/", "reason"]
    assert not table.set_index("op").loc["+", "excluded"]
    assert set(FC.kept(wide, table).index.get_level_values("op")) == {"+"}
    op = pd.factorize(wide.index.get_level_values("op"))[0]
    f = FC.faithfulness_of_kept_operators(wide["circuit"], wide["full"], wide["ablated"], op)
    assert 0.5 < f < 1.0  # the flat operator (float noise 3e-8) is left out, not averaged


# --------------------------------------------------------------------------- operand grids


def test_grids_per_digit_models_get_two_digit_operands():
    toy = HG.operand_ranges(999)
    assert toy == {"+": (0, 99), "-": (0, 99), "*": (0, 31), "/": (0, 31)}
    digits = HG.operand_ranges(9, per_digit_max=99)
    assert set(digits.values()) == {(0, 99)}
    assert HG.operand_ranges(9, per_digit_max=9) == {op: (0, 9) for op in "+-*/"}
    recs = HG.grid_records("+", (0, 99), fewshot=2)
    sub = HG.subsample(recs, 500, seed=0)
    assert len(sub) == 500 and sub == HG.subsample(recs, 500, seed=0) and len({(r.a, r.b) for r in sub}) == 500
    assert HG.subsample(recs, None, 0) == recs and HG.subsample(recs, 20_000, 0) == recs
