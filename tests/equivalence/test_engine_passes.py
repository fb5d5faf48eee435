"""Each pass of arithlib.engine against the literal reference, one plain forward pass of
the whole prompt (``hf(tokens).logits`` / ``hf.base_model(tokens)``): a pass on a shared
prefix's keys and values, a pass that starts at block L from the full pass's stream (with
rows joining later), and the greedy/teacher-forced runner."""

from __future__ import annotations

import pytest
import torch

import arithlib.datasets as ds
from arithlib import engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_qwen2):
    return tiny_qwen2.bridge


@pytest.fixture(scope="module")
def tokens(model):
    """Four prompts that share a 7-token prefix and differ after it."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.hf_module(model).config.vocab_size
    prefix = torch.randint(0, vocab, (1, 7), generator=g).repeat(4, 1)
    return torch.cat([prefix, torch.randint(0, vocab, (4, 3), generator=g)], 1)


def reference_logits(model, tokens):
    with torch.no_grad():
        return engine.hf_module(model)(tokens, use_cache=False).logits


def test_forward_keeps_the_last_positions(model, tokens):
    ref = reference_logits(model, tokens)
    with torch.no_grad():
        out = engine.forward(model, tokens, keep=2)
    assert out.cache is None and out.logits.shape[1] == 2
    torch.testing.assert_close(out.logits, ref[:, -2:], rtol=0, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(engine.last_position_logits(model, tokens), ref[:, -1].float(), rtol=0, atol=1e-5)


def test_a_pass_on_a_shared_prefix_equals_the_full_pass(model, tokens):
    ref = reference_logits(model, tokens)
    n = engine.common_prefix(tokens.tolist())
    assert n == 7
    with torch.no_grad():
        cache = engine.prefix_cache(model, tokens[:1, :n], len(tokens))
        out = engine.forward(model, tokens[:, n:], cache=cache, keep=1)
    torch.testing.assert_close(out.logits[:, -1], ref[:, -1], rtol=0, atol=1e-5)
    assert out.cache is cache  # extended in place


def test_a_pass_from_block_l_equals_the_full_pass(model, tokens):
    """run_blocks from the stream entering block L (recorded by run_decoder) gives the
    decoder's output bit for bit; rows that join at a later block likewise."""
    hf = engine.hf_module(model)
    n_layers = engine.n_blocks(model)
    with torch.no_grad():
        full = hf.base_model(input_ids=tokens, use_cache=False).last_hidden_state
        _, _, streams = engine.run_decoder(hf, input_ids=tokens, record=range(n_layers))
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        for first in range(n_layers):
            hidden, _ = engine.run_blocks(model, streams[first], first=first, position_ids=positions,
                                          cache=engine.empty_cache(model), keep_cache=True)
            assert torch.equal(engine.decoder_norm(model, hidden), full)
        # two copies of the batch: one from block 0, one joining at the last block
        last = n_layers - 1
        hidden, _ = engine.run_blocks(model, streams[0], first=0, position_ids=positions,
                                      cache=engine.empty_cache(model), keep_cache=False,
                                      join=lambda l, d: streams[l] if l == last else None)
        both = engine.decoder_norm(model, hidden)
    assert both.shape[0] == 2 * len(tokens)
    torch.testing.assert_close(both[:len(tokens)], full, rtol=0, atol=1e-5)
    torch.testing.assert_close(both[len(tokens):], full, rtol=0, atol=1e-5)


def test_decoder_pass_is_the_base_model(model, tokens):
    hf = engine.hf_module(model)
    with torch.no_grad():
        hidden, cache = engine.decoder_pass(model, tokens)
        ref = hf.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    assert torch.equal(hidden, ref)
    assert len(engine.filled_cache_layers(cache)) == engine.n_blocks(model)


def test_the_prefix_runner_equals_full_passes(tiny_qwen2, model):
    """First-step logits of PrefixRunner's plan (shared few-shot prefixes) equal each
    prompt's own full pass."""
    import arithlib.finetune as ft

    prompts = ds.PromptSet.build(ft.yu_lora_data(n_train=0, n_test=12, seed=0, fewshot=2)["test"],
                                 tiny_qwen2.tokenizer)
    runner = engine.PrefixRunner(model, prompts, batch_size=8)
    assert any(p >= engine.MIN_SHARED_PREFIX for p, _ in runner.plan)  # the prefix is shared
    with torch.no_grad():
        for p, index in runner.plan:
            logits, _ = runner.first_step(p, index)
            for row, i in enumerate(index):
                ref = reference_logits(model, torch.tensor([prompts.input_ids[i]]))[0, -1].float()
                torch.testing.assert_close(logits[row], ref, rtol=0, atol=1e-5)
