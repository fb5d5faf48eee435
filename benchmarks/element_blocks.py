#!/usr/bin/env python
"""Benchmark: CNA's element-wise passes over logits in cache-sized blocks, against 64 MB blocks.

The exact CNA importance (Yu & Ananiadou 2024, Sec. 4.1) needs, for every (prompt,
neuron) pair it scores, the log-partition of the logits with the neuron's value vector
added: per vocabulary chunk, a gather of the two projections, a scale, a shift, an exp
and two row reductions (:func:`arithlib.yu.cna_importance.exact_importance` for chosen
pairs, :func:`~arithlib.yu.cna_importance.log_partition_all` for every pair). Those
passes are memory-bound: over a block of 2**24 float32 values (64 MB) each pass streams
from memory; over 2**20 (4 MB, :data:`~arithlib.yu.cna_importance.ELEMENT_BLOCK`) the
block stays in the caches from one pass to the next. Each value is reduced over its own
vocabulary chunk only, so the block does not change a bit; this checks that too.

Random tensors at a model's shapes (default: Qwen2.5-Coder-0.5B's d_model 896, vocabulary
151,936, 4,864 neurons per layer), one layer; both block sizes timed in the same run,
best of ``--repeats``. Appends the table to benchmarks/RESULTS.md.

    python benchmarks/element_blocks.py
    python benchmarks/element_blocks.py --vocab 4096 --neurons 256 --rows 8 --no-append   # tiny
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

import results  # noqa: E402
import roofline  # noqa: E402

from arithlib.core.readout import FinalNorm  # noqa: E402
from arithlib.yu import cna_importance as CI  # noqa: E402

#: The element block of the code before blocks were sized to the caches (the memory bound
#: of the logits block, 2**24 values).
WHOLE_BLOCK = 2**24


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--neurons", type=int, default=4864, help="neurons of the layer (d_mlp)")
    ap.add_argument("--rows", type=int, default=200, help="prompts x runs read at the layer")
    ap.add_argument("--candidates", type=int, default=200, help="neurons scored exactly per row (chosen pairs)")
    ap.add_argument("--all-rows", type=int, default=8, help="rows whose every neuron is scored (log_partition_all)")
    ap.add_argument("--block", type=int, default=CI.ELEMENT_BLOCK, help="element block timed against 2**24")
    ap.add_argument("--repeats", type=int, default=3)
    return roofline.run_parsed(ap, argv, _run)


def _run(a: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    d, V, K, R = a.d_model, a.vocab, a.neurons, a.rows
    W_U = (torch.randn(V, d, generator=g) * 0.05).T  # [d, V], a transposed view as a bridge's W_U
    b_U = torch.zeros(V)
    norm = FinalNorm(kind="rms", weight=torch.rand(d, generator=g) + 0.5, bias=None, eps=1e-6)
    resid = torch.randn(R, d, generator=g)
    coef = torch.randn(R, K, generator=g)
    values = torch.randn(K, d, generator=g) * 0.1
    targets = torch.randint(0, V, (R,), generator=g)
    scale = torch.rand(R, generator=g) + 1
    rows = torch.arange(R).repeat_interleave(a.candidates)
    cols = torch.randint(0, K, (R * a.candidates,), generator=g)
    n_all = min(a.all_rows, R)
    rc, v, sigma = CI._pair_terms(resid[:n_all], coef[:n_all], values, norm, scale[:n_all])
    gr, gv, beta = rc * norm.weight, v * norm.weight, CI._beta(norm, W_U, b_U)

    def pairs(block: int) -> torch.Tensor:
        return CI.exact_importance(
            resid, coef, values, targets, norm, W_U, b_U, pairs=(rows, cols), scale=scale, element_block=block
        )

    def every(block: int) -> torch.Tensor:
        return CI.log_partition_all(gr, gv, coef[:n_all].float(), sigma, W_U, beta, element_block=block)

    out = []
    for name, fn, n_values in (
        (f"chosen pairs ({R} rows x {a.candidates})", pairs, R * a.candidates),
        (f"every pair ({n_all} rows x {K})", every, n_all * K),
    ):
        t_whole, r_whole = roofline.best_time(lambda fn=fn: fn(WHOLE_BLOCK), a.repeats)
        t_block, r_block = roofline.best_time(lambda fn=fn: fn(a.block), a.repeats)
        out.append((name, n_values, t_whole, t_block, torch.equal(r_whole, r_block)))
    where = f"cpu ({torch.get_num_threads()} threads)"
    table = [
        "| function | device | pairs | 2^24-value blocks (s) | "
        f"{a.block:,}-value blocks (s) | speedup | bit-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, n, tw, tb, same in out:
        table.append(f"| {name} | {where} | {n:,} | {tw:.2f} | {tb:.2f} | {tw / tb:.2f}x | {'yes' if same else 'NO'} |")
    print("\n".join(table))
    if not a.no_append:
        note = (
            f"Random tensors at d_model {d}, vocabulary {V:,}, {K:,} neurons; one layer, vocabulary chunks of "
            f"{CI.VOCAB_CHUNK} columns, best of {a.repeats}. The time includes the two products per chunk, "
            "which the block does not change."
        )
        results.append(results.section("CNA's element-wise passes in cache-sized blocks", table, note=note))
    return {name: {"speedup": tw / tb, "identical": same} for name, _, tw, tb, same in out}


if __name__ == "__main__":
    main()
