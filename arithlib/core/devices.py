"""Where and in what precision a model runs: device names (``"auto"``, ``"cuda:N"``),
dtypes (bfloat16 on a GPU, float32 on a CPU), device maps that split a model across
devices, and the checks that reject a placement before anything is loaded."""

from __future__ import annotations

import copy
import json
import re
from typing import TYPE_CHECKING, Any

import torch

from arithlib.engine.adapter import as_device, clean_param_name

if TYPE_CHECKING:  # heavy imports stay lazy
    from transformers import PretrainedConfig


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
