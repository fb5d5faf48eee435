"""CNA (Yu & Ananiadou 2024, Sec. 4): the batched importance equals a per-neuron loop
through the model's own final norm and unembedding; the two-stage mode equals the
exact mode on the neurons it scores; the cached-prefix forward passes equal full
ones; the per-prompt interventions equal the shared ablation hooks row by row; the
pruned concept count equals a brute-force top-k."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.methods.ablation as A
import arithlib.methods.answer_runs as AR
import arithlib.methods.neuron_zeroing as NZ
import arithlib.methods.neurons as N
import arithlib.yu.cna as C
import arithlib.yu.cna_importance as CI
import arithlib.yu.cna_norm as CN
import arithlib.yu.key_heads as KH
import arithlib.yu.mask_keep as MK
import arithlib.yu.pe_dag as DAG
import arithlib.yu.shallow_neurons as SN
from arithlib.core.evaluate import evaluate, greedy_answers
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir
from arithlib.core.readout import final_norm, unembedding
from arithlib.core.stats import decode_correct


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request):
    return load_model(str(random_model_dir(request.param)))


@pytest.fixture(scope="module")
def qwen():
    return load_model(str(random_model_dir("qwen2")))


def _prompts(model, ops=("+",), n=6, fewshot=2):
    recs = ds.yu_prompts(ops=list(ops), n_digits=1, n_per_template=n, templates=[3], fewshot=fewshot, seed=0)
    return PromptSet.build(recs, model.tokenizer)


def _runs(model, ps, head=(1, 0)):
    a = AR.run_last_position(model.bridge, ps)
    b = AR.run_last_position(model.bridge, ps, A.zero_heads_hooks([head]))
    return a, b


def _neuron_masks_literal(sets, d_mlp, keep_layers=None):
    """neuron_masks as first written: one element write per neuron."""
    masks = {}
    if keep_layers is None:
        for i, neurons in enumerate(sets):
            for layer, n in neurons:
                if layer not in masks:
                    masks[layer] = torch.zeros(len(sets), d_mlp, dtype=torch.bool)
                masks[layer][i, n] = True
        return masks
    for layer in keep_layers:
        masks[layer] = torch.ones(len(sets), d_mlp, dtype=torch.bool)
    for i, neurons in enumerate(sets):
        for layer, n in neurons:
            if layer in masks:
                masks[layer][i, n] = False
    return masks


def test_neuron_masks_equal_the_element_by_element_masks():
    g = torch.Generator().manual_seed(0)
    sets = [[(int(l), int(n)) for l, n in torch.randint(0, 6, (k, 2), generator=g).tolist()] for k in range(9)]
    sets[3] = sets[3] + sets[3][:2]  # a neuron twice
    for keep in (None, [5, 1, 4], [7]):  # keep: layers without any set's neuron, in any order
        got, ref = MK.neuron_masks(sets, 8, 6, keep_layers=keep), _neuron_masks_literal(sets, 6, keep)
        assert list(got) == list(ref) and all(torch.equal(got[l], ref[l]) for l in ref)
    per_prompt = N.prompt_neuron_masks(sets, range(6), 6)
    assert all(torch.equal(per_prompt[l], ref) for l, ref in _neuron_masks_literal(sets, 6).items())
    assert not any(per_prompt[l].any() for l in range(6) if l not in _neuron_masks_literal(sets, 6))


def test_run_conditions_stacked_equal_separate_full_runs(tiny):
    b = tiny.bridge
    ps = _prompts(tiny, ops=("+", "-"))
    masks = MK.neuron_masks([[(0, i % 5), (1, 2)] for i in range(len(ps))], 2, tiny.info.d_mlp)
    conds = {
        "plain": None,
        "head": A.zero_heads_hooks([(0, 1)]),
        "neurons": A.zero_neurons_hooks([(1, 3), (0, 7)]),
        "per-prompt": NZ.rowwise_neuron_hooks(masks, position=None),
    }
    for max_rows in (1, 1000):  # one condition per pass, all in one pass
        runs = AR.run_conditions(b, ps, conds, max_rows=max_rows)
        for name, hooks in conds.items():
            ref = AR.run_last_position(b, ps, hooks, share_prefix=False)
            assert torch.equal(runs[name].pred, ref.pred)
            assert torch.allclose(runs[name].logprob, ref.logprob, atol=1e-4)
            assert torch.allclose(runs[name].resid_mid, ref.resid_mid, atol=1e-4)
            assert torch.allclose(runs[name].coef, ref.coef, atol=1e-4)
    assert not torch.allclose(runs["head"].coef, runs["plain"].coef, atol=1e-4)


def test_shared_prefix_gives_full_forward_results_for_every_hook(tiny):
    """Hooks at position -1 (which would also edit the shared prefix's last token) and
    mean ablation (means looked up by length) run unshared: the same numbers as
    ``share_prefix=False``. Zeroing at every position keeps the shared fast path."""
    b = tiny.bridge
    ps = _prompts(tiny, ops=("+", "-"))
    d_mlp = tiny.info.d_mlp
    conds = {
        "heads -1": A.zero_heads_hooks([(0, 0), (0, 1)], position=-1),
        "neurons -1": A.zero_neurons_hooks([(0, j) for j in range(0, d_mlp, 2)], position=-1),
        "keep -1": A.keep_neurons_hooks([(0, 1)], layers=[0], position=-1),
    }
    means = A.mean_activations(b, ps, [A.post_hook(0)])
    mean = {"mean": A.mean_neurons_hooks([(0, j) for j in range(0, d_mlp, 2)], means)}
    for cs in (conds, mean):  # the prefix pass would look up a mean for the prefix's length
        shared = AR.run_conditions(b, ps, cs, share_prefix=True)
        full = AR.run_conditions(b, ps, cs, share_prefix=False)
        for name in cs:
            assert torch.allclose(shared[name].logprob, full[name].logprob, atol=1e-4), name
            assert torch.allclose(shared[name].resid_mid, full[name].resid_mid, atol=1e-4), name
            assert not any(A.is_position_invariant(fn) for _, fn in cs[name])
    fast = A.zero_heads_hooks([(0, 1)]) + A.zero_neurons_hooks([(1, 3)]) + A.keep_neurons_hooks([(1, 2)], layers=[1])
    assert all(A.is_position_invariant(fn) for _, fn in fast)
    assert not A.is_position_invariant(lambda act, hook: act)


def test_capture_matches_full_forward_and_shared_prefix(tiny):
    b = tiny.bridge
    ps = _prompts(tiny, ops=("+", "-"))
    hooks = A.zero_heads_hooks([(0, 1)])
    run = AR.run_last_position(b, ps, hooks)
    full = AR.run_last_position(b, ps, hooks, share_prefix=False)
    assert torch.allclose(run.resid_mid, full.resid_mid, atol=1e-4)
    assert torch.allclose(run.coef, full.coef, atol=1e-4)
    # against the bridge's own forward with hooks
    for batch in ps.batches(64):
        store = {}

        def grab(name):
            def fn(x, hook):
                store[name] = x[:, -1].clone()
                return x

            return fn

        cap = [("blocks.1.hook_resid_mid", grab("mid")), ("blocks.1.mlp.hook_post", grab("post"))]
        with torch.no_grad(), b.hooks(fwd_hooks=hooks + cap):
            logits = b(batch.tokens)[:, -1]
        assert torch.allclose(run.resid_mid[batch.index, 1], store["mid"], atol=1e-4)
        assert torch.allclose(run.coef[batch.index, 1], store["post"], atol=1e-4)
        assert torch.equal(run.pred[batch.index], logits.argmax(-1))
        lp = logits.log_softmax(-1).gather(1, batch.answer_ids[:, None])[:, 0]
        assert torch.allclose(run.logprob[batch.index], lp, atol=1e-4)


def test_exact_importance_equals_per_neuron_loop(tiny):
    b = tiny.bridge
    ps = _prompts(tiny)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    t = ps.first_answer_ids
    for layer in range(tiny.info.n_layers):
        r, m = run.resid_mid[:, layer], run.coef[:, layer]
        batched = CI.exact_importance(r, m, N.w_out(b, layer), t, norm, W_U, b_U, vocab_chunk=100)
        loop = CI.importance_loop(b, r, m, layer, t)
        assert torch.allclose(batched, loop, atol=1e-4), (batched - loop).abs().max()
        blocked = CI.exact_importance(
            r, m, N.w_out(b, layer), t, norm, W_U, b_U, vocab_chunk=64, block_elems=64 * 128 * 2
        )  # two rows per block
        assert torch.allclose(blocked, loop, atol=1e-4)
        K = m.shape[1]
        small = CI.exact_importance(
            r, m, N.w_out(b, layer), t, norm, W_U, b_U, vocab_chunk=4096, block_elems=K * 50
        )  # one row's [K, 4096] block is over the bound
        assert torch.allclose(small, loop, atol=1e-4)
        rows, cols = torch.tensor([0, 2, 2, 1]), torch.tensor([5, 5, 7, 0])
        pairs = CI.exact_importance(r, m, N.w_out(b, layer), t, norm, W_U, b_U, pairs=(rows, cols), vocab_chunk=77)
        assert torch.allclose(pairs, loop[rows, cols], atol=1e-4)


def test_exact_importance_blocks_stay_within_block_elems(tiny, monkeypatch):
    """The logits block never exceeds ``block_elems``, also when one row's [K, vocab_chunk]
    block alone would (the vocabulary chunk shrinks)."""
    b = tiny.bridge
    ps = _prompts(tiny)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    r, m = run.resid_mid[:, 0], run.coef[:, 0]
    sizes = []
    get = CI._Scratch.get
    monkeypatch.setattr(
        CI._Scratch,
        "get",
        lambda self, slot, shape, dtype: sizes.append(math.prod(shape)) or get(self, slot, shape, dtype),
    )
    bound = m.shape[1] * 50
    CI.exact_importance(r, m, N.w_out(b, 0), ps.first_answer_ids, norm, W_U, b_U, vocab_chunk=4096, block_elems=bound)
    assert sizes and max(sizes) <= bound


def test_first_order_is_close_for_small_coefficients(qwen):
    b = qwen.bridge
    ps = _prompts(qwen)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    t = ps.first_answer_ids
    r, m = run.resid_mid[:, 1], run.coef[:, 1] * 1e-3
    stats, base = CI.layer_stats(r, t, norm, W_U, b_U, vocab_chunk=100)
    approx = CI.first_order_importance(r, m, N.w_out(b, 1), t, norm, W_U, stats)
    exact = CI.exact_importance(r, m, N.w_out(b, 1), t, norm, W_U, b_U)
    assert torch.allclose(approx, exact, atol=1e-6, rtol=1e-2)
    loop_base = CI.importance_loop(b, r, torch.zeros_like(m), 1, t)
    assert torch.allclose(loop_base, torch.zeros_like(loop_base), atol=1e-6)


def _layer_stats_literal(resid, targets, norm, W_U, b_U, vocab_chunk, scale=None):
    """layer_stats as first written: every element-wise step a fresh whole tensor."""
    r = CI._centre(resid.float(), norm)
    d = r.shape[-1]
    gr = r * norm.weight
    sigma0 = torch.sqrt(r.pow(2).sum(-1) / d + norm.eps) if scale is None else scale.float()
    beta = CI._beta(norm, W_U, b_U)
    R = r.shape[0]
    m = torch.full((R,), -torch.inf)
    s, pA, q = torch.zeros(R), torch.zeros(R), torch.zeros(R, d)
    for v0 in range(0, W_U.shape[1], vocab_chunk):
        Wc = W_U[:, v0 : v0 + vocab_chunk]
        A = gr @ Wc
        z = A / sigma0[:, None] + beta[v0 : v0 + vocab_chunk]
        m_new = torch.maximum(m, z.max(-1).values)
        carry = torch.exp(m - m_new)
        e = torch.exp(z - m_new[:, None])
        s = s * carry + e.sum(-1)
        pA = pA * carry + (e * A).sum(-1)
        q = q * carry[:, None] + e @ Wc.T
        m = m_new
    pA, q = pA / s, q / s[:, None]
    lse0 = m + torch.log(s)
    A_w = (gr * W_U[:, targets].T).sum(-1)
    return CI.LayerStats(sigma0, A_w, lse0, pA, q), A_w / sigma0 + beta[targets] - lse0


@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("element_block", [1, 7 * 300, CI.ELEMENT_BLOCK])
def test_layer_stats_equal_the_literal_form_bit_for_bit(qwen, with_scale, element_block):
    """The element-wise passes on reused buffers, a block of rows at a time (one row, a few,
    all), compute each statistic by the same operations as whole fresh tensors: equal bit
    for bit, the vocabulary's last, shorter chunk included."""
    b = qwen.bridge
    ps = _prompts(qwen)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    t = ps.first_answer_ids
    r = torch.cat([run.resid_mid[:, layer] for layer in range(qwen.info.n_layers)])  # rows of every layer
    tt = t.repeat(qwen.info.n_layers)
    scale = CN.final_scale(run.final_resid, norm).repeat(qwen.info.n_layers) if with_scale else None
    assert W_U.shape[1] % 300 != 0
    got, got_base = CI.layer_stats(r, tt, norm, W_U, b_U, vocab_chunk=300, scale=scale, element_block=element_block)
    ref, ref_base = _layer_stats_literal(r, tt, norm, W_U, b_U, 300, scale)
    for name in ("sigma0", "A_w", "lse0", "pA", "q"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.equal(got_base, ref_base)


@pytest.mark.parametrize("with_scale", [False, True])
def test_stacked_layer_stats_equal_each_layers_own(qwen, with_scale):
    """Several layers' rows in one vocabulary pass (in groups of any size) give each
    layer's layer_stats: every statistic is per row."""
    b = qwen.bridge
    ps = _prompts(qwen)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    t = ps.first_answer_ids
    scale = CN.final_scale(run.final_resid, norm) if with_scale else None
    layers = list(range(qwen.info.n_layers))
    rows = [run.resid_mid[:, layer] for layer in layers]
    for max_rows in (1, len(t) * 2, 10_000):  # one layer per group, two, all
        stacked = CI.layer_stats_stacked(rows, t, norm, W_U, b_U, vocab_chunk=300, scale=scale, max_rows=max_rows)
        assert len(stacked) == len(layers)
        for r, (stats, base) in zip(rows, stacked):
            own, own_base = CI.layer_stats(r, t, norm, W_U, b_U, vocab_chunk=300, scale=scale)
            for name in ("sigma0", "A_w", "lse0", "pA", "q"):
                assert torch.allclose(getattr(stats, name), getattr(own, name), atol=1e-5), name
            assert torch.allclose(base, own_base, atol=1e-5)


def test_log_partition_does_not_depend_on_the_chunking(qwen):
    """The vocabulary chunk (and its rounding to a multiple of 256 when the block bound
    cuts it) only reorders the online log-sum-exp's additions."""
    b = qwen.bridge
    ps = _prompts(qwen)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    r, m = run.resid_mid[:, 1], run.coef[:, 1]
    rc, v, sigma = CI._pair_terms(r, m, N.w_out(b, 1), norm)
    gr, gv, beta = rc * norm.weight, v * norm.weight, CI._beta(norm, W_U, b_U)
    ref = CI.log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk=W_U.shape[1], block_elems=2**40)
    K = m.shape[1]
    for chunk, block in ((CI.VOCAB_CHUNK, 2**24), (1000, 700 * K), (97, 2**24)):
        got = CI.log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk=chunk, block_elems=block)
        assert torch.allclose(got, ref, atol=1e-5), (chunk, (got - ref).abs().max())


