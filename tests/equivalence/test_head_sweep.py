"""Yu's head sweep: the prefix-sharing, layer-resuming engine equals zeroing the head
with a full forward pass at every position; the two-stage sweep reports only exact
numbers; the screen's recall and tie rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.engine as E
import arithlib.methods.ablation as A
import arithlib.methods.knockouts as KO
import arithlib.methods.patching as P
import arithlib.yu.head_sweep as HS
from arithlib.core.evaluate import answer_logits
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir

TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    return load_model(str(random_model_dir(request.param)))


@pytest.fixture(scope="module")
def toy():
    return load_model("toy-arith")


def _full_forward_states(model, tokens: torch.Tensor, head: tuple[int, int]) -> torch.Tensor:
    """The literal intervention: one full forward pass with the head's output zeroed at
    every position (its W_O slice), final-normed state at the last position."""
    store = {}

    def grab(act, hook):
        store["h"] = act[:, -1].clone()

    with torch.no_grad(), model.hooks(fwd_hooks=A.zero_heads_hooks([head]) + [("ln_final.hook_normalized", grab)]):
        model(tokens)
    return store["h"]


def test_zeroed_head_states_equal_full_forward_at_every_position(tiny):
    b = tiny.bridge
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(4, b.cfg.d_vocab, (4, 12), generator=g)
    tokens[:, :8] = tokens[0, :8]  # an 8-token prefix shared by every row
    heads = [(0, 1), (1, 0), (1, 3), (b.cfg.n_layers - 1, 2)]
    got, clean = HS.zeroed_head_states(b, tokens, heads, max_tokens=9)  # several passes per layer
    for j, hd in enumerate(heads):
        torch.testing.assert_close(got[j], _full_forward_states(b, tokens, hd), atol=TOL, rtol=0)
    # the old answer-position screen is a different intervention: it differs for an early head
    old = P.run_variants(b, E.clean_run(b, tokens), [P.ablation_edits([(0, 1)], 0.0, position=-1)])[0]
    assert (old - got[0]).abs().max() > 1e-3


@pytest.mark.toy_model
def test_exact_sweep_equals_reference_and_accuracy(toy):
    b = toy.bridge
    recs = [
        r
        for n in (1, 2)
        for r in ds.yu_prompts(["+", "-"], n_digits=n, n_per_template=4, seed=0, fewshot=2, templates=[3])
    ]
    ps = PromptSet.build(recs, toy.tokenizer)
    heads = [(0, 0), (1, 2), (b.cfg.n_layers - 1, 1)]
    fast = HS.exact_head_sweep(b, ps, heads, progress=False)
    ref = KO.head_sweep(b, ps, heads=heads, position=None, progress=False).sort_values(["layer", "head", "prompt"])
    assert (fast["correct"].to_numpy() == ref["correct"].to_numpy()).all()
    assert (fast["clean_correct"].to_numpy() == ref["clean_correct"].to_numpy()).all()
    layer, head = heads[1]
    with torch.no_grad(), b.hooks(fwd_hooks=A.zero_heads_hooks([(layer, head)])):
        lg = answer_logits(b, ps)
    rows = fast[(fast.layer == layer) & (fast["head"] == head)].sort_values("prompt")
    np.testing.assert_allclose(rows["answer_logit"], lg.gather(1, ps.first_answer_ids[:, None])[:, 0], atol=TOL)


def test_rank_heads_breaks_ties_by_logit_drop_then_index():
    acc = pd.DataFrame(
        {
            "op": "+",
            "n_digits": 1,
            "layer": [0, 0, 1, 2],
            "head": [0, 1, 0, 0],
            "accuracy_drop": [0.0, 0.0, 0.0, 0.1],
            "logit_drop": [0.1, 0.5, 0.5, -1.0],
        }
    )
    r = HS.rank_heads(acc)
    # the accuracy drop first; equal drops by the larger logit drop; equal both by (layer, head)
    assert [(x.layer, x.head) for x in r.itertuples()] == [(2, 0), (0, 1), (1, 0), (0, 0)]
    assert r["rank"].tolist() == [1, 2, 3, 4]


def test_setting_accuracy_relative_drop_and_interval():
    rows = pd.DataFrame(
        {
            "op": "+",
            "n_digits": 1,
            "layer": 0,
            "head": 0,
            "prompt": range(10),
            "correct": [True] * 4 + [False] * 6,
            "clean_correct": [True] * 8 + [False] * 2,
            "answer_logit": 1.0,
            "clean_answer_logit": 2.0,
        }
    )
    acc = HS.setting_accuracy(rows).iloc[0]
    assert acc.accuracy == 0.4 and acc.baseline_accuracy == 0.8 and acc.relative_drop == pytest.approx(0.5)
    assert acc.logit_drop == 1.0 and acc.accuracy_low < 0.4 < acc.accuracy_high


@pytest.mark.toy_model
def test_two_stage_sweep_reports_exact_numbers_and_recall(toy):
    b = toy.bridge
    recs = ds.yu_prompts(["+", "-"], n_digits=1, n_per_template=None, seed=0, fewshot=2, templates=[3])
    ps = PromptSet.build(recs, toy.tokenizer)
    sweep = HS.yu_head_sweep(b, ps, screen_n=6, top_k=3, seed=0, progress=False)
    n_heads = b.cfg.n_layers * b.cfg.n_heads
    assert len(sweep.screen) == 2 * n_heads and (sweep.screen["n"] == 6).all()
    assert (sweep.exact.groupby("op")["n"].first() == ps.to_frame().groupby("op").size()).all()
    assert (sweep.exact.groupby("op").size() == 3).all()
    exact_all = HS.rank_heads(HS.setting_accuracy(HS.exact_head_sweep(b, ps, progress=False)))
    for r in sweep.exact.itertuples():  # stage 2 numbers are the exact sweep's
        e = exact_all[(exact_all.op == r.op) & (exact_all.layer == r.layer) & (exact_all["head"] == r.head)].iloc[0]
        assert r.accuracy == e.accuracy
    rec = HS.sweep_recall(sweep.screen, exact_all, top_k=3, ks=(1, 3))
    assert set(rec["k"]) == {1, 3} and rec["recall"].between(0, 1).all()


@pytest.mark.toy_model
def test_cached_sweep_resumes_with_the_same_rows(toy, tmp_path, monkeypatch):
    """A stopped sweep resumes from the batches it stored; other heads are not served
    from the cache."""
    b = toy.bridge
    recs = ds.yu_prompts(["+", "-"], n_digits=1, n_per_template=4, seed=0, fewshot=2, templates=[3])
    ps = PromptSet.build(recs, toy.tokenizer)
    heads = [(0, 0), (1, 2)]
    plain = HS.exact_head_sweep(b, ps, heads, batch_size=4, progress=False)
    first = HS.exact_head_sweep(b, ps, heads, batch_size=4, progress=False, cache_dir=tmp_path)
    stored = sorted(tmp_path.glob("*.pkl"))
    assert len(stored) >= 2 and not list(tmp_path.glob("*.tmp"))
    pd.testing.assert_frame_equal(first, plain)

    def no_compute(*a, **k):
        raise AssertionError("recomputed a cached batch")

    monkeypatch.setattr(HS, "zeroed_head_states", no_compute)
    pd.testing.assert_frame_equal(
        HS.exact_head_sweep(b, ps, heads, batch_size=4, progress=False, cache_dir=tmp_path), plain
    )
    stored[0].unlink()  # as if stopped before that batch: only it is computed again
    with pytest.raises(AssertionError, match="recomputed"):
        HS.exact_head_sweep(b, ps, heads, batch_size=4, progress=False, cache_dir=tmp_path)
    monkeypatch.undo()
    again = HS.exact_head_sweep(b, ps, heads, batch_size=4, progress=False, cache_dir=tmp_path)
    pd.testing.assert_frame_equal(again, plain)
    monkeypatch.setattr(HS, "zeroed_head_states", no_compute)
    with pytest.raises(AssertionError, match="recomputed"):  # other heads: another key
        HS.exact_head_sweep(b, ps, [(0, 1)], batch_size=4, progress=False, cache_dir=tmp_path)


@pytest.mark.toy_model
def test_a_store_counts_the_reused_batches_compute_time(toy, tmp_path):
    """Given a Store, a resumed sweep adds what its loaded batches took to reused_seconds
    (notebook 01's timings over several sessions)."""
    from arithlib.run.stored import Store

    recs = ds.yu_prompts(["+"], n_digits=1, n_per_template=4, seed=0, fewshot=2, templates=[3])
    ps = PromptSet.build(recs, toy.tokenizer)
    first = Store(tmp_path)
    rows = HS.exact_head_sweep(toy.bridge, ps, [(0, 0)], batch_size=4, progress=False, cache_dir=first)
    assert first.reused_seconds == 0.0 and len(list(tmp_path.glob("*.json"))) == len(list(tmp_path.glob("*.pkl"))) > 0
    later = Store(tmp_path)
    pd.testing.assert_frame_equal(
        HS.exact_head_sweep(toy.bridge, ps, [(0, 0)], batch_size=4, progress=False, cache_dir=later), rows
    )
    assert later.reused_seconds > 0
