#!/usr/bin/env python
"""Benchmark: per-prompt neuron zeroing at the answer position, each row from its lowest
zeroed layer vs every row through every layer.

Yu & Ananiadou's mask / keep (Table 5) and lowest-neuron (Table 6) tests zero, for each
prompt, its own neurons at the answer position (notebook 04). The literal path runs
every (condition, prompt) row through every layer and the whole unembedding
(:func:`arithlib.methods.neuron_zeroing.zeroing_runs_literal`); the fast one lets each
row join at its lowest zeroed layer from the clean residual stream
(:func:`arithlib.methods.neuron_zeroing.zeroing_runs`). The conditions here are drawn
like notebook 04's: per prompt, 99 neurons of the layers from ``--low`` up ("mask"),
every other neuron of the upper half ("keep"), and the lowest of the 99 alone
("lowest", with the coefficients captured). Times both in the same run, counts their
GFLOP, checks the predictions are equal and the coefficients close, and appends the
row to benchmarks/RESULTS.md.

    python benchmarks/neuron_zeroing.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import results  # noqa: E402
import roofline  # noqa: E402

import arithlib.core.datasets as ds  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.methods.neuron_zeroing import zeroing_runs, zeroing_runs_literal  # noqa: E402
from arithlib.yu.mask_keep import neuron_masks  # noqa: E402


def conditions(cfg, n: int, n_draws: int, low: int, seed: int = 0) -> tuple[dict, dict]:
    """(mask and keep conditions, lowest-neuron conditions) for ``n`` prompts."""
    rng = np.random.default_rng(seed)
    upper = list(range(cfg.n_layers // 2, cfg.n_layers))
    mk, lowest = {}, {}
    for c in range(n_draws):
        sets = [
            sorted({(int(rng.integers(low, cfg.n_layers)), int(rng.integers(cfg.d_mlp))) for _ in range(99)})
            for _ in range(n)
        ]
        mk[f"mask {c}"] = neuron_masks(sets, cfg.n_layers, cfg.d_mlp)
        mk[f"keep {c}"] = neuron_masks(sets, cfg.n_layers, cfg.d_mlp, upper)
        lowest[f"lowest {c}"] = neuron_masks([s[:1] for s in sets], cfg.n_layers, cfg.d_mlp)
    return mk, lowest


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts (one batch: notebook 04's batch size)")
    ap.add_argument("--draws", type=int, default=4, help="draws of each condition")
    ap.add_argument("--low", type=int, default=None, help="lowest layer of the drawn neurons (default: a quarter)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    bridge, cfg = loaded.bridge, loaded.bridge.cfg
    recs = ds.yu_prompts(ops=["+", "-"], n_digits=1, n_per_template=None, templates=[3], fewshot=2)
    ps = PromptSet.build(recs, loaded.tokenizer)
    ps = ps.subset(list(range(min(a.prompts, len(ps)))))
    mk, lowest = conditions(cfg, len(ps), a.draws, cfg.n_layers // 4 if a.low is None else a.low)

    def run(fn):
        return fn(bridge, ps, mk, batch_size=len(ps)), fn(bridge, ps, lowest, capture_coef=True, batch_size=len(ps))

    with torch.no_grad():  # not torch.set_grad_enabled(False): main() also runs inside the tests
        f_lit, t_lit, (mk_lit, low_lit) = roofline.measure(lambda: run(zeroing_runs_literal), a.repeats)
        f_fast, t_fast, (mk_fast, low_fast) = roofline.measure(lambda: run(zeroing_runs), a.repeats)
    same = all(torch.equal(mk_lit[k].pred, mk_fast[k].pred) for k in mk) and all(
        torch.equal(low_lit[k].pred, low_fast[k].pred) for k in lowest
    )
    diff = max(float((low_lit[k].coef - low_fast[k].coef).abs().max()) for k in lowest)
    row = {
        "model": a.model,
        "threads": torch.get_num_threads(),
        "rows": f"{len(ps)} x {len(mk) + len(lowest)}",
        "literal_s": t_lit,
        "fast_s": t_fast,
        "speedup": t_lit / t_fast,
        "literal_gflop": f_lit / 1e9,
        "fast_gflop": f_fast / 1e9,
        "same_predictions": same,
        "max_abs_coef_diff": diff,
    }
    line = (
        f"| {row['model']} | cpu ({row['threads']} threads) | {row['rows']} | {t_lit:.2f} | {t_fast:.2f} | "
        f"{row['speedup']:.2f}x | {row['literal_gflop']:.1f} | {row['fast_gflop']:.1f} | {'yes' if same else 'NO'} | "
        f"{diff:.1e} |"
    )
    table = [
        "| model | device | prompts x conditions | every layer (s) | from the lowest zeroed layer (s) | speedup | "
        "every layer GFLOP | from the lowest GFLOP | same predictions | max abs coefficient diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
        line,
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(
            results.section("Per-prompt neuron zeroing: each row from its lowest zeroed layer vs every layer", table)
        )
    return row


if __name__ == "__main__":
    main()