def test_element_blocks_do_not_change_a_bit(qwen):
    """The element-wise passes over logits run in blocks of ``element_block`` values (rows
    and neurons at a time); each (row, neuron) is reduced over its vocabulary chunk only,
    so every block size gives the same bits, with every pair and with chosen pairs."""
    b = qwen.bridge
    ps = _prompts(qwen)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    r, m, t = run.resid_mid[:, 1], run.coef[:, 1], ps.first_answer_ids
    values = N.w_out(b, 1)
    rc, v, sigma = CI._pair_terms(r, m, values, norm)
    gr, gv, beta = rc * norm.weight, v * norm.weight, CI._beta(norm, W_U, b_U)
    K, C = m.shape[1], 256
    ref = CI.log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk=C, block_elems=2**40, element_block=2**40)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, len(t), (300,), generator=g)
    cols = torch.randint(0, K, (300,), generator=g)
    pairs_ref = CI.exact_importance(
        r, m, values, t, norm, W_U, b_U, pairs=(rows, cols), vocab_chunk=C, element_block=2**40
    )
    for block in (C, 7 * C, K * C + C, 3 * K * C):  # one row-neuron, a few neurons, a row and more, rows
        got = CI.log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk=C, block_elems=2**40, element_block=block)
        assert torch.equal(got, ref), block
        pairs = CI.exact_importance(
            r, m, values, t, norm, W_U, b_U, pairs=(rows, cols), vocab_chunk=C, element_block=block
        )
        assert torch.equal(pairs, pairs_ref), block


