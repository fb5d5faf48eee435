"""Random-weight models of the architectures the papers used (Llama, Mistral, Qwen2,
GPT-J, GPT-NeoX, GPT-2): tiny ones, with a small byte-level tokenizer, for tests; full-size
shapes (:data:`FULL_SHAPES`) for GPU benchmarks."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from arithlib.core.devices import resolve_device
from arithlib.core.models import LoadedModel, _boot, _finish, _prepare_tokenizer, model_info
from arithlib.core.packaged_models import _MARKER, _is_complete
from arithlib.core.weights import record_weights
from arithlib.run.paths import cache_root

if TYPE_CHECKING:  # heavy imports stay lazy
    from transformers import PretrainedConfig, PreTrainedModel

_log = logging.getLogger(__name__)

RANDOM_ARCHS = ("llama", "mistral", "qwen2", "gptj", "gpt_neox", "gpt2")

_TINY = dict(layers=2, d=64, heads=4, kv=2, mlp=128, vocab=512, ctx=256)


def _tiny_kwargs(arch: str) -> dict[str, Any]:
    """HF config kwargs of the ``tiny`` shape of ``arch``."""
    t = _TINY
    if arch in ("llama", "mistral", "qwen2"):
        kw: dict[str, Any] = dict(
            vocab_size=t["vocab"],
            hidden_size=t["d"],
            intermediate_size=t["mlp"],
            num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"],
            num_key_value_heads=t["kv"],
            max_position_embeddings=t["ctx"],
        )
        if arch == "qwen2":
            kw["tie_word_embeddings"] = True  # like Qwen2.5-0.5B/1.5B
        if arch == "mistral":
            kw["sliding_window"] = None
        return kw
    if arch == "gptj":
        return dict(
            vocab_size=t["vocab"],
            n_embd=t["d"],
            n_inner=t["mlp"],
            n_layer=t["layers"],
            n_head=t["heads"],
            n_positions=t["ctx"],
            rotary_dim=8,
        )
    if arch == "gpt_neox":
        return dict(
            vocab_size=t["vocab"],
            hidden_size=t["d"],
            intermediate_size=t["mlp"],
            num_hidden_layers=t["layers"],
            num_attention_heads=t["heads"],
            max_position_embeddings=t["ctx"],
            rotary_pct=0.25,
        )
    if arch == "gpt2":
        return dict(
            vocab_size=t["vocab"],
            n_embd=t["d"],
            n_inner=t["mlp"],
            n_layer=t["layers"],
            n_head=t["heads"],
            n_positions=t["ctx"],
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {RANDOM_ARCHS}.")


# Full-size shapes of the papers' models (random weights, for GPU benchmarks).
FULL_SHAPES: dict[tuple[str, str], dict[str, Any]] = {
    ("llama", "llama3-8b"): dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    ("llama", "llama2-7b"): dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    ("mistral", "mistral-7b"): dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        sliding_window=None,
    ),
    ("gptj", "gptj-6b"): dict(
        vocab_size=50400,
        n_embd=4096,
        n_layer=28,
        n_head=16,
        n_positions=2048,
        rotary_dim=64,
    ),
    # Qwen2.5-Coder-1.5B as the registry's dequantized checkpoint configures it (the
    # real weights travel as a 1 GB GGUF; this shape checks the same code path on a GPU).
    ("qwen2", "qwen2.5-coder-1.5b"): dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    ("gpt_neox", "pythia-6.9b"): dict(
        vocab_size=50432,
        hidden_size=4096,
        intermediate_size=16384,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        rotary_pct=0.25,
    ),
}


def random_shapes(arch: str) -> list[str]:
    """Shapes :func:`random_model_dir` offers for ``arch``."""
    return ["tiny"] + [s for (a, s) in FULL_SHAPES if a == arch]


def _random_config(arch: str, shape: str) -> PretrainedConfig:
    """HF config of a random model (tokenizer special-token ids filled in for tiny)."""
    from transformers import AutoConfig

    if arch not in RANDOM_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {RANDOM_ARCHS}.")
    if shape == "tiny":
        kwargs = _tiny_kwargs(arch)
        kwargs.update(
            bos_token_id=_SPECIALS.index("<bos>"),
            eos_token_id=_SPECIALS.index("<eos>"),
            pad_token_id=_SPECIALS.index("<pad>"),
        )
    elif (arch, shape) in FULL_SHAPES:
        kwargs = dict(FULL_SHAPES[(arch, shape)])
    else:
        raise ValueError(f"unknown shape {shape!r} for {arch}; choose one of {random_shapes(arch)}.")
    return AutoConfig.for_model(arch, **kwargs)


_SPECIALS = ["<unk>", "<pad>", "<bos>", "<eos>"]
_WORDS = (
    "the of and to a in is it you that he was for on are with as i his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number no most people my "
    "over know than call first who may down side now find new work part take get place made "
    "plus minus times divided equals answer sum result question"
).split()
# Qwen2's pre-tokenizer regex: digits one by one, words with their leading space.
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable-character map used by byte-level BPE."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def random_tokenizer() -> PreTrainedTokenizerFast:  # noqa: F821 (lazy import)
    """A small byte-level BPE tokenizer for random models (339 tokens).

    Specials ``<unk> <pad> <bos> <eos>`` (ids 0-3), one token per printable ASCII
    character (so one per digit, operator, space and newline: ``"3+5="`` is four
    tokens), and merges that make ~110 common lowercase words single tokens.
    It is built exactly as ``Qwen2Tokenizer`` rebuilds a tokenizer from its vocab
    and merges (Qwen's split regex + byte-level BPE), because ``AutoTokenizer``
    forces that class on any ``qwen2`` directory; every architecture then
    tokenizes identically. Characters outside ASCII are dropped (there is no
    byte fallback). No BOS is added by the tokenizer itself.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bytes_ = _byte_chars()
    vocab: dict[str, int] = {}
    for tok in _SPECIALS:
        vocab[tok] = len(vocab)
    for b in [9, 10, 13, *range(32, 127)]:
        vocab[bytes_[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                vocab[word[:i]] = len(vocab)
                merges.append((word[: i - 1], word[i - 1]))
    tk = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def build_random(config: PretrainedConfig, seed: int, device: str, dtype: torch.dtype) -> PreTrainedModel:
    """A model of ``config`` with random weights initialised on ``device`` from ``seed``.

    Uses a forked RNG, so the caller's global RNG state is untouched.
    """
    from transformers import AutoModelForCausalLM

    devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_model_dir(arch: str, shape: str = "tiny", seed: int = 0) -> Path:
    """Directory of a random-weight model of ``arch`` (config, tokenizer, and for
    ``tiny`` also safetensors weights), at ``cache_root()/random/<arch>-<shape>-<seed>/``.

    ``arch`` is one of ``RANDOM_ARCHS``. ``shape="tiny"`` is 2 layers, d_model 64,
    4 heads (2 KV heads for Llama/Mistral/Qwen2), d_mlp 128, vocab 512: built in
    seconds and loadable with :func:`load_model`. Full-size shapes
    (:data:`FULL_SHAPES`, e.g. ``("llama", "llama3-8b")``) are for GPU benchmarks:
    only config and tokenizer are written (an 8B model is 16 GB in fp16);
    build the weights on the GPU with :func:`random_model` or
    :func:`load_random_model`. Deterministic in ``seed``.
    """
    config = _random_config(arch, shape)
    out = cache_root() / "random" / f"{arch}-{shape}-{seed}"
    if _is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
        with_weights = shape == "tiny"
        if with_weights:
            build_random(config, seed, "cpu", torch.float32).save_pretrained(str(tmp), safe_serialization=True)
            record_weights(tmp)
        else:
            config.save_pretrained(str(tmp))
        random_tokenizer().save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps({"arch": arch, "shape": shape, "seed": seed, "weights": with_weights}))
        try:
            os.replace(tmp, out)
        except OSError:
            if not _is_complete(out):  # lost a race to a concurrent builder: theirs is as good
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def random_model(
    arch: str, shape: str = "tiny", seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """An HF model of ``arch``/``shape`` with random weights, in eval mode on ``device``.

    ``tiny`` models are read from :func:`random_model_dir` (same weights on every
    device); full-size shapes are initialised directly on ``device`` in ``dtype``
    (deterministic for a given seed and device).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(device)
    path = random_model_dir(arch, shape, seed)
    if shape == "tiny":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return build_random(AutoConfig.from_pretrained(str(path)), seed, device, dtype)


def load_random_model(
    arch: str, shape: str = "tiny", seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """:func:`random_model` booted as a bridge (for benchmarks of full-size shapes)."""
    from transformers import AutoTokenizer

    device = resolve_device(device)
    t0 = time.perf_counter()
    path = random_model_dir(arch, shape, seed)
    hf_model = random_model(arch, shape, seed, device, dtype)
    tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(str(path)))
    bridge = _boot(str(path), device=device, dtype=dtype, tokenizer=tokenizer, hf_model=hf_model)
    _finish(bridge, tokenizer, None)
    info = model_info(hf_model.config, name=f"random-{arch}-{shape}-{seed}", source="local", model=hf_model)
    _log.info("built random %s/%s on %s in %.1f s", arch, shape, device, time.perf_counter() - t0)
    return LoadedModel(bridge=bridge, tokenizer=tokenizer, info=info, device=device, dtype=dtype)
