#!/usr/bin/env python
"""Benchmark: Yu's head sweep (every head zeroed at every position), the engine of
:func:`arithlib.yu.head_sweep.exact_head_sweep` against the baseline of one pass per head
that recomputes every position of every prompt from the head's layer up
(:func:`arithlib.methods.knockouts.head_sweep` with ``position=None``), and against one full
forward pass per head (the literal intervention; its time is the baseline pass time x
n_layers / (n_layers - mean head layer), measured directly on ``--full-heads`` heads).

Same model, prompts (Yu's template 4 with the 2-shot prefix, 1-digit + by default) and
heads (``--heads`` evenly spaced over all layers); the two fast paths are checked equal
(first-token correctness). Prints a markdown table and appends it to RESULTS.md.

    python benchmarks/head_sweep.py --model qwen2.5-coder-0.5b --prompts 32 --heads 24
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import arithlib.core.datasets as ds  # noqa: E402
import arithlib.methods.ablation as A  # noqa: E402
import arithlib.methods.knockouts as KO  # noqa: E402
import arithlib.yu.head_sweep as HS  # noqa: E402
from arithlib.core.evaluate import answer_logits  # noqa: E402
from arithlib.core.models import load_model  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append, section  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--full-heads", type=int, default=4)
    ap.add_argument("--op", default="+")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    m = load_model(args.model)
    b = m.bridge
    recs = ds.yu_prompts([args.op], n_digits=1, n_per_template=args.prompts, seed=0, fewshot=2, templates=[3])
    ps = PromptSet.build(recs, m.tokenizer)
    L, H = b.cfg.n_layers, b.cfg.n_heads
    every = [(l, h) for l in range(L) for h in range(H)]
    heads = [every[i] for i in np.linspace(0, len(every) - 1, args.heads).round().astype(int)]
    HS.exact_head_sweep(b, ps.subset([0]), heads[:1], progress=False)  # warm-up
    t = time.perf_counter()
    fast = HS.exact_head_sweep(b, ps, heads, progress=False)
    t_fast = time.perf_counter() - t
    t = time.perf_counter()
    base = KO.head_sweep(b, ps, heads=heads, position=None, progress=False).sort_values(["layer", "head", "prompt"])
    t_base = time.perf_counter() - t
    same = bool((fast["correct"].to_numpy() == base["correct"].to_numpy()).all())
    t = time.perf_counter()
    for hd in heads[: args.full_heads]:
        with b.hooks(fwd_hooks=A.zero_heads_hooks([hd])):
            answer_logits(b, ps)
    t_full = (time.perf_counter() - t) / args.full_heads * len(heads)
    T = len(ps.input_ids[0])
    table = [
        "| engine | seconds | ratio to one full forward per head |",
        "|---|---|---|",
        f"| one full forward per head (measured on {args.full_heads}, scaled) | {t_full:.1f} | 1.00 |",
        f"| every position recomputed from the head's layer (knockouts.head_sweep) | {t_base:.1f} | "
        f"{t_full / t_base:.2f} |",
        f"| prefix once per head + query tokens from the head's layer (head_sweep) | {t_fast:.1f} | "
        f"{t_full / t_fast:.2f} |",
    ]
    note = (
        f"{args.model}, {len(ps)} prompts of {T} tokens (1D {args.op}, 2-shot prefix), {len(heads)} heads evenly "
        f"spaced over {L} x {H}; the two fast engines agree on every prompt's correctness: {same}."
    )
    text = section("Yu head sweep: every head zeroed at every position", table, note=note, argv=argv)
    print(text)
    if not args.no_append:
        append(text)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