def test_two_stage_equals_exact_on_scored_neurons(tiny):
    b = tiny.bridge
    ps = _prompts(tiny)
    a, bb = _runs(tiny, ps, head=(0, 1))
    t = ps.first_answer_ids
    exact = C.importance_from_runs(b, [a, bb], t, mode="exact")
    two = C.importance_from_runs(b, [a, bb], t, mode="two_stage", n_candidates=17, vocab_chunk=128)
    scored = torch.isfinite(two["importance"])
    assert scored.sum() == 2 * len(ps) * 17  # every candidate in both runs
    assert torch.allclose(two["importance"][scored], exact["importance"][scored], atol=1e-5)
    assert torch.allclose(two["approx"], exact["approx"], atol=1e-6, equal_nan=True)
    # candidates are the top stage-1 changes of each prompt
    change = (two["approx"][0] - two["approx"][1]).reshape(len(ps), -1)
    for i in range(len(ps)):
        top = set(change[i].topk(17).indices.tolist())
        assert set(scored[0, i].reshape(-1).nonzero().flatten().tolist()) == top


def test_cna_compare_skips_layers_below_the_head(qwen):
    b = qwen.bridge
    ps = _prompts(qwen)
    res = C.cna_compare(b, ps, A.zero_heads_hooks([(1, 2)]), mode="exact", progress=False)
    assert res.layers == [1]
    assert torch.isnan(res.importance_a[:, 0]).all() and torch.isfinite(res.importance_a[:, 1]).all()
    i = 0
    top = res.top(i, 5)
    vals = [float(res.change[i][n]) for n in top]
    assert vals == sorted(vals, reverse=True) and all(l == 1 for l, _ in top)
    frame = res.top_frame(i, 3, tokenizer=qwen.tokenizer, model=b)
    assert list(frame["rank"]) == [1, 2, 3] and "top_tokens" in frame
    assert abs(frame.change[0] - (frame.imp_a[0] - frame.imp_b[0])) < 1e-6
    for j in range(len(ps)):  # one row, bit for bit the row of the whole change tensor
        assert torch.allclose(res.change_of(j), res.change[j], rtol=0, atol=0, equal_nan=True)
    nodes, _ = DAG.pe_dag(b, res, i, k=3)
    assert nodes["change"].tolist() == [float(res.change[i][l, n]) for l, n in zip(nodes.layer, nodes.neuron)]
    two = C.cna_compare(b, ps, A.zero_heads_hooks([(1, 2)]), mode="two_stage", n_candidates=20, progress=False)
    for i in range(len(ps)):
        assert two.top(i, 5) == [n for n in res.top(i, 200) if n in set(two.top(i, 20))][:5]


