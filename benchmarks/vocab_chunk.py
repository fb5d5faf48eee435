#!/usr/bin/env python
"""Benchmark: the vocabulary passes of CNA's importance, by chunk width and row count.

Every CNA importance (Yu & Ananiadou Sec. 4.1) reads neurons through the unembedding:
the baseline statistics of each row (:func:`arithlib.yu.cna_importance.layer_stats`)
and the log-partition of each neuron's logits
(:func:`arithlib.yu.cna_importance.log_partition_all`) are products
``rows @ W_U[:, chunk]`` over the vocabulary, chunk by chunk. How fast such a product
runs depends on its shape: the chunk width and the number of rows. This measures

1. the product's rate at several widths and row counts, on the model's own W_U;
2. one layer's log-partition of every neuron for two rows (notebook 07's bias CNA), at
   the width the old bound gave (8,192 columns capped by a 2**24-element block: 3,449 at
   Qwen-0.5B's 4,864 neurons) and at ``VOCAB_CHUNK``;
3. ``layer_stats`` of every layer for a few dozen rows (notebook 04's and 05's stage 1),
   one layer per pass with 16,384 columns (the old way) and all layers stacked in one
   pass (:func:`arithlib.yu.cna_importance.layer_stats_stacked`) with ``VOCAB_CHUNK``,

each pair in the same run, with the largest difference between the two. Appends the
tables to benchmarks/RESULTS.md.

    python benchmarks/vocab_chunk.py --model qwen2.5-coder-0.5b
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

import arithlib.yu.cna_importance as CI  # noqa: E402
from arithlib.core.readout import final_norm, unembedding  # noqa: E402
from arithlib.methods.neurons import w_out  # noqa: E402

WIDTHS = (512, 1024, 2048, 3449, 8192, 16384)


def product_rates(W_U: torch.Tensor, rows: list[int], widths: tuple[int, ...], columns: int, repeats: int) -> dict:
    """GFLOP/s of ``x @ W_U[:, v0:v0+w]`` over the first ``columns`` columns, per (rows, width)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    cols = min(columns, W_U.shape[1])
    for n in rows:
        x = torch.randn(n, W_U.shape[0], generator=g)
        for w in widths:

            def run(x=x, w=w):
                for v0 in range(0, cols, w):
                    x @ W_U[:, v0 : v0 + w]

            t, _ = roofline.best_time(run, repeats)
            out[(n, w)] = 2 * n * W_U.shape[0] * cols / t / 1e9
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--layer", type=int, default=None, help="layer whose neurons are read (default: the middle)")
    ap.add_argument("--rows", type=int, default=48, help="rows of the stage-1 statistics (05: 2 runs x 24 cases)")
    ap.add_argument("--columns", type=int, default=32768, help="vocabulary columns timed in part 1")
    ap.add_argument("--repeats", type=int, default=2)
    return roofline.run_parsed(ap, argv, _run)


def _run(a: argparse.Namespace) -> dict:
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    bridge, cfg = loaded.bridge, loaded.bridge.cfg
    norm = final_norm(bridge)
    W_U, b_U = unembedding(bridge)
    d, K, L = int(cfg.d_model), int(cfg.d_mlp), int(cfg.n_layers)
    layer = L // 2 if a.layer is None else a.layer
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # 1: the product's rate by shape
        rates = product_rates(W_U, [24, 400, K], WIDTHS, a.columns, a.repeats)
        # 2: one layer's log-partition of every neuron, two rows
        resid = torch.randn(2, d, generator=g) * 4
        coef = torch.randn(2, K, generator=g)
        rc, v, sigma = CI._pair_terms(resid, coef, w_out(bridge, layer), norm)
        gr, gv, beta = rc * norm.weight, v * norm.weight, CI._beta(norm, W_U, b_U)
        old_width = max(1, min(8192, W_U.shape[1], 2**24 // K))
        flops_lp = 2 * (K + 2) * d * W_U.shape[1]
        t_old, lp_old = roofline.best_time(
            lambda: CI.log_partition_all(gr, gv, coef, sigma, W_U, beta, vocab_chunk=old_width), a.repeats
        )
        t_new, lp_new = roofline.best_time(lambda: CI.log_partition_all(gr, gv, coef, sigma, W_U, beta), a.repeats)
        diff_lp = float((lp_old - lp_new).abs().max())
        # 3: every layer's stage-1 statistics
        rows = [torch.randn(a.rows, d, generator=g) * 4 for _ in range(L)]
        targets = torch.randint(0, W_U.shape[1], (a.rows,), generator=g)
        flops_st = 2 * 2 * a.rows * L * d * W_U.shape[1]  # A = g r W_U and q = e W_U^T

        def per_layer():
            return [CI.layer_stats(r, targets, norm, W_U, b_U, vocab_chunk=16384) for r in rows]

        def stacked():
            return CI.layer_stats_stacked(rows, targets, norm, W_U, b_U)

        t_pl, st_pl = roofline.best_time(per_layer, a.repeats)
        t_sk, st_sk = roofline.best_time(stacked, a.repeats)
        diff_st = max(float((x[0].lse0 - y[0].lse0).abs().max()) for x, y in zip(st_pl, st_sk))
    threads = torch.get_num_threads()
    where = f"cpu ({threads} threads)"
    t1 = [
        "| rows \\ columns per chunk | " + " | ".join(str(w) for w in WIDTHS) + " |",
        "|---|" + "---|" * len(WIDTHS),
    ]
    for n in sorted({n for n, _ in rates}):
        t1.append(f"| {n} | " + " | ".join(f"{rates[(n, w)]:.1f}" for w in WIDTHS) + " |")
    t2 = [
        "| model | device | part | old (s) | new (s) | speedup | old GFLOP/s | new GFLOP/s | max abs diff (nats) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {a.model} | {where} | log-partition, layer {layer}, 2 rows x {K} neurons ({old_width} -> "
        f"{CI.VOCAB_CHUNK} columns) | {t_old:.2f} | {t_new:.2f} | {t_old / t_new:.2f}x | "
        f"{flops_lp / t_old / 1e9:.1f} | {flops_lp / t_new / 1e9:.1f} | {diff_lp:.1e} |",
        f"| {a.model} | {where} | stage-1 statistics, {L} layers x {a.rows} rows (per layer, 16384 columns -> "
        f"stacked, {CI.VOCAB_CHUNK}) | {t_pl:.2f} | {t_sk:.2f} | {t_pl / t_sk:.2f}x | "
        f"{flops_st / t_pl / 1e9:.1f} | {flops_st / t_sk / 1e9:.1f} | {diff_st:.1e} |",
    ]
    print("GFLOP/s of rows @ W_U[:, chunk]:\n" + "\n".join(t1) + "\n\n" + "\n".join(t2))
    if not a.no_append:
        note = (
            f"{a.model}, d_model {d}, vocabulary {W_U.shape[1]}, {where}. First table: GFLOP/s of "
            f"`rows @ W_U[:, chunk]` over the first {min(a.columns, W_U.shape[1])} columns."
        )
        results.append(
            results.section("Vocabulary passes of CNA: chunk width and stacked rows", t1 + [""] + t2, note=note)
        )
    return {
        "rates": rates,
        "log_partition_speedup": t_old / t_new,
        "stats_speedup": t_pl / t_sk,
        "max_abs_diff": max(diff_lp, diff_st),
    }


if __name__ == "__main__":
    main()
