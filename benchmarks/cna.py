#!/usr/bin/env python
"""Benchmark: CNA importance (Yu & Ananiadou 2024, Sec. 4.1) of every FFN neuron for N
prompts, batched (``arithlib.cna.exact_importance``: shared value projections, vocabulary
in chunks, online logsumexp) against the per-neuron loop through the model's own
``ln_final`` and unembedding (``arithlib.cna.importance_loop``). Both are exact; the
script checks they agree, prints a markdown table and appends it, with the command,
to ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/cna.py --model toy-arith --n-prompts 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import arithlib.cna as C  # noqa: E402
import results  # noqa: E402
import arithlib.datasets as ds  # noqa: E402
from arithlib.models import load_model, random_model_dir  # noqa: E402


def _timed(fn, repeats: int, sync) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="toy-arith", help="registry name, local dir, or random-<arch> (tiny random weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-chunk", type=int, default=8192)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args()

    name = str(random_model_dir(args.model.split("-", 1)[1])) if args.model.startswith("random-") else args.model
    loaded = load_model(name, device=args.device)
    b, info = loaded.bridge, loaded.info
    recs = ds.yu_prompts(ops=["+", "-"], n_digits=1, n_per_template=None, templates=[3], fewshot=2)
    ps = ds.PromptSet.build(recs, loaded.tokenizer)
    ps = ps.subset(list(range(min(args.n_prompts, len(ps)))))
    run = C.run_last_position(b, ps, batch_size=64)
    t = ps.first_answer_ids
    norm, (W_U, b_U) = C.final_norm(b), C.unembedding(b)
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    resid = run.resid_mid.to(dev)
    coef = run.coef.to(dev)

    def batched():
        return torch.stack([C.exact_importance(resid[:, l], coef[:, l], C.mlp_values(b, l), t, norm, W_U, b_U,
                                               vocab_chunk=args.vocab_chunk) for l in range(info.n_layers)], 1)

    def loop():
        return torch.stack([C.importance_loop(b, resid[:, l], coef[:, l], l, t) for l in range(info.n_layers)], 1)

    with torch.no_grad():
        t_batched, imp_b = _timed(batched, args.repeats, sync)
        t_loop, imp_l = _timed(loop, max(1, args.repeats // 3), sync)
    diff = float((imp_b - imp_l).abs().max())
    n_neurons = info.n_layers * info.d_mlp
    row = (f"| {args.model} | {args.device} ({torch.get_num_threads()} threads) | {len(ps)} | {n_neurons} | {info.d_vocab} "
           f"| {t_batched:.3f} | {t_loop:.3f} | {t_loop / t_batched:.1f}x | {diff:.1e} |")
    header = ("| model | device | prompts | neurons (L x d_mlp) | vocab | batched (s) | per-neuron loop (s) "
              "| speedup | max abs diff |\n|---|---|---|---|---|---|---|---|---|")
    print(header)
    print(row)
    if not args.no_append:
        results.append(results.section("CNA importance, all neurons x prompts: batched vs per-neuron loop",
                                       [*header.split("\n"), row]))
        print(f"appended to {results.RESULTS}")


if __name__ == "__main__":
    main()
