#!/usr/bin/env python
"""Benchmark: the readout of answer-position passes, the exact top-1 token of many final
states, three ways against the literal full product.

* ``literal``: ``F.linear`` over the whole vocabulary, then ``max`` (what a full forward
  pass's logits give).
* ``argmax``: :meth:`arithlib.methods.patching.Unembed.argmax`, a running maximum over
  vocabulary chunks, never holding every logit (neuron zeroing reads it).
* ``top1``: :meth:`arithlib.methods.patching.Unembed.top1`, which computes only the tokens
  a Cauchy-Schwarz bound around the clean state leaves in play (patching, knockouts and the
  head sweep read it).

The states are those of notebook 01's knockout curve: the answer position of ``--prompts``
prompts with the first k heads of random orders mean-ablated there (k from 1 to 80, the
curve's ks), so small and large departures from the clean state are both present. Checks
that all three give the same tokens, and appends the row to benchmarks/RESULTS.md.

    python benchmarks/readout.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import results  # noqa: E402
import roofline  # noqa: E402

import arithlib.core.datasets as ds  # noqa: E402
import arithlib.methods.ablation as A  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import clean_run  # noqa: E402
from arithlib.methods.knockouts import random_orders  # noqa: E402
from arithlib.methods.patching import Unembed, ablation_edits, run_variants  # noqa: E402

KS = (1, 2, 3, 5, 7, 10, 14, 20, 28, 40, 56, 80)  # notebook 01's knockout curve


def knockout_states(bridge, tokenizer, n_prompts: int, n_orders: int, seed: int = 0):
    """(final states [V, B, d] of the knockout variants, clean final states [B, d]) of the
    first ``n_prompts`` same-length prompts of Zhang's set."""
    ps = PromptSet.build(ds.zhang_prompts(ops=["+", "-"], n_per_template=8, fewshot=2, seed=seed), tokenizer)
    lengths = [len(x) for x in ps.input_ids]
    common = max(set(lengths), key=lengths.count)
    ps = ps.subset([i for i, n in enumerate(lengths) if n == common][:n_prompts])
    tokens = torch.tensor(ps.input_ids)
    cfg = bridge.cfg
    means = A.mean_activations(bridge, ps, [A.z_hook(l) for l in range(cfg.n_layers)])
    end = {l: means[A.z_hook(l)][common][-1] for l in range(cfg.n_layers)}
    orders = random_orders(cfg.n_layers, cfg.n_heads, n_orders, seed)
    variants = [ablation_edits(o[:k], end, -1) for o in orders.values() for k in KS if k <= len(o)]
    run = clean_run(bridge, tokens)
    return run_variants(bridge, run, variants), run.final


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts (notebook 01's batch size)")
    ap.add_argument("--orders", type=int, default=5, help="head orders (notebook 01: the effect order and 4 random)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    with torch.no_grad():  # not torch.set_grad_enabled(False): main() also runs inside the tests
        h, clean = knockout_states(loaded.bridge, loaded.tokenizer, a.prompts, a.orders)
        un = Unembed(loaded.bridge)

        def literal():
            return F.linear(h, un.weight, un.bias).max(-1)

        f_lit, t_lit, (m_lit, i_lit) = roofline.measure(literal, a.repeats)
        f_arg, t_arg, (i_arg, m_arg) = roofline.measure(lambda: un.argmax(h), a.repeats)
        f_top, t_top, (i_top, m_top) = roofline.measure(lambda: un.top1(h, clean), a.repeats)
    same = torch.equal(i_lit, i_arg) and torch.equal(i_lit, i_top)
    diff = max(float((m_lit - m_arg).abs().max()), float((m_lit - m_top).abs().max()))
    rows = f"{h.shape[0]} x {h.shape[1]}"
    line = (
        f"| {a.model} | cpu ({torch.get_num_threads()} threads) | {rows} | {t_lit:.3f} | {t_arg:.3f} | "
        f"{t_top:.3f} | {t_lit / t_arg:.2f}x | {t_lit / t_top:.2f}x | {f_lit / 1e9:.1f} | {f_top / 1e9:.1f} | "
        f"{'yes' if same else 'NO'} | {diff:.1e} |"
    )
    table = [
        "| model | device | variants x prompts | literal (s) | argmax (s) | top1 (s) | argmax speedup | "
        "top1 speedup | literal GFLOP | top1 GFLOP | same tokens | max abs max-logit diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        line,
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(results.section("Readout of answer-position states: exact top-1 three ways", table))
    return {"same": same, "literal_s": t_lit, "argmax_s": t_arg, "top1_s": t_top, "max_diff": diff}


if __name__ == "__main__":
    main()
