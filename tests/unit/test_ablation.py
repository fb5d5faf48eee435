"""Ablation hooks equal editing the weights they stand for (Yu: a head's W_O slice,
a neuron's W_out column), and mean ablation uses the per-length reference mean."""

from __future__ import annotations

import copy

import pytest
import torch

import arithlib.methods.ablation as A
from arithlib.core.models import load_model
from arithlib.core.random_models import random_model_dir


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(random_model_dir("llama")))


TOKENS = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 6, 7, 3]])


def test_zero_heads_equals_zeroing_w_o_slice(tiny):
    b, dh = tiny.bridge, tiny.info.d_head
    with torch.no_grad(), b.hooks(fwd_hooks=A.zero_heads_hooks([(0, 1), (1, 2), (1, 0)])):
        hooked = b(TOKENS)
    hf = copy.deepcopy(b.original_model)
    for layer, head in [(0, 1), (1, 2), (1, 0)]:
        hf.model.layers[layer].self_attn.o_proj.weight.data[:, head * dh : (head + 1) * dh] = 0
    with torch.no_grad():
        ref = hf(TOKENS).logits
        base = b(TOKENS)
    assert torch.allclose(hooked, ref, atol=1e-5)
    assert not torch.allclose(hooked, base, atol=1e-3)


def test_zero_neurons_equals_zeroing_w_out_column(tiny):
    b = tiny.bridge
    with torch.no_grad(), b.hooks(fwd_hooks=A.zero_neurons_hooks([(0, 3), (1, 5), (1, 7)])):
        hooked = b(TOKENS)
    hf = copy.deepcopy(b.original_model)
    for layer, k in [(0, 3), (1, 5), (1, 7)]:
        hf.model.layers[layer].mlp.down_proj.weight.data[:, k] = 0
    with torch.no_grad():
        assert torch.allclose(hooked, hf(TOKENS).logits, atol=1e-5)


def test_keep_neurons_keeps_only_listed(tiny):
    b = tiny.bridge
    seen = {}
    keep = [(1, 2), (1, 9)]
    hooks = A.keep_neurons_hooks(keep, layers=[1]) + [
        ("blocks.1.mlp.hook_post", lambda a, hook: seen.setdefault("a", a.clone()))
    ]
    with torch.no_grad(), b.hooks(fwd_hooks=hooks):
        b(TOKENS)
    nz = seen["a"].abs().sum((0, 1)).nonzero().flatten().tolist()
    assert set(nz) <= {2, 9}


def test_mean_ablation_uses_reference_mean(tiny, digit_tokenizer):
    import arithlib.core.datasets as ds
    from arithlib.core.prompt_sets import PromptSet

    # a prompt set with token ids inside the tiny model's vocabulary
    ps = PromptSet.build(ds.nikankin_prompts(["+"], n_per_op=6), digit_tokenizer)
    ps.input_ids = [[i % 100 for i in ids] for ids in ps.input_ids]
    b = tiny.bridge
    means = A.mean_activations(b, ps, [A.z_hook(0), A.post_hook(1)])
    length = len(ps.input_ids[0])
    stacked = torch.tensor(ps.input_ids)
    captured = {}
    with torch.no_grad(), b.hooks(fwd_hooks=[(A.z_hook(0), lambda a, hook: captured.setdefault("z", a.clone()))]):
        b(stacked)
    assert torch.allclose(means[A.z_hook(0)][length], captured["z"].mean(0), atol=1e-5)
    out = {}
    hooks = A.mean_heads_hooks([(0, 2)], means) + [(A.z_hook(0), lambda a, hook: out.setdefault("z", a.clone()))]
    with torch.no_grad(), b.hooks(fwd_hooks=hooks):
        b(stacked)
    assert torch.allclose(out["z"][:, :, 2], means[A.z_hook(0)][length][:, 2].expand_as(out["z"][:, :, 2]), atol=1e-5)
    with pytest.raises(KeyError, match="length"):
        with torch.no_grad(), b.hooks(fwd_hooks=A.mean_neurons_hooks([(1, 0)], means)):
            b(stacked[:, :-1])
