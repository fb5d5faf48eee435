"""The adapter to transformers/TransformerLens internals (arithlib.engine.adapter): caches
written through the bridge, built, repeated, selected and cut; single blocks equal the
decoder. Under transformers >= 5.24 (cache argument renamed to ``cache``) the bridge
tests fail without :func:`fix_bridge_cache`."""

from __future__ import annotations

import inspect

import pytest
import torch

from arithlib.core.models import load_model
from arithlib.core.random_models import random_model_dir
from arithlib.engine import adapter as hc


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(random_model_dir("qwen2")))


def _ids(seed: int = 0, shape=(3, 9)) -> torch.Tensor:
    return torch.randint(0, 400, shape, generator=torch.Generator().manual_seed(seed))


def test_cache_arg_matches_installed_transformers():
    from transformers.masking_utils import create_causal_mask

    assert hc.cache_arg() in inspect.signature(inspect.unwrap(create_causal_mask)).parameters


@torch.no_grad()
def test_bridge_writes_its_cache(tiny):
    hf = hc.hf_module(tiny.bridge)
    layers = hc.filled_cache_layers(hc.output_cache(hf(_ids(), use_cache=True)))
    assert len(layers) == tiny.info.n_layers
    assert layers[0][0].shape[:3] == (3, tiny.info.n_kv_heads, 9)


@torch.no_grad()
def test_prefix_cached_pass_equals_full_pass(tiny):
    """The fast path of every runner: the prefix once, the rest on its cache."""
    hf = hc.hf_module(tiny.bridge)
    ids = _ids()
    full = hf(ids).logits[:, -1]
    prefix = hc.output_cache(hf(ids[:1, :5], use_cache=True))
    cache = hc.repeat_cache(hf.config, prefix, 3)
    rest = hf(
        torch.cat([ids[:1, :5].expand(3, 5), ids[:, 5:]], 1)[:, 5:], use_cache=True, **hc.cache_kwargs(cache)
    ).logits[:, -1]
    same_prefix = hf(torch.cat([ids[:1, :5].expand(3, 5), ids[:, 5:]], 1)).logits[:, -1]
    assert torch.allclose(rest, same_prefix, atol=1e-5)
    own = hc.output_cache(hf(ids[:, :5], use_cache=True))
    step = hf(ids[:, 5:], use_cache=True, **hc.cache_kwargs(own)).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-5)


def test_fix_bridge_cache_is_idempotent(tiny):
    assert hc.fix_bridge_cache(tiny.bridge) == 0  # load_model applied it already (or nothing is needed)


def test_cache_building_blocks():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(random_model_dir("qwen2")))
    k = [torch.randn(2, 2, 4, 8) for _ in range(2)]
    v = [torch.randn(2, 2, 4, 8) for _ in range(2)]
    cache = hc.new_cache(config, [(k[0], v[0]), None])
    got = hc.cache_layers(cache)
    assert got[1] is None and torch.equal(got[0][0], k[0]) and torch.equal(got[0][1], v[0])
    with pytest.raises(ValueError, match="layer 1"):
        hc.filled_cache_layers(cache)
    full = hc.new_cache(config, zip(k, v))
    tiled = hc.cache_layers(hc.repeat_cache(config, full, 3))
    assert torch.equal(tiled[1][0], k[1].repeat(3, 1, 1, 1))
    assert torch.equal(hc.cache_layers(full)[0][0], k[0])  # the source is left as it was
    inter = hc.repeat_rows_(hc.new_cache(config, zip(k, v)), 3)
    assert torch.equal(hc.cache_layers(inter)[1][1], v[1].repeat_interleave(3, 0))
    picked = hc.cache_layers(hc.select_cache_rows(config, full, torch.tensor([1])))
    assert torch.equal(picked[0][0], k[0][1:])
    longer = hc.new_cache(config, zip(k, v))
    longer.update(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), 0)
    longer.update(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), 1)
    hc.truncate_cache(longer, 4)
    assert longer.get_seq_length() == 4 and torch.equal(hc.cache_layers(longer)[1][0], k[1])


@torch.no_grad()
def test_blocks_one_by_one_equal_the_decoder(tiny):
    """causal_mask + run_block from a recorded stream equals the decoder's own pass."""
    hf = hc.hf_module(tiny.bridge)
    decoder = hf.get_decoder()
    ids = _ids(1)
    prefix = hc.output_cache(decoder(input_ids=ids[:, :6], use_cache=True))
    ref = decoder(input_ids=ids[:, 6:], use_cache=True, **hc.cache_kwargs(prefix)).last_hidden_state
    past = hc.output_cache(decoder(input_ids=ids[:, :6], use_cache=True))
    hidden = decoder.embed_tokens(ids[:, 6:])
    position_ids = torch.arange(6, 9).unsqueeze(0)
    pos = decoder.rotary_emb(hidden, position_ids)
    for l, block in enumerate(decoder.layers):
        mask = hc.causal_mask(hf.config, hidden, past, position_ids, l)
        hidden = hc.run_block(
            block, hidden, mask=mask, position_embeddings=pos, position_ids=position_ids, cache=past, use_cache=True
        )
    assert torch.allclose(decoder.norm(hidden), ref, atol=1e-5)
    assert past.get_seq_length() == 9


