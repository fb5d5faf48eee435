"""On a CPU: device maps and dtypes through ``load_model``, every tensor the
library makes for a layer on that layer's device, and the toy pipeline in bfloat16
against float32.

No GPU is needed. A split model is imitated by giving the toy model a fake accelerate
``hf_device_map`` that puts block 1 (and, in one test, the embedding and unembedding)
on the ``meta`` device while its weights stay on the CPU: the library reads where a
module runs from that map (as it does on a real split model), so every tensor it builds
for block 1 must come out on ``meta``. The old code put them all on "the model's device"
(its first parameter's, the CPU), which a real two-GPU split rejects mid-forward."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.engine as E
import arithlib.methods.ablation as A
import arithlib.methods.patching as P
import arithlib.nikankin.activation_patching as AP
from arithlib.core.evaluate import accuracy, evaluate
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.yu import cna as C
from arithlib.yu import head_sweep as HS

META = torch.device("meta")
CPU = torch.device("cpu")


@pytest.fixture
def toy():
    """A fresh toy model per test (the fake maps are set on its HF module)."""
    return load_model("toy-arith")


def _fake_split(model, monkeypatch, *, ends_on_meta: bool = False) -> None:
    """Pretend accelerate split ``model``: block 1 on ``meta`` (and with ``ends_on_meta``
    the embedding, final norm and unembedding too), the rest on the CPU."""
    hf = model.original_model
    rest = "meta" if ends_on_meta else "cpu"
    fake = {
        "model.embed_tokens": rest,
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "meta",
        "model.norm": rest,
        "lm_head": rest,
    }
    monkeypatch.setattr(hf, "hf_device_map", fake, raising=False)


def _tensors(obj, seen=None) -> list[torch.Tensor]:
    """Tensors reachable from a hook function's closure (lists, tuples, dicts, cells)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x, seen)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x, seen)]
    if callable(obj) and getattr(obj, "__closure__", None):
        return [t for cell in obj.__closure__ for t in _tensors(cell.cell_contents, seen)]
    return []


def _tokens(model, B: int = 3, T: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, model.cfg.d_vocab, (B, T), generator=g)


# --------------------------------------------------------------------------- placement


@pytest.mark.toy_model
def test_hook_values_are_built_on_their_layers_device(toy, monkeypatch):
    """variant_hooks (activation patching, path patching, ablations, the head sweep):
    the values and index tensors of an edit of block 1 are made on block 1's device."""
    b = toy.bridge
    _fake_split(b, monkeypatch)
    dh = b.cfg.d_head
    edits = [
        P.Edit(P.Component("head", 0, 1), -1, torch.ones(3, dh)),
        P.Edit(P.Component("head", 1, 2), -1, torch.ones(3, dh)),
        P.Edit(P.Component("mlp", 1), -1, 0.0),
    ]
    hooks = dict(P.variant_hooks(b, [edits], 3, 8, 9))
    assert {t.device for t in _tensors(hooks[edits[0].component.hook_name])} == {CPU}
    for e in edits[1:]:
        devices = {t.device for t in _tensors(hooks[e.component.hook_name])}
        assert devices == {META}, (e.component.hook_name, devices)


@pytest.mark.toy_model
def test_kv_caches_and_recorded_streams_go_to_their_layers_device(toy, monkeypatch):
    """The fast path's prefix cache holds each layer's keys and values on that layer's
    device, and the stream each block receives (the clean stream a variant joins from,
    its mask and positions) is on that block's device."""
    b = toy.bridge
    run = E.clean_run(b, _tokens(b))  # a real run on the CPU
    hf = b.original_model
    _fake_split(b, monkeypatch)
    cache = E.recorded._make_cache(hf, run, 5, torch.arange(3).repeat(2), [3, 6])
    from arithlib.engine.adapter import cache_layers

    kv = cache_layers(cache)
    assert kv[0][0].device == CPU and kv[1][0].device == META and kv[1][1].device == META

    seen = []

    def spy(block, hidden, *, mask, position_embeddings, position_ids, cache=None, use_cache=False):
        layer = next(i for i, blk in enumerate(hf.model.layers) if blk is block)
        layers = cache_layers(cache)
        seen.append(
            (
                layer,
                hidden.device,
                position_ids.device,
                {t.device for t in position_embeddings},
                layers[layer][0].device if layers[layer] is not None else None,
            )
        )
        return torch.zeros(hidden.shape)  # the blocks do not run: placement only

    from arithlib.engine import passes

    monkeypatch.setattr(passes, "run_block", spy)
    monkeypatch.setattr(passes, "causal_mask", lambda *a, **k: None)
    E.resume(b, run, 5, [0, 1])
    assert seen[0] == (0, CPU, CPU, {CPU}, CPU)
    assert seen[1] == (1, META, META, {META}, META), seen[1]


