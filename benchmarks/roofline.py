"""How close a benchmarked call comes to the machine's peak arithmetic rate.

* :func:`counted_flops`: the floating-point operations a call performs, counted by the
  notebooks' own counter (:mod:`arithlib.engine.flops`, torch's per-operator formulas)
  over one extra (untimed) call: every matrix product,
  batched product and fused attention the call dispatches, whatever code path it takes,
  so no benchmark keeps a hand-written FLOP formula that could drift from the code.
  Element-wise work (norms, softmax, the logsumexp of CNA) is not counted: it is
  memory-bound, and the ratio to the FLOP peak says how much of the time it costs.
* :func:`flop_peak`: the dense peak of the device in that dtype, from the datasheet for
  known GPUs (:data:`GPU_PEAKS`), else measured in the same run
  (:func:`measure_peak`: a CPU has no datasheet number torch can look up, so its
  roofline is the best rate its BLAS reaches on the model's MLP shape).
* :func:`rate`: achieved TFLOP/s and the fraction of the peak.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: Dense tensor-core peaks (TFLOP/s) by dtype, and HBM bandwidth (TB/s), by GPU name
#: fragment (NVIDIA datasheets, SXM parts; float32 without TF32, torch's default).
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0, "bandwidth": 4.8},
    "H100": {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0, "bandwidth": 3.35},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5, "bandwidth": 2.0},
}


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_parsed(ap: argparse.ArgumentParser, argv: list[str] | None, run: Callable[[argparse.Namespace], Any]) -> Any:
    """Add the options every CPU benchmark shares (``--threads``, ``--no-append``) to ``ap``,
    parse ``argv`` and return ``run(args)`` with torch's thread count set to ``--threads``."""
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the notebooks run with 1)")
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    with torch_threads(a.threads):
        return run(a)


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def best_time(fn: Callable[[], Any], repeats: int, device: str | torch.device = "cpu") -> tuple[float, Any]:
    """(fastest wall seconds of ``repeats`` calls, the last call's result), synchronising
    the device around each call."""
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def counted_flops(fn: Callable[[], Any]) -> float:
    """FLOPs of one call of ``fn`` (matrix products and attention), counted by
    :func:`arithlib.engine.counting` (the counter behind the notebooks' floors) while it
    runs once more."""
    from arithlib import engine

    with engine.counting():
        before = engine.counted_flops()
        fn()
        return float(engine.counted_flops() - before)


def measure(fn: Callable[[], Any], repeats: int, device: str | torch.device = "cpu") -> tuple[float, float, Any]:
    """(FLOPs of one call, best seconds of ``repeats`` calls, the last call's result):
    the FLOP-counting call comes first and doubles as the warm-up of the timed ones."""
    flops = counted_flops(fn)
    seconds, out = best_time(fn, repeats, device)
    return flops, max(seconds, 1e-9), out


def gpu_datasheet(device: str | torch.device) -> tuple[str, dict[str, float]] | None:
    """(name fragment, peaks) of a GPU in :data:`GPU_PEAKS`, else None."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next(((key, peaks) for key, peaks in GPU_PEAKS.items() if key in name), None)


def measure_peak(
    d_model: int,
    d_mlp: int,
    device: str | torch.device,
    dtype: torch.dtype,
    rows: tuple[int, ...] = (256, 1024, 4096),
    reps: int = 5,
    copy_mb: int = 64,
) -> tuple[float, float]:
    """(TFLOP/s, TB/s) this machine reaches, measured now: the best rate of the MLP's
    product ``[rows, d_model] @ [d_model, d_mlp]`` and of a ``copy_mb`` MB copy (read +
    write)."""
    from arithlib.run.floor import matmul_peak

    best = matmul_peak(d_model, d_mlp, dtype=dtype, device=str(device), rows=rows)["gflop_s"] * 1e9
    n = copy_mb * 2**20 // 4
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds, _ = best_time(lambda: [dst.copy_(src) for _ in range(reps)], 2, device)
    return best / 1e12, 2 * n * 4 * reps / seconds / 1e12


def flop_peak(device: str | torch.device, dtype: torch.dtype, d_model: int, d_mlp: int) -> tuple[float, str]:
    """(peak TFLOP/s, where it comes from): a known GPU's datasheet, else measured here
    on the model's MLP shape."""
    sheet = gpu_datasheet(device)
    dname = dtype_name(dtype)
    if sheet is not None and dname in sheet[1]:
        return sheet[1][dname], f"{sheet[0]} datasheet"
    return measure_peak(d_model, d_mlp, device, dtype)[0], "measured"


def bandwidth_peak(device: str | torch.device, dtype: torch.dtype, d_model: int, d_mlp: int) -> tuple[float, str]:
    """(memory bandwidth in TB/s, where it comes from): a known GPU's datasheet, else the
    copy rate measured now (:func:`measure_peak` with a single-row product)."""
    sheet = gpu_datasheet(device)
    if sheet is not None:
        return sheet[1]["bandwidth"], f"{sheet[0]} datasheet"
    return measure_peak(d_model, d_mlp, device, dtype, rows=(1,))[1], "measured copy"


def rate(flops: float, seconds: float, peak_tflops: float) -> tuple[float, float]:
    """(achieved TFLOP/s, fraction of ``peak_tflops``) of ``flops`` done in ``seconds``."""
    achieved = flops / seconds / 1e12
    return achieved, achieved / peak_tflops


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def device_label(device: str | torch.device) -> str:
    """The device as a table cell: the GPU's name, or ``cpu (N threads)``."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({torch.get_num_threads()} threads)"


def num(x: float | None) -> str:
    """A table cell of a measured number: 3 significant digits, "–" for none."""
    return "–" if x is None or not math.isfinite(x) else f"{x:.3g}"


def pct(x: float | None) -> str:
    """A fraction as a percentage cell, "–" for none."""
    return "–" if x is None or not math.isfinite(x) else f"{100 * x:.3g}%"


def peak_cell(peak: float, source: str) -> str:
    """The peak with where it comes from: ``989 (H100 datasheet)``, ``0.12 (measured)``."""
    return f"{peak:.0f} ({source})" if peak >= 10 else f"{peak:.2g} ({source})"