def test_rowwise_hooks_equal_shared_hooks_row_by_row(tiny):
    b = tiny.bridge
    ps = _prompts(tiny)
    sets = [[(0, i), (1, 2 * i)] for i in range(len(ps))]
    masks = MK.neuron_masks(sets, tiny.info.n_layers, tiny.info.d_mlp)
    keep_masks = MK.neuron_masks(sets, tiny.info.n_layers, tiny.info.d_mlp, keep_layers=[1])
    heads = A.zero_heads_hooks([(1, 1)], position=-1)
    conds = {
        "rows": NZ.rowwise_neuron_hooks(masks),
        "keep": NZ.rowwise_neuron_hooks(keep_masks),
        "heads": heads,
        "none": None,
    }
    runs = AR.run_answer_conditions(b, ps, conds, capture=("coef",), max_rows=7)  # stacked in chunks
    keep = runs["keep"]
    plain = AR.run_last_position(b, ps, None)
    assert torch.allclose(runs["none"].logprob, plain.logprob, atol=1e-4)
    ref_heads = AR.run_last_position(b, ps, heads, share_prefix=False)
    assert torch.allclose(runs["heads"].logprob, ref_heads.logprob, atol=1e-4)
    for i in range(len(ps)):
        one = ps.subset([i])
        ref = AR.run_last_position(b, one, A.zero_neurons_hooks(sets[i], position=-1), share_prefix=False)
        assert torch.allclose(runs["rows"].logprob[i], ref.logprob[0], atol=1e-4)
        assert torch.allclose(runs["rows"].coef[i], ref.coef[0], atol=1e-4)
        assert runs["rows"].coef[i, 1, 2 * i] == 0
        ref_keep = AR.run_last_position(
            b, one, A.keep_neurons_hooks(sets[i], layers=[1], position=-1), share_prefix=False
        )
        assert torch.allclose(keep.logprob[i], ref_keep.logprob[0], atol=1e-4)


def test_correct_mask_equals_greedy_verdict(qwen):
    b = qwen.bridge
    ps = _prompts(qwen, ops=("+", "-"), n=5)
    # make the model's own greedy continuation the answer: all correct by "first"
    _, gen = greedy_answers(b, ps, extra_tokens=0)
    own = PromptSet(ps.records, ps.input_ids, [g[:2] for g in gen], ps.cf_input_ids, ps.tokenizer)
    assert AR.correct_mask(b, own, "first").all()
    frame = evaluate(b, own, full_answer=True)
    assert AR.correct_mask(b, own, "full").tolist() == frame.correct_full.tolist()
    assert AR.correct_mask(b, ps, "full").tolist() == evaluate(b, ps).correct_full.tolist()


def _brute_force_counts(Y: torch.Tensor, W: torch.Tensor, concepts: dict, k: int) -> list[int]:
    """Distinct concepts among each row's top-k tokens, from the whole product (the literal method)."""
    return [len({concepts[t] for t in row.tolist() if t in concepts}) for row in (Y @ W).topk(k, dim=1).indices]


def test_concept_counts_equal_brute_force():
    torch.manual_seed(0)
    W = torch.randn(16, 700)
    Y = torch.randn(300, 16)
    concepts = {i: f"num:{i % 7}" for i in range(0, 700, 9)}
    got = SN.concept_counts(Y, W, concepts, k=50, min_count=1, vocab_chunk=64)
    ref = _brute_force_counts(Y, W, concepts, 50)
    assert got.tolist() == ref
    got2 = SN.concept_counts(Y, W, concepts, k=50, min_count=2, vocab_chunk=64)
    assert got2.tolist() == [r if r >= 2 else 0 for r in ref]
    # the scan order (sample-informed or random) does not change the result
    assert SN.concept_counts(Y, W, concepts, k=50, vocab_chunk=100, n_sample=0, row_chunk=77).tolist() == ref


@pytest.mark.parametrize("ties", [False, True])
def test_merge_top_values_equal_a_whole_topk(ties):
    """The grouped merge gives exactly the k largest values of [top | chunk] on every row
    whose values change, and leaves only rows with no chunk value above their k-th: from
    an empty top (the first chunk, dense), a risen one (sparse), with ties, and at widths
    the groups do not divide (merged whole)."""
    g = torch.Generator().manual_seed(1)
    k = 7
    for w in (16 * 7, 16 * 40, 16 * 40 + 3):
        z0 = torch.randn(40, w, generator=g)
        if ties:
            z0 = z0.mul(2).round()  # many equal values, equal to the k-th among them
        top = torch.full((40, k), -torch.inf)
        for step in range(4):
            z = z0 + step * 0.25 if not ties else z0.roll(step, 1)
            rows, merged = SN.merge_top_values(top, z)
            literal = torch.cat([top, z], 1).topk(k, dim=1).values
            assert torch.equal(merged, literal[rows])
            untouched = torch.ones(len(top), dtype=torch.bool)
            untouched[rows] = False
            assert torch.equal(literal[untouched], top[untouched])
            assert not (z[untouched] > top[untouched, -1:]).any()
            top = literal


def test_concept_counts_grouped_merge_equal_brute_force():
    """The same counts with chunks wide enough for the grouped merge (16 groups and more)."""
    torch.manual_seed(2)
    W = torch.randn(16, 4000)
    Y = torch.randn(500, 16)
    concepts = {i: f"num:{i % 11}" for i in range(0, 4000, 13)}
    ref = _brute_force_counts(Y, W, concepts, 10)
    for chunk in (256, 1024):
        got = SN.concept_counts(Y, W, concepts, k=10, min_count=1, vocab_chunk=chunk)
        assert got.tolist() == ref
        whole = SN.concept_counts(Y, W, concepts, k=10, min_count=1, vocab_chunk=chunk, merge_group=None)
        assert whole.tolist() == ref
        assert SN.concept_counts(Y, W, concepts, k=10, min_count=2, vocab_chunk=chunk).tolist() == [
            r if r >= 2 else 0 for r in ref
        ]


def test_concept_of_counts_numbers_and_operations_only():
    """Yu Sec. 4.4's concepts "related to numbers or operations": digits, English number
    words, operators. Roman and foreign numerals, ordinals and multiples are not (the
    old list counted them and selected 12 % of the shallow neurons at M = 2)."""
    assert SN.concept_of(" 8") == "num:8" and SN.concept_of("Eight") == "num:8" and SN.concept_of("42") == "num:42"
    assert SN.concept_of(" hundred") == "num:100" and SN.concept_of("nineteen") == "num:19"
    assert SN.concept_of(" plus") == "op:add" and SN.concept_of("÷") == "op:div" and SN.concept_of("-") == "op:sub"
    for text in ("VIII", "XV", "acht", "huit", "fifth", "first", "twice", "dozen", "I", "the", " "):
        assert SN.concept_of(text) is None, text


def test_concept_counts_per_row_min_count():
    torch.manual_seed(1)
    W = torch.randn(8, 300)
    Y = torch.randn(120, 8)
    concepts = {i: f"num:{i % 5}" for i in range(0, 300, 4)}
    ref = torch.tensor(_brute_force_counts(Y, W, concepts, 50))
    need = torch.randint(0, 7, (120,))
    got = SN.concept_counts(Y, W, concepts, k=50, min_count=need, vocab_chunk=32)
    assert got.tolist() == torch.where(ref >= need, ref, torch.zeros_like(ref)).tolist()


