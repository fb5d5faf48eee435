#!/usr/bin/env python
"""Benchmark: grouped-query key/value expansion into reused buffers, against fresh tensors.

A grouped-query attention expands its key and value heads to the query heads on every
call (transformers' ``repeat_kv``). The passes that resume many rows after a cached
few-shot prefix (knockouts, patching, neuron zeroing) expand hundreds of rows of keys
and values per layer; on the CPU each fresh expansion above glibc's mmap threshold is new
pages from the kernel. :func:`arithlib.engine.adapter.repeat_kv_reusing` writes into two
buffers kept between calls instead. This times, in the same run,

1. the expansion alone, transformers' copy against the reused buffers, at several row
   counts after a ``--prefix``-token cache;
2. one answer-position pass of those rows through the whole model on a repeated prefix
   cache (the shape of a knockout's resumed rows), both ways, with the largest difference
   of the logits (the same copy: it should be 0).

Appends the table to benchmarks/RESULTS.md.

    python benchmarks/gqa_buffers.py --model qwen2.5-coder-0.5b
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

from arithlib.engine import adapter  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024], help="rows resumed after the prefix")
    ap.add_argument("--prefix", type=int, default=52, help="cached positions (a 2-shot prompt: about 50)")
    ap.add_argument("--repeats", type=int, default=3)
    return roofline.run_parsed(ap, argv, _run)


def _run(a: argparse.Namespace) -> dict:
    from transformers.models.llama import modeling_llama

    loaded = bench_model.load(a.model)  # load_model installs the reused buffers
    bridge = loaded.bridge
    hf = adapter.hf_module(bridge)
    cfg = hf.config
    n_kv = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
    n_rep = int(cfg.num_attention_heads) // n_kv
    d_head = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    adapter.reuse_gqa_buffers()
    original = adapter._REPEAT_KV_ORIGINAL
    g = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(0, int(cfg.vocab_size), (1, a.prefix), generator=g)
    rows_out = []
    max_diff = 0.0
    with torch.no_grad():
        prefix = adapter.output_cache(hf(prefix_ids, use_cache=True))
        for n in a.rows:
            kv = torch.randn(n, n_kv, a.prefix + 1, d_head, generator=g)

            def expand(fn, kv=kv):
                fn(kv, n_rep)
                fn(kv, n_rep)

            t_copy, _ = roofline.best_time(lambda: expand(original), a.repeats)
            t_reuse, _ = roofline.best_time(lambda: expand(adapter.repeat_kv_reusing), a.repeats)
            last = torch.randint(0, int(cfg.vocab_size), (n, 1), generator=g)

            def answer_pass(last=last, n=n):
                cache = adapter.repeat_cache(cfg, prefix, n)
                return hf(last, use_cache=True, **adapter.cache_kwargs(cache)).logits[:, -1]

            modeling_llama.repeat_kv = original
            try:
                p_copy, lg_copy = roofline.best_time(answer_pass, a.repeats)
            finally:
                modeling_llama.repeat_kv = adapter.repeat_kv_reusing
            p_reuse, lg_reuse = roofline.best_time(answer_pass, a.repeats)
            max_diff = max(max_diff, float((lg_copy - lg_reuse).abs().max()))
            rows_out.append((n, t_copy, t_reuse, p_copy, p_reuse))
    adapter.release_gqa_buffers()
    where = f"cpu ({torch.get_num_threads()} threads)"
    table = [
        "| model | device | rows | keys + values, copy (ms) | reused (ms) | speedup | answer pass, copy (s) "
        "| reused (s) | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, tc, tr, pc, pr in rows_out:
        table.append(
            f"| {a.model} | {where} | {n} | {tc * 1e3:.1f} | {tr * 1e3:.1f} | {tc / tr:.2f}x | {pc:.3f} | {pr:.3f} "
            f"| {pc / pr:.2f}x |"
        )
    print("\n".join(table) + f"\n\nlargest logit difference: {max_diff:.1e}")
    if not a.no_append:
        note = (
            f"{a.model}: {n_kv} key/value heads repeated {n_rep} times, head size {d_head}, {a.prefix} cached "
            f"positions + 1; best of {a.repeats}. Largest logit difference between the two ways: {max_diff:.1e}."
        )
        results.append(results.section("Grouped-query key/value expansion into reused buffers", table, note=note))
    return {
        "expand_speedup": {n: tc / tr for n, tc, tr, _, _ in rows_out},
        "pass_speedup": {n: pc / pr for n, _, _, pc, pr in rows_out},
        "max_abs_diff": max_diff,
    }


if __name__ == "__main__":
    main()
