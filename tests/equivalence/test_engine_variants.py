"""Weight variants run together (:func:`arithlib.engine.variant_passes`, and
:func:`arithlib.methods.answer_runs.run_weight_variants` on it) against the literal
reference: one plain forward pass per variant with its weights swapped in."""

from __future__ import annotations

import pytest
import torch

from arithlib import engine
from arithlib.methods import answer_runs as AR
from arithlib.methods.model_weights import params_by_clean_name, use_weights
from arithlib.yu import lora as LO

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_qwen2):
    return tiny_qwen2.bridge


def _variant(model, layer: int, seed: int, names=("q_proj", "k_proj", "v_proj", "o_proj"), bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    params = params_by_clean_name(model)
    out = {}
    for p in names:
        for kind in ("weight", "bias") if bias else ("weight",):
            name = f"model.layers.{layer}.self_attn.{p}.{kind}"
            if name in params:
                out[name] = params[name].detach() + 0.3 * torch.randn(params[name].shape, generator=g)
    return out


def _tokens(model, prefix: int = 7, rows: int = 4, rest: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    vocab = engine.hf_module(model).config.vocab_size
    head = torch.randint(0, vocab, (1, prefix), generator=g).repeat(rows, 1)
    return torch.cat([head, torch.randint(0, vocab, (rows, rest), generator=g)], 1)


@pytest.mark.parametrize("share_prefix", [True, False])
def test_variant_passes_equal_one_full_pass_per_variant(model, share_prefix):
    """Variants of the first block (two of them), of a middle one with biases changed too,
    and of the last one, stacked: each variant's logits are those of a plain pass of the
    model with its weights swapped in."""
    n_layers = engine.n_blocks(model)
    variants = [
        (0, _variant(model, 0, 1)),
        (0, _variant(model, 0, 2, names=("q_proj",))),
        (1, _variant(model, 1, 3, bias=True)),
        (n_layers - 1, _variant(model, n_layers - 1, 4, names=("o_proj", "v_proj"))),
    ]
    tokens = _tokens(model)
    B = tokens.shape[0]
    with torch.no_grad():
        run = engine.clean_run(model, tokens)
        got = engine.variant_passes(model, run, variants, share_prefix=share_prefix).float()
        plain = engine.hf_module(model)(tokens, use_cache=False).logits[:, -1].float()
        for j, (_, weights) in enumerate(variants):
            with use_weights(model, weights):
                ref = engine.hf_module(model)(tokens, use_cache=False).logits[:, -1].float()
            assert not torch.allclose(ref, plain, atol=1e-3)  # the variant changes the answer's logits
            assert torch.allclose(got[j * B : (j + 1) * B], ref, rtol=0, atol=1e-5), j


def test_variants_are_checked_before_any_pass(model):
    run = engine.clean_run(model, _tokens(model))
    with pytest.raises(ValueError, match="ordered by block"):
        engine.variant_passes(model, run, [(1, _variant(model, 1, 0)), (0, _variant(model, 0, 0))])
    with pytest.raises(ValueError, match="not a linear layer's weight in block 0"):
        engine.variant_passes(model, run, [(0, _variant(model, 1, 0))])
    params = params_by_clean_name(model)
    norm = "model.layers.0.input_layernorm.weight"
    with pytest.raises(ValueError, match="not a linear layer's weight"):
        engine.variant_passes(model, run, [(0, {norm: params[norm].detach().clone()})])
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="shape"):
        engine.variant_passes(model, run, [(0, {q: params[q].detach()[:, :-1].clone()})])


def test_run_weight_variants_equal_one_run_per_model(tiny_qwen2):
    """The answer-position runs of several one-block models (LoRA-like: attention
    projections of one layer) together give what one :func:`run_last_position` per model
    with its weights swapped in gives: predictions, log-probabilities, every layer's
    resid_mid and coefficients (the original's below the model's block), the final state."""
    bridge = tiny_qwen2.bridge
    cases = LO.yu_cna_cases(tiny_qwen2.tokenizer, n_cases=10)
    base = AR.run_last_position(bridge, cases, batch_size=4)
    models = {"b": (1, _variant(bridge, 1, 5)), "a": (0, _variant(bridge, 0, 6)), "c": (1, _variant(bridge, 1, 7))}
    got = AR.run_weight_variants(bridge, cases, models, base, batch_size=4, max_rows=8)  # 2 variants per pass
    assert list(got) == list(models)
    for name, (_, weights) in models.items():
        with use_weights(bridge, weights):
            ref = AR.run_last_position(bridge, cases, batch_size=4)
        for field in ("pred", "logprob", "resid_mid", "coef", "final_resid"):
            a, b = getattr(got[name], field), getattr(ref, field)
            assert a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=0, atol=1e-5), (name, field)