def test_layer_ov_matches_value_and_output_projections(qwen):
    b = qwen.bridge
    hf = b.original_model
    layer = 1
    attn = hf.model.layers[layer].self_attn
    x = torch.randn(3, qwen.info.d_model)
    g = hf.model.layers[layer].input_layernorm.weight
    with torch.no_grad():
        v = (x * g) @ attn.v_proj.weight.T  # no bias: OV of the direction
        H, kv, dh = qwen.info.n_heads, qwen.info.n_kv_heads, qwen.info.d_head
        v = v.view(3, kv, dh).repeat_interleave(H // kv, dim=1).reshape(3, H * dh)
        ref = v @ attn.o_proj.weight.T
    assert torch.allclose(x @ SN.layer_ov(b, layer), ref, atol=1e-4)


def _sweep_rows(drops: dict, logit: dict | None = None, ops=("+", "-", "/"), digits=(1,)) -> pd.DataFrame:
    """Exact-sweep rows: drops[(op, n_digits)][(layer, head)] (missing head: not measured)."""
    rows = []
    for op in ops:
        for nd in digits:
            for (layer, head), drop in drops.get((op, nd), {}).items():
                rows.append(
                    {
                        "op": op,
                        "n_digits": nd,
                        "layer": layer,
                        "head": head,
                        "accuracy": 1 - drop,
                        "baseline_accuracy": 1.0,
                        "accuracy_drop": drop,
                        "n": 20,
                        "logit_drop": (logit or {}).get((op, nd, layer, head), 0.0),
                    }
                )
    return pd.DataFrame(rows)


def test_key_heads_from_sweep(tmp_path):
    drops = {
        ("+", 1): {(3, 1): 0.5, (2, 0): 0.1, (0, 0): 0.0},
        ("-", 1): {(3, 1): 0.5, (2, 0): 0.2},
        ("/", 1): {(2, 0): 0.5, (3, 1): 0.1},
    }
    frame = _sweep_rows(drops)
    assert KH.key_heads_from_sweep(frame) == {"+-": (3, 1), "/": (2, 0)}
    sel = KH.select_key_heads(frame)
    assert sel.lowers_1d.all() and (sel.selection == KH.KEY_HEAD_BY_1D).all()
    assert sel.set_index("group").loc["+-", "score"] == pytest.approx(0.5)
    with pytest.raises(FileNotFoundError, match="notebook 01"):
        KH.key_heads_from_sweep(tmp_path / "01_yu_head_sweep.csv")
    with pytest.raises(ValueError, match="/"):
        KH.key_heads_from_sweep(frame[frame.op != "/"])
    with pytest.raises(ValueError, match="rerun notebook 01"):  # a sweep from before the exact stage
        KH.key_heads_from_sweep(frame.drop(columns="logit_drop"))


def test_key_head_rule_ties_and_coverage():
    """Heads measured on both + and - come first (a head the sweep measured on + only has
    no known - drop); equal drops go to the larger logit drop, then the lower (layer, head)."""
    drops = {
        ("+", 1): {(5, 0): 0.9, (4, 1): 0.3, (4, 0): 0.3, (1, 1): 0.3},
        ("-", 1): {(4, 1): 0.3, (4, 0): 0.3, (1, 1): 0.3},
        ("/", 1): {(2, 2): 0.2, (2, 1): 0.2},
    }
    logit = {("+", 1, 4, 1): 2.0, ("-", 1, 4, 1): 2.0, ("+", 1, 1, 1): 2.0, ("-", 1, 1, 1): 2.0}
    heads = KH.key_heads_from_sweep(_sweep_rows(drops, logit))
    assert heads == {"+-": (1, 1), "/": (2, 1)}


def test_key_head_fallback_when_no_head_lowers_1d_accuracy():
    """Qwen2.5-0.5B answers every 1D prompt with any one head zeroed: the old rule took a
    1D tie; the fallback states it and ranks by the mean drop over every digit count."""
    drops = {}
    for op in ("+", "-", "/"):
        drops[(op, 1)] = {(0, 0): 0.0, (3, 1): 0.0, (5, 2): 0.0}
        drops[(op, 2)] = {(0, 0): 0.05, (3, 1): 0.40, (5, 2): 0.05}
        drops[(op, 3)] = {(0, 0): 0.0, (3, 1): 0.0, (5, 2): 0.10}
    sel = KH.select_key_heads(_sweep_rows(drops, digits=(1, 2, 3)))
    assert not sel.lowers_1d.any() and (sel.selection == KH.KEY_HEAD_FALLBACK).all()
    assert {r.group: (r.layer, r.head) for r in sel.itertuples()} == {"+-": (3, 1), "/": (3, 1)}
    assert sel.settings_total.tolist() == [6, 3] and sel.score.iloc[0] == pytest.approx(0.4 / 3)
    table = KH.key_head_table(_sweep_rows(drops, digits=(1, 2, 3)), sel)
    assert len(table) == 3 and (table.accuracy_drop == 0).all() and not table.lowers_1d.any()


def test_key_head_from_committed_smollm2_sweep():
    path = Path(__file__).resolve().parents[2] / "figures" / "smollm2-135m" / "01_yu_head_sweep.csv"
    if not path.exists():
        pytest.skip("no committed SmolLM2 sweep")
    sel = KH.select_key_heads(path)
    assert sel.lowers_1d.all()  # SmolLM2 has heads whose removal lowers 1D accuracy
    table = KH.key_head_table(path, sel)
    assert (table.groupby("group").accuracy_drop.mean() > 0).all()


def test_coefficient_decrease_and_lowest_neuron():
    assert C.coefficient_decrease(torch.tensor([2.0, -2.0]), torch.tensor([1.0, -1.0])) == pytest.approx(50.0)
    assert C.coefficient_decrease(torch.tensor([2.0]), torch.tensor([3.0])) == pytest.approx(-50.0)
    imp = torch.zeros(4, 10)
    imp[1, 3], imp[1, 5] = 0.2, 0.7
    assert MK.lowest_neuron([(3, 1), (1, 3), (1, 5), (2, 2)], imp) == (1, 5)
    assert C.deep_layers(32) == list(range(17, 32)) and C.deep_layers(24) == list(range(13, 24))


def test_yu_division_1d():
    recs = C.yu_division_1d(fewshot=2)
    assert len(recs) == 81 and all(r.a == r.b * r.answer for r in recs)
    ref = {(r.a, r.b): r for r in ds.yu_prompts(ops=["/"], n_digits=1, n_per_template=None, templates=[3], fewshot=2)}
    for r in recs:
        if (r.a, r.b) in ref:
            assert r.full_text == ref[(r.a, r.b)].full_text and r.answer_text == ref[(r.a, r.b)].answer_text


def test_tables_run_on_tiny_model(qwen):
    b = qwen.bridge
    ps = _prompts(qwen, ops=("+", "-"), n=4)
    res = C.cna_compare(b, ps, A.zero_heads_hooks([(1, 0)]), mode="exact", progress=False)
    table = MK.mask_keep_table(b, ps, res, ks=(5, 2), n_seeds=2, progress=False)
    assert set(table.intervention) == {"mask", "keep", "random mask", "random keep"} and len(table) == 2 * (2 + 2 * 2)
    assert sorted(table[table.intervention == "random mask"].seed.unique()) == [0, 1]
    only = MK.mask_keep_table(b, ps, res, ks=(5, 2), n_seeds=2, control_ks=[5], progress=False)
    assert set(only[only.intervention.str.startswith("random")].K) == {5} and len(only) == 2 * 2 + 2 * 2
    for row in table.itertuples():
        assert decode_correct(row.correct_by_prompt).mean() == pytest.approx(row.accuracy)
    # zeroing a case's top neurons at the answer position matches zero_neurons_hooks there
    i, top = 0, res.top(0, 5)
    ref = AR.run_last_position(
        b, ps.subset([i]), A.zero_neurons_hooks(top, position=-1), capture=(), share_prefix=False
    )
    runs = AR.run_answer_conditions(
        b,
        ps,
        {"m": NZ.rowwise_neuron_hooks(MK.neuron_masks([res.top(j, 5) for j in range(len(ps))], 2, qwen.info.d_mlp))},
    )
    assert runs["m"].pred[i] == ref.pred[0]
    res0 = C.cna_compare(b, ps, A.zero_heads_hooks([(0, 1)]), mode="exact", progress=False)  # scores layers 0, 1
    summary, per_case = MK.lowest_neuron_table(b, ps, res0, ks=(5,), n_seeds=2, progress=False)
    assert len(per_case) > 0
    assert list(summary.columns[:2]) == ["K", "coef_decrease"] and "random_coef_decrease" in summary
    rnd = per_case[per_case.kind == "random"]
    assert (
        set(rnd.seed) <= {0, 1}
        and (
            rnd.lowest_layer
            == rnd.merge(
                per_case[per_case.kind == "lowest"][["case", "lowest_layer"]], on="case", suffixes=("", "_l")
            ).lowest_layer_l.to_numpy()
        ).all()
    )
    dag = DAG.pe_dag_cases(b, res0, k=5, n_seeds=2, progress=False)
    assert set(dag.kind) == {"top", "random"} and dag.case.nunique() == len(ps)
    # the 'top' rows agree with pe_dag's edges on case 0
    _, edges0 = DAG.pe_dag(b, res0, 0, k=5)
    top0 = dag[(dag.case == 0) & (dag.kind == "top")].iloc[0]
    assert top0.n_pairs == len(edges0) and top0.n_edges == int(edges0.edge.sum())
    nodes, edges = DAG.pe_dag(b, res, 0, k=5)
    assert len(nodes) == 5
    key = DAG.effective_key(b, 1, top[0][1], res.run_a.resid_mid[0, 1])
    assert key.shape == (qwen.info.d_model,)
    x = res.run_a.resid_mid[0, 1]
    eps = 1e-3 * key / key.norm()
    m0 = DAG.mlp_coefficients(b, 1, x[None])[0, top[0][1]]
    m1 = DAG.mlp_coefficients(b, 1, (x + eps)[None])[0, top[0][1]]
    assert torch.allclose(m1 - m0, (key * eps).sum(), rtol=0.05, atol=1e-6)
    counts = SN.shallow_concept_counts(b, qwen.tokenizer, 1, progress=False)
    assert len(counts) == qwen.info.d_mlp and set(counts.ov_layer) <= {-1, 1}
    hid = SN.hidden_interpretable_table(b, ps, counts, ms=(0, 1), n_seeds=3, progress=False)
    assert set(hid.set) == {"hidden-interpretable", "random"} and len(hid) == 2 * (1 + 3)
    assert (hid.paper_n[hid.M == 1] == 10426).all() and (hid.n_shallow == qwen.info.d_mlp).all()
    part = SN.hidden_interpretable_table(b, ps, counts, ms=(0, 1), n_seeds=3, control_ms=[1], progress=False)
    assert part.groupby("M").size().to_dict() == {0: 2, 1: 4}
    for row in hid.itertuples():  # per-case correctness (the report's paired bootstrap) gives the accuracy back
        assert decode_correct(row.correct_by_prompt).mean() == pytest.approx(row.accuracy)
    ex = SN.shallow_neuron_examples(b, ps, 0, key, head_layer=1, n=3)
    assert len(ex) == 3 + 2


def test_tables_refuse_fewer_scored_neurons_than_k(qwen):
    """Two-stage mode scores n_candidates neurons per case: a K above that would label
    rows K while masking fewer neurons."""
    b = qwen.bridge
    ps = _prompts(qwen, ops=("+",), n=3)
    res = C.cna_compare(b, ps, A.zero_heads_hooks([(1, 0)]), mode="two_stage", n_candidates=3, progress=False)
    with pytest.raises(ValueError, match="fewer than 5 finite CNA scores.*raise n_candidates to at least 5"):
        MK.mask_keep_table(b, ps, res, ks=(5,), progress=False)
    with pytest.raises(ValueError, match="raise n_candidates to at least 4"):
        MK.lowest_neuron_table(b, ps, res, ks=(4,), progress=False)
    table = MK.mask_keep_table(b, ps, res, ks=(3,), n_seeds=1, progress=False)
    assert len(table) == 4
    MK.lowest_neuron_table(b, ps, res, ks=(3,), progress=False)


def test_operand_positions_need_one_token_operands(qwen):
    tok = qwen.tokenizer
    ps = _prompts(qwen)
    pos = SN.operand_positions(ps, 0)
    texts = [tok.decode([t]).strip() for t in ps.input_ids[0]]
    assert texts[pos["A"]] == str(ps.records[0].a) and texts[pos["B"]] == str(ps.records[0].b) and pos["A"] < pos["B"]
    two = PromptSet.build(ds.yu_prompts(["+"], n_digits=2, n_per_template=2, templates=[3], fewshot=2), tok)
    with pytest.raises(ValueError, match=r"operand \d+ of '\d+ \+ \d+ = ' is not a single token.*n_digits=1"):
        SN.operand_positions(two, 0)
    words = PromptSet.build(
        ds.yu_prompts(["+"], n_digits=1, numerals="words", n_per_template=2, templates=[3], fewshot=2), tok
    )
    with pytest.raises(ValueError, match="is not a token of its own.*numerals='digits'"):
        SN.operand_positions(words, 0)


def test_concept_tokens_skip_only_ids_past_the_tokenizer():
    class Tok:
        """Three tokens; ids past them raise IndexError (as sentencepiece does)."""

        def __init__(self, broken: int | None = None):
            self.broken = broken

        def __len__(self) -> int:
            return 3

        def decode(self, ids: list[int]) -> str:
            if ids[0] >= 3:
                raise IndexError("piece id is out of range")
            if ids[0] == self.broken:
                raise RuntimeError("broken tokenizer")
            return ["8", "the", " plus"][ids[0]]

    assert SN.concept_tokens(Tok(), vocab_size=5) == {0: "num:8", 2: "op:add"}
    with pytest.raises(RuntimeError, match="broken"):
        SN.concept_tokens(Tok(broken=1), vocab_size=5)


def test_hidden_interpretable_table_runs_each_neuron_set_once(qwen, monkeypatch):
    b = qwen.bridge
    ps = _prompts(qwen, ops=("+", "-"), n=3)
    K = qwen.info.d_mlp
    counts = pd.DataFrame({"layer": [0] * K, "neuron": list(range(K)), "n_concepts": [j % 3 for j in range(K)]})
    calls = []
    real = AR.run_conditions

    def counted(*args, **kwargs):
        calls.append(list(args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(SN, "run_conditions", counted)
    hid = SN.hidden_interpretable_table(b, ps, counts, ms=(0, 1, 2, 5), n_seeds=1, progress=False)
    # base + M=0 (both sets = every neuron, run once) + M=1, M=2 (two sets each); M=5 selects nothing (= base)
    assert len(calls) == 1 and len(calls[0]) == 1 + 1 + 2 + 2
    monkeypatch.setattr(SN, "run_conditions", real)
    every = AR.run_last_position(b, ps, A.zero_neurons_hooks([(0, j) for j in range(K)]), capture=()).accuracy
    base = AR.run_last_position(b, ps, None, capture=()).accuracy
    m0 = hid[hid.M == 0].set_index("set").accuracy
    assert m0["hidden-interpretable"] == m0["random"] == every
    assert (hid[hid.M == 5].accuracy == base).all() and (hid[hid.M == 5].n_neurons == 0).all()


def test_keep_zeroes_exactly_the_layers_cna_scored(qwen, monkeypatch):
    """Yu's keep zeroes the other neurons of layers 17-31, the layers CNA scores from head
    17^22 up; the old default (17/32 of the depth) zeroed layers CNA never scored or
    left scored ones out. With the key head in layer 0 CNA scores layers 0 and 1."""
    b = qwen.bridge
    ps = _prompts(qwen, ops=("+",), n=3)
    for head in ((0, 1), (1, 0)):
        res = C.cna_compare(b, ps, A.zero_heads_hooks([head]), mode="exact", progress=False)
        assert res.layers == list(range(head[0], qwen.info.n_layers))
        seen = {}
        real = MK.zeroing_runs

        def spy(model, prompts, conditions, **kw):
            seen.update(conditions)
            return real(model, prompts, conditions, **kw)

        monkeypatch.setattr(MK, "zeroing_runs", spy)
        table = MK.mask_keep_table(b, ps, res, ks=(3,), n_seeds=1, progress=False)
        monkeypatch.setattr(MK, "zeroing_runs", real)
        for name in ("keep|3|", "random keep|3|0"):
            assert sorted(int(layer) for layer in seen[name]) == res.layers
        assert (table[table.intervention == "keep"].keep_layers == MK.layer_span(res.layers)).all()
    assert MK.layer_span([13, 14, 15, 20]) == "13-15,20"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_layer_ov_factors_multiply_to_the_ov_map(arch):
    b = load_model(str(random_model_dir(arch))).bridge
    for layer in range(b.cfg.n_layers):
        A_, B_ = SN.layer_ov_factors(b, layer)
        assert torch.allclose(A_ @ B_, SN.layer_ov(b, layer), atol=1e-5)


def test_ov_concept_counts_equal_brute_force_over_every_reading_layer():
    """A neuron of MLP l is read by attention layers l+1..H (attention j runs before MLP j);
    it counts the most concepts any of those projections holds."""
    torch.manual_seed(2)
    H, K, d, V = 4, 30, 12, 400
    values = [torch.randn(K, d) for _ in range(H)]
    factors = [(torch.randn(d, 5), torch.randn(5, d)) for _ in range(H)]
    g, W_U = torch.rand(d) + 0.5, torch.randn(d, V)
    concepts = {i: f"num:{i % 6}" for i in range(0, V, 7)}

    def count(vec, j):
        A_, B_ = factors[j - 1]
        top = (((vec @ A_ @ B_) * g) @ W_U).topk(20).indices.tolist()
        return len({concepts[t] for t in top if t in concepts})

    best, where = SN.ov_concept_counts(values, factors, g, W_U, concepts, k=20)
    for l in range(H):
        for n in range(K):
            per_j = {j: count(values[l][n], j) for j in range(l + 1, H + 1)}
            m = max(per_j.values())
            assert best[l * K + n] == m
            assert where[l * K + n] == (min(j for j, c in per_j.items() if c == m) if m > 0 else -1)
    capped, _ = SN.ov_concept_counts(values, factors, g, W_U, concepts, k=20, cap=2)
    assert ((capped == best) | ((capped >= 2) & (best >= 2))).all()
    with pytest.raises(ValueError, match="attention layers 1..4"):
        SN.ov_concept_counts(values, factors[:3], g, W_U, concepts)


# --------------------------------------------------------------------------- the authors' norm reading


def _authors_log_increase(
    hf_model,
    resid_mid: torch.Tensor,
    coef: torch.Tensor,
    fc2_vectors: torch.Tensor,
    final_hidden: torch.Tensor,
    predict_index: int,
    eps: float,
) -> torch.Tensor:
    """A literal transcription of Yu & Ananiadou's ``get_bsvalues`` / ``get_log_increase``
    (their public CNA notebook) for one case and one layer: every candidate vector
    resid_mid + m_k fc2_k, and resid_mid alone, times rsqrt(final_var + eps) (final_var
    from the original run's final hidden state), times the final norm's weight, through
    lm_head; log p(predict_index) increase. Written from their code, not from arithlib."""
    final_var = final_hidden.pow(2).mean(-1, keepdim=True)

    def get_bsvalues(vector):
        vector = vector * torch.rsqrt(final_var + eps)
        vector_rmsn = vector * hf_model.model.norm.weight.data
        return hf_model.lm_head(vector_rmsn).data

    origin_prob_log = torch.log(torch.softmax(get_bsvalues(resid_mid), -1)[predict_index])
    ffn_subvalues = (coef * fc2_vectors).T  # fc2_vectors = down_proj.weight [d, d_mlp]: rows m_k fc2_k
    plus = ffn_subvalues + resid_mid
    probs = torch.softmax(get_bsvalues(plus), -1)[:, predict_index]
    return torch.log(probs) - origin_prob_log


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_final_reading_equals_the_authors_formula_for_every_neuron(arch):
    """One case, every neuron of every layer: the library's exact importance (``cna_compare``
    path: ``importance_from_runs`` in the "final" reading) equals the authors' formula,
    with final_var taken from a plain HF forward pass (the final norm's input)."""
    from arithlib.engine.adapter import hf_module

    model = load_model(str(random_model_dir(arch)))
    b = model.bridge
    hf = hf_module(b)
    ps = _prompts(model, n=2)
    run = AR.run_last_position(b, ps)
    t = ps.first_answer_ids
    seen = {}
    h = hf.model.norm.register_forward_hook(lambda mod, inp, out: seen.__setitem__("final", inp[0][:, -1].detach()))
    try:
        with torch.no_grad():
            hf(torch.tensor([ps.input_ids[0]]))
    finally:
        h.remove()
    assert torch.allclose(run.final_resid[0], seen["final"][0].float(), atol=1e-4)
    ours = C.importance_from_runs(b, [run], t, mode="exact")["importance"][0, 0]  # [L, d_mlp]
    eps = hf.config.rms_norm_eps
    with torch.no_grad():
        for layer in range(model.info.n_layers):
            w = hf.model.layers[layer].mlp.down_proj.weight.data  # [d, d_mlp]
            ref = _authors_log_increase(
                hf, run.resid_mid[0, layer], run.coef[0, layer], w, seen["final"][0].float(), int(t[0]), eps
            )
            assert torch.allclose(ours[layer], ref.float(), atol=1e-4), (layer, (ours[layer] - ref).abs().max())


def test_fast_paths_equal_the_loop_in_the_final_reading(tiny):
    """Exact (all neurons, pairs, blocked), stage 1 and the per-neuron loop agree when every
    vector is read with one fixed scale per row."""
    b = tiny.bridge
    ps = _prompts(tiny)
    run = AR.run_last_position(b, ps)
    norm, (W_U, b_U) = final_norm(b), unembedding(b)
    t = ps.first_answer_ids
    scale = CN.final_scale(run.final_resid, norm)
    for layer in range(tiny.info.n_layers):
        r, m = run.resid_mid[:, layer], run.coef[:, layer]
        loop = CI.importance_loop(b, r, m, layer, t, scale=scale)
        batched = CI.exact_importance(r, m, N.w_out(b, layer), t, norm, W_U, b_U, vocab_chunk=100, scale=scale)
        assert torch.allclose(batched, loop, atol=1e-4), (batched - loop).abs().max()
        rows, cols = torch.tensor([0, 2, 2, 1]), torch.tensor([5, 5, 7, 0])
        pairs = CI.exact_importance(
            r, m, N.w_out(b, layer), t, norm, W_U, b_U, pairs=(rows, cols), vocab_chunk=77, scale=scale
        )
        assert torch.allclose(pairs, loop[rows, cols], atol=1e-4)
        stats, _ = CI.layer_stats(r, t, norm, W_U, b_U, scale=scale)
        small = m * 1e-2  # first order: exact up to O(m^2) (and fp32 noise near 5e-7)
        approx = CI.first_order_importance(r, small, N.w_out(b, layer), t, norm, W_U, stats, scale)
        exact_small = CI.exact_importance(r, small, N.w_out(b, layer), t, norm, W_U, b_U, scale=scale)
        assert torch.allclose(approx, exact_small, atol=2e-6, rtol=5e-2), (approx - exact_small).abs().max()


def test_both_runs_are_read_with_the_original_runs_final_scale(qwen):
    """Run b (head zeroed) is read with run a's scale: its importance equals the loop with
    run a's scale, not with its own final state's; and the two readings differ."""
    b = qwen.bridge
    ps = _prompts(qwen)
    res = C.cna_compare(b, ps, A.zero_heads_hooks([(0, 1)]), mode="exact", progress=False)
    own = C.cna_compare(b, ps, A.zero_heads_hooks([(0, 1)]), mode="exact", progress=False, norm_reading="own")
    assert res.norm_reading == "final" and own.norm_reading == "own"
    norm = final_norm(b)
    scale_a = CN.final_scale(res.run_a.final_resid, norm)
    assert not torch.allclose(scale_a, CN.final_scale(res.run_b.final_resid, norm))
    for layer in res.layers:
        ref_b = CI.importance_loop(
            b, res.run_b.resid_mid[:, layer], res.run_b.coef[:, layer], layer, res.targets, scale=scale_a
        )
        assert torch.allclose(res.importance_b[:, layer], ref_b, atol=1e-4)
        ref_own = CI.importance_loop(b, res.run_b.resid_mid[:, layer], res.run_b.coef[:, layer], layer, res.targets)
        assert torch.allclose(own.importance_b[:, layer], ref_own, atol=1e-4)
    assert not torch.allclose(res.importance_a[:, res.layers], own.importance_a[:, res.layers], atol=1e-3)
    with pytest.raises(ValueError, match="norm_reading"):
        C.cna_compare(b, ps, None, mode="exact", progress=False, norm_reading="rms")


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "gpt2"])  # sequential blocks
def test_a_neurons_own_rows_give_its_coefficient_as_the_whole_mlp_does(arch):
    """PE-DAG's fast path: one neuron's gate and up rows (and bias, and the MLP's own
    activation) equal the whole MLP's coefficient at that neuron, gated or not."""
    from arithlib.core.random_models import load_random_model

    b = load_random_model(arch).bridge
    g = torch.Generator().manual_seed(0)
    for layer in range(b.cfg.n_layers):
        x = torch.randn(7, b.cfg.d_model, generator=g)
        neurons = [0, 3, b.cfg.d_mlp - 1]
        whole = DAG.mlp_coefficients(b, layer, x)[:, neurons]
        assert torch.allclose(DAG.neuron_coefficients(b, layer, neurons, x), whole, rtol=1e-5, atol=1e-6)


def test_pe_dag_on_neuron_rows_equals_pe_dag_on_the_whole_mlp(qwen, monkeypatch):
    """pe_dag_cases and pe_dag with neuron_coefficients against the literal method (every
    coefficient read off a pass through the whole MLP, every value vector read one by one)."""
    b, ps = qwen.bridge, _prompts(qwen)
    res = C.cna_compare(b, ps, A.zero_heads_hooks([(0, 1)]), mode="exact", progress=False)
    fast = DAG.pe_dag_cases(b, res, k=5, n_seeds=2, progress=False)
    fast_nodes, fast_edges = DAG.pe_dag(b, res, 0, k=5)
    monkeypatch.setattr(DAG, "neuron_coefficients", lambda m, l, ns, x: DAG.mlp_coefficients(m, l, x)[:, list(ns)])
    monkeypatch.setattr(DAG, "value_vectors", lambda m, ns, cache: torch.stack([N.w_out(m, l)[k] for l, k in ns]))
    literal = DAG.pe_dag_cases(b, res, k=5, n_seeds=2, progress=False)
    nodes, edges = DAG.pe_dag(b, res, 0, k=5)
    pd.testing.assert_frame_equal(fast, literal, rtol=1e-4, atol=1e-6)
    pd.testing.assert_frame_equal(fast_edges, edges, rtol=1e-4, atol=1e-6)
    pd.testing.assert_frame_equal(fast_nodes, nodes)
