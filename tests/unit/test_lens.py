"""The answer-position logit lens reproduces the model's output at the last layer, and
direct logit attribution sums to the answer logit (RMSNorm and LayerNorm models)."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.zhang.answer_cache as AC
import arithlib.zhang.lens as Lens
from arithlib.core.evaluate import answer_logits
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir


def _perturb_norms(model, seed: int = 0) -> None:
    """Give every norm a non-trivial weight (and bias, where it has one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("transformer.ln_f"):
                if name.endswith("weight"):
                    p.copy_(0.5 + torch.rand(p.shape, generator=g))
                elif name.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def setup(request):
    m = load_model(str(random_model_dir(request.param)))
    _perturb_norms(m.bridge.original_model)
    recs = ds.zhang_prompts(ops=["+", "*"], templates=[0], n_per_template=4, seed=0, fewshot=1)
    ps = PromptSet.build(recs, m.tokenizer)
    cache = AC.cache_answer_position(m.bridge, ps, batch_size=4, check_full_answer=False, progress=False)
    return m, ps, cache


def test_logit_lens_last_layer_is_the_model(setup):
    m, ps, cache = setup
    lens = Lens.logit_lens_answer(m.bridge, cache, ps)
    n_layers = m.info.n_layers
    assert sorted(lens.layer.unique()) == list(range(-1, n_layers))
    logits = answer_logits(m.bridge, ps)
    ref_lp = logits.log_softmax(-1).gather(1, ps.first_answer_ids[:, None]).squeeze(1)
    ref_rank = (logits > logits.gather(1, ps.first_answer_ids[:, None])).sum(-1)
    last = lens[lens.layer == n_layers - 1].sort_values("prompt")
    assert torch.allclose(torch.tensor(last.logprob.to_numpy()), ref_lp, atol=1e-4)
    assert last["rank"].tolist() == ref_rank.tolist()
    assert ((lens.prob >= 0) & (lens.prob <= 1)).all()


def test_dla_sums_to_the_answer_logit(setup):
    m, ps, cache = setup
    dla = Lens.direct_logit_attribution_answer(m.bridge, cache, ps)
    assert set(dla.component) == {"embed", "bias", "attn", "mlp"}
    assert Lens.dla_reconstruction_error(dla, cache) < 1e-3
    n = m.info.n_layers
    assert len(dla) == len(ps) * (2 + 2 * n)


def test_dla_needs_its_activations(setup):
    m, ps, cache = setup
    with pytest.raises(ValueError, match="needs"):
        Lens.direct_logit_attribution_answer(
            m.bridge,
            AC.AnswerCache(
                {"mlp_out": cache.acts["mlp_out"]},
                cache.final_scale,
                cache.answer_logit,
                cache.pred_ids,
                cache.correct_first,
            ),
            ps,
        )


def test_dla_refuses_a_final_norm_of_unknown_kind(setup):
    """DLA reads the final norm through arithlib.core.readout, which names a norm it cannot write
    as a formula rather than guess (centring and bias would be dropped without a word)."""
    m, ps, cache = setup

    class OddNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(m.info.d_model))
            self.eps = 1e-6

    odd = SimpleNamespace(ln_final=OddNorm(), cfg=SimpleNamespace())  # a model whose final norm is neither
    with pytest.raises(NotImplementedError, match="neither RMSNorm nor LayerNorm"):
        Lens.direct_logit_attribution_answer(odd, cache, ps)


def test_lens_summary_and_first_layer():
    lens = pd.DataFrame(
        {"layer": [0, 0, 1, 1, 2, 2], "rank": [5, 20, 0, 3, 0, 0], "prob": [0.1, 0.0, 0.6, 0.2, 0.9, 0.8]}
    )
    s = Lens.lens_summary(lens)
    assert s.set_index("layer").loc[1, "top1"] == 0.5
    assert s.set_index("layer").loc[0, "top10"] == 0.5
    assert Lens.first_layer_reaching(s, "top1", 0.5) == 1
    assert Lens.first_layer_reaching(s, "top1", 1.0) == 2
    assert Lens.first_layer_reaching(s, "mean_prob", 0.99) is None


def test_matches_transformer_lens_logit_lens(setup):
    """TransformerLens's own logit_lens (full run_with_cache) gives the same numbers."""
    from transformer_lens.tools.analysis import logit_lens

    m, ps, cache = setup
    ours = Lens.logit_lens_answer(m.bridge, cache, ps)
    for i in (0, len(ps) - 1):
        tokens = torch.tensor([ps.input_ids[i]])
        theirs = logit_lens(m.bridge, tokens, targets=ps.first_answer_ids[i : i + 1], return_type="log_probs")
        ref = theirs.values.reshape(-1)  # [embed, after block 0, ..., after the last block]
        mine = torch.tensor(ours[ours.prompt == i].sort_values("layer").logprob.to_numpy())
        assert torch.allclose(mine, ref.float(), atol=1e-4)


def test_transformer_lens_dla_refuses_this_bridge(setup):
    """Why DLA is written here: TransformerLens's needs compatibility mode."""
    from transformer_lens.tools.analysis import direct_logit_attribution

    m, ps, _ = setup
    with pytest.raises(ValueError, match="compatibility mode"):
        direct_logit_attribution(m.bridge, torch.tensor([ps.input_ids[0]]), answer_tokens=int(ps.first_answer_ids[0]))
