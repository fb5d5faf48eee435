#!/usr/bin/env python
"""Benchmark: the shallow neurons' concept counts, each vocabulary chunk merged into the
running top-k through a screen of group maxima, against one ``topk`` over the whole chunk.

Yu & Ananiadou 2024, Sec. 4.4 count the number and operation concepts among the top-50
tokens of every shallow neuron's value vector carried through an attention layer's OV map
(:func:`arithlib.yu.shallow_neurons.concept_counts`). The products behind them have inner
size 128 (the OV map's rank on Qwen2.5-0.5B), so they are cheap, and ``topk`` over each
8,192-column chunk took twice as long as the product that made it.
:func:`~arithlib.yu.shallow_neurons.merge_top_values` merges only the values that can enter
a row's top-k; the counts must be equal, and this checks that too.

Random tensors at a model's shapes (default: Qwen2.5-Coder-0.5B's OV rank 128, vocabulary
151,936, two layers of 4,864 neurons); both merges timed in the same run, best of
``--repeats``. Appends the table to benchmarks/RESULTS.md.

    python benchmarks/top_merge.py
    python benchmarks/top_merge.py --vocab 8192 --rows 300 --no-append   # tiny
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

from arithlib.yu import shallow_neurons as SN  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=128, help="inner size of the products (the OV map's rank)")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--rows", type=int, default=2 * 4864, help="neuron vectors counted")
    ap.add_argument("--k", type=int, default=50, help="top-k tokens per row")
    ap.add_argument("--repeats", type=int, default=2)
    return roofline.run_parsed(ap, argv, _run)


def _run(a: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    Y = torch.randn(a.rows, a.rank, generator=g)
    W = torch.randn(a.rank, a.vocab, generator=g)
    concepts = {i: f"num:{i % 37}" for i in range(0, a.vocab, max(1, a.vocab // 400))}

    def count(group: int | None) -> torch.Tensor:
        return SN.concept_counts(Y, W, concepts, k=a.k, min_count=1, merge_group=group)

    t_whole, c_whole = roofline.best_time(lambda: count(None), a.repeats)
    t_group, c_group = roofline.best_time(lambda: count(SN.MERGE_GROUP), a.repeats)
    same = torch.equal(c_whole, c_group)
    where = f"cpu ({torch.get_num_threads()} threads)"
    table = [
        "| function | device | rows x vocabulary | whole-chunk topk (s) | grouped merge (s) | speedup | equal counts |",
        "|---|---|---|---|---|---|---|",
        f"| concept_counts, k = {a.k} | {where} | {a.rows:,} x {a.vocab:,} | {t_whole:.2f} | {t_group:.2f} | "
        f"{t_whole / t_group:.2f}x | {'yes' if same else 'NO'} |",
    ]
    print("\n".join(table))
    if not a.no_append:
        note = (
            f"Random tensors, inner size {a.rank}, {len(concepts)} concept tokens, every row counted "
            f"(min_count 1, no pruning), best of {a.repeats}. Both runs do the same products."
        )
        results.append(results.section("Concept counts: grouped top-k merge vs whole-chunk topk", table, note=note))
    return {"speedup": t_whole / t_group, "identical": same}


if __name__ == "__main__":
    main()
