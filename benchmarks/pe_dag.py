#!/usr/bin/env python
"""Benchmark: one upper neuron's coefficient for PE-DAG, from its own rows vs the whole MLP.

PE-DAG (Yu & Ananiadou Sec. 4.3; notebook 04) recomputes an upper neuron's coefficient
with each lower neuron's sub-value removed from its layer's input: one call per upper
neuron, with a row per removed sub-value (the case's lower neurons and their random
controls: about 50 rows on the committed runs). The literal method reads the coefficient
off a pass through the whole MLP (:func:`arithlib.yu.pe_dag.mlp_coefficients`); the fast
one computes the neuron alone from its gate and up rows
(:func:`arithlib.yu.pe_dag.neuron_coefficients`). This times both at the same rows in the
same run, counts their GFLOP, checks the values agree and appends the row to
benchmarks/RESULTS.md.

    python benchmarks/pe_dag.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import results  # noqa: E402
import roofline  # noqa: E402

from arithlib.yu.pe_dag import mlp_coefficients, neuron_coefficients  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--rows", type=int, default=48, help="rows per call (the sub-values removed)")
    ap.add_argument("--calls", type=int, default=20, help="calls timed (one per upper neuron)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    bridge, cfg = loaded.bridge, loaded.bridge.cfg
    g = torch.Generator().manual_seed(0)
    layer = cfg.n_layers // 2
    x = torch.randn(a.calls, a.rows, cfg.d_model, generator=g)
    neurons = torch.randint(cfg.d_mlp, (a.calls,), generator=g).tolist()

    def literal():
        return torch.stack([mlp_coefficients(bridge, layer, x[i])[:, n] for i, n in enumerate(neurons)])

    def fast():
        return torch.stack([neuron_coefficients(bridge, layer, [n], x[i])[:, 0] for i, n in enumerate(neurons)])

    with torch.no_grad():  # not torch.set_grad_enabled(False): main() also runs inside the tests
        f_lit, t_lit, v_lit = roofline.measure(literal, a.repeats)
        f_fast, t_fast, v_fast = roofline.measure(fast, a.repeats)
    row = {
        "model": a.model,
        "threads": torch.get_num_threads(),
        "calls x rows": f"{a.calls} x {a.rows}",
        "literal_s": t_lit,
        "fast_s": t_fast,
        "speedup": t_lit / t_fast,
        "literal_gflop": f_lit / 1e9,
        "fast_gflop": f_fast / 1e9,
        "max_abs_diff": float((v_lit - v_fast).abs().max()),
    }
    line = (
        f"| {row['model']} | cpu ({row['threads']} threads) | {row['calls x rows']} | {t_lit:.3f} | {t_fast:.4f} | "
        f"{row['speedup']:.0f}x | {row['literal_gflop']:.2f} | {row['fast_gflop']:.4f} | {row['max_abs_diff']:.1e} |"
    )
    table = [
        "| model | device | calls x rows | whole MLP (s) | neuron rows (s) | speedup | whole MLP GFLOP | "
        "neuron rows GFLOP | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
        line,
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(results.section("PE-DAG: an upper neuron's coefficient, its own rows vs the whole MLP", table))
    return row


if __name__ == "__main__":
    main()