@pytest.mark.toy_model
def test_inputs_and_logits_follow_the_embedding_and_unembedding(toy, monkeypatch):
    """Token ids go to the input embedding's device, states to the unembedding's."""
    from arithlib.engine import PrefixRunner

    b = toy.bridge
    _fake_split(b, monkeypatch, ends_on_meta=True)
    ps = PromptSet.build(ds.nikankin_prompts(["+"], max_operand=9, n_per_op=4, seed=0), toy.tokenizer)
    assert PrefixRunner(b, ps, 4).device == META
    unembed = P.Unembed(b)
    assert unembed.device == META
    from arithlib.engine.adapter import input_device

    assert next(ps.batches(4, input_device(b))).tokens.device == META


@pytest.mark.toy_model
def test_mean_and_mask_hooks_use_the_activations_device(toy):
    """Mean ablation and per-prompt masks move their tensors to the activation they
    edit (a hook on a block on another device gets its activation there)."""
    b = toy.bridge
    T, H, dh = 5, b.cfg.n_heads, b.cfg.d_head
    means = {"blocks.1.attn.hook_z": {T: torch.ones(T, H, dh)}}
    ((_, fn),) = A.mean_heads_hooks([(1, 2)], means, position=-1)
    z = torch.zeros(2, T, H, dh, device=META)
    assert fn(z, None).device == META


# --------------------------------------------------------------------------- load_model


TOY_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


@pytest.mark.toy_model
def test_load_model_with_an_explicit_device_map_on_the_cpu():
    """An explicit map (dict or JSON text) loads through boot_transformers and gives the
    plain load's logits."""
    plain = load_model("toy-arith")
    mapped = load_model("toy-arith", device_map=TOY_MAP)
    as_json = load_model("toy-arith", device_map=json.dumps(TOY_MAP), dtype="float32")
    tokens = _tokens(plain.bridge)
    with torch.no_grad():
        ref = plain.bridge(tokens)
        for lm in (mapped, as_json):
            assert lm.device == "cpu" and lm.dtype == torch.float32
            assert torch.allclose(lm.bridge(tokens), ref, atol=1e-5)


@pytest.mark.toy_model
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(device_map={"": "cuda:7"}), "does not exist"),
        (dict(device_map={**TOY_MAP, "model.layers.1": 7}), "does not exist"),
        (dict(device_map={"model.layers.0": "cpu"}), "unplaced"),
        (dict(device_map={**TOY_MAP, "model.decoder": "cpu"}), "does not have"),
        (dict(device_map="everywhere"), "unknown device map"),
        (dict(device_map="{not json"), "not valid JSON"),
        (dict(device_map="auto", max_memory={"cpu": "1KiB"}), "max_memory totals"),
        (dict(device_map="auto", max_memory={"cpu": "lots"}), "is not a size"),
        (dict(device_map="auto", max_memory={3: "80GiB"}), "does not exist"),
        (dict(device="cpu", device_map="auto"), "pass one"),
        (dict(dtype="float8"), "unknown dtype"),
    ],
)
def test_bad_placements_fail_before_loading(kwargs, message, monkeypatch):
    """Each bad map or budget raises a ValueError that says what to do, before any
    weights are read."""
    import transformer_lens.model_bridge as mb

    def no_boot(*a, **k):
        raise AssertionError("the bridge was booted despite a bad placement")

    monkeypatch.setattr(mb.TransformerBridge, "boot_transformers", staticmethod(no_boot))
    with pytest.raises(ValueError, match=message):
        load_model("toy-arith", **kwargs)


def test_dtype_defaults():
    from arithlib.core.devices import default_dtype, resolve_dtype

    assert default_dtype("cpu") == torch.float32 and default_dtype("cuda:0") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bf16") == resolve_dtype("torch.bfloat16") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16


# --------------------------------------------------------------------------- bfloat16 vs float32


@pytest.fixture(scope="module")
def both():
    """The toy model in float32 and in bfloat16 (on the CPU), and its prompts."""
    fp32, bf16 = load_model("toy-arith", dtype="float32"), load_model("toy-arith", dtype="bfloat16")
    assert next(bf16.bridge.parameters()).dtype == torch.bfloat16
    recs = ds.nikankin_prompts(["+", "-"], max_operand=99, max_result=198, n_per_op=40, seed=3)
    return fp32, bf16, PromptSet.build(recs, fp32.tokenizer)


