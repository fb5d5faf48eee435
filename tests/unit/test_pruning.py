"""Tests of arithlib.yu.pruning (Yu & Ananiadou 2024, Sec. 6.1) on tiny random-weight
models: pruning that keeps every neuron reproduces the original logits; a pruned model
equals the full-size model with the same neurons zeroed (hooks and weight masking);
parameter counts; the original stays untouched; the union ranking is Yu's union of
per-case top-K; random keep sets; LoRA on a pruned model; CNA between a LoRA model and
the original."""

from __future__ import annotations

import pytest
import torch

import arithlib.methods.ablation as A
import arithlib.methods.finetune as FT
import arithlib.methods.finetune_data as FD
import arithlib.methods.model_weights as MW
import arithlib.yu.lora as LO
import arithlib.yu.pruned_model as PM
import arithlib.yu.pruning as P
import arithlib.yu.pruning_selection as PS
from arithlib.core import papers
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen2", "llama", "gpt2", "gpt_neox"])
def tiny(request):
    return load_model(str(random_model_dir(request.param)))


@pytest.fixture(scope="module")
def qwen():
    return load_model(str(random_model_dir("qwen2")))


TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])


def _logits(model, tokens=TOKENS, hooks=None):
    with torch.no_grad():
        if hooks is not None:
            with model.hooks(fwd_hooks=hooks):
                return model(tokens).float()
        return FT._hf(model)(tokens).logits.float() if not hasattr(model, "cfg") else model(tokens).float()


