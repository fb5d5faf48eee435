#!/usr/bin/env python
"""Benchmark: a pass run for its keys and values only, with and without the unembedding.

Every pass on a shared few-shot prefix first computes that prefix's keys and values
(:func:`arithlib.engine.prefix_cache` at batch 1, :func:`arithlib.engine.shared_prefix_cache`
for a batch, the runner's prefix cache): no logits of those passes are read. A causal-LM
call still unembeds the last position of every row, and on the CPU that product reads the
whole vocabulary matrix (Qwen2.5-Coder-0.5B: 151,936 x 896, 545 MB in float32) for a few
rows, far from the matrix-product peak. The decoder alone (:func:`arithlib.engine.decoder_pass`)
leaves it out. This times both at the shapes of the notebooks' passes (a prefix at batch 1;
the rest of a batch of ``--rows`` prompts on that prefix) in the same run, counts their
GFLOP, checks the keys and values are identical and appends the table to
benchmarks/RESULTS.md.

    python benchmarks/cache_pass.py --model qwen2.5-coder-0.5b
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

from arithlib.engine import adapter, hf_module  # noqa: E402
from arithlib.engine.passes import decoder_pass, forward  # noqa: E402


def _with_logits(model, tokens: torch.Tensor, cache=None):
    """The old cache pass: the causal LM, last position unembedded (and thrown away)."""
    return forward(model, tokens, cache=cache, keep=1, keep_cache=True).cache


def _decoder_only(model, tokens: torch.Tensor, cache=None):
    return decoder_pass(model, tokens, cache=cache)[1]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--prefix", type=int, default=60, help="tokens of the few-shot prefix (batch 1)")
    ap.add_argument("--rest", type=int, default=8, help="tokens of each prompt after the prefix")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64], help="prompts per batch on the prefix")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the notebooks run with one each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    with bench_model.torch_threads(a.threads):
        return _run(a, argv)


def _run(a: argparse.Namespace, argv: list[str] | None) -> list[dict]:
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    model = loaded.bridge
    vocab = hf_module(model).config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (1, a.prefix), generator=g)
    rows = []
    with torch.no_grad():  # not torch.set_grad_enabled(False): main() also runs inside the tests
        base = _decoder_only(model, prefix)
        cases = [("prefix", 1, lambda f: f(model, prefix))]
        for n in a.rows:
            rest = torch.randint(vocab, (n, a.rest), generator=g)

            def on_prefix(f, rest=rest, n=n):
                return f(model, rest, adapter.repeat_cache(hf_module(model).config, base, n))  # base stays as it was

            cases.append(("rest on the prefix", n, on_prefix))
        for what, n, run in cases:
            f_old, t_old, c_old = roofline.measure(lambda run=run: run(_with_logits), a.repeats)
            f_new, t_new, c_new = roofline.measure(lambda run=run: run(_decoder_only), a.repeats)
            same = all(
                torch.equal(k0, k1) and torch.equal(v0, v1)
                for (k0, v0), (k1, v1) in zip(
                    adapter.filled_cache_layers(c_old), adapter.filled_cache_layers(c_new), strict=True
                )
            )
            rows.append(
                {
                    "pass": what,
                    "rows": n,
                    "tokens": a.prefix if n == 1 else a.rest,
                    "with_logits_s": t_old,
                    "decoder_s": t_new,
                    "speedup": t_old / t_new,
                    "with_logits_gflop": f_old / 1e9,
                    "decoder_gflop": f_new / 1e9,
                    "identical": same,
                }
            )
    table = [
        "| model | threads | pass | rows x tokens | with logits (s) | decoder only (s) | speedup | "
        "GFLOP with logits | GFLOP decoder | keys and values identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {a.model} | {torch.get_num_threads()} | {r['pass']} | {r['rows']} x {r['tokens']} | "
            f"{r['with_logits_s']:.3f} | {r['decoder_s']:.3f} | {r['speedup']:.2f}x | {r['with_logits_gflop']:.1f} | "
            f"{r['decoder_gflop']:.1f} | {'yes' if r['identical'] else 'NO'} |"
            for r in rows
        ),
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(
            results.section(
                "Cache-only passes: causal LM (last position unembedded) vs decoder only",
                table,
                argv=argv,
                note=(
                    "Best of the repeats; GFLOP counted by arithlib.engine.flops. The decoder-only pass is what "
                    "prefix_cache, shared_prefix_cache and the prefix runner's key/value pass now run."
                ),
            )
        )
    return rows


if __name__ == "__main__":
    main()
