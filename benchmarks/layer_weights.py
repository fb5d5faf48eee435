#!/usr/bin/env python
"""Benchmark: reading one layer's MLP weights from a TransformerBridge.

The bridge's ``W_out`` / ``W_in`` / ``W_gate`` / ``W_V`` / ``W_O`` properties stack the
parameter of every layer into a new tensor on each access, so ``bridge.W_out[layer]``
copies all layers to return one (and the returned view keeps the whole copy alive).
:func:`arithlib.methods.neurons.w_out` reads ``bridge.blocks[layer].mlp.W_out`` instead. This
times both for every layer of a registry model (same values, checked) and appends the
row to benchmarks/RESULTS.md.

    python benchmarks/layer_weights.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import results  # noqa: E402

from arithlib.methods.neurons import w_out  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def stacked_values(bridge, layer: int) -> torch.Tensor:
    """The baseline: the bridge's stacked property, indexed."""
    return bridge.W_out[layer].detach().float()


def time_all_layers(fn, bridge, n_layers: int, repeats: int) -> float:
    """Best of ``repeats`` wall times of reading every layer once."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for layer in range(n_layers):
            fn(bridge, layer).sum()  # touch the result
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    bridge = bench_model.load(a.model).bridge  # on the CPU, in float32
    L = bridge.cfg.n_layers
    same = all(torch.equal(stacked_values(bridge, layer), w_out(bridge, layer)) for layer in range(L))
    t_stacked = time_all_layers(stacked_values, bridge, L, a.repeats)
    t_layer = time_all_layers(w_out, bridge, L, a.repeats)
    row = {
        "model": a.model,
        "layers": L,
        "stacked": t_stacked,
        "per_layer": t_layer,
        "speedup": t_stacked / t_layer,
        "same": same,
    }
    table = (
        "| model | layers | bridge.W_out[l], all layers (s) | blocks[l].mlp.W_out, all layers (s) | speedup | "
        "same values |\n|---|---|---|---|---|---|\n"
        f"| {a.model} | {L} | {t_stacked:.3f} | {t_layer:.4f} | {row['speedup']:.0f}x | {same} |"
    )
    print(table)
    if not a.no_append:
        results.append(
            results.section(
                "One layer's MLP weights from the bridge: stacked property vs the block's own",
                table.split("\n"),
                where=f"{platform.machine()}, {torch.get_num_threads()} threads",
                argv=argv,
            )
        )
    return row


if __name__ == "__main__":
    main()