def _some_keep(model, seed=0):
    """Every layer pruned: layer 0 keeps a random third, the last layer keeps nothing
    when there are two or more layers."""
    n_layers = model.info.n_layers
    g = torch.Generator().manual_seed(seed)
    keep = {}
    for l in range(n_layers):
        w = PM.ffn_width(model.bridge, l)
        keep[l] = torch.randperm(w, generator=g)[: w // 3]
    if n_layers > 1:
        keep[n_layers - 1] = torch.tensor([], dtype=torch.long)
    return keep


def test_keeping_every_neuron_reproduces_logits(tiny):
    widths = PM.ffn_widths(tiny.bridge)
    keep = {l: torch.arange(w) for l, w in enumerate(widths)}
    pruned = PM.prune_ffn(tiny.bridge, keep)
    assert pruned is not FT.shared_hf_model(tiny.bridge)
    base = _logits(tiny.bridge)
    with torch.no_grad():
        out = pruned(TOKENS).logits.float()
    assert base.dtype == torch.float32
    assert torch.allclose(out, base, atol=TOL, rtol=0)
    assert PM.ffn_widths(pruned) == widths
    assert MW.count_parameters(pruned) == MW.count_parameters(FT.shared_hf_model(tiny.bridge))


def test_pruned_equals_masked(tiny):
    keep = _some_keep(tiny)
    pruned = PM.prune_ffn(tiny.bridge, keep)
    assert PM.ffn_widths(pruned) == [len(keep[l]) for l in range(tiny.info.n_layers)]
    with torch.no_grad():
        out = pruned(TOKENS).logits.float()
    hooked = _logits(tiny.bridge, hooks=A.keep_neurons_hooks(PM.keep_pairs(keep), sorted(keep), position=None))
    assert torch.allclose(out, hooked, atol=TOL, rtol=0)
    with MW.use_weights(tiny.bridge, PM.mask_weights(tiny.bridge, keep)):
        masked = _logits(tiny.bridge)
    assert torch.allclose(out, masked, atol=TOL, rtol=0)
    assert not torch.allclose(out, _logits(tiny.bridge), atol=1e-3)  # pruning did change the model


def test_original_untouched_and_weights_shared(qwen):
    hf = FT.shared_hf_model(qwen.bridge)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    flags = {n: p.requires_grad for n, p in hf.named_parameters()}
    base = _logits(qwen.bridge)
    pruned = PM.prune_ffn(qwen.bridge, {1: [0, 5, 7]})
    for n, p in hf.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.requires_grad == flags[n], n  # the shared tensors' flags are the original's
    assert not any(p.requires_grad for n, p in pruned.named_parameters() if "layers.1.mlp" in n)
    assert torch.equal(_logits(qwen.bridge), base)
    shared = dict(pruned.named_parameters())
    assert (
        shared["model.layers.1.self_attn.q_proj.weight"].data_ptr()
        == dict(hf.named_parameters())["model.layers.1.self_attn.q_proj.weight"].data_ptr()
    )
    assert (
        shared["model.layers.0.mlp.down_proj.weight"].data_ptr()
        == dict(hf.named_parameters())["model.layers.0.mlp.down_proj.weight"].data_ptr()
    )
    assert shared["model.layers.1.mlp.down_proj.weight"].shape == (qwen.info.d_model, 3)
    independent = PM.prune_ffn(qwen.bridge, {1: [0, 5, 7]}, share_weights=False)
    assert (
        dict(independent.named_parameters())["model.layers.0.mlp.down_proj.weight"].data_ptr()
        != dict(hf.named_parameters())["model.layers.0.mlp.down_proj.weight"].data_ptr()
    )
    assert pruned.config.arithlib_pruned_ffn["widths"] == {"1": 3}
    assert FT.model_fingerprint(pruned) != FT.model_fingerprint(PM.prune_ffn(qwen.bridge, {1: [0, 5, 8]}))


def test_parameter_counts(tiny):
    keep = _some_keep(tiny)
    pruned = PM.prune_ffn(tiny.bridge, keep)
    d = tiny.info.d_model
    removed = sum(PM.ffn_width(tiny.bridge, l) - len(idx) for l, idx in keep.items())
    # per neuron: gated MLPs have a gate row, an up row and a down column (no biases in
    # Qwen2/Llama); GPT-2 / NeoX an fc_in row with its bias and an fc_out column
    per_neuron = 3 * d if tiny.info.gated_mlp else 2 * d + 1
    assert MW.count_parameters(pruned) == MW.count_parameters(FT.shared_hf_model(tiny.bridge)) - removed * per_neuron
    layers = sorted(keep)
    full, small = PM.parameter_counts(tiny.bridge, layers), PM.parameter_counts(pruned, layers)
    assert full["n_params"] - small["n_params"] == removed * per_neuron
    assert full["n_deep_ffn_params"] - small["n_deep_ffn_params"] == removed * per_neuron
    assert small["n_deep_neurons"] == sum(len(v) for v in keep.values())
    assert full["n_deep_neurons"] == tiny.info.n_layers * tiny.info.d_mlp


def test_case_ranks_and_union_ranking():
    torch.manual_seed(0)
    N, layers, K = 4, [2, 3], 6
    change = torch.randn(N, len(layers), K)
    approx = torch.randn(N, len(layers), K)
    scores = PS.CNAScores(change, approx, layers, "exact", None, 1.0, 1.0, torch.zeros(N, dtype=torch.long))
    ranking = PS.union_ranking(scores)
    assert len(ranking) == len(layers) * K and ranking.order.tolist() == list(range(1, 13))
    flat = change.reshape(N, -1)
    for k in range(1, 8):
        expected = set()
        for i in range(N):
            expected |= set(flat[i].topk(k).indices.tolist())
        u = PS.union_top_k(ranking, k)
        got = {layers.index(l) * K + n for l, n in zip(u.layer, u.neuron)}
        assert got == expected
        # the union of top-k is a prefix of the order
        assert set(ranking.order[ranking.best_rank <= k]) == set(range(1, len(expected) + 1))
    curve = PS.union_size_curve(ranking, [1, 2, 3])
    assert curve.union_size.tolist() == [len(PS.union_top_k(ranking, k)) for k in (1, 2, 3)]
    keep = PS.keep_from_ranking(ranking, 5, layers)
    assert sum(len(v) for v in keep.values()) == 5 and set(keep) == set(layers)
    assert PS.k_of_prefix(ranking, 5) == int(ranking.best_rank.iloc[4])
    # two-stage: exact scores first, then the stage-1 change
    exact = torch.tensor([[float("nan"), 0.1, float("nan"), -5.0]])
    first = torch.tensor([[9.0, 0.0, 3.0, 0.0]])
    assert PS.case_ranks(exact, first).tolist() == [[2, 0, 3, 1]]


def test_random_keep():
    keep = PS.random_keep([1, 2], {1: 10, 2: 20}, 7, seed=3)
    assert sum(len(v) for v in keep.values()) == 7 and set(keep) == {1, 2}
    assert all(int(v.max()) < w for v, w in ((keep[1], 10), (keep[2], 20)) if len(v))
    again = PS.random_keep([1, 2], {1: 10, 2: 20}, 7, seed=3)
    assert all(torch.equal(keep[l], again[l]) for l in keep)
    matched = PS.random_keep([1, 2], 10, 0, seed=0, layer_counts={1: 3, 2: 4})
    assert [len(matched[1]), len(matched[2])] == [3, 4]
    assert PS.n_for_share(0.05, 1000) == 50 and PS.n_for_share(0.0001, 100) == 1
    assert P.scaled_top_k(papers.YU_DEEP_NEURONS) == 500


def test_lora_on_pruned_model(qwen):
    splits = FD.yu_lora_data(n_train=16, n_test=8, seed=0, fewshot=1)
    train, test = (PromptSet.build(splits[k], qwen.tokenizer) for k in ("train", "test"))
    cfg = FT.TrainConfig(lr=1e-2, epochs=1, batch_size=8, max_steps=2, seed=0)
    hf = FT.shared_hf_model(qwen.bridge)
    before = {n: p.detach().clone() for n, p in hf.named_parameters()}
    keep = {1: torch.arange(0, qwen.info.d_mlp, 4)}
    tokens = PM.timing_tokens(test, 4)
    row = P.prune_and_finetune(qwen.bridge, keep, 0, train, test, cfg, tokens=tokens, repeats=1)
    assert row["n_kept"] == qwen.info.d_mlp // 4 and row["n_lora"] > 0
    assert 0 <= row["accuracy"] <= 1 and 0 <= row["accuracy_pruned"] <= 1 and row["forward_s"] > 0
    assert row["n_deep_neurons"] == qwen.info.d_mlp // 4
    for n, p in hf.named_parameters():
        assert torch.equal(p, before[n]), n
    sweep, keeps = P.share_sweep(
        qwen.bridge,
        _ranking_for(qwen),
        [0.1, 0.5],
        [1],
        0,
        train,
        test,
        cfg,
        random_seeds=[0],
        fine_tune=[0.5],
        progress=False,
    )
    assert len(sweep) == 4 and set(sweep.selection) == {"cna", "random"}
    assert sweep[sweep.share == 0.1].accuracy.isna().all() and sweep[sweep.share == 0.5].accuracy.notna().all()
    assert (sweep.groupby("share").n_kept.nunique() == 1).all()
    assert len(P.summarize_sweep(sweep)) == 4


def test_sweep_evaluations_start_at_the_first_pruned_layer(qwen):
    """The pruned models differ from the original from layer 1 on: their evaluations start
    there from the recorded stream, and give the full passes' numbers."""
    from arithlib.engine import LayerInputs

    splits = FD.yu_lora_data(n_train=16, n_test=8, seed=0, fewshot=1)
    train, test = (PromptSet.build(splits[k], qwen.tokenizer) for k in ("train", "test"))
    cfg = FT.TrainConfig(lr=1e-2, epochs=1, batch_size=8, max_steps=2, seed=0)
    cols = ["accuracy_pruned", "accuracy_first_pruned", "accuracy", "mean_answer_logprob"]
    runs = {}
    for name, inputs in (
        ("late", P.recorded_streams(0, [1])),
        ("full", {"train": LayerInputs([]), "test": LayerInputs([])}),
    ):
        sweep, _ = P.share_sweep(
            qwen.bridge,
            _ranking_for(qwen),
            [0.1, 0.5],
            [1],
            0,
            train,
            test,
            cfg,
            random_seeds=[0],
            fine_tune=[0.5],
            progress=False,
            inputs=inputs,
        )
        runs[name] = (sweep[cols], len(inputs["test"]))
    assert runs["late"][1] > 0 and runs["full"][1] == 0
    assert runs["late"][0].equals(runs["full"][0])


def _ranking_for(model):
    K = model.info.d_mlp
    change = torch.randn(2, 1, K, generator=torch.Generator().manual_seed(0))
    return PS.union_ranking(
        PS.CNAScores(change, change, [1], "exact", None, 1.0, 1.0, torch.zeros(2, dtype=torch.long))
    )


def test_lora_cna_scores_match_finetune_lora_cna(qwen):
    cases = PS.yu_1d_cases(qwen.tokenizer, per_op=2, fewshot=1)
    assert len(cases) == 8 and {r.op for r in cases.records} == {"+", "-", "*", "/"}
    name = "model.layers.0.self_attn.o_proj.weight"
    w = dict(FT.shared_hf_model(qwen.bridge).named_parameters())[name]
    weights = {name: w.detach() * 1.5}
    scores = PS.lora_cna_scores(qwen.bridge, cases, weights, [1], mode="exact", progress=False)
    assert scores.change.shape == (8, 1, qwen.info.d_mlp) and torch.isfinite(scores.change).all()
    _, details = LO.lora_cna(qwen.bridge, cases, {"m": weights}, ks=(5,), layers=[1], mode="exact", progress=False)
    ref = details["m"]["importance"] - details["m"]["importance_orig"]
    assert torch.allclose(scores.change[:, 0], ref[:, 1], atol=1e-5)
    with pytest.raises(ValueError):
        PS.lora_cna_scores(qwen.bridge, cases, {"model.layers.1.mlp.down_proj.weight": torch.zeros(1)}, [1])


def test_lora_on_a_model_pruned_below_it_reads_no_stream_recorded_above_the_pruning(qwen, monkeypatch):
    """LoRA on block 1 of a model pruned in block 0: the validation stream recorded at
    block 1 by the original's LoRA does not hold for it, so its validation passes (each
    epoch's and the lr choice's) run from the embeddings, with the full passes' numbers."""
    from arithlib.engine import LayerInputs

    splits = FD.yu_lora_data(n_train=16, n_val=8, n_test=0, seed=0, fewshot=1)
    train, val = (PromptSet.build(splits[k], qwen.tokenizer) for k in ("train", "val"))
    cfg = FT.TrainConfig(lr=1e-2, epochs=1, batch_size=8, seed=0, eval_batch_size=8)
    val_inputs = LayerInputs([1])
    P.lora_on(qwen.bridge, 1, train, cfg, val_set=val, lrs=[1e-2, 1e-3], val_inputs=val_inputs)  # the original
    assert len(val_inputs) > 0
    pruned = P.prune_ffn(qwen.bridge, {0: torch.arange(8)})
    kw = dict(val_set=val, lrs=[1e-2, 1e-3], unchanged_below=0)
    import arithlib.engine.prefix as engine_prefix

    starts, real = [], engine_prefix.run_decoder

    def spy(*a, **k):
        starts.append(k.get("start", 0))
        return real(*a, **k)

    monkeypatch.setattr(engine_prefix, "run_decoder", spy)
    late = P.lora_on(pruned, 1, train, cfg, val_inputs=val_inputs, **kw)
    assert starts and set(starts) == {0}
    full = P.lora_on(pruned, 1, train, cfg, **kw)
    assert late.epochs.equals(full.epochs) and late.config.lr == full.config.lr
    assert all(torch.equal(late.weights[n], full.weights[n]) for n in full.weights)