@torch.no_grad()
def test_repeat_kv_reusing_equals_transformers_copy():
    """Two results in turn stay valid (keys, then values); the third reuses the first's
    buffer; under grad mode and above the size bound, the original copy."""
    from transformers.models.llama import modeling_llama

    hc.reuse_gqa_buffers()
    assert modeling_llama.repeat_kv is hc.repeat_kv_reusing
    assert not hc.reuse_gqa_buffers()  # idempotent
    original = hc._REPEAT_KV_ORIGINAL
    g = torch.Generator().manual_seed(0)
    k, v, k2 = (torch.randn(3, 2, 5, 4, generator=g) for _ in range(3))
    rk, rv = hc.repeat_kv_reusing(k, 3), hc.repeat_kv_reusing(v, 3)
    assert torch.equal(rk, original(k, 3)) and torch.equal(rv, original(v, 3))
    rk2 = hc.repeat_kv_reusing(k2, 3)
    assert torch.equal(rk2, original(k2, 3)) and torch.equal(rv, original(v, 3))
    assert rk2.data_ptr() == rk.data_ptr() != rv.data_ptr()
    with torch.enable_grad():
        assert hc.repeat_kv_reusing(k.clone().requires_grad_(), 3).grad_fn is not None
        kept = hc.repeat_kv_reusing(k, 3)  # needs no gradient, but the queries' backward may save it
        assert kept.data_ptr() not in {b.data_ptr() for b in hc._repeat_kv_buffers}
    big = torch.zeros(1, 1, 1, 8)
    old, hc.REPEAT_KV_MAX_ELEMENTS = hc.REPEAT_KV_MAX_ELEMENTS, 8
    try:
        assert hc.repeat_kv_reusing(big, 2).data_ptr() not in {b.data_ptr() for b in hc._repeat_kv_buffers}
    finally:
        hc.REPEAT_KV_MAX_ELEMENTS = old
    hc.release_gqa_buffers()


@torch.no_grad()
def test_bridge_passes_equal_with_reused_gqa_buffers(tiny):
    """A GQA bridge's cached and uncached passes give the same logits bit for bit with the
    reused buffers as with transformers' own expansion."""
    from transformers.models.llama import modeling_llama

    assert tiny.info.n_kv_heads < tiny.bridge.cfg.n_heads  # the random Qwen2 is grouped-query
    hc.reuse_gqa_buffers()
    hf, ids = hc.hf_module(tiny.bridge), _ids(1, (4, 11))

    def passes():
        full = tiny.bridge(ids)
        prefix = hc.output_cache(hf(ids[:, :6], use_cache=True))
        step = hf(ids[:, 6:], use_cache=True, **hc.cache_kwargs(prefix)).logits
        return full, step

    reused = passes()
    modeling_llama.repeat_kv = hc._REPEAT_KV_ORIGINAL
    try:
        own = passes()
    finally:
        modeling_llama.repeat_kv = hc.repeat_kv_reusing
    for a, b in zip(reused, own):
        assert torch.equal(a, b)


@torch.no_grad()
def test_cache_with_room_writes_in_place_and_equals_a_concatenation(tiny):
    """The added positions go into the reserved room (no new tensor) with the keys and
    values a DynamicLayer's concatenation gives; past the room, after a crop, or under
    grad mode, the layer concatenates as DynamicLayer does."""
    cfg = hc.hf_module(tiny.bridge).config
    g = torch.Generator().manual_seed(0)
    kv, d = tiny.info.n_kv_heads, cfg.hidden_size // cfg.num_attention_heads
    room_k, room_v = torch.randn(3, kv, 7, d, generator=g), torch.randn(3, kv, 7, d, generator=g)
    cache = hc.cache_with_room(cfg, [(room_k, room_v, 4)] + [None] * (tiny.info.n_layers - 1))
    plain = hc.new_cache(cfg, [(room_k[:, :, :4].clone(), room_v[:, :, :4].clone())])
    assert cache.get_seq_length(0) == 4
    new_k, new_v = torch.randn(3, kv, 2, d, generator=g), torch.randn(3, kv, 2, d, generator=g)
    k, v = cache.update(new_k, new_v, 0)
    k0, v0 = plain.update(new_k, new_v, 0)
    assert torch.equal(k, k0) and torch.equal(v, v0) and k.data_ptr() == room_k.data_ptr()
    more = torch.randn(3, kv, 2, d, generator=g)
    k, _ = cache.update(more, more, 0)  # 6 + 2 > 7: concatenated
    assert k.shape[-2] == 8 and k.data_ptr() != room_k.data_ptr() and torch.equal(k, plain.update(more, more, 0)[0])
    cropped = hc.cache_with_room(cfg, [(room_k.clone(), room_v.clone(), 4)])
    hc.truncate_cache(cropped, 3)
    k, _ = cropped.update(new_k, new_v, 0)
    assert k.shape[-2] == 5 and torch.equal(k[:, :, 3:], new_k)
    tracked = hc.cache_with_room(cfg, [(room_k.clone(), room_v.clone(), 4)])
    with torch.enable_grad():
        k, _ = tracked.update(new_k, new_v, 0)
    assert k.data_ptr() != tracked.layers[0]._room[0].data_ptr() and torch.equal(k[:, :, 4:], new_k)
