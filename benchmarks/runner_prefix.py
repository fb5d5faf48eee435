#!/usr/bin/env python
"""Benchmark: the answer-position runner's prefix caches, one batch-1 pass per batch
against one per distinct shared prefix.

:class:`arithlib.engine.AnswerPositionRunner` (notebook 03's grid passes and circuits)
keeps every prompt's keys and values. Each same-length batch's common prefix (the few-shot
prefix and the query's first tokens) runs once at batch 1; such a pass reads every
weight for a dozen tokens, so its time is the reading of the weights, whatever its
length. Batches of one operator's grid start with the same few tokens (Qwen2.5-Coder: 33
batches of 64 prompts, 11 distinct prefixes), and the runner now runs each distinct prefix
once for all of them (:func:`arithlib.engine.shared_prefix_cache`'s ``computed``). This
builds the runner's caches both ways on notebook 03's grid (one operator, ``--prompts``
pairs of 2-digit operands, 2-shot), in the same run, counts the GFLOP, checks the keys and
values are identical and appends the table to benchmarks/RESULTS.md.

    python benchmarks/runner_prefix.py --model qwen2.5-coder-0.5b
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

from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import adapter, common_prefix, shared_prefix_cache  # noqa: E402
from arithlib.nikankin.heuristic_grids import grid_records, operand_ranges, subsample  # noqa: E402


def build(model, prompts: PromptSet, batch_size: int, reuse: bool) -> list:
    """Every batch's prefix cache, as the runner's constructor builds them (``reuse``: one
    batch-1 pass per distinct shared prefix; else one per batch)."""
    computed: dict | None = {} if reuse else None
    with torch.no_grad():
        return [
            shared_prefix_cache(model, b.tokens[:, :-1], computed)
            for b in prompts.batches(batch_size, "cpu")
            if b.tokens.shape[1] > 1
        ]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--op", default="+", choices=["+", "-", "*", "/"])
    ap.add_argument("--prompts", type=int, default=2000, help="grid pairs (notebook 03's max_grid_prompts)")
    ap.add_argument("--batch-size", type=int, default=64, help="notebook 03's batch_size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the notebooks run with one each)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    with bench_model.torch_threads(a.threads):
        return _run(a, argv)


def _run(a: argparse.Namespace, argv: list[str] | None) -> list[dict]:
    loaded = bench_model.load(a.model, a.device, a.dtype)
    model = loaded.bridge
    rng = operand_ranges(9, False, 99, [a.op])[a.op]
    prompts = PromptSet.build(subsample(grid_records(a.op, rng, fewshot=2), a.prompts, 0), loaded.tokenizer)
    batches = [b for b in prompts.batches(a.batch_size, "cpu") if b.tokens.shape[1] > 1]
    distinct = {tuple(b.tokens[0, : common_prefix(b.tokens[:, :-1].tolist())].tolist()) for b in batches}
    f_old, t_old, old = roofline.measure(lambda: build(model, prompts, a.batch_size, False), a.repeats)
    f_new, t_new, new = roofline.measure(lambda: build(model, prompts, a.batch_size, True), a.repeats)
    same = all(
        torch.equal(k0, k1) and torch.equal(v0, v1)
        for c0, c1 in zip(old, new, strict=True)
        for (k0, v0), (k1, v1) in zip(adapter.filled_cache_layers(c0), adapter.filled_cache_layers(c1), strict=True)
    )
    row = {
        "model": a.model,
        "prompts": len(prompts),
        "batches": len(batches),
        "distinct": len(distinct),
        "per_batch_s": t_old,
        "per_prefix_s": t_new,
        "speedup": t_old / t_new,
        "per_batch_gflop": f_old / 1e9,
        "per_prefix_gflop": f_new / 1e9,
        "identical": same,
    }
    table = [
        "| model | threads | prompts (batches, distinct prefixes) | a prefix pass per batch (s) | "
        "per distinct prefix (s) | speedup | GFLOP per batch | GFLOP per prefix | keys and values identical |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {a.model} | {torch.get_num_threads()} | {row['prompts']} ({row['batches']}, {row['distinct']}) | "
        f"{t_old:.2f} | {t_new:.2f} | {row['speedup']:.2f}x | {row['per_batch_gflop']:.0f} | "
        f"{row['per_prefix_gflop']:.0f} | {'yes' if same else 'NO'} |",
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(
            results.section(
                "The answer-position runner's prefix caches: a batch-1 pass per batch vs per distinct prefix",
                table,
                argv=argv,
                note=(
                    f"Notebook 03's grid for {a.op!r} (2-digit operands, 2-shot, seed 0); best of the repeats; "
                    "GFLOP counted by arithlib.engine.flops. The runner's constructor now builds its caches the "
                    "second way."
                ),
            )
        )
    return [row]


if __name__ == "__main__":
    main()
