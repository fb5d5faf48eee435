#!/usr/bin/env python
"""Benchmark: one vs two torch CPU threads for notebook 03's answer-position passes.

Notebook 03 used to pin ``threads = 1`` (chosen on a machine whose cores other jobs
shared); this measurement made its default torch's own (a thread per core). It times :class:`arithlib.engine.AnswerPositionRunner` (its prefix cache, then five
answer-position passes) on the first ``--n-prompts`` Nikankin prompts (2-shot) with each
thread count in turn, twice, and prints the times; the ratio is the result.

    python benchmarks/threads.py --model qwen2.5-coder-0.5b --threads 1 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import roofline  # noqa: E402

import arithlib.core.datasets as ds  # noqa: E402
import arithlib.engine as E  # noqa: E402
from arithlib.core.models import load_model  # noqa: E402
from arithlib.core.prompt_sets import PromptSet, single_token_max  # noqa: E402


def time_runner(bridge, prompts: PromptSet, threads: int, passes: int = 5) -> tuple[float, float]:
    """(prefix-cache seconds, seconds for ``passes`` answer-position passes) with ``threads``."""
    with roofline.torch_threads(threads):
        t0 = time.perf_counter()
        runner = E.AnswerPositionRunner(bridge, prompts, batch_size=64)
        t1 = time.perf_counter()
        for _ in range(passes):
            runner.logits()
        return t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--n-prompts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    loaded = load_model(a.model)
    recs = ds.nikankin_prompts(max_operand=single_token_max(loaded.tokenizer), n_per_op=None, seed=0, fewshot=2)
    ps = PromptSet.build(recs, loaded.tokenizer)
    ps = ps.subset(list(range(min(a.n_prompts, len(ps)))))
    rows = []
    print(f"{len(ps)} prompts, {a.model}")
    print("| round | threads | prefix cache (s) | 5 answer-position passes (s) |\n|---|---|---|---|")
    for r in range(a.rounds):
        for t in a.threads:
            pre, passes = time_runner(loaded.bridge, ps, t)
            rows.append({"round": r, "threads": t, "prefix_s": pre, "passes_s": passes})
            print(f"| {r + 1} | {t} | {pre:.2f} | {passes:.2f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
