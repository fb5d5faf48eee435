"""Neuron-level attribution, faithfulness and logit lens (arithlib.methods.neurons) on a tiny
random-weight Llama: the answer-position runner equals full forward passes, attribution
patching approximates exact mean ablation, faithfulness is 0 and 1 at its ends, and the
logit lens reproduces the model's own unembedding."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import arithlib.engine as E
import arithlib.methods.ablation as A
import arithlib.methods.neurons as N
import arithlib.nikankin.heuristic_grids as HG
from arithlib.core.evaluate import answer_logits
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(random_model_dir("llama")))


@pytest.fixture(scope="module")
def grid(tiny):
    # operands 0..5 with mixed lengths (the 2-digit results make no prompt longer, so add "-" too)
    return PromptSet.build(
        HG.grid_records("+", (0, 5), fewshot=2) + HG.grid_records("-", (0, 5), fewshot=1), tiny.tokenizer
    )


@pytest.fixture(scope="module")
def setup(tiny, grid):
    layers = [0, 1]
    runner = E.AnswerPositionRunner(tiny.bridge, grid, batch_size=16)
    acts = N.neuron_activations(tiny.bridge, grid, layers)
    means = N.last_position_means(acts)
    return runner, layers, acts, means


def test_default_layers():
    assert N.default_layers(24) == list(range(12, 24))
    assert N.default_layers(4) == [2, 3]
    with pytest.raises(ValueError):
        N.default_layers(0)


def test_runner_equals_full_forward(tiny, grid, setup):
    runner, layers, acts, means = setup
    assert len(grid.length_groups()) == 2
    assert torch.allclose(runner.logits(), answer_logits(tiny.bridge, grid), atol=1e-4)
    # twice in a row: the KV cache is cropped back after each pass
    assert torch.allclose(runner.logits(), runner.logits(), atol=1e-6)


def test_runner_mean_ablation_equals_full_forward_ablation(tiny, grid, setup):
    runner, layers, acts, means = setup
    neurons = [(0, 3), (1, 5), (1, 70)]
    # the shared per-length cache, with the answer-position mean at the last position
    full_cache = {A.post_hook(x): {} for x in layers}
    for length in grid.length_groups():
        for i, x in enumerate(layers):
            m = torch.zeros(length, means.shape[-1])
            m[-1] = means[i]
            full_cache[A.post_hook(x)][length] = m
    with torch.no_grad(), tiny.bridge.hooks(fwd_hooks=A.mean_neurons_hooks(neurons, full_cache, position=-1)):
        ref = answer_logits(tiny.bridge, grid)
    got = runner.logits(A.mean_neurons_hooks(neurons, N.runner_means(means, layers), position=-1))
    assert torch.allclose(got, ref, atol=1e-4)
    assert not torch.allclose(got, runner.logits(), atol=1e-4)


def test_collect_matches_plain_collection(tiny, grid, setup):
    runner, layers, acts, means = setup
    col = runner.collect([A.post_hook(1)])
    assert torch.allclose(col[A.post_hook(1)], acts[:, 1], atol=1e-4)
    assert col["logits"].shape == (len(grid), tiny.info.d_vocab)
    assert means.shape == (2, tiny.info.d_mlp)


def test_attribution_approximates_exact_ablation(tiny, setup):
    runner, layers, acts, means = setup
    cand = N.number_token_ids(tiny.tokenizer, 9)
    attr = N.neuron_attribution(runner, layers, means=means, candidates=cand)
    assert attr.shape == (len(runner), 2, tiny.info.d_mlp)
    top = N.top_neurons_per_layer(N.neuron_scores(attr[:, 1:]), [1], 6)
    exact = N.exact_neuron_effects(runner, top, layers, means, cand)
    approx = np.array([float(attr[:, 1, k].mean()) for _, k in top])
    assert np.corrcoef(approx, exact["effect"].to_numpy())[0, 1] > 0.95
    assert np.allclose(approx, exact["effect"].to_numpy(), rtol=0.2, atol=1e-5)
    # counterfactual baseline equal to the clean activations: zero attribution
    zero = N.neuron_attribution(runner, [1], baseline_acts=acts[:, 1:], candidates=cand)
    assert zero.abs().max() < 1e-5
    with pytest.raises(ValueError, match="exactly one"):
        N.neuron_attribution(runner, [1])


def test_attribution_with_frozen_weights(tiny, setup):
    """Weights without ``requires_grad`` (or a caller under ``no_grad``): the same
    attribution, bit for bit, and the flags untouched."""
    runner, layers, acts, means = setup
    cand = N.number_token_ids(tiny.tokenizer, 9)
    ref = N.neuron_attribution(runner, layers, means=means, candidates=cand)
    params = list(tiny.bridge.parameters())
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        frozen = N.neuron_attribution(runner, layers, means=means, candidates=cand)
        with torch.no_grad():
            in_no_grad = N.neuron_attribution(runner, layers, means=means, candidates=cand)
        assert not any(p.requires_grad for p in params)
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    assert torch.equal(frozen, ref) and torch.equal(in_no_grad, ref)


def test_faithfulness_ends(tiny, setup):
    runner, layers, acts, means = setup
    d = tiny.info.d_mlp
    everything = N.complement([], layers, d)
    assert len(everything) == 2 * d
    full = N.neuron_circuit_faithfulness(runner, everything, layers, means)
    none = N.neuron_circuit_faithfulness(runner, [], layers, means)
    assert full["faithfulness"] == pytest.approx(1.0, abs=1e-4)
    assert full["faithfulness_per_prompt"] == pytest.approx(1.0, abs=1e-4)
    assert none["faithfulness"] == pytest.approx(0.0, abs=1e-6)
    # all but one neuron kept goes through the ablation hooks
    most = N.neuron_circuit_faithfulness(runner, everything[1:], layers, means)
    assert np.isfinite(most["faithfulness"]) and abs(most["faithfulness"] - 1) < 0.5
    assert full["n_neurons"] == 2 * d and none["n_neurons"] == 0


def test_faithfulness_curve_and_k_choice(tiny, setup):
    runner, layers, acts, means = setup
    scores = torch.rand(2, tiny.info.d_mlp, generator=torch.Generator().manual_seed(0))
    ks = N.share_grid(tiny.info.d_mlp, (0, 0.1, 1.0))
    assert ks == [0, 13, 128]
    curve = N.faithfulness_curve(runner, scores, layers, means, ks)
    assert list(curve.k_per_layer) == ks
    assert curve.faithfulness.iloc[-1] == pytest.approx(1.0, abs=1e-4)
    assert N.smallest_faithful_k(curve, 0.99) == 128
    assert N.smallest_faithful_k(curve, -1.0) == 0
    with pytest.raises(ValueError):
        N.share_grid(10, (1.5,))


def test_normalised_logit_faithfulness_arithmetic():
    answers = torch.tensor([0, 1])
    full = torch.tensor([[4.0, 2.0], [1.0, 4.0]])  # y = 1, 1
    ablated = torch.tensor([[1.0, 4.0], [4.0, 2.0]])  # y = 0.25, 0.5
    circuit = torch.tensor([[3.0, 4.0], [4.0, 3.0]])  # y = 0.75, 0.75
    out = N.normalised_logit_faithfulness(circuit, full, ablated, answers)
    assert out["faithfulness_per_prompt"] == pytest.approx(((0.5 / 0.75) + (0.25 / 0.5)) / 2)
    assert out["faithfulness"] == pytest.approx(0.75 / 1.25)
    assert out["accuracy"] == 0.0


def test_top_neurons_and_errors():
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.2, 0.8]])
    assert N.top_neurons_per_layer(scores, [4, 7], 2) == [(4, 1), (4, 2), (7, 0), (7, 2)]
    with pytest.raises(ValueError):
        N.top_neurons_per_layer(scores, [4, 7], 4)
    with pytest.raises(ValueError):
        N.top_neurons_per_layer(scores, [4], 1)


def test_masked_hooks_ablate_per_prompt(tiny, setup):
    runner, layers, acts, means = setup
    n = len(runner)
    per_prompt = [[(1, i % 7), (0, 2)] if i % 2 else [] for i in range(n)]
    got = runner.logits(N.masked_mean_hooks(N.prompt_neuron_masks(per_prompt, layers, tiny.info.d_mlp), means, layers))
    base = runner.logits()
    cache = N.runner_means(means, layers)
    for i in (0, 1, 3):
        if per_prompt[i]:
            ref = runner.logits(A.mean_neurons_hooks(per_prompt[i], cache, position=-1))[i]
        else:
            ref = base[i]
        assert torch.allclose(got[i], ref, atol=1e-4)


def test_logits_many_equals_separate_passes(tiny, setup):
    runner, layers, acts, means = setup
    cache = N.runner_means(means, layers)
    per_prompt = [[(1, i % 7)] if i % 3 else [(0, 2), (1, 9)] for i in range(len(runner))]
    conditions = [
        None,
        A.mean_neurons_hooks([(0, 3), (1, 5)], cache, position=-1),
        [],
        N.masked_mean_hooks(N.prompt_neuron_masks(per_prompt, layers, tiny.info.d_mlp), means, layers),
        A.mean_neurons_hooks(N.complement([], layers, tiny.info.d_mlp), cache, position=-1),
    ]
    separate = [runner.logits(c) for c in conditions]
    for max_rows in (16, 10_000):  # one condition per pass (batches of up to 16 prompts), all in one pass
        together = runner.logits_many(conditions, max_rows=max_rows)
        assert len(together) == len(conditions)
        for got, ref in zip(together, separate):
            assert torch.allclose(got, ref, atol=1e-4)
    assert not torch.allclose(separate[1], separate[0], atol=1e-4)
    assert torch.allclose(runner.logits(), separate[0], atol=1e-6)  # the runner's cache is left as it was


def test_logit_lens_reproduces_unembedding(tiny, grid):
    b = tiny.bridge
    col = N.collect_last_position(b, grid, ["ln_final.hook_in", "ln_final.hook_scale"])
    scale = N.final_norm_scale(col, b)
    lens = N.logit_directions(b, col["ln_final.hook_in"]) / scale[:, None]
    assert torch.allclose(lens, col["logits"], atol=1e-3)
    ids = N.number_token_ids(tiny.tokenizer, 9)
    frame = N.neuron_logit_lens(b, [(1, 0), (1, 5)], ids)
    assert len(frame) == 20 and set(frame.value) == set(range(10))
    direct = N.logit_directions(b, N.value_vectors(b, [(1, 5)]), ids)[0]
    assert np.allclose(frame[frame.neuron == 5].lens.to_numpy(), direct.numpy(), atol=1e-5)


def test_logit_contributions_sum_to_mlp_direct_effect(tiny, grid):
    b = tiny.bridge
    col = N.collect_last_position(b, grid, [A.post_hook(1), "blocks.1.hook_mlp_out", "ln_final.hook_scale"])
    scale = N.final_norm_scale(col, b)
    answers = grid.first_answer_ids
    contrib = N.neuron_logit_contributions(b, col[A.post_hook(1)][:, None], [1], answers, scale)
    total = contrib.sum((1, 2))
    direct = (N.logit_directions(b, col["blocks.1.hook_mlp_out"]) / scale[:, None]).gather(1, answers[:, None])[:, 0]
    assert torch.allclose(total, direct, atol=1e-3)


def test_number_tokens_and_grid_pivot(tiny):
    ids = N.number_token_ids(tiny.tokenizer, 9)
    assert len(ids) == 10 and len(set(ids.tolist())) == 10
    with pytest.raises(ValueError, match="single token"):
        N.number_token_ids(tiny.tokenizer, 12)
    frame = pd.DataFrame({"a": [0, 0, 1], "b": [0, 1, 1]})
    g = N.operand_grid(frame, np.array([1.0, 2.0, 3.0]))
    assert g.loc[1, 1] == 3.0 and np.isnan(g.loc[1, 0])


def test_bad_layers(tiny, setup):
    runner, *_ = setup
    with pytest.raises(ValueError, match="out of range"):
        N.neuron_activations(tiny.bridge, runner.prompts, [5])
    with pytest.raises(ValueError, match="duplicates"):
        N.neuron_activations(tiny.bridge, runner.prompts, [1, 1])


def test_subset_and_greedy(tiny, grid, setup):
    from arithlib.core.evaluate import evaluate

    runner, layers, acts, means = setup
    idx = [5, 0, len(grid) - 1, 7]
    N.neuron_attribution(runner, [1], means=means[1:])  # a gradient pass must leave the cache copyable
    sub = runner.subset(idx)
    assert torch.allclose(sub.logits(), runner.logits()[idx], atol=1e-5)
    assert [r.a for r in sub.prompts.records] == [grid.records[i].a for i in idx]
    frame = evaluate(tiny.bridge, grid)
    assert (runner.greedy_correct() == frame["correct_full"].to_numpy()).all()
    assert torch.allclose(runner.logits(), answer_logits(tiny.bridge, grid), atol=1e-4)  # cache restored
    rec = E.AnswerPositionRunner(tiny.bridge, grid, batch_size=16, record=[A.post_hook(1)])
    assert torch.allclose(rec.clean[A.post_hook(1)], acts[:, 1], atol=1e-4)
    assert torch.allclose(rec.subset(idx).clean["logits"], rec.clean["logits"][idx])


def test_check_answers_equals_the_recorded_pass_and_greedy_decoding(tiny, grid):
    """Teacher forcing over the answers gives the answer position's activations, the
    first-token and the greedy correctness of :meth:`collect` and :meth:`greedy_correct`,
    on answers that the model writes (its own greedy continuations, cut at 1, 2 and 3
    tokens: the stop check decides) and on the grid's answers (mostly wrong)."""
    import dataclasses

    runner = E.AnswerPositionRunner(tiny.bridge, grid, batch_size=16)
    gen = [[] for _ in range(len(grid))]
    for index, past, last, prefix_len in runner._batches:  # the model's own greedy continuation
        nxt = last
        try:
            for _ in range(4):
                out = E.forward(tiny.bridge, nxt, cache=past, keep=1, keep_cache=True)
                past, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
                for row, i in enumerate(index.tolist()):
                    gen[i].append(int(nxt[row, 0]))
        finally:
            runner._restore(past, prefix_len)
    own = dataclasses.replace(grid, answer_ids=[g[: 1 + i % 3] for i, g in enumerate(gen)])
    names = [A.post_hook(1), "ln_final.hook_scale"]
    for prompts in (own, grid):
        r = E.AnswerPositionRunner(tiny.bridge, prompts, batch_size=16)
        got = r.check_answers(names)
        ref = r.collect(names)
        for n in names:
            torch.testing.assert_close(got.acts[n], ref[n], rtol=1e-4, atol=1e-5)
        assert (got.correct_first == N.correct_first(ref["logits"], prompts.first_answer_ids).numpy()).all()
        assert (got.correct_full == r.greedy_correct()).all()
        only_first = r.check_answers(decode=False)
        assert (only_first.correct_full == got.correct_first).all() and not only_first.acts
    assert got.correct_first.mean() < 0.5  # the grid's answers: the random model gets few right
    mine = E.AnswerPositionRunner(tiny.bridge, own, batch_size=16)
    assert mine.check_answers().correct_first.all()
    # the stop check reads the token after the answer: make some of those "go on writing the number"
    go_on = {tiny.tokenizer.decode([gen[i][1 + i % 3]]) for i in range(0, len(own), 5)}
    import arithlib.engine.answer as EA

    ends = EA._ends_answer
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EA, "_ends_answer", lambda text: text not in go_on and ends(text))
        full = mine.check_answers().correct_full
        assert (full == mine.greedy_correct()).all() and 0 < full.sum() < len(own)


def test_value_vectors_gathered_per_layer_equal_one_row_per_neuron(tiny):
    """value_vectors, gathered layer by layer, equals one W_out row per neuron bit for bit,
    in the neurons' order (layers interleaved, a neuron repeated), reading each layer once
    into the cache; no neuron gives an empty [0, d_model]."""
    b = tiny.bridge
    L, K = b.cfg.n_layers, b.cfg.d_mlp
    neurons = [(L - 1, 0), (0, K - 1), (L - 1, 3), (0, 2), (0, K - 1)]
    literal = torch.stack([N.w_out(b, l)[k] for l, k in neurons])
    cache = {}
    assert torch.equal(N.value_vectors(b, neurons, cache), literal)
    assert sorted(cache) == [0, L - 1]
    assert torch.equal(N.value_vectors(b, neurons[:2], cache), literal[:2])
    assert N.value_vectors(b, []).shape == (0, b.cfg.d_model)
