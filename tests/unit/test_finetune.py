"""Tests of arithlib.methods.finetune on a tiny_qwen2 random Qwen2 model (GQA: 4 query heads, 2 KV
heads, q/k/v biases): answer-position forward, data splits, LoRA per layer
(determinism, merged weights, base untouched), precise SFT (slices, GQA counting,
H/h rescaling), full SFT, checkpoints, CNA on LoRA models, key heads from notebook 01."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.methods.answer_loss as al
import arithlib.methods.finetune as ft
import arithlib.methods.finetune_data as fd
import arithlib.methods.model_weights as mw
import arithlib.run.scales as SC
import arithlib.yu.lora as LO
import arithlib.zhang.sft as SFT
from arithlib.core import papers
from arithlib.core.evaluate import answer_logits as eval_answer_logits
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir
from arithlib.core.stats import decode_correct

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tiny_qwen2):
    splits = fd.yu_lora_data(n_train=40, n_test=16, n_val=8, seed=0, fewshot=2)
    return {k: PromptSet.build(v, tiny_qwen2.tokenizer) for k, v in splits.items()}


CFG = ft.TrainConfig(lr=1e-2, epochs=1, batch_size=8, seed=0)


# --------------------------------------------------------------------------- plumbing


def test_shared_model_shares_storage(tiny_qwen2):
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    assert plain is ft.shared_hf_model(tiny_qwen2.bridge)
    assert not any("_original_component" in n for n, _ in plain.named_parameters())
    bridge_params = {ft.clean_param_name(n): p for n, p in tiny_qwen2.bridge.original_model.named_parameters()}
    for n, p in plain.named_parameters():
        assert p.data_ptr() == bridge_params[n].data_ptr()
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(plain(x).logits, tiny_qwen2.bridge(x), atol=1e-5)


def test_use_weights_swaps_and_restores(tiny_qwen2):
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    name = "model.layers.1.self_attn.o_proj.weight"
    before = dict(plain.named_parameters())[name].detach().clone()
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        base = tiny_qwen2.bridge(x)
        with mw.use_weights(tiny_qwen2.bridge, {name: torch.zeros_like(before)}):
            assert torch.equal(dict(plain.named_parameters())[name], torch.zeros_like(before))
            assert not torch.allclose(tiny_qwen2.bridge(x), base)
    assert torch.equal(dict(plain.named_parameters())[name], before)
    with pytest.raises(KeyError):
        with mw.use_weights(plain, {"no.such.weight": before}):
            pass


def test_to_loaded_model_boots_bridge(tiny_qwen2):
    from arithlib.core.random_models import random_model

    loaded = mw.to_loaded_model(random_model("qwen2"), tiny_qwen2.tokenizer, name="copy")
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(loaded.bridge(x), tiny_qwen2.bridge(x), atol=1e-5)
    assert loaded.info.n_kv_heads == 2


# --------------------------------------------------------------------------- data


def test_split_records_disjoint_by_operand_pair():
    recs = ds.yu_prompts(ops=["+", "-"], n_digits=2, n_per_template=50, allow_negative=True, seed=0)
    a = fd.split_records(recs, {"test": 30, "train": 100}, seed=1)
    b = fd.split_records(recs, {"test": 30, "train": 100}, seed=1)
    assert [r.text for r in a["test"]] == [r.text for r in b["test"]]
    assert len(a["test"]) == 30 and len(a["train"]) == 100
    keys = lambda rs: {(r.op, r.a, r.b) for r in rs}  # noqa: E731
    assert not keys(a["test"]) & keys(a["train"])
    with pytest.raises(ValueError):
        fd.split_records(recs[:4], {"test": 4, "train": 4})


def test_yu_lora_data_has_negative_results():
    splits = fd.yu_lora_data(n_train=200, n_test=50, n_val=20, seed=0)
    assert [len(splits[k]) for k in ("train", "val", "test")] == [200, 20, 50]
    assert any(r.answer < 0 and r.answer_text.startswith("-") for r in splits["train"])
    assert all(10 <= r.a <= 99 for r in splits["train"])


def test_answer_batches_keep_groups_together(data):
    ps = data["train"]
    batches = fd.answer_batches(ps, 4, shuffle=True, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(len(ps)))
    assert batches == fd.answer_batches(ps, 4, shuffle=True, seed=3)
    assert batches != fd.answer_batches(ps, 4, shuffle=True, seed=4)
    assert sorted(len(b) for b in batches)[1:] == [4] * (len(batches) - 1)
    groups = lambda b: [(ps.records[i].op, ps.records[i].template_id) for i in b]  # noqa: E731
    for b in batches:  # a group's members are contiguous within a batch
        g = groups(b)
        assert all(g.index(x) == i or g[i - 1] == x for i, x in enumerate(g))


# --------------------------------------------------------------------------- forward and accuracy


def test_teacher_forced_logits_match_full_forward(tiny_qwen2, data):
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    ps = data["train"]
    index = max(fd.answer_batches(ps, 8), key=len)
    with torch.no_grad():
        shared, mask = al.teacher_forced_logits(plain, ps, index, extra=1)
        for row, i in enumerate(index):
            seq = torch.tensor([ps.input_ids[i] + ps.answer_ids[i]])
            full = plain(seq).logits[0].float()
            s, k = len(ps.input_ids[i]) - 1, len(ps.answer_ids[i]) + 1
            assert mask[row].sum() == k
            assert torch.allclose(shared[row, :k], full[s : s + k], atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "gptj", "gpt_neox", "gpt2"])
def test_teacher_forced_logits_across_prefix_groups(arch):
    """A batch spanning several few-shot groups (one of them a single prompt): each
    group's prefix runs once, the rows' rest on top of it, and every row's logits and
    gradients equal its own plain forward pass."""
    model = load_model(str(random_model_dir(arch)))
    plain = ft.shared_hf_model(model.bridge)
    splits = fd.yu_lora_data(n_train=40, n_test=0, n_val=0, seed=0, fewshot=2)
    ps = PromptSet.build(splits["train"], model.tokenizer)
    groups: dict = {}
    for i, r in enumerate(ps.records):
        groups.setdefault(fd._prefix_key(r), []).append(i)
    big = [g for g in groups.values() if len(g) >= 2][:3]
    index = [i for g in big for i in g[:3]] + [next(g for g in groups.values() if g not in big)[0]]
    seqs = [ps.input_ids[i] + ps.answer_ids[i] for i in index]
    starts = [len(ps.input_ids[i]) - 1 for i in index]
    plen = al._row_prefix_lengths(ps, index, seqs, starts)
    assert len({tuple(s[:p]) for s, p in zip(seqs, plen)}) == len(big) + 1  # one prefix per group
    assert plen[-1] == starts[-1] and all(0 < p <= s for p, s in zip(plen, starts))
    weight = next(ft.decoder_layers(plain)[0].parameters())  # gradients through the prefix's keys and values
    flag = weight.requires_grad
    weight.requires_grad_(True)
    try:
        shared, mask = al.teacher_forced_logits(plain, ps, index, extra=1)
        (grad_shared,) = torch.autograd.grad(shared[mask].sum(), weight)
        ref, ref_mask = al.teacher_forced_logits(plain, ps, index, extra=1, share_prefix=False)
        (grad_ref,) = torch.autograd.grad(ref[ref_mask].sum(), weight)
    finally:
        weight.requires_grad_(flag)
    assert mask.equal(ref_mask)
    assert torch.allclose(shared[mask], ref[mask], atol=1e-4)
    assert torch.allclose(grad_shared, grad_ref, atol=1e-3)
    with torch.no_grad():
        for row, i in enumerate(index):
            full = plain(torch.tensor([seqs[row]])).logits[0].float()
            k = int(mask[row].sum())
            assert torch.allclose(shared[row, :k].detach(), full[starts[row] : starts[row] + k], atol=1e-4)


def test_answer_loss_is_answer_token_cross_entropy(tiny_qwen2, data):
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    ps = data["train"]
    index = fd.answer_batches(ps, 8)[0]
    with torch.no_grad():
        loss = al.answer_loss(plain, ps, index)
        total, n = 0.0, 0
        for i in index:
            seq = torch.tensor([ps.input_ids[i] + ps.answer_ids[i]])
            lp = plain(seq).logits[0].log_softmax(-1)
            s = len(ps.input_ids[i]) - 1
            for j, t in enumerate(ps.answer_ids[i]):
                total -= float(lp[s + j, t])
                n += 1
    assert abs(float(loss) - total / n) < 1e-4


def test_answer_accuracy_agrees_with_evaluate(tiny_qwen2, data):
    ps = data["test"]
    frame = al.answer_accuracy(tiny_qwen2.bridge, ps)
    logits = eval_answer_logits(tiny_qwen2.bridge, ps)
    assert (frame.correct_first.to_numpy() == (logits.argmax(-1) == ps.first_answer_ids).numpy()).all()
    first = logits.log_softmax(-1).gather(1, ps.first_answer_ids[:, None])[:, 0].numpy()
    assert np.allclose(frame.first_logprob.to_numpy(), first, atol=1e-4)
    assert (frame.correct_full <= frame.correct_first).all()


# --------------------------------------------------------------------------- LoRA


def test_lora_deterministic_and_local(tiny_qwen2, data):
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    a = LO.train_lora(tiny_qwen2.bridge, 1, data["train"], CFG, data["val"], progress=False)
    b = LO.train_lora(tiny_qwen2.bridge, 1, data["train"], CFG, data["val"], progress=False)
    assert set(a.weights) == {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"}
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert any(not torch.equal(a.weights[k], before[k]) for k in a.weights)
    after = dict(plain.named_parameters())
    assert set(after) == set(before) and all(torch.equal(before[n], after[n]) for n in before)
    assert a.n_trainable == 16 * (64 + 64) * 2 + 16 * (64 + 32) * 2  # r (in + out) for q, o (64x64), k, v (32x64)
    assert list(a.epochs.epoch) == [1] and a.samples_per_second > 0
    c = LO.train_lora(tiny_qwen2.bridge, 1, data["train"], replace(CFG, seed=1), progress=False)
    assert any(not torch.equal(a.weights[k], c.weights[k]) for k in a.weights)


def test_lora_merged_weights_equal_peft_forward(tiny_qwen2, data):
    from peft import LoraConfig, get_peft_model

    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    torch.manual_seed(0)
    pm = get_peft_model(
        plain,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], layers_to_transform=[0]),
    )
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
        x = torch.tensor([[5, 6, 7, 8, 9, 10]])
        expected = plain(x).logits
        merged = LO.merged_lora_weights(plain, pm)
    pm.unload()
    with torch.no_grad(), mw.use_weights(plain, merged):
        assert torch.allclose(plain(x).logits, expected, atol=1e-5)


def test_lora_layer_sweep_and_lr_selection(tiny_qwen2, data):
    frame, fitted, lr_table = LO.lora_layer_sweep(
        tiny_qwen2.bridge,
        [0, 1],
        data["train"],
        data["val"],
        data["test"],
        CFG,
        lrs=(1e-2, 1e-3),
        lr_layers=[1],
        progress=False,
    )
    assert list(frame.layer) == [-1, 0, 1]
    assert set(fitted) == {0, 1}
    assert lr_table.chosen.sum() == 1 and set(lr_table.lr) == {1e-2, 1e-3}
    chosen = float(lr_table.loc[lr_table.chosen, "lr"].iloc[0])
    assert fitted[0].config.lr == chosen  # layers outside lr_layers reuse the chosen lr
    assert frame.accuracy.between(0, 1).all()
    # per-prompt correctness in test-set order: the report's paired bootstrap reads it back to the accuracy
    for row in frame.itertuples():
        bits = decode_correct(row.correct_by_prompt)
        assert len(bits) == len(data["test"]) and bits.mean() == pytest.approx(row.accuracy)


def test_checkpoint_resume_gives_same_weights(tiny_qwen2, data, tmp_path):
    cfg = replace(CFG, epochs=2)
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    names = ["model.layers.0.self_attn.q_proj.weight"]

    def run(ckdir):
        params = {n: p for n, p in plain.named_parameters() if n in names}
        backup = {n: p.detach().clone() for n, p in params.items()}
        try:
            state, record = ft.train_parameters(
                plain, ft.Trainable(params), data["train"], cfg, None, progress=False, checkpoint_dir=ckdir
            )
        finally:
            with torch.no_grad():
                for n, v in backup.items():
                    params[n].copy_(v)
        return state, record

    full, rec = run(tmp_path / "a")
    assert len(list((tmp_path / "a").glob("epoch-*.pt"))) == 2
    (tmp_path / "a" / "epoch-002.pt").unlink()  # "interrupted" after epoch 1
    resumed, rec2 = run(tmp_path / "a")
    assert all(torch.equal(full[n], resumed[n]) for n in full)
    assert rec2["history"].step.tolist() == rec["history"].step.tolist()


def test_cached_training_is_reused(tiny_qwen2, data, tmp_path):
    a = LO.train_lora(tiny_qwen2.bridge, 0, data["train"], CFG, progress=False, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*/result.pt"))) == 1
    b = LO.train_lora(tiny_qwen2.bridge, 0, data["train"], CFG, progress=False, cache_dir=tmp_path)
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert not list(tmp_path.glob("*/checkpoints/epoch-*.pt"))


def test_cached_training_credits_its_store(tiny_qwen2, data, tmp_path):
    """Trained weights loaded from a Store's folder add the seconds and GFLOP their training
    took (recorded beside result.pt) to that store's reused time, as a section's own
    stored results do: a run that reuses them still shows their cost."""
    from arithlib.engine import counting
    from arithlib.run.stored import Store, stored_meta

    first = Store(tmp_path)
    with counting():
        LO.train_lora(tiny_qwen2.bridge, 0, data["train"], CFG, progress=False, cache_dir=first)
    (path,) = tmp_path.glob("*/result.pt")
    seconds, gflop = stored_meta(path, "seconds"), stored_meta(path, "gflop")
    assert seconds > 0 and gflop > 0 and first.reused_seconds == 0
    later = Store(tmp_path)
    LO.train_lora(tiny_qwen2.bridge, 0, data["train"], CFG, progress=False, cache_dir=later)
    assert later.reused_seconds == seconds and later.reused_gflop == gflop


# --------------------------------------------------------------------------- precise and full SFT


def test_head_slices_gqa_counts(tiny_qwen2):
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    d, dh = 64, 16
    # heads 0 and 1 read KV group 0, head 2 reads group 1 (4 heads, 2 KV heads)
    masks, scales, counts = SFT.head_slices(plain, [(0, 0), (0, 1), (0, 2)])
    q = masks["model.layers.0.self_attn.q_proj.weight"]
    assert q.sum() == 3 * dh * d and q[: 3 * dh].all() and not q[3 * dh :].any()
    k = masks["model.layers.0.self_attn.k_proj.weight"]
    assert k.all()  # both groups
    o = masks["model.layers.0.self_attn.o_proj.weight"]
    assert o[:, : 3 * dh].all() and not o[:, 3 * dh :].any()
    assert scales["model.layers.0.self_attn.q_proj.weight"] == pytest.approx(4 / 3)
    assert counts["n_kv_groups"] == 2
    per_head = dh * d + dh + d * dh  # Q rows (+ bias) and O columns
    per_group = 2 * (dh * d + dh)  # K and V rows (+ biases)
    assert SFT.precise_param_count(plain, [(0, 0), (0, 1)]) == 2 * per_head + 1 * per_group
    assert SFT.precise_param_count(plain, [(0, 0), (0, 1)], kv="none") == 2 * per_head
    mlp = sum(p.numel() for n, p in plain.named_parameters() if n.startswith("model.layers.1.mlp."))
    assert SFT.precise_param_count(plain, [(0, 0)], mlps=[1]) == per_head + per_group + mlp
    with pytest.raises(ValueError):
        SFT.head_slices(plain, [(5, 0)])


def test_precise_sft_trains_only_slices_and_restores(tiny_qwen2, data):
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    heads = [(1, 3)]
    cfg = replace(CFG, weight_decay=0.1)
    res = SFT.precise_sft(tiny_qwen2.bridge, heads, data["train"], cfg, progress=False)
    masks, _, _ = SFT.head_slices(plain, heads)
    assert set(res.weights) == set(masks)
    for n, w in res.weights.items():
        changed = w != before[n]
        assert changed.any()
        assert not (changed & ~masks[n]).any(), f"{n} changed outside the head's slice"
    assert all(torch.equal(p, before[n]) for n, p in plain.named_parameters())
    assert res.n_trainable == SFT.precise_param_count(plain, heads)


def test_precise_sft_gradient_rescale_with_sgd(tiny_qwen2, data):
    """One SGD step: the update of a selected slice is H/h times larger with rescaling."""
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    name = "model.layers.0.self_attn.q_proj.weight"
    before = dict(plain.named_parameters())[name].detach().clone()
    cfg = ft.TrainConfig(
        lr=1e-3, epochs=1, batch_size=64, max_steps=1, optimizer="sgd", grad_clip=None, schedule="constant"
    )
    a = SFT.precise_sft(tiny_qwen2.bridge, [(0, 1)], data["train"], cfg, rescale=True, progress=False)
    b = SFT.precise_sft(tiny_qwen2.bridge, [(0, 1)], data["train"], cfg, rescale=False, progress=False)
    da, db = a.weights[name] - before, b.weights[name] - before
    assert torch.allclose(da, 4.0 * db, atol=1e-7)  # H = 4 heads, h = 1 selected


def test_full_sft_trains_everything_and_returns_the_weights_leaving_the_model_as_it_was(tiny_qwen2, data):
    """Full SFT returns every trained weight and restores the model (it trained it in
    place before, which left no way to try a second lr on the same model)."""
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    before = {n: p.detach().clone() for n, p in mw.params_by_clean_name(plain).items()}
    res = SFT.full_sft(tiny_qwen2.bridge, data["train"], CFG, progress=False)
    assert res.n_trainable == mw.count_parameters(plain)
    assert set(res.weights) == set(before)
    assert all(not torch.equal(res.weights[n], before[n]) for n in before)  # every weight trained
    assert all(torch.equal(p, before[n]) for n, p in mw.params_by_clean_name(plain).items())  # model restored
    again = SFT.full_sft(tiny_qwen2.bridge, data["train"], CFG, progress=False)  # from the same start: the same weights
    assert all(torch.equal(again.weights[n], res.weights[n]) for n in before)
    swapped = ft.evaluate_weights(tiny_qwen2.bridge, res.weights, {"test": data["test"]})
    assert len(swapped) == len(data["test"])


def test_sft_lr_is_chosen_per_method_on_the_validation_split(tiny_qwen2, data):
    """choose_lr: with several lrs and validation prompts, the lr whose model scores best
    on them (select_lr's table, val_accuracy measured on the validation split); with one
    lr or no validation prompts, that one lr, unscored. The cpu scale searches a grid
    that holds Zhang's lr."""
    fits = []

    def fit(lr):
        fits.append(lr)
        return SFT.full_sft(tiny_qwen2.bridge, data["train"], replace(CFG, lr=lr), progress=False)

    best, table = ft.choose_lr(tiny_qwen2.bridge, fit, (1e-2, 1e-4), data["val"])
    assert fits == [1e-2, 1e-4] and table.chosen.sum() == 1 and best.config.lr == table[table.chosen].lr.iloc[0]
    on_val = ft.evaluate_weights(tiny_qwen2.bridge, best.weights, {"val": data["val"]})["correct_full"].mean()
    assert table[table.chosen].val_accuracy.iloc[0] == pytest.approx(on_val)
    assert table.val_accuracy.max() == pytest.approx(on_val)
    fits.clear()
    one, table = ft.choose_lr(tiny_qwen2.bridge, fit, (1e-2, 1e-4), None)
    assert fits == [1e-2] and one.config.lr == 1e-2 and table.val_accuracy.isna().all() and table.chosen.all()
    assert (
        papers.ZHANG_SFT["lr"] in SC.FINETUNE_SCALES["cpu"]["sft_lrs"] and len(SC.FINETUNE_SCALES["cpu"]["sft_lrs"]) > 1
    )
    assert SC.FINETUNE_SCALES["paper"]["sft_lrs"] == (papers.ZHANG_SFT["lr"],)


# --------------------------------------------------------------------------- model state after training

STEPS = replace(CFG, max_steps=2)


def _state(module: torch.nn.Module) -> tuple[list, list]:
    """Every parameter's name, ``requires_grad`` and ``.grad`` object; every module's mode."""
    return (
        [(n, p.requires_grad, p.grad) for n, p in module.named_parameters()],
        [(n, m.training) for n, m in module.named_modules()],
    )


def _assert_same_state(got: tuple[list, list], want: tuple[list, list]) -> None:
    assert [(n, f) for n, f, _ in got[0]] == [(n, f) for n, f, _ in want[0]]
    assert all(g is w for (_, _, g), (_, _, w) in zip(got[0], want[0])), "a .grad was replaced"
    assert got[1] == want[1]


@contextlib.contextmanager
def _entry_point(method: str, tiny_qwen2, data) -> Iterator[tuple[torch.nn.Module, Callable[[], object]]]:
    """(the module a training entry point works on, the call) with that module in an
    unusual state: mixed ``requires_grad``, train mode except block 0, a ``.grad`` on
    the trained (or, for LoRA, wrapped) weight of block 1. Weights and state restored after."""
    owner = load_model(str(random_model_dir("qwen2"))) if method == "full" else tiny_qwen2  # full SFT: a fresh copy
    target = owner.bridge if method == "bridge" else ft.shared_hf_model(owner.bridge)
    name = "model.layers.1.self_attn.q_proj.weight"
    weight = mw.params_by_clean_name(target)[name]
    calls = {
        "lora": lambda: LO.train_lora(tiny_qwen2.bridge, 1, data["train"], STEPS, data["val"], progress=False),
        "precise": lambda: SFT.precise_sft(
            tiny_qwen2.bridge, [(1, 0)], data["train"], STEPS, data["val"], mlps=[0], progress=False
        ),
        "full": lambda: SFT.full_sft(owner.bridge, data["train"], STEPS, data["val"], progress=False),
        "bridge": lambda: ft.train_parameters(
            tiny_qwen2.bridge, ft.Trainable({name: weight}), data["train"], STEPS, data["val"], progress=False
        ),
    }
    saved, backup = _state(target), weight.detach().clone()
    try:
        for i, p in enumerate(target.parameters()):
            p.requires_grad_(i % 2 == 0)
        target.train()
        ft.decoder_layers(target)[0].eval()
        weight.grad = torch.ones_like(weight)
        yield target, calls[method]
    finally:
        with torch.no_grad():
            weight.copy_(backup)
        for (_, flag, grad), p in zip(saved[0], target.parameters()):
            p.requires_grad_(flag)
            p.grad = grad
        for (_, training), m in zip(saved[1], target.modules()):
            m.training = training


@pytest.mark.parametrize("method", ["lora", "precise", "full", "bridge"])
def test_training_restores_grad_flags_and_modes(tiny_qwen2, data, method):
    """LoRA, precise SFT, full SFT and the loop itself leave every parameter's
    ``requires_grad`` and ``.grad`` and every module's train/eval mode as they found them
    (the bridge's own parameters too: ``train_parameters`` on a bridge trains them)."""
    with _entry_point(method, tiny_qwen2, data) as (target, train):
        before = _state(target)
        res = train()
        assert len(res[1]["history"] if method == "bridge" else res.history) == 2
        _assert_same_state(_state(target), before)
        assert not any("lora_" in n for n, _ in target.named_parameters())


@pytest.mark.parametrize("method", ["lora", "precise", "bridge"])
def test_training_runs_with_gradients_turned_off_and_leaves_them_off(tiny_qwen2, data, method):
    """A caller under ``torch.no_grad()`` (a notebook that turned autograd off) still trains:
    the loop turns gradients on for itself and the caller's mode is back afterwards."""
    with _entry_point(method, tiny_qwen2, data) as (_, train), torch.no_grad():
        res = train()
        assert not torch.is_grad_enabled()
    assert len(res[1]["history"] if method == "bridge" else res.history) == 2


@pytest.mark.parametrize("method", ["lora", "precise", "full", "bridge"])
def test_training_restores_state_on_error(tiny_qwen2, data, method, monkeypatch):
    """An exception in the middle of training (here: the second batch's loss) leaves
    the flags, gradients and modes as they were, and LoRA's peft wrapping removed."""
    real, calls = al.answer_loss, []

    def failing_loss(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(ft, "answer_loss", failing_loss)
    with _entry_point(method, tiny_qwen2, data) as (target, train):
        before = _state(target)
        names = [n for n, _ in target.named_parameters()]
        with pytest.raises(RuntimeError, match="boom"):
            train()
        assert len(calls) == 2
        _assert_same_state(_state(target), before)
        assert [n for n, _ in target.named_parameters()] == names


# --------------------------------------------------------------------------- key heads, bands, CNA


def test_rank_components(tmp_path):
    rows = []
    for op, shift in (("+", 0.0), ("-", 0.02)):
        rows += [
            {"op": op, "kind": "head", "layer": 0, "head": 1, "effect": -0.20 + shift},
            {"op": op, "kind": "head", "layer": 1, "head": 0, "effect": -0.04 + shift},
            {"op": op, "kind": "head", "layer": 1, "head": 2, "effect": -0.10 + shift},
            {"op": op, "kind": "mlp", "layer": 0, "head": -1, "effect": -0.01},
            {"op": op, "kind": "mlp", "layer": 1, "head": -1, "effect": -0.30},
        ]
    rows.append({"op": "all", "kind": "head", "layer": 1, "head": 0, "effect": -9.0})  # pooled row: ignored
    path = tmp_path / "01_path_patching.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    heads, mlps = SFT.rank_components(path)
    assert list(zip(heads.layer, heads["head"])) == [(0, 1), (1, 2), (1, 0)]
    assert heads.effect.iloc[0] == pytest.approx(-0.19)
    assert heads.key.tolist() == [True, True, False]
    assert mlps.layer.tolist() == [1, 0]
    with pytest.raises(FileNotFoundError, match="notebook 01"):
        SFT.rank_components(tmp_path / "missing" / "01_path_patching.csv")


def test_scaled_head_counts_and_bands():
    assert SFT.scaled_head_counts(papers.ZHANG_HEAD_COUNTS, 1024) == {k: k for k in papers.ZHANG_HEAD_COUNTS}
    assert SFT.scaled_head_counts((8, 32, 64), 336) == {8: 3, 32: 11, 64: 21}
    assert LO.yu_bands(32) == {
        "shallow": list(range(1, 10)),
        "middle": list(range(10, 17)),
        "deep": list(range(17, 31)),
    }
    assert LO.reference_layer(32) == 9
    assert SC.scale_settings("auto", "cpu", False, 24)["scale"] == "cpu"  # the judged CPU scale
    s = SC.scale_settings("cpu", "cpu", False, 24)
    assert s["scale"] == "cpu" and s["layers"] == list(range(24))
    assert SC.scale_settings("auto", "cuda", False, 24)["n_train"] == 18_000
    assert SC.scale_settings("cpu", "cpu", True, 24)["scale"] == "quick"
    with pytest.raises(ValueError):
        SC.scale_settings("huge", "cpu", False, 24)


def test_curve_shape_and_bands():
    bands = {"shallow": [1, 2], "middle": [3, 4], "deep": [5, 6]}
    acc = {-1: 0.5, 0: 0.6, 1: 0.9, 2: 0.9, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.55, 7: 0.95}
    frame = pd.DataFrame({"layer": list(acc), "accuracy": list(acc.values())})
    shape = LO.curve_shape(frame, bands)
    assert shape["all_above_original"] and shape["bands_decreasing"]
    assert shape["best_layer"] == 7 and shape["worst_layer"] == 6
    assert shape["slopes"]["middle"] == pytest.approx(-0.1)
    assert shape["edge_gaps"][7] == pytest.approx(0.95 - (0.55 + 0.6) / 2)
    table = LO.accuracy_bands(frame, bands)
    assert table.set_index("band").loc["shallow", "mean_gain_over_original"] == pytest.approx(0.4)


@pytest.mark.parametrize(("mode", "elems"), [("exact", 2**27), ("two_stage", 2**27), ("two_stage", 1)])
def test_lora_cna_joint_equals_one_model_at_a_time(tiny_qwen2, monkeypatch, mode, elems):
    """All LoRA models scored against the original in one importance call (and in groups of
    one, ``elems=1``) give each model's importances, in it and in the original, and Table
    10's rows as the literal per-model loop: one ``importance_from_runs([model, original])``
    per model, read with the original's final scale."""
    import arithlib.yu.cna as C

    bridge = tiny_qwen2.bridge
    cases = LO.yu_cna_cases(tiny_qwen2.tokenizer, n_cases=6)
    plain = dict(ft.shared_hf_model(bridge).named_parameters())
    g = torch.Generator().manual_seed(3)
    models = {
        label: {
            name: p.detach() + 0.2 * torch.randn(p.shape, generator=g)
            for name, p in plain.items()
            if f"layers.{layer}.self_attn." in name and name.endswith("proj.weight")
        }
        for label, layer in (("a", 0), ("b", 1), ("c", 0))  # two models with LoRA in the same layer
    }
    assert len(models) == 3
    monkeypatch.setattr(LO, "_IMPORTANCE_ELEMS", elems)
    kw = dict(mode=mode, n_candidates=7, layers=[0, 1])
    rows, details = LO.lora_cna(bridge, cases, models, ks=(5, 3), progress=False, batch_size=4, **kw)
    targets = cases.first_answer_ids
    run_o = LO._last_position_run(bridge, cases, None, 4)
    orig = C.importance_from_runs(bridge, [run_o], targets, select="score", **kw)["importance"][0]
    expected_rows = []
    for name, weights in models.items():
        run_m = LO._last_position_run(bridge, cases, weights, 4)
        out = C.importance_from_runs(bridge, [run_m, run_o], targets, select="change", scale_from=1, **kw)
        for key, ref in (("importance", out["importance"][0]), ("importance_orig", out["importance"][1])):
            got = details[name][key]
            assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), (name, key)  # the same candidates
            assert torch.allclose(got, ref, rtol=0, atol=1e-6, equal_nan=True), (name, key)
        LO._coefficient_rows(
            expected_rows, [], name, run_o, run_m, out["importance"][0] - out["importance"][1], orig, (5, 3), 6
        )
    expected = pd.DataFrame(expected_rows)
    assert list(rows.model) == list(expected.model) and list(rows.k) == list(expected.k)
    assert np.allclose(rows.coef_increase, expected.coef_increase, rtol=0, atol=1e-9, equal_nan=True)
    if mode == "two_stage":  # the reference run is read at the union of the models' candidates only
        assert torch.isnan(details["a"]["importance"]).any()


def test_lora_cna_zero_change_and_guard(tiny_qwen2):
    cases = LO.yu_cna_cases(tiny_qwen2.tokenizer, n_cases=4)
    assert cases.records[0].text.strip() == "3 + 5 ="
    plain = ft.shared_hf_model(tiny_qwen2.bridge)
    same = {
        "model.layers.1.self_attn.q_proj.weight": dict(plain.named_parameters())[
            "model.layers.1.self_attn.q_proj.weight"
        ]
        .detach()
        .clone()
    }
    rows, details = LO.lora_cna(tiny_qwen2.bridge, cases, {"same": same}, ks=(5,), progress=False)
    assert set(rows["selection"]) == {"cna", "original"}
    assert np.allclose(rows.coef_increase, 0.0)
    per = details["per_case"]  # the ratio's parts per case give the table's increase back
    for (sel, k), g in per.groupby(["selection", "k"]):
        inc = rows[(rows.selection == sel) & (rows.k == k)].coef_increase.item()
        assert 100 * g.num.sum() / g.den.sum() == pytest.approx(inc, abs=1e-4)
    assert set(per.case) <= set(range(len(cases))) and (per.den >= 0).all()
    mlp = {
        "model.layers.1.mlp.down_proj.weight": dict(plain.named_parameters())["model.layers.1.mlp.down_proj.weight"]
        .detach()
        .clone()
    }
    with pytest.raises(ValueError, match="attention only"):
        LO.lora_cna(tiny_qwen2.bridge, cases, {"mlp": mlp}, progress=False)
    table = LO.coefficient_table(
        tiny_qwen2.bridge, cases.subset([0]), {"original": None, "same": same}, [(1, 3), (0, 2)]
    )
    assert np.allclose(table.original, table.same)
    layer_of = {"same": 1}
    t10 = LO.band_increase_table(rows, layer_of, {"deep": [1]})
    assert list(t10.columns) == ["band", "layers", "n_models", "top5"]


def test_full_sft_memory_guard(tiny_qwen2, data, monkeypatch):
    monkeypatch.setattr(SFT, "available_memory", lambda: 1024)
    with pytest.raises(MemoryError, match="GiB"):
        SFT.full_sft(tiny_qwen2.bridge, data["train"], CFG, progress=False)
    nbytes = sum(p.numel() * p.element_size() for p in ft.shared_hf_model(tiny_qwen2.bridge).parameters())
    # gradients and AdamW's two moments (the original weights wait on disk)
    assert SFT.full_sft_memory(tiny_qwen2.bridge, "adamw") == pytest.approx(1.1 * 3 * nbytes, rel=0.01)
    assert SFT.full_sft_memory(tiny_qwen2.bridge, "sgd") == pytest.approx(1.1 * 1 * nbytes, rel=0.01)


def test_a_cached_full_sft_loads_without_the_memory_check(tiny_qwen2, data, tmp_path, monkeypatch):
    """The memory guard is for training: a result in the cache loads however little
    memory is free (the guard refused it before, and notebook 08 lost its full-SFT rows)."""
    first = SFT.full_sft(tiny_qwen2.bridge, data["train"], CFG, progress=False, cache_dir=tmp_path)
    monkeypatch.setattr(SFT, "available_memory", lambda: 1024)
    again = SFT.full_sft(tiny_qwen2.bridge, data["train"], CFG, progress=False, cache_dir=tmp_path)
    assert all(torch.equal(again.weights[n], w) for n, w in first.weights.items())
    with pytest.raises(MemoryError):
        SFT.full_sft(tiny_qwen2.bridge, data["train"], replace(CFG, lr=CFG.lr / 2), progress=False, cache_dir=tmp_path)


def test_make_optimizer_decays_only_the_decayed_parameters():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    for p in (a, b):
        p.grad = torch.zeros(4)  # no gradient: the step is the decay alone
    opt = ft.make_optimizer([a, b], ft.TrainConfig(lr=0.1, weight_decay=0.5), decayed=[a])
    opt.step()
    assert torch.allclose(a.detach(), torch.full((4,), 1 - 0.1 * 0.5)) and torch.equal(b.detach(), torch.ones(4))
    assert isinstance(ft.make_optimizer([a], ft.TrainConfig(optimizer="sgd")), torch.optim.SGD)


def test_cpu_scale_is_the_default_on_a_cpu_and_sized_for_a_five_point_interval():
    """On a CPU "auto" is the judged "cpu" scale (quick=True stays the smoke
    test), with every layer and a test split sized by stats.n_for_half_width."""
    from arithlib.core.stats import n_for_half_width

    assert SC.resolve_scale("auto", "cpu", False) == "cpu" and SC.resolve_scale("auto", "cpu", True) == "quick"
    assert SC.resolve_scale("auto", "cuda", False) == "paper"
    assert SC.resolve_scale("auto", "cpu", False, auto_cpu="quick") == "quick"  # how runs before it resolved
    s = SC.scale_settings("auto", "cpu", False, 24)
    assert s["scale"] == "cpu" and s["layers"] == list(range(24))
    assert s["n_test"] == n_for_half_width(0.5, SC.JUDGED_HALF_WIDTH) == 385
    assert s["n_train"] > SC.FINETUNE_SCALES["quick"]["n_train"] and s["n_val"] > 0 and s["lr_search"] != "none"


def test_auto_takes_the_stated_smaller_scale_above_one_billion_parameters_on_a_cpu():
    """A model above one billion parameters may use a smaller stated scale: "auto" on a CPU gives
    "cpu-bands" (the cpu scale's data on layer 0, the reference layer and each band's
    centre; precise SFT of the top-32 heads only) above CPU_FULL_SCALE_MAX_PARAMS, and
    stays "cpu" at or below it, "paper" on a GPU and "quick" in quick mode."""
    from arithlib.yu import pruning

    big, small = SC.CPU_FULL_SCALE_MAX_PARAMS + 1, SC.CPU_FULL_SCALE_MAX_PARAMS
    assert SC.resolve_scale("auto", "cpu", False, n_params=big) == "cpu-bands"
    assert SC.resolve_scale("auto", "cpu", False, n_params=small) == "cpu"
    assert SC.resolve_scale("auto", "cuda", False, n_params=big) == "paper"
    assert SC.resolve_scale("auto", "cpu", True, n_params=big) == "quick"
    assert SC.resolve_scale("cpu", "cpu", False, n_params=big) == "cpu"  # a scale asked for by name is kept
    s = SC.scale_settings("auto", "cpu", False, 28, n_params=big)
    assert s["scale"] == "cpu-bands" and s["layers"] == SC.scale_settings("cpu", "cpu", True, 28)["layers"]
    assert LO.reference_layer(28) in s["layers"] and 0 in s["layers"] and len(s["layers"]) < 28
    for k in ("n_train", "n_val", "n_test", "lr_search", "lora_epochs", "sft_lrs", "cna_cases"):
        assert s[k] == SC.FINETUNE_SCALES["cpu"][k], k
    assert s["head_counts"] == (32,) and s["mlp_counts"] == ()
    assert pruning.pruning_scale("cpu-bands") == {**pruning.pruning_scale("cpu"), "scale": "cpu-bands"}


def test_run_record_adds_parameters_to_the_params_json(tmp_path):
    """Parameters known only after loading (the resolved scale) reach the params JSON."""
    import json

    from arithlib.run.runs import Run

    run = Run("05_lora_mechanism", None, tmp_path, {"notebook": "05_lora_mechanism", "scale": "auto"})
    run.record(scale_resolved="cpu-bands", n_params=1_543_714_304)
    saved = json.loads((tmp_path / "05_lora_mechanism_params.json").read_text())
    assert saved["scale"] == "auto" and saved["scale_resolved"] == "cpu-bands" and saved["n_params"] == 1_543_714_304


def test_lr_is_chosen_on_the_validation_split(tiny_qwen2, data, monkeypatch):
    """Yu's lr grid is searched on the validation split: select_lr scores every lr there,
    and the table's val_accuracy is the chosen model's accuracy on it (not on the test)."""
    seen = []
    real = ft.select_lr

    def spy(fit, lrs, val_set, evaluate_on):
        seen.append(val_set)
        return real(fit, lrs, val_set, evaluate_on)

    monkeypatch.setattr(ft, "select_lr", spy)
    _, fitted, lr_table = LO.lora_layer_sweep(
        tiny_qwen2.bridge, [1], data["train"], data["val"], data["test"], CFG, lrs=(1e-2, 1e-3), progress=False
    )
    assert len(seen) == 1 and seen[0] is data["val"]
    chosen = lr_table[lr_table.chosen].iloc[0]
    on_val = ft.evaluate_weights(tiny_qwen2.bridge, fitted[1].weights, {"val": data["val"]})["correct_full"].mean()
    assert chosen.val_accuracy == pytest.approx(on_val) and fitted[1].config.lr == chosen.lr


@pytest.mark.parametrize("scale", [1e-3, 1.0, 10.0])
def test_clip_gradients_equals_torch_clip_grad_norm_bit_for_bit(scale):
    """Below, near and above the bound: the same gradients as torch's clip_grad_norm_ (which
    also multiplies by a factor of 1)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    norm = float(torch.linalg.vector_norm(torch.cat([x.flatten() for x in grads])))
    grads = [x * (scale / norm) for x in grads]  # total norm = scale
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    theirs = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, q, x in zip(ours, theirs, grads):
        p.grad, q.grad = x.clone(), x.clone()
    ft.clip_gradients(ours, 1.0)
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours, theirs))
    assert (scale >= 1) == any(not torch.equal(p.grad, x) for p, x in zip(ours, grads))  # clipped from the bound on
