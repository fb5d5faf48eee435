"""Each pass of arithlib.engine against the literal reference, one plain forward pass of
the whole prompt (``hf(tokens).logits`` / ``hf.base_model(tokens)``): a pass on a shared
prefix's keys and values, a pass that starts at block L from the full pass's stream (with
rows joining later), and the greedy/teacher-forced runner."""

from __future__ import annotations

import pytest
import torch

from arithlib import engine
from arithlib.core.prompt_sets import PromptSet
from arithlib.engine import adapter, passes
from arithlib.engine import prefix as prefix_plan

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
        cache = passes.prefix_cache(model, tokens[:1, :n], len(tokens))
        out = engine.forward(model, tokens[:, n:], cache=cache, keep=1)
    torch.testing.assert_close(out.logits[:, -1], ref[:, -1], rtol=0, atol=1e-5)
    assert out.cache is cache  # extended in place


def test_cache_passes_skip_the_unembedding_and_keep_the_full_passs_keys_values(tiny_qwen2, model, tokens):
    """prefix_cache, shared_prefix_cache and the runner's prefix keys are decoder passes:
    the unembedding never runs (it reads the whole vocabulary matrix for logits nobody
    reads), and the keys and values are the old logit-computing pass's, bit for bit."""
    hf = engine.hf_module(model)
    calls: list[int] = []
    handle = hf.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    n = engine.common_prefix(tokens.tolist())
    try:
        with torch.no_grad():
            got = adapter.filled_cache_layers(passes.prefix_cache(model, tokens[:1, :n], 1))
            shared = adapter.filled_cache_layers(engine.shared_prefix_cache(model, tokens))
            runner = prefix_plan.PrefixRunner(model, _some_prompts(tiny_qwen2), batch_size=4)
            runner._prefix_kv([tuple(tokens[0, :n].tolist())])
        assert calls == []
        with torch.no_grad():
            ref = adapter.filled_cache_layers(engine.forward(model, tokens[:1, :n], keep=1, keep_cache=True).cache)
            full = adapter.filled_cache_layers(engine.forward(model, tokens, keep=1, keep_cache=True).cache)
    finally:
        handle.remove()
    assert calls == [1, 1]  # the reference passes did unembed
    for (k, v), (rk, rv) in zip(got, ref, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    kv = runner._kv[tuple(tokens[0, :n].tolist())]
    for (k, v), (rk, rv) in zip(kv, ref, strict=True):
        assert torch.equal(k, rk[0]) and torch.equal(v, rv[0])
    for (k, v), (rk, rv) in zip(shared, full, strict=True):
        torch.testing.assert_close(k, rk, rtol=0, atol=1e-5)  # the prefix ran once at batch 1
        torch.testing.assert_close(v, rv, rtol=0, atol=1e-5)


def _some_prompts(loaded) -> PromptSet:
    import arithlib.methods.finetune_data as fd

    return PromptSet.build(fd.yu_lora_data(n_train=0, n_test=12, seed=0, fewshot=2)["test"], loaded.tokenizer)


def test_a_pass_from_block_l_equals_the_full_pass(model, tokens):
    """run_blocks from the stream entering block L (recorded by run_decoder) gives the
    decoder's output bit for bit; rows that join at a later block likewise."""
    hf = engine.hf_module(model)
    n_layers = engine.n_blocks(model)
    with torch.no_grad():
        full = hf.base_model(input_ids=tokens, use_cache=False).last_hidden_state
        _, _, streams = passes.run_decoder(hf, input_ids=tokens, record=range(n_layers))
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        for first in range(n_layers):
            hidden, _ = passes.run_blocks(
                model,
                streams[first],
                first=first,
                position_ids=positions,
                cache=passes.empty_cache(model),
                keep_cache=True,
            )
            assert torch.equal(engine.decoder_norm(model, hidden), full)
        # two copies of the batch: one from block 0, one joining at the last block
        last = n_layers - 1
        hidden, _ = passes.run_blocks(
            model,
            streams[0],
            first=0,
            position_ids=positions,
            cache=passes.empty_cache(model),
            keep_cache=False,
            join=lambda l, d: streams[l] if l == last else None,
        )
        both = engine.decoder_norm(model, hidden)
    assert both.shape[0] == 2 * len(tokens)
    torch.testing.assert_close(both[: len(tokens)], full, rtol=0, atol=1e-5)
    torch.testing.assert_close(both[len(tokens) :], full, rtol=0, atol=1e-5)


def test_decoder_pass_is_the_base_model(model, tokens):
    hf = engine.hf_module(model)
    with torch.no_grad():
        hidden, cache = passes.decoder_pass(model, tokens)
        ref = hf.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    assert torch.equal(hidden, ref)
    assert len(adapter.filled_cache_layers(cache)) == engine.n_blocks(model)


def test_the_prefix_runner_equals_full_passes(tiny_qwen2, model):
    """First-step logits of PrefixRunner's plan (shared few-shot prefixes) equal each
    prompt's own full pass."""
    import arithlib.methods.finetune_data as fd

    prompts = PromptSet.build(fd.yu_lora_data(n_train=0, n_test=12, seed=0, fewshot=2)["test"], tiny_qwen2.tokenizer)
    runner = engine.PrefixRunner(model, prompts, batch_size=8)
    assert any(p >= prefix_plan.MIN_SHARED_PREFIX for p, _ in runner.plan)  # the prefix is shared
    with torch.no_grad():
        for p, index in runner.plan:
            logits, _ = runner.first_step(p, index)
            for row, i in enumerate(index):
                ref = reference_logits(model, torch.tensor([prompts.input_ids[i]]))[0, -1].float()
                torch.testing.assert_close(logits[row], ref, rtol=0, atol=1e-5)


def test_greedy_tokens_equal_hf_generate(model, tokens):
    """greedy_tokens (decoding on the growing KV cache) against transformers' generate."""
    hf = engine.hf_module(model)
    ids = tokens[:1]
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
        got = [int(t) for _, t in zip(range(6), engine.greedy_tokens(model, ids))]
    assert got == ref.tolist()


def test_shared_prefix_logits_equal_the_full_pass(model, tokens):
    ref = reference_logits(model, tokens)
    with torch.no_grad():
        for shared in (0, 4, 7):
            out = engine.shared_prefix_logits(model, tokens, shared, keep=2)
            torch.testing.assert_close(out, ref[:, -2:], rtol=0, atol=1e-5)


def test_stacked_conditions_equal_one_full_pass_each(model, tokens):
    """condition_pass and answer_pass (conditions stacked along the batch, prefix shared)
    against one full pass per condition with the condition's hooks."""

    def scale(f):
        def fn(act, hook):
            return act * f

        fn.position_invariant = True
        return fn

    conditions = [[], [("blocks.0.hook_mlp_out", scale(0.0))], [("blocks.1.hook_attn_out", scale(2.0))]]
    refs = []
    for hooks in conditions:
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            refs.append(reference_logits(model, tokens)[:, -1])
    ref = torch.cat(refs)
    with torch.no_grad():
        for shared in (0, 7):
            torch.testing.assert_close(engine.condition_pass(model, tokens, conditions, shared), ref, rtol=0, atol=1e-5)
    # answer_pass: hooks at the last position only, on the cached earlier positions
    last_only = [[(n, _last(f)) for n, f in c] for c in conditions]
    refs = []
    for hooks in last_only:
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            refs.append(reference_logits(model, tokens)[:, -1])
    with torch.no_grad():
        base = engine.shared_prefix_cache(model, tokens[:, :-1])
        with model.hooks(fwd_hooks=engine.stacked_hooks(last_only, len(tokens))):
            got = engine.answer_pass(model, tokens[:, -1:], base, len(conditions))
    torch.testing.assert_close(got, torch.cat(refs), rtol=0, atol=1e-5)


def _last(fn):
    """``fn`` applied at the last position only."""

    def last(act, hook):
        act[:, -1:] = fn(act[:, -1:], hook)
        return act

    return last


def test_the_answer_position_runner_runs_each_shared_prefix_once(tiny_qwen2, model, monkeypatch):
    """Batches that start with the same tokens (the few-shot prefix) share one batch-1
    pass of them; their keys and values are those of a pass per batch, bit for bit."""
    from arithlib.nikankin.heuristic_grids import grid_records

    ps = PromptSet.build(grid_records("+", (10, 17), fewshot=2), tiny_qwen2.tokenizer)  # one few-shot prefix
    batches = list(ps.batches(4, "cpu"))
    shared = [tuple(b.tokens[0, : engine.common_prefix(b.tokens[:, :-1].tolist())].tolist()) for b in batches]
    shared = [q for q, b in zip(shared, batches) if q and len(b.tokens) > 1]  # the batches with a shared prefix
    assert len(set(shared)) < len(shared)  # the check needs batches that share a prefix
    rows: list[int] = []
    real = passes.decoder_pass

    def counted(m, toks, **kw):
        rows.append(toks.shape[0])
        return real(m, toks, **kw)

    monkeypatch.setattr(engine.answer, "decoder_pass", counted)
    monkeypatch.setattr(passes, "decoder_pass", counted)  # prefix_cache's
    runner = engine.AnswerPositionRunner(model, ps, batch_size=4)
    assert rows.count(1) == len(set(shared))  # one per distinct prefix, not one per batch
    monkeypatch.setattr(engine.answer, "decoder_pass", real)
    monkeypatch.setattr(passes, "decoder_pass", real)
    with torch.no_grad():
        for (index, past, last, n), batch in zip(runner._batches, batches, strict=True):
            alone = engine.shared_prefix_cache(model, batch.tokens[:, :-1])  # its own batch-1 pass
            for (k, v), (rk, rv) in zip(
                adapter.filled_cache_layers(past), adapter.filled_cache_layers(alone), strict=True
            ):
                assert torch.equal(k, rk) and torch.equal(v, rv)
