#!/usr/bin/env python
"""Benchmark: one AdamW step over every weight of a model (full SFT's optimizer step).

``arithlib.finetune.make_optimizer`` uses torch's fused AdamW kernel, one pass over each
parameter and its two moments; the baseline is the single-tensor loop
(``foreach=False``), a pass per elementwise operation. Both step the model's own
parameters (copies) with the same random gradients; the first step (which allocates the
moments) is timed apart from the mean of the next ones, and the largest difference
between the two results is reported. Appends the row to benchmarks/RESULTS.md.

    python benchmarks/optimizer.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import results  # noqa: E402
from arithlib.finetune import TrainConfig, make_optimizer  # noqa: E402
from arithlib.models import load_model, load_random_model  # noqa: E402


def run_steps(weights: list[torch.Tensor], grads: list[torch.Tensor], fused: bool, steps: int
              ) -> tuple[float, float, list[torch.Tensor]]:
    """(first step s, mean of the later steps s, the parameters after ``steps``)."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g
    config = TrainConfig(lr=1e-4)
    opt = make_optimizer(params, config) if fused else torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0,
                                                                         foreach=False)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    del opt
    gc.collect()
    return times[0], sum(times[1:]) / max(1, len(times) - 1), [p.detach() for p in params]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (the first allocates AdamW's moments)")
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = load_random_model(a.model.removeprefix("random-"), "tiny") if a.model.startswith("random-") \
        else load_model(a.model)
    hf = loaded.bridge.original_model
    weights = [p.detach() for p in {p.data_ptr(): p for p in hf.parameters()}.values()]
    n = sum(w.numel() for w in weights)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(w.shape, generator=gen) * 1e-3 for w in weights]
    first_loop, later_loop, out_loop = run_steps(weights, grads, fused=False, steps=a.steps)
    first_fused, later_fused, out_fused = run_steps(weights, grads, fused=True, steps=a.steps)
    diff = max(float((x - y).abs().max()) for x, y in zip(out_loop, out_fused))
    row = {"model": a.model, "params": n, "first_loop": first_loop, "later_loop": later_loop,
           "first_fused": first_fused, "later_fused": later_fused, "speedup": later_loop / later_fused, "max_diff": diff}
    table = ("| model | parameters | single-tensor: first step (s) | later steps (s) | fused: first step (s) | "
             "later steps (s) | speedup (later steps) | max abs diff |\n|---|---|---|---|---|---|---|---|\n"
             f"| {a.model} | {n / 1e6:.0f} M | {first_loop:.2f} | {later_loop:.2f} | {first_fused:.2f} | "
             f"{later_fused:.2f} | {row['speedup']:.1f}x | {diff:.1e} |")
    print(table)
    if not a.no_append:
        results.append(results.section("Full SFT's AdamW step: fused kernel vs single-tensor loop", table.split("\n"),
                                       where=f"{platform.machine()}, {torch.get_num_threads()} threads", argv=argv))
    return row


if __name__ == "__main__":
    main()
