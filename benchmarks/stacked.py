#!/usr/bin/env python
"""Benchmark: several interventions per forward pass, and a batch's few-shot prefix run
once, against the one-at-a-time baseline in the same run.

* ``neurons.AnswerPositionRunner.logits_many`` (notebook 03's heuristic ablations,
  faithfulness curve and exact effects): ``--conditions`` mean ablations of random
  neuron sets of the second half of the layers, on the answer position of ``--n``
  grid prompts ``a+b=`` (2-shot), against one ``logits`` call per condition.
* ``cna.run_conditions`` (notebook 04's runs a/b and M sweep): the same number of
  neuron sets zeroed at every position of Yu's 1-digit prompts, against one
  ``run_last_position`` per set.
* ``patching.grouped_clean_run`` (notebook 01's path patching, sweeps and knockouts):
  a same-length batch of 2-shot Zhang prompts (several templates and operators) with
  each few-shot prefix run once, against the whole batch.

Checks that each pair gives the same values within float rounding; prints a markdown
table and appends it, with the command, to ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/stacked.py --model qwen2.5-coder-0.5b
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

import arithlib.ablation as A  # noqa: E402
import arithlib.cna as C  # noqa: E402
import arithlib.datasets as ds  # noqa: E402
import arithlib.heuristics as H  # noqa: E402
import arithlib.neurons as N  # noqa: E402
import arithlib.patching as P  # noqa: E402
import results  # noqa: E402
from arithlib.models import load_model  # noqa: E402


def best_of(fn, repeats: int):
    """(fastest seconds, last result) of ``repeats`` calls."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def neuron_sets(layers: list[int], d_mlp: int, n_sets: int, size: int, seed: int) -> list[list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(seed)
    return [[(layers[int(i) % len(layers)], int(k)) for i, k in
             zip(torch.randint(0, len(layers), (size,), generator=g), torch.randint(0, d_mlp, (size,), generator=g))]
            for _ in range(n_sets)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=50, help="answer-position prompts (03: 50 per operator)")
    ap.add_argument("--conditions", type=int, default=11, help="interventions (03: base + 10 heuristics)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args()

    loaded = load_model(args.model, device=args.device)
    b, tok, info = loaded.bridge, loaded.tokenizer, loaded.info
    torch.set_grad_enabled(False)
    layers = N.default_layers(info.n_layers)
    rows, same = [], []

    grid = ds.PromptSet.build(H.grid_records("+", (0, 9), fewshot=2), tok)
    grid = grid.subset(list(range(min(args.n, len(grid)))))
    runner = N.AnswerPositionRunner(b, grid, batch_size=64)
    means = torch.zeros(len(layers), info.d_mlp)
    cache = N.runner_means(means, layers)
    sets = neuron_sets(layers, info.d_mlp, args.conditions - 1, 200, seed=0)
    conds = [None] + [A.mean_neurons_hooks(s, cache, position=-1) for s in sets]
    t_one, one = best_of(lambda: [runner.logits(c) for c in conds], args.repeats)
    t_many, many = best_of(lambda: runner.logits_many(conds), args.repeats)
    same.append(all(torch.allclose(x, y, atol=1e-3) for x, y in zip(one, many)))
    rows.append(("03 answer position: `logits_many` vs one `logits` per condition",
                 f"{len(conds)} conditions x {len(grid)} prompts", t_one, t_many, same[-1]))

    yu = ds.PromptSet.build(ds.yu_prompts(ops=["+", "-"], n_digits=1, n_per_template=None, templates=[3], fewshot=2), tok)
    yu = yu.subset(list(range(0, len(yu), max(1, len(yu) // args.n)))[: args.n])
    shallow = list(range(info.n_layers // 2))
    zs = {str(i): A.zero_neurons_hooks(s) for i, s in
          enumerate([[]] + neuron_sets(shallow, info.d_mlp, args.conditions - 1, 2000, seed=1))}
    t_one, one = best_of(lambda: {k: C.run_last_position(b, yu, h, capture=()) for k, h in zs.items()}, args.repeats)
    t_many, many = best_of(lambda: C.run_conditions(b, yu, zs, capture=()), args.repeats)
    same.append(all(torch.equal(one[k].pred, many[k].pred) and torch.allclose(one[k].logprob, many[k].logprob, atol=1e-3)
                    for k in zs))
    rows.append(("04 every position: `run_conditions` vs one `run_last_position` per condition",
                 f"{len(zs)} conditions x {len(yu)} prompts", t_one, t_many, same[-1]))

    zh = ds.PromptSet.build(ds.zhang_prompts(ops=["+", "-"], n_per_template=4, seed=0, fewshot=2), tok)
    batch = max(zh.batches(16), key=lambda x: len(x.index))
    groups = P.prefix_groups(zh, batch.index)
    spec = P.path_end_captures(info.n_layers, attention=True)
    t_one, one = best_of(lambda: P.clean_run(b, batch.tokens, spec, share_prefix=False), args.repeats)
    t_many, many = best_of(lambda: P.grouped_clean_run(b, batch.tokens, groups, spec), args.repeats)
    same.append(torch.allclose(one.final, many.final, atol=1e-3) and
                (one.resid is None or torch.allclose(one.resid, many.resid, atol=1e-3)))
    rows.append(("01 clean run: each few-shot prefix once (`grouped_clean_run`) vs whole rows",
                 f"{len(batch.index)} prompts x {batch.tokens.shape[1]} tokens, {sum(len(g) > 1 for g in groups)} "
                 f"shared prefixes", t_one, t_many, same[-1]))

    device = f"{args.device} ({torch.get_num_threads()} threads)" if args.device == "cpu" else args.device
    table = ["| model | device | what | size | baseline (s) | new (s) | speedup | same values |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {args.model} | {device} | {what} | {size} | {a:.2f} | {n:.2f} | {a / n:.1f}x | {ok} |"
              for what, size, a, n, ok in rows]
    text = results.section("Stacked interventions and shared prefixes (notebooks 01, 03, 04)", table)
    print(text)
    if not all(same):
        raise SystemExit("a pair disagrees: not appended")
    if not args.no_append:
        results.append(text)


if __name__ == "__main__":
    main()
