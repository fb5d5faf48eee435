"""Tests of arithlib.engine.streams: a pass that starts at a layer from the recorded
stream equals the full pass bit for bit (with and without shared prefixes), records
only what the model shares with the reference, and other architectures run in full."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import arithlib.engine.prefix as engine_prefix
import arithlib.methods.answer_loss as al
import arithlib.methods.finetune as ft
import arithlib.methods.finetune_data as fd
import arithlib.methods.model_weights as mw
import arithlib.yu.lora as LO
import arithlib.zhang.sft as SFT
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir
from arithlib.engine import LayerInputs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def test_set(tiny_qwen2):
    return PromptSet.build(fd.yu_lora_data(n_train=0, n_test=24, seed=0, fewshot=2)["test"], tiny_qwen2.tokenizer)


def changed(hf, layer: int) -> dict[str, torch.Tensor]:
    """A weight of block ``layer`` perturbed (as a LoRA adapter on that layer would be)."""
    name = f"model.layers.{layer}.self_attn.o_proj.weight"
    w = dict(hf.named_parameters())[name].detach()
    return {name: w + 0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(layer))}


@pytest.mark.parametrize("share_prefix", [True, False])
def test_late_start_equals_full_pass(tiny_qwen2, test_set, share_prefix):
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    inputs = LayerInputs([1])
    with torch.no_grad():
        batches = fd.answer_batches(test_set, 8)
        for index in batches:  # the reference run records the stream entering block 1
            al.teacher_forced_logits(
                hf, test_set, index, extra=1, share_prefix=share_prefix, inputs=inputs, same_below=2
            )
        assert len(inputs) == len(batches)
        with mw.use_weights(hf, changed(hf, 1)):
            for index in batches:
                full, mask = al.teacher_forced_logits(hf, test_set, index, extra=1, share_prefix=share_prefix)
                late, late_mask = al.teacher_forced_logits(
                    hf, test_set, index, extra=1, share_prefix=share_prefix, inputs=inputs, same_below=1
                )
                assert torch.equal(mask, late_mask) and torch.equal(full, late)


def test_evaluate_weights_uses_the_first_changed_layer(tiny_qwen2, test_set, monkeypatch):
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    assert ft.first_changed_layer(hf, None) == 2
    assert ft.first_changed_layer(hf, changed(hf, 1)) == 1
    assert ft.first_changed_layer(hf, {"model.embed_tokens.weight": None}) == 0
    inputs = {"test": LayerInputs([1])}
    base = ft.evaluate_weights(hf, None, {"test": test_set}, 8, inputs=inputs)
    recorded = len(inputs["test"])
    assert recorded > 0
    starts = []
    real = engine_prefix.run_decoder  # the packed runs of teacher_forced_logits (rows_on_prefixes)

    def spy(*a, **kw):
        starts.append(kw.get("start", 0))
        return real(*a, **kw)

    monkeypatch.setattr(engine_prefix, "run_decoder", spy)
    late = ft.evaluate_weights(hf, changed(hf, 1), {"test": test_set}, 8, inputs=inputs)
    full = ft.evaluate_weights(hf, changed(hf, 1), {"test": test_set}, 8)
    assert set(starts[: len(starts) // 2]) == {1} and set(starts[len(starts) // 2 :]) == {0}
    assert late.equals(full) and not late.answer_logprob.equals(base.answer_logprob)
    # a model that differs from block 0 on neither uses nor adds to the recording
    starts.clear()
    ft.evaluate_weights(hf, changed(hf, 0), {"test": test_set}, 8, inputs=inputs)
    assert set(starts) == {0} and len(inputs["test"]) == recorded


def test_changed_model_records_only_below_its_change(tiny_qwen2, test_set):
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    inputs = {"test": LayerInputs([1])}
    ft.evaluate_weights(hf, changed(hf, 0), {"test": test_set}, 8, inputs=inputs, unchanged_below=2)
    assert len(inputs["test"]) == 0  # block 0 differs: the stream entering block 1 is not the reference's
    ft.evaluate_weights(hf, changed(hf, 1), {"test": test_set}, 8, inputs=inputs)
    assert len(inputs["test"]) > 0  # below block 1 it is


def test_other_architectures_run_in_full(test_set):
    model = load_model(str(random_model_dir("gpt2")))
    hf = ft.shared_hf_model(model.bridge)
    ps = PromptSet.build(test_set.records, model.tokenizer)
    inputs = {"test": LayerInputs([1])}
    a = ft.evaluate_weights(hf, None, {"test": ps}, 8, inputs=inputs)
    assert len(inputs["test"]) == 0
    assert a.equals(ft.evaluate_weights(hf, None, {"test": ps}, 8))


def test_lora_training_from_recorded_stream_gives_the_same_weights(tiny_qwen2):
    """LoRA on block 1: its training batches start at block 1 from the stream recorded by
    an earlier run (the deeper-first order of lora_layer_sweep), with the same weights
    and losses bit for bit."""
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    train = PromptSet.build(fd.yu_lora_data(n_train=24, n_test=0, seed=0, fewshot=2)["train"], tiny_qwen2.tokenizer)
    cfg = ft.TrainConfig(lr=1e-2, epochs=1, batch_size=8, seed=0)
    inputs = LayerInputs([1])
    LO.train_lora(hf, 1, train, cfg, progress=False, inputs=inputs)  # records
    assert len(inputs) == len(fd.answer_batches(train, 8))
    late = LO.train_lora(hf, 1, train, cfg, progress=False, inputs=inputs)
    full = LO.train_lora(hf, 1, train, cfg, progress=False)
    assert late.history["loss"].equals(full.history["loss"])
    assert all(torch.equal(late.weights[n], full.weights[n]) for n in full.weights)


def test_lora_validation_from_recorded_stream(tiny_qwen2, monkeypatch):
    """The validation passes of a LoRA training on block 1 (each epoch's, and the lr
    choice's) start at block 1 from the stream a first run recorded: the same validation
    accuracies, lr table and weights bit for bit as full passes."""
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    data = fd.yu_lora_data(n_train=16, n_test=0, n_val=16, seed=0, fewshot=2)
    train, val = (PromptSet.build(data[k], tiny_qwen2.tokenizer) for k in ("train", "val"))
    cfg = ft.TrainConfig(lr=1e-2, epochs=2, batch_size=8, seed=0, eval_batch_size=8)
    val_inputs = LayerInputs([1])
    LO.train_lora(hf, 1, train, cfg, val, progress=False, val_inputs=val_inputs)  # records
    assert len(val_inputs) == len(fd.answer_batches(val, 8))
    starts = []
    real = engine_prefix.run_decoder

    def spy(*a, **kw):
        starts.append(kw.get("start", 0))
        return real(*a, **kw)

    monkeypatch.setattr(engine_prefix, "run_decoder", spy)

    def fit(lr, inputs):
        return LO.train_lora(hf, 1, train, replace(cfg, lr=lr), val, progress=False, val_inputs=inputs)

    late, late_table = ft.choose_lr(hf, lambda lr: fit(lr, val_inputs), [1e-2, 1e-3], val, 8, val_inputs=val_inputs)
    n_late = len(starts)
    full, full_table = ft.choose_lr(hf, lambda lr: fit(lr, None), [1e-2, 1e-3], val, 8)
    assert 1 in set(starts[:n_late]) and set(starts[n_late:]) == {0}  # training and validation passes
    assert late_table.equals(full_table) and late.epochs.equals(full.epochs)
    assert all(torch.equal(late.weights[n], full.weights[n]) for n in full.weights)


def test_dropout_in_training_runs_in_full(tiny_qwen2):
    from arithlib.engine import can_start_late

    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    assert can_start_late(hf)
    hf.train()
    try:
        assert can_start_late(hf)
        hf.config.attention_dropout = 0.1
        assert not can_start_late(hf)
    finally:
        hf.config.attention_dropout = 0.0
        hf.eval()


def test_precise_sft_and_its_row_from_recorded_streams(tiny_qwen2, test_set):
    """Precise SFT of heads in block 1 trains from block 1 on; its evaluation row (math
    sets) starts there too; both equal the full passes."""
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    train = PromptSet.build(fd.yu_lora_data(n_train=16, n_test=0, seed=1, fewshot=2)["train"], tiny_qwen2.tokenizer)
    cfg = ft.TrainConfig(lr=1e-2, epochs=1, batch_size=8, seed=0)
    train_inputs, eval_inputs = LayerInputs([1]), {"test": LayerInputs([1])}
    SFT.evaluate_method(hf, tiny_qwen2.tokenizer, None, {"test": test_set}, inputs=eval_inputs)  # the original records
    LO.train_lora(hf, 1, train, cfg, progress=False, inputs=train_inputs)  # so does this run
    late = SFT.precise_sft(hf, [(1, 0)], train, cfg, progress=False, inputs=train_inputs)
    full = SFT.precise_sft(hf, [(1, 0)], train, cfg, progress=False)
    assert all(torch.equal(late.weights[n], full.weights[n]) for n in full.weights)
    row_late = SFT.evaluate_method(hf, tiny_qwen2.tokenizer, late.weights, {"test": test_set}, inputs=eval_inputs)
    row_full = SFT.evaluate_method(hf, tiny_qwen2.tokenizer, late.weights, {"test": test_set})
    assert row_late == row_full


def test_memory_cap_keeps_results(tiny_qwen2, test_set):
    """Past ``max_bytes`` nothing more is recorded and those batches run in full."""
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    capped = {"test": LayerInputs([1], max_bytes=1)}
    ft.evaluate_weights(hf, None, {"test": test_set}, 8, inputs=capped)
    assert len(capped["test"]) == 0 and capped["test"].nbytes == 0
    late = ft.evaluate_weights(hf, changed(hf, 1), {"test": test_set}, 8, inputs=capped)
    assert late.equals(ft.evaluate_weights(hf, changed(hf, 1), {"test": test_set}, 8))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lora_epochs_reuse_one_recording_and_equal_full_passes(arch):
    """Two epochs of LoRA on block 1 record the frozen stream once per batch (the same
    batches every epoch, ``epoch_batches``), and training from it gives the weights and
    losses of full forward+backward passes bit for bit (tiny_qwen2 random Qwen2 and Llama)."""
    model = load_model(str(random_model_dir(arch)))
    hf = ft.shared_hf_model(model.bridge)
    train = PromptSet.build(fd.yu_lora_data(n_train=24, n_test=0, seed=0, fewshot=2)["train"], model.tokenizer)
    cfg = ft.TrainConfig(lr=1e-2, epochs=2, batch_size=8, seed=0)
    first, second = fd.epoch_batches(train, 8, 0, 0), fd.epoch_batches(train, 8, 0, 1)
    assert sorted(map(sorted, first)) == sorted(map(sorted, second))  # the same batches every epoch ...
    assert any(fd.epoch_batches(train, 8, 0, e) != first for e in range(1, 6))  # ... in a new order
    inputs = LayerInputs([1])
    recording = LO.train_lora(hf, 1, train, cfg, progress=False, inputs=inputs)
    assert len(inputs) == len(first)  # once per batch, not once per epoch
    late = LO.train_lora(hf, 1, train, cfg, progress=False, inputs=inputs)
    full = LO.train_lora(hf, 1, train, cfg, progress=False)
    assert len(full.history) == 2 * len(first)
    for other in (late, recording):
        assert other.history["loss"].equals(full.history["loss"])
        assert all(torch.equal(other.weights[n], full.weights[n]) for n in full.weights)


@pytest.mark.parametrize("packing", ["row by row", "a few rows", "all rows"])
def test_packed_rows_equal_one_plain_pass_each_and_start_late_bit_for_bit(tiny_qwen2, test_set, packing):
    """rows_on_prefixes in one pack, in several (each distinct prefix once per pack) and
    one row per pack: every row's states equal its own plain forward pass; a pass that
    starts at block 1 from the recorded packs equals the full packed pass bit for bit."""
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    index = max(fd.answer_batches(test_set, 12), key=len)
    seqs = [test_set.input_ids[i] + test_set.answer_ids[i] for i in index]
    starts = [len(test_set.input_ids[i]) - 1 for i in index]
    plen = al._row_prefix_lengths(test_set, index, seqs, starts)
    assert any(plen) and len({tuple(s[:p]) for s, p in zip(seqs, plen)}) < len(index)  # shared prefixes
    max_tokens = {"row by row": 1, "a few rows": 3 * max(map(len, seqs)), "all rows": engine_prefix.PACK_TOKENS}[
        packing
    ]
    packs = engine_prefix._pack_groups(seqs, plen, max_tokens)
    assert [r for g in packs for r in g] == list(range(len(index)))
    assert {"row by row": len(packs) == len(index), "a few rows": 1 < len(packs) < len(index)}.get(
        packing, len(packs) == 1
    )
    inputs = LayerInputs([1])
    with torch.no_grad():
        hidden = engine_prefix.rows_on_prefixes(
            hf, seqs, plen, inputs=inputs, key="k", same_below=1, max_tokens=max_tokens
        )
        for r, (s, p) in enumerate(zip(seqs, plen)):
            ref = hf.model(torch.tensor([s])).last_hidden_state[0, p:]
            torch.testing.assert_close(hidden[r, : len(s) - p], ref, rtol=0, atol=1e-5)
        with mw.use_weights(hf, changed(hf, 1)):
            full = engine_prefix.rows_on_prefixes(hf, seqs, plen, max_tokens=max_tokens)
            late = engine_prefix.rows_on_prefixes(
                hf, seqs, plen, inputs=inputs, key="k", same_below=1, max_tokens=max_tokens
            )
    assert torch.equal(full, late)


def test_packed_rows_refuse_an_attention_that_reads_no_mask(tiny_qwen2, monkeypatch):
    hf = ft.shared_hf_model(tiny_qwen2.bridge)
    monkeypatch.setattr(hf.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(NotImplementedError, match="masked attention"):
        engine_prefix.rows_on_prefixes(hf, [[5, 6, 7], [5, 6, 8]], [2, 2])