@pytest.mark.toy_model
def test_bf16_accuracy_matches_fp32(both):
    """Greedy accuracy per operator within 5 points (80 prompts; measured: equal, 97.5 %)."""
    fp32, bf16, ps = both
    a = accuracy(evaluate(fp32.bridge, ps), "op").set_index("op")["accuracy"]
    b = accuracy(evaluate(bf16.bridge, ps), "op").set_index("op")["accuracy"]
    assert (a - b).abs().max() <= 0.05, (a, b)


@pytest.mark.toy_model
def test_bf16_patching_effects_match_fp32(both):
    """Activation patching (Nikankin): the indirect effects of every head and MLP at the
    last position correlate >= 0.97 with fp32's and the top-5 components agree in >= 4
    (measured: r = 0.99999, 5 of 5, largest difference 2.6 % of the largest effect)."""
    fp32, bf16, ps = both
    sub = ps.subset(range(0, len(ps), 8))
    comps = P.heads_and_mlps(fp32.bridge)
    fa = AP.activation_patching(fp32.bridge, sub, comps, progress=False)
    fb = AP.activation_patching(bf16.bridge, sub, comps, progress=False)
    ma, mb = fa.groupby("component")["ie"].mean(), fb.groupby("component")["ie"].mean()
    assert np.corrcoef(ma, mb[ma.index])[0, 1] >= 0.97
    assert len(set(ma.nlargest(5).index) & set(mb.nlargest(5).index)) >= 4


@pytest.mark.toy_model
def test_bf16_cna_ranking_overlaps_fp32(both):
    """CNA (Yu & Ananiadou Sec. 4.1, exact importance, a head zeroed in run b): the
    top-10 neurons of each case overlap fp32's in >= 7 of 10 on average (the
    importance itself is computed in fp32 from the bf16 model's activations; measured
    9.9 of 10)."""
    fp32, bf16, ps = both
    sub = ps.subset(range(0, len(ps), 10))
    hooks = A.zero_heads_hooks([(1, 0)])
    ra = C.cna_compare(fp32.bridge, sub, hooks, mode="exact", progress=False)
    rb = C.cna_compare(bf16.bridge, sub, hooks, mode="exact", progress=False)
    overlap = [len(set(ra.top(i, 10)) & set(rb.top(i, 10))) for i in range(len(sub))]
    assert np.mean(overlap) >= 7, overlap


@pytest.mark.toy_model
def test_bf16_head_sweep_accuracy_matches_fp32(both):
    """Yu's head sweep (every head zeroed at every position): per head and operator the
    accuracy differs by <= 5 points, one prompt of the 20 per setting (measured: identical on
    one machine, one flip on another; 1e-9 absorbs 1 - 0.95 != 0.05 in floats)."""
    fp32, bf16, ps = both
    sub = ps.subset(range(0, len(ps), 2))
    acc = [
        HS.setting_accuracy(HS.exact_head_sweep(m.bridge, sub, progress=False)).set_index(
            ["op", "n_digits", "layer", "head"]
        )["accuracy"]
        for m in (fp32, bf16)
    ]
    assert (acc[0] - acc[1][acc[0].index]).abs().max() <= 0.05 + 1e-9, pd.concat(acc, axis=1)


@pytest.mark.toy_model
def test_sft_of_bf16_weights_warns_and_lora_would_not(both):
    """Full/precise SFT trains a bf16 model's own weights with bf16 AdamW moments: a
    warning says so and what to do (LoRA adapters are fp32, peft's default upcast)."""
    from dataclasses import replace

    import arithlib.methods.finetune as FT

    fp32, bf16, ps = both
    train = ps.subset(range(16))
    cfg = replace(FT.TrainConfig(lr=1e-3, epochs=1, batch_size=8, seed=0), max_steps=1)
    for lm, warns in ((bf16, True), (fp32, False)):
        plain = FT.shared_hf_model(lm.bridge)
        name = "model.layers.1.self_attn.q_proj.weight"
        param = dict(plain.named_parameters())[name]
        backup = param.detach().clone()
        try:
            with pytest.warns(UserWarning, match="float32") if warns else _no_warning():
                FT.train_parameters(
                    plain, FT.Trainable({name: param}), train, cfg, None, progress=False, keep_state=False
                )
        finally:
            with torch.no_grad():
                param.copy_(backup)


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.filterwarnings("error", message="training .* parameters in place")

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
