#!/usr/bin/env python
"""Benchmark: how fast this machine multiplies a model's MLP matrices, by batch rows.

Every notebook's CPU time is mostly ``Linear.forward`` (py-spy profiles of the
notebooks; see RESULTS.md), so its speed is set by the rate of ``[M, d_model] @
[d_model, d_mlp]`` matrix products, which depends on M, the number of token rows per
call: few rows read every weight for little arithmetic. This prints that rate for the
MLP shapes of the given models (no weights are loaded: the shapes come from the
registry, and Llama-3-8B's from its config) at M = 1 .. 4096, on any device and dtype,
and appends the table to benchmarks/RESULTS.md.

    python benchmarks/gemm.py --models qwen2.5-coder-0.5b qwen2.5-coder-1.5b
    python benchmarks/gemm.py --models qwen2.5-coder-1.5b llama3-8b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

from arithlib.run.floor import matmul_rate  # noqa: E402

#: (d_model, d_mlp) of the MLP up-projection, by model (the registry's shapes).
SHAPES = {
    "smollm2-135m": (576, 1536),
    "qwen2.5-coder-0.5b": (896, 4864),
    "qwen2.5-coder-1.5b": (1536, 8960),
    "llama3-8b": (4096, 14336),
}


def gemm_rate(
    m: int, k: int, n: int, seconds: float = 1.0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """GFLOP/s of ``F.linear([m, k], [n, k])`` on ``device`` (:func:`arithlib.run.floor.matmul_rate`,
    the rate a notebook's floor is measured against)."""
    return matmul_rate(m, k, n, seconds=seconds, dtype=dtype, device=device)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"], choices=sorted(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64, 256, 1024, 4096])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    rows = []
    for model in a.models:
        k, n = SHAPES[model]
        rates = {m: gemm_rate(m, k, n, a.seconds, dtype, a.device) for m in a.rows}
        best = max(rates.values())
        rows.append({"model": model, "shape": f"{k} x {n}", "rates": rates, "best": best})
    cols = " | ".join(f"M = {m}" for m in a.rows)
    header = f"| model | MLP matrix | {cols} |\n|---|---|" + "---|" * len(a.rows)
    lines = [
        f"| {r['model']} | {r['shape']} | "
        + " | ".join(f"{v:.0f} ({v / r['best']:.0%})" for v in r["rates"].values())
        + " |"
        for r in rows
    ]
    text = "\n".join([header, *lines])
    print(text)
    if not a.no_write:
        if torch.device(a.device).type == "cuda":
            where = f"{torch.cuda.get_device_name(a.device)}, torch {torch.__version__}"
        else:
            where = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
        results.append(
            results.section(
                f"{a.dtype} matrix product rate by rows per call",
                text.split("\n"),
                where=where,
                argv=argv,
                note="GFLOP/s of `[M, d_model] @ [d_model, d_mlp]` (share of the best M in parentheses).",
            )
        )
    return rows


if __name__ == "__main__":
    main()
