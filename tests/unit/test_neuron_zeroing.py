"""Per-prompt neuron zeroing at the answer position: the fast path (each row from its
lowest zeroed layer) equals the literal
one (every row through every layer, the full logits), for row sets that start in every
layer, stay clean, or zero whole layers; the tables of mask / keep and the lowest neuron
are the same either way."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.methods.ablation as A
import arithlib.methods.neuron_zeroing as NZ
import arithlib.yu.cna as C
import arithlib.yu.mask_keep as MK
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir
from arithlib.engine import clean_run, resume, resume_rows


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request):
    return load_model(str(random_model_dir(request.param)))


def _prompts(model, ops=("+", "-"), n=4, fewshot=2):
    recs = ds.yu_prompts(ops=list(ops), n_digits=1, n_per_template=n, templates=[0, 3], fewshot=fewshot, seed=0)
    return PromptSet.build(recs, model.tokenizer)


def _conditions(model, N: int, seed: int = 0) -> dict[str, dict[int, torch.Tensor]]:
    """Random per-prompt sets: some prompts untouched, some in layer 0 only, some in the
    last layer only, whole layers kept."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    out: dict[str, dict[int, torch.Tensor]] = {"none": {}}
    for name, size in (("few", 3), ("many", 40)):
        sets = []
        for i in range(N):
            kind = i % 4
            layers = (
                []
                if kind == 0
                else [0]
                if kind == 1
                else [cfg.n_layers - 1]
                if kind == 2
                else list(range(cfg.n_layers))
            )
            sets.append(
                [
                    (l, int(torch.randint(cfg.d_mlp, (1,), generator=g)))
                    for l in layers
                    for _ in range(size // max(len(layers), 1))
                ]
            )
        out[name] = MK.neuron_masks(sets, cfg.n_layers, cfg.d_mlp)
        out[f"keep {name}"] = MK.neuron_masks(sets, cfg.n_layers, cfg.d_mlp, keep_layers=[cfg.n_layers - 1])
    return out


def test_fast_runs_equal_the_literal_runs(tiny):
    b = tiny.bridge
    ps = _prompts(tiny)
    conds = _conditions(b, len(ps))
    fast = NZ.zeroing_runs(b, ps, conds, capture_coef=True, batch_size=5, max_rows=7)
    ref = NZ.zeroing_runs_literal(b, ps, conds, capture_coef=True, batch_size=5)
    for name in conds:
        assert torch.equal(fast[name].pred, ref[name].pred), name
        torch.testing.assert_close(fast[name].coef, ref[name].coef, rtol=1e-4, atol=1e-5, msg=name)
    assert fast["none"].accuracy == ref["none"].accuracy


def test_fill_sets_the_masked_neurons_to_the_given_values_as_mean_ablation_does(tiny):
    """With ``fill`` the masked neurons take the layer's values: the literal runs equal the
    answer-position runner with :func:`arithlib.methods.ablation.mean_neurons_hooks` on a
    fixed neuron set, and the fast runs equal the literal ones; a masked layer without
    values is refused before any pass."""
    from arithlib.engine import AnswerPositionRunner
    from arithlib.methods import neurons as N

    b = tiny.bridge
    ps = _prompts(tiny)
    L, d = b.cfg.n_layers, b.cfg.d_mlp
    layers = list(range(L))
    means = torch.randn(L, d, generator=torch.Generator().manual_seed(3))
    fill = {l: means[l] for l in layers}
    fixed = [(0, 1), (0, 7), (L - 1, 2), (L - 1, 5)]
    conds = _conditions(b, len(ps)) | {"fixed": N.prompt_neuron_masks([fixed] * len(ps), layers, d)}
    fast = NZ.zeroing_runs(b, ps, conds, capture_coef=True, batch_size=5, max_rows=7, fill=fill)
    ref = NZ.zeroing_runs_literal(b, ps, conds, capture_coef=True, batch_size=5, fill=fill)
    for name in conds:
        assert torch.equal(fast[name].pred, ref[name].pred), name
        torch.testing.assert_close(fast[name].coef, ref[name].coef, rtol=1e-4, atol=1e-5, msg=name)
    runner = AnswerPositionRunner(b, ps, batch_size=5)
    logits = runner.logits(A.mean_neurons_hooks(fixed, N.runner_means(means, layers), position=-1))
    assert torch.equal(ref["fixed"].pred, logits.argmax(-1))
    assert (ref["fixed"].coef[:, 0, 1] == means[0, 1]).all() and (
        ref["fixed"].coef[:, L - 1, 5] == means[L - 1, 5]
    ).all()
    with pytest.raises(ValueError, match="fill has no values for layers"):
        NZ.zeroing_runs(b, ps, conds, fill={0: means[0]})


def test_clean_runs_kept_by_the_caller_are_reused_and_change_nothing(tiny, monkeypatch):
    """A second call with the caller's dict of clean runs runs no clean pass and gives the
    same runs; a call that captures coefficients does not take a run kept without them."""
    b = tiny.bridge
    ps = _prompts(tiny)
    conds = _conditions(b, len(ps))
    ref = NZ.zeroing_runs(b, ps, conds, capture_coef=True, batch_size=5, max_rows=7)
    kept: dict = {}
    NZ.zeroing_runs(b, ps, conds, batch_size=5, clean_runs=kept)  # without coefficients
    calls = []
    monkeypatch.setattr(NZ, "clean_run", lambda *a, **k: calls.append(1) or clean_run(*a, **k))
    first = NZ.zeroing_runs(b, ps, conds, capture_coef=True, batch_size=5, max_rows=7, clean_runs=kept)
    n_batches = len(calls)
    again = NZ.zeroing_runs(b, ps, conds, capture_coef=True, batch_size=5, max_rows=7, clean_runs=kept)
    assert n_batches > 1 and len(calls) == n_batches  # the first call ran each batch's clean pass, the second none
    for name in conds:
        for got in (first, again):
            assert torch.equal(got[name].pred, ref[name].pred), name
            assert torch.equal(got[name].coef, ref[name].coef), name


def test_entry_layer_is_the_lowest_zeroed_layer():
    m = {
        3: torch.tensor([[True, False], [False, False], [False, False]]),
        1: torch.tensor([[False, False], [False, True], [False, False]]),
    }
    assert NZ.entry_layers(m, torch.tensor([0, 1, 2]), 5).tolist() == [3, 1, 5]
    assert NZ.entry_layers(m, torch.tensor([2, 0]), 5).tolist() == [5, 3]


def test_resume_rows_equal_resume_and_the_clean_run(tiny):
    """A row that joins at layer L from the clean stream and is not edited ends where the
    clean run ends; copies of the batch by rows equal resume's copies."""
    b = tiny.bridge
    tokens = next(iter(_prompts(tiny).batches(6, "cpu"))).tokens
    run = clean_run(b, tokens)
    B, T = tokens.shape
    rows = [2, 0, 1, 2, 5 % B]
    h = resume_rows(b, run, T - 1, rows, [0, 0, 1, 1, 1])
    torch.testing.assert_close(h, run.final[rows], rtol=1e-4, atol=1e-5)
    by_copy = resume(b, run, T - 2, [0, 1])
    by_rows = resume_rows(b, run, T - 2, list(range(B)) * 2, [0] * B + [1] * B)
    assert torch.equal(by_copy, by_rows)
    with pytest.raises(ValueError, match="non-decreasing"):
        resume_rows(b, run, T - 1, [0, 1], [1, 0])


def test_tables_equal_with_the_literal_runs(tiny, monkeypatch):
    """mask / keep and the lowest-neuron tables, fast against literal: the same rows."""
    b = tiny.bridge
    ps = _prompts(tiny)
    res = C.cna_compare(b, ps, A.zero_heads_hooks([(0, 1)]), mode="exact", progress=False)  # scores layers 0, 1
    kw = dict(n_seeds=2, progress=False, batch_size=5)
    fast_mk = MK.mask_keep_table(b, ps, res, ks=(5, 2), **kw)
    fast_low, fast_cases = MK.lowest_neuron_table(b, ps, res, ks=(5, 2), **kw)
    monkeypatch.setattr(
        MK,
        "zeroing_runs",
        lambda model, prompts, conds, **k: NZ.zeroing_runs_literal(
            model,
            prompts,
            conds,
            capture_coef=k.get("capture_coef", False),
            coef_at=k.get("coef_at"),
            targets=k.get("targets"),
            batch_size=5,
        ),
    )
    ref_mk = MK.mask_keep_table(b, ps, res, ks=(5, 2), **kw)
    ref_low, ref_cases = MK.lowest_neuron_table(b, ps, res, ks=(5, 2), **kw)
    pd.testing.assert_frame_equal(fast_mk, ref_mk)
    pd.testing.assert_frame_equal(fast_low, ref_low, rtol=1e-4)
    pd.testing.assert_frame_equal(fast_cases, ref_cases, rtol=1e-4, atol=1e-4)
    assert len(fast_cases) > 0


def test_coefficients_at_named_neurons_equal_the_full_capture(tiny, monkeypatch):
    """``coef_at`` keeps, per prompt, the coefficients of the neurons it names (any layers,
    none for some prompts): bit for bit the entries of the full ``coef`` of every
    condition, NaN past each prompt's list; it shares the clean runs kept for a full
    capture and asks for too few prompts' lists with an error."""
    b = tiny.bridge
    ps = _prompts(tiny)
    conds = _conditions(b, len(ps))
    L, d = b.cfg.n_layers, b.cfg.d_mlp
    g = torch.Generator().manual_seed(5)
    coef_at = [
        [(int(torch.randint(L, (1,), generator=g)), int(torch.randint(d, (1,), generator=g))) for _ in range(i % 4)]
        for i in range(len(ps))
    ]
    kept: dict = {}
    full = NZ.zeroing_runs(b, ps, conds, capture_coef=True, batch_size=5, max_rows=7, clean_runs=kept)
    calls = []
    monkeypatch.setattr(NZ, "clean_run", lambda *a, **k: calls.append(1) or clean_run(*a, **k))
    some = NZ.zeroing_runs(b, ps, conds, coef_at=coef_at, batch_size=5, max_rows=7, clean_runs=kept)
    assert not calls  # the full capture's clean runs serve it
    for name in conds:
        assert torch.equal(some[name].pred, full[name].pred) and some[name].coef is None
        for i, pairs in enumerate(coef_at):
            want = torch.tensor([float(full[name].coef[i, l, n]) for l, n in pairs])
            got = some[name].coef_at[i]
            assert torch.equal(got[: len(pairs)], want), (name, i)
            assert torch.isnan(got[len(pairs) :]).all()
    with pytest.raises(ValueError, match="coef_at names neurons for"):
        NZ.zeroing_runs(b, ps, conds, coef_at=coef_at[:-1])
