"""Answer-position caching equals a full forward pass; Zhang's cosines, the curve
pivot rule, the Fig. 6c single-case helpers and the linear probes do what they say."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.zhang.answer_cache as AC
import arithlib.zhang.mlp_curves as MC
import arithlib.zhang.probing as P
from arithlib.core.evaluate import evaluate
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet, single_token_numbers
from arithlib.core.random_models import random_model_dir


@pytest.fixture(scope="module")
def tiny():
    m = load_model(str(random_model_dir("llama")))
    hf = m.bridge.original_model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial norm weights, so "MLP input" != "normalized residual"
        for layer in hf.model.layers:
            layer.post_attention_layernorm.weight.copy_(
                0.5 + torch.rand(layer.post_attention_layernorm.weight.shape, generator=g)
            )
        hf.model.norm.weight.copy_(0.5 + torch.rand(hf.model.norm.weight.shape, generator=g))
    return m


@pytest.fixture(scope="module")
def prompts(tiny):
    recs = ds.zhang_prompts(ops=["+", "-"], templates=[0, 1], n_per_template=5, seed=0, fewshot=2)
    return PromptSet.build(recs, tiny.tokenizer)


def _reference(bridge, prompts, names):
    out = {n: [] for n in names}
    for ids in prompts.input_ids:
        _, cache = bridge.run_with_cache(torch.tensor([ids]), names_filter=lambda n: n in names)
        for n in names:
            out[n].append(cache[n][0, -1])
    return {n: torch.stack(v) for n, v in out.items()}


@pytest.mark.parametrize("share_prefix", [True, False])
def test_cache_matches_run_with_cache(tiny, prompts, share_prefix):
    b = tiny.bridge
    cache = AC.cache_answer_position(b, prompts, batch_size=4, share_prefix=share_prefix, progress=False)
    names = [AC.ACT_HOOKS[k].format(L=layer) for k in AC.ACT_HOOKS for layer in range(2)] + [AC.FINAL_SCALE_HOOK]
    ref = _reference(b, prompts, names)
    for kind, pattern in AC.ACT_HOOKS.items():
        for layer in range(2):
            assert torch.allclose(cache.acts[kind][:, layer], ref[pattern.format(L=layer)], atol=1e-4), (kind, layer)
    assert torch.allclose(cache.final_scale, ref[AC.FINAL_SCALE_HOOK].reshape(-1), atol=1e-5)


def test_mlp_in_is_the_mlp_modules_input(tiny, prompts):
    hf = tiny.bridge.original_model
    cache = AC.cache_answer_position(tiny.bridge, prompts, kinds=["resid_mid", "mlp_in"], progress=False)
    ln2 = hf.model.layers[1].post_attention_layernorm
    with torch.no_grad():
        expected = ln2(cache.acts["resid_mid"][:, 1])
    assert torch.allclose(cache.acts["mlp_in"][:, 1], expected, atol=1e-5)


def test_write_measure_is_the_mlps_write_of_a_full_forward_pass(tiny, prompts):
    """The verdict's answer curve is cos(resid_post - resid_mid, W_U[C]) (Zhang Sec. 4.2: the
    MLP's isolated contribution is what it adds to the residual stream): computed here
    literally, per prompt, from a full forward pass with hooks and the model's own lm_head,
    it equals unembed_cosines' write_C (from the prefix-sharing answer-position cache); the
    literal delta_C (output minus the normalised input) is a different quantity."""
    b = tiny.bridge
    cache = AC.cache_answer_position(b, prompts, batch_size=4, progress=False)
    numbers = single_token_numbers(tiny.tokenizer, 9)
    frame = MC.unembed_cosines(cache, prompts, MC.unembed_matrix(b), numbers)
    got = frame[frame.measure == "write_C"].pivot(index="prompt", columns="layer", values="value")
    assert got.shape == (len(prompts), 2)
    names = [f"blocks.{layer}.{h}" for layer in range(2) for h in ("hook_resid_mid", "hook_resid_post", "hook_mlp_out")]
    ref = _reference(b, prompts, names)
    W_U = b.original_model.lm_head.weight.detach().float().T  # [d_model, vocab]
    answer = torch.as_tensor(prompts.first_answer_ids)
    for layer in range(2):
        write = ref[f"blocks.{layer}.hook_resid_post"] - ref[f"blocks.{layer}.hook_resid_mid"]
        expected = torch.nn.functional.cosine_similarity(write, W_U[:, answer].T, dim=-1)
        assert np.allclose(got[layer].to_numpy(), expected.numpy(), atol=1e-4), layer
        # a sequential block: the write is the MLP module's output (so old runs' out_C is the same vector)
        assert torch.allclose(write, ref[f"blocks.{layer}.hook_mlp_out"], atol=1e-5)
    literal = frame[frame.measure == "delta_C"].pivot(index="prompt", columns="layer", values="value")
    assert not np.allclose(literal.to_numpy(), got.to_numpy(), atol=1e-2)


def test_correctness_matches_evaluate(tiny, prompts):
    cache = AC.cache_answer_position(tiny.bridge, prompts, kinds=["resid_post"], batch_size=3, progress=False)
    frame = evaluate(tiny.bridge, prompts)
    assert cache.correct_first.tolist() == frame["correct_first"].tolist()
    assert cache.correct_full.tolist() == frame["correct_full"].tolist()
    assert torch.allclose(cache.answer_logit, torch.tensor(frame["answer_logit"].to_numpy()), atol=1e-4)
    sub = cache.subset(torch.tensor([True, False] * (len(cache) // 2) + [True] * (len(cache) % 2)))
    assert len(sub) == (len(cache) + 1) // 2


def test_cache_rejects_bad_input(tiny, prompts):
    with pytest.raises(ValueError, match="unknown activation kind"):
        AC.cache_answer_position(tiny.bridge, prompts, kinds=["nope"], progress=False)
    with pytest.raises(ValueError, match="empty"):
        AC.cache_answer_position(tiny.bridge, prompts.subset([]), progress=False)


def test_single_token_numbers(digit_tokenizer):
    import arithlib.methods.neurons as N

    ids = single_token_numbers(digit_tokenizer, 20)
    assert sorted(ids) == list(range(10))  # per-digit: only 0..9 are single tokens
    assert MC.first_token_id(digit_tokenizer, 47) == ids[4]
    assert N.number_token_ids(digit_tokenizer, 9).tolist() == [ids[n] for n in range(10)]
    with pytest.raises(ValueError, match="10 is not a single token"):
        N.number_token_ids(digit_tokenizer, 20)


def _fake_cache(n: int, layers: int, d: int, mlp_in: torch.Tensor, mlp_out: torch.Tensor) -> AC.AnswerCache:
    z = torch.zeros(n)
    return AC.AnswerCache({"mlp_in": mlp_in, "mlp_out": mlp_out}, z, z, z.long(), z.bool())


def test_unembed_cosines_on_known_vectors(digit_tokenizer):
    recs = [r for r in ds.zhang_prompts(ops=["+"], templates=[0], fewshot=0) if r.answer < 10][:4]
    ps = PromptSet.build(recs, digit_tokenizer)
    vocab = len(digit_tokenizer)
    d = vocab  # W_U = identity: each token its own orthogonal direction
    W_U = torch.eye(d)
    nums = single_token_numbers(digit_tokenizer, 9)
    n = len(ps)
    mlp_in = torch.zeros(n, 2, d)
    mlp_out = torch.zeros(n, 2, d)
    for i, r in enumerate(ps.records):
        mlp_in[i, :, nums[r.a]] = 1.0  # MLP_in points at A
        mlp_out[i, :, nums[r.a]] = 1.0
        mlp_out[i, :, nums[r.answer]] += 1.0  # MLP_out - MLP_in points at C
    frame = MC.unembed_cosines(_fake_cache(n, 2, d, mlp_in, mlp_out), ps, W_U, nums)
    mean = frame.groupby("measure")["value"].mean()
    assert mean["in_A"] == pytest.approx(1.0)
    assert mean["delta_C"] == pytest.approx(1.0)
    assert mean["delta_other"] == pytest.approx(0.0)
    assert mean["in_A_x"] == pytest.approx(1.0)  # the other numbers are orthogonal here
    assert mean["delta_C_x"] == pytest.approx(1.0)
    # a direction shared by every number raises the raw cosines but not the excess
    shared = torch.zeros(d)
    shared[list(nums.values())] = 1.0
    common = shared.expand(n, 2, d).clone()
    frame2 = MC.unembed_cosines(_fake_cache(n, 2, d, common, common * 2), ps, W_U, nums)
    m2 = frame2.groupby("measure")["value"].mean()
    assert m2["in_A"] > 0.3 and m2["in_A_x"] == pytest.approx(0.0, abs=1e-6)
    assert set(frame.columns) >= {"prompt", "op", "layer", "measure", "value"}
    # without resid_mid / resid_post in the cache the MLP's write is not measured
    assert len(frame) == n * 2 * len([m for m, v in MC.COSINE_MEASURES.items() if v[0] != "write"])


def test_summarise_curves_band():
    frame = pd.DataFrame({"measure": "m", "layer": 0, "value": [1.0, 2.0, 3.0, 4.0]})
    s = MC.summarise_curves(frame)
    row = s.iloc[0]
    assert row["mean"] == 2.5 and row["n"] == 4
    from scipy import stats

    half = stats.t.ppf(0.975, 3) * np.std([1, 2, 3, 4], ddof=1) / 2
    assert row["hi"] - row["mean"] == pytest.approx(half)


def test_curve_points_rise_then_fall():
    y = [0, 0.01, 0, 0.02, 0.1, 0.4, 0.9, 1.0, 0.8, 0.5, 0.3, 0.31, 0.3]
    p = MC.curve_points(y)
    assert p.peak == 7
    assert p.start == 4  # y[3] = 0.02 is the last value below 0.1 before the peak
    assert p.inflection == 6  # largest one-layer increase: 0.4 -> 0.9
    assert p.end == 10  # from layer 10 on, within 0.1 of the final 0.3
    assert p.rise == pytest.approx(1.0)


def test_curve_points_monotone_and_fall():
    rising = [0, 0, 0, 0.2, 0.6, 0.8, 0.95, 1.0]
    p = MC.curve_points(rising)
    assert (p.start, p.inflection, p.peak, p.end) == (3, 4, 7, 6)
    q = MC.curve_points([-v for v in rising], direction="fall")
    assert q == p
    flat = MC.curve_points([1.0, 1.0, 1.0])
    assert flat.rise == 0.0
    with pytest.raises(ValueError):
        MC.curve_points([1.0])
    with pytest.raises(ValueError):
        MC.curve_points([0, 1], direction="up")


def test_number_projection_and_coarse_to_fine():
    d, layers = 10, 4
    W_U = torch.eye(d)
    nums = {n: n for n in range(10)}
    mlp_in = torch.zeros(1, layers, d)
    mlp_out = torch.zeros(1, layers, d)
    # layer 0: 3 on top; layer 1: 6 (neighbour of 7) on top; layers 2-3: 7 on top
    mlp_out[0, 0, 3] = 1
    mlp_out[0, 1, 6], mlp_out[0, 1, 7] = 1, 0.5
    mlp_out[0, 2, 7], mlp_out[0, 2, 6], mlp_out[0, 2, 8] = 1, 0.6, 0.5
    mlp_out[0, 3, 7], mlp_out[0, 3, 6] = 1, 0.1
    proj = MC.number_projection(_fake_cache(1, layers, d, mlp_in, mlp_out), 0, W_U, nums)
    top = MC.top_numbers(proj, k=2)
    assert top.loc[1, "top"] == [6, 7]
    c2f = MC.coarse_to_fine(proj, answer=7)
    assert c2f["first_top1"] == 2
    assert c2f["neighbour_top_layers"] == [1]
    assert c2f["coarse_to_fine"] is True
    assert c2f["rank_by_layer"][1] == 2
    with pytest.raises(IndexError):
        MC.number_projection(_fake_cache(1, layers, d, mlp_in, mlp_out), 3, W_U, nums)


def test_distance_profile(digit_tokenizer):
    recs = [r for r in ds.zhang_prompts(ops=["+"], templates=[0], fewshot=0) if r.answer < 10][:3]
    ps = PromptSet.build(recs, digit_tokenizer)
    d = len(digit_tokenizer)
    W_U = torch.eye(d)
    nums = single_token_numbers(digit_tokenizer, 9)
    mlp_in = torch.zeros(3, 1, d)
    mlp_out = torch.zeros(3, 1, d)
    for i, r in enumerate(ps.records):
        mlp_out[i, 0, nums[r.answer]] = 1.0
    prof = MC.distance_profile(_fake_cache(3, 1, d, mlp_in, mlp_out), ps, W_U, nums)
    by = prof.set_index("distance")["mean"]
    assert by[0] == pytest.approx(1.0) and by[1] == pytest.approx(0.0)


def test_grouped_split_keeps_pairs_apart():
    groups = np.repeat(np.arange(20), 4)
    train, test = P.grouped_split(groups, 0.25, seed=1)
    assert set(groups[train]).isdisjoint(groups[test])
    assert len(train) + len(test) == 80
    again = P.grouped_split(groups, 0.25, seed=1)
    assert (again[0] == train).all()


def test_linear_probes_find_the_encoding_layer():
    rng = np.random.default_rng(0)
    n, d = 240, 16
    a = rng.integers(10, 100, n)
    b = rng.integers(10, 100, n)
    labels = pd.DataFrame(
        {
            "a": a,
            "b": b,
            "result": a + b,
            "result_last_digit": (a + b) % 10,
            "group": [f"+|{x}|{y}" for x, y in zip(a, b)],
        }
    )
    acts = torch.tensor(rng.normal(size=(n, 2, d)), dtype=torch.float32)
    acts[:, 1, 0] = torch.tensor(a, dtype=torch.float32)  # layer 1 encodes a linearly
    acts[:, 1, 1:11] = torch.nn.functional.one_hot(torch.tensor((a + b) % 10), 10).float() * 3
    res = P.linear_probes(acts, labels, ["a", "result_last_digit"], seed=0, progress=False)
    score = res.set_index(["target", "layer"])["score"]
    base = res.set_index(["target", "layer"])["baseline"]
    assert score["a", 1] > 0.95 and score["a", 0] < 0.3
    assert score["result_last_digit", 1] > 0.9 and base["result_last_digit", 1] < 0.4
    best = P.best_layers(res)
    assert best.set_index("target").loc["a", "layer"] == 1
    with pytest.raises(ValueError):
        P.linear_probes(acts[:10], labels, progress=False)


def test_probe_labels(digit_tokenizer):
    ps = PromptSet.build(ds.yu_prompts(ops=["+"], n_digits=2, n_per_template=3, templates=[3]), digit_tokenizer)
    lab = P.probe_labels(ps, ["a", "result", "result_last_digit"])
    r = ps.records[0]
    assert lab.loc[0, "result"] == r.answer and lab.loc[0, "result_last_digit"] == r.answer % 10
    assert lab.loc[0, "group"] == f"+|{r.a}|{r.b}"
    with pytest.raises(ValueError):
        P.probe_labels(ps, ["nope"])


def test_curve_point_table_and_stratified_indices(digit_tokenizer):
    summary = pd.DataFrame(
        {
            "measure": ["in_A"] * 4 + ["delta_other"] * 4,
            "layer": [0, 1, 2, 3] * 2,
            "mean": [0, 0.1, 1.0, 0.5, 0, -0.1, -1.0, -1.0],
        }
    )
    t = MC.curve_point_table(summary).set_index("measure")
    assert t.loc["in_A", "peak"] == 2 and t.loc["delta_other", "peak"] == 2
    assert t.loc["delta_other", "direction"] == "fall"
    ps = PromptSet.build(ds.zhang_prompts(ops=["+", "-"], templates=[0], fewshot=0), digit_tokenizer)
    idx = AC.stratified_indices(ps, 10, seed=3)
    ops = [ps.records[i].op for i in idx]
    assert ops.count("+") == 5 and ops.count("-") == 5 and idx == sorted(set(idx))
    assert idx == AC.stratified_indices(ps, 10, seed=3)


def test_figures_draw_from_the_tables():
    import matplotlib

    matplotlib.use("Agg")
    import arithlib.plots.probing as pp

    rows = [
        {"measure": m, "layer": layer, "value": v}
        for m in MC.COSINE_MEASURES
        for layer in range(4)
        for v in (0.1 * layer, 0.1 * layer + 0.05)
    ]
    summary = MC.summarise_curves(pd.DataFrame(rows))
    points = MC.curve_point_table(summary)
    figs = [pp.cosine_curves({"m1": summary, "m2": summary}, {"m1": [1, 2]}, {"m1": points})]
    proj = pd.DataFrame(
        {
            "layer": np.repeat(range(3), 10),
            "number": np.tile(range(10), 3),
            "value": np.linspace(-1, 1, 30),
            "rank": np.tile(range(10, 0, -1), 3),
        }
    )
    figs.append(pp.number_heatmap(proj, 7))
    prof = pd.DataFrame({"layer": [0, 1, 0, 1], "distance": [0, 0, 1, 1], "mean": [0.1, 0.2, 0.0, 0.1], "n": 3})
    figs.append(pp.distance_curves({"m": prof, "empty": prof.iloc[:0]}))
    lens = pd.DataFrame(
        {
            "layer": [-1, 0, 1],
            "mean_rank": [100, 5, 0],
            "median_rank": [90, 4, 0],
            "mean_prob": [0, 0.2, 0.9],
            "top1": [0, 0.1, 1],
            "top10": [0, 0.5, 1],
            "n": 5,
        }
    )
    figs.append(pp.lens_curves({"m": lens}))
    dla = pd.DataFrame(
        {
            "component": ["attn", "attn", "mlp", "mlp"],
            "layer": [0, 1, 0, 1],
            "mean": [0.1, 0.2, 0.3, 1.0],
            "lo": 0.0,
            "hi": 1.1,
        }
    )
    figs.append(pp.dla_curves({"m": dla}, {"m": [1]}))
    probes = pd.DataFrame(
        {
            "target": ["a", "a", "result_last_digit", "result_last_digit"],
            "metric": ["R2", "R2", "accuracy", "accuracy"],
            "layer": [-1, 0, -1, 0],
            "score": [0.1, 0.9, 0.2, 0.8],
            "baseline": [0.0, -0.1, 0.1, 0.1],
        }
    )
    figs.append(pp.probe_curves({"m": probes}))
    for fig in figs:
        assert fig.axes and all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes if ax.lines)
    assert figs[1].axes[0].get_xlabel() and figs[1].axes[0].get_ylabel()
    assert pp.short_name("/a/b/very-long-model-name-that-goes-on-and-on").endswith("…")


def test_curve_points_leave_out_layer_0():
    """The embedding layer's jump (cos -0.49 at layer 0, -0.03 at layer 1 on
    Qwen-0.5B) set the curve's range, so the climb's onset (Zhang's inflection) was
    read at layer 1; layer 0 is now outside the search."""
    y = [-0.5, 0.0, 0.0, 0.0, 0.02, 0.1, 0.3, 0.35]
    p = MC.curve_points(y, "rise")
    assert (p.start, p.inflection, p.peak) == (5, 6, 7)  # the climb of layers 4..7, not the 0 -> 1 jump
    assert p.rise == pytest.approx(0.35)
    assert MC.curve_points(y, "rise", first_layer=0).start == 1  # the old reading: layer 0 sets the range
    with pytest.raises(ValueError):
        MC.curve_points([0.0, 1.0], first_layer=1)
