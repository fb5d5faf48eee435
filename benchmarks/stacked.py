#!/usr/bin/env python
"""Benchmark: several interventions per forward pass, and a batch's few-shot prefix run
once, against the one-at-a-time baseline in the same run.

* ``engine.AnswerPositionRunner.logits_many`` (notebook 03's heuristic ablations,
  faithfulness curve and exact effects): ``--conditions`` mean ablations of random
  neuron sets of the second half of the layers, on the answer position of ``--n``
  grid prompts ``a+b=`` (2-shot), against one ``logits`` call per condition.
* ``cna.run_conditions`` (notebook 04's runs a/b and M sweep): the same number of
  neuron sets zeroed at every position of Yu's 1-digit prompts, against one
  ``run_last_position`` per set.
* ``engine.grouped_clean_run`` (notebook 01's path patching, sweeps and knockouts):
  a same-length batch of 2-shot Zhang prompts (several templates and operators) with
  each few-shot prefix run once, against the whole batch.

Each variant is timed with ``roofline.best_time`` (the GPU synchronised around each
call) and its FLOPs counted by ``roofline.counted_flops`` in one extra, untimed call
(which also warms the kernels up); the table gives GFLOP, achieved TFLOP/s and the
fraction of the FLOP peak (``roofline.flop_peak``: the GPU's datasheet, or measured on
the CPU). Checks that each pair gives the same values within the dtype's rounding
(:func:`tolerance`); prints a markdown table and appends it, with the command, to
``benchmarks/RESULTS.md``. ``main(argv)`` returns the rows as dicts.

    .venv/bin/python benchmarks/stacked.py --model qwen2.5-coder-0.5b
    python benchmarks/stacked.py --model random-llama:llama3-8b --device cuda --dtype bfloat16
    python benchmarks/stacked.py --model random-llama --n 8 --conditions 3 --no-append   # tiny code-path check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import results  # noqa: E402
import roofline  # noqa: E402

import arithlib.core.datasets as ds  # noqa: E402
import arithlib.engine as E  # noqa: E402
import arithlib.methods.ablation as A  # noqa: E402
import arithlib.methods.answer_runs as AR  # noqa: E402
import arithlib.methods.neurons as N  # noqa: E402
import arithlib.nikankin.heuristic_grids as HG  # noqa: E402
import arithlib.zhang.path_patching as PP  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402


def neuron_sets(layers: list[int], d_mlp: int, n_sets: int, size: int, seed: int) -> list[list[tuple[int, int]]]:
    """``n_sets`` random sets of ``size`` (layer, neuron) pairs (plain ints: the ablation
    hooks move their index tensors to the activation's device)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (layers[int(i) % len(layers)], int(k))
            for i, k in zip(
                torch.randint(0, len(layers), (size,), generator=g), torch.randint(0, d_mlp, (size,), generator=g)
            )
        ]
        for _ in range(n_sets)
    ]


def tolerance(dtype: torch.dtype) -> float:
    """How far two computations of the same values may differ, relative to their
    magnitude: 1e-3 in float32 (the check this benchmark always made, as an absolute
    bound on logits), 8 units of the dtype's rounding in bfloat16 / float16
    (0.0625 / 0.0078): their results differ by a few units per layer when the batch
    shapes (hence the matrix-product kernels) differ, a wrong intervention by O(1)."""
    return 1e-3 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps


def max_diff(pairs) -> float:
    """Largest absolute difference over pairs of tensors (0 for none)."""
    return max((float((x.float() - y.float()).abs().max()) for x, y in pairs if x.numel()), default=0.0)


def scale(tensors) -> float:
    """The magnitude the tolerance is relative to: max |value|, at least 1."""
    return max([1.0] + [float(t.float().abs().max()) for t in tensors if t.numel()])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--n", type=int, default=50, help="answer-position prompts (03: 50 per operator)")
    ap.add_argument("--conditions", type=int, default=11, help="interventions (03: base + 10 heuristics)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args(argv)

    loaded = bench_model.load(args.model, args.device, args.dtype)
    b, tok = loaded.bridge, loaded.tokenizer
    device, dtype = loaded.device, loaded.dtype
    cfg = b.cfg
    tol = tolerance(dtype)
    low = dtype != torch.float32
    layers = N.default_layers(cfg.n_layers)
    rows: list[dict] = []

    def add(what: str, size: str, one: tuple, many: tuple, same: bool, compared: str, diff: float) -> None:
        rows.append(
            {
                "what": what,
                "size": size,
                "baseline_flops": one[0],
                "baseline_s": one[1],
                "new_flops": many[0],
                "new_s": many[1],
                "speedup": one[1] / many[1],
                "same": bool(same),
                "compared": compared,
                "max_diff": diff,
            }
        )

    with torch.no_grad():  # not torch.set_grad_enabled(False): main() is also called from the tests
        # 03: mean ablations at the answer position. The means live on the model's device
        # (float32, as ablation.mean_activations leaves them; the hooks cast to the
        # activation's dtype), so no hook copies them from the host on every pass.
        grid = PromptSet.build(HG.grid_records("+", (0, 9), fewshot=2), tok)
        grid = grid.subset(list(range(min(args.n, len(grid)))))
        runner = E.AnswerPositionRunner(b, grid, batch_size=64)
        means = torch.zeros(len(layers), cfg.d_mlp, device=device)
        cache = N.runner_means(means, layers)
        sets = neuron_sets(layers, cfg.d_mlp, args.conditions - 1, 200, seed=0)
        conds = [None] + [A.mean_neurons_hooks(s, cache, position=-1) for s in sets]
        one = roofline.measure(lambda: [runner.logits(c) for c in conds], args.repeats, device)
        many = roofline.measure(lambda: runner.logits_many(conds), args.repeats, device)
        atol = tol if not low else tol * scale(one[2])
        same = all(torch.allclose(x, y, atol=atol) for x, y in zip(one[2], many[2]))
        add(
            "03 answer position: `logits_many` vs one `logits` per condition",
            f"{len(conds)} conditions x {len(grid)} prompts",
            one,
            many,
            same,
            f"logits, atol {atol:.2g}",
            max_diff(zip(one[2], many[2])),
        )

        # 04: neuron sets zeroed at every position.
        yu = PromptSet.build(
            ds.yu_prompts(ops=["+", "-"], n_digits=1, n_per_template=None, templates=[3], fewshot=2), tok
        )
        yu = yu.subset(list(range(0, len(yu), max(1, len(yu) // args.n)))[: args.n])
        shallow = list(range(cfg.n_layers // 2))
        zs = {
            str(i): A.zero_neurons_hooks(s)
            for i, s in enumerate([[]] + neuron_sets(shallow, cfg.d_mlp, args.conditions - 1, 2000, seed=1))
        }
        one = roofline.measure(
            lambda: {k: AR.run_last_position(b, yu, h, capture=()) for k, h in zs.items()}, args.repeats, device
        )
        many = roofline.measure(lambda: AR.run_conditions(b, yu, zs, capture=()), args.repeats, device)
        lp_one, lp_many = [one[2][k].logprob for k in zs], [many[2][k].logprob for k in zs]
        atol = tol if not low else tol * scale(lp_one)
        lp_same = all(torch.allclose(x, y, atol=atol) for x, y in zip(lp_one, lp_many))
        agree = float(torch.cat([(one[2][k].pred == many[2][k].pred).float() for k in zs]).mean())
        # float32: every prediction equal; lower precision: near-tied logits may swap the
        # argmax (bf16 logits are rounded to 2^-5 steps at magnitude 4-8), so 90 % suffice
        min_agree = 1.0 if not low else 0.9
        add(
            "04 every position: `run_conditions` vs one `run_last_position` per condition",
            f"{len(zs)} conditions x {len(yu)} prompts",
            one,
            many,
            lp_same and agree >= min_agree,
            f"log p(answer), atol {atol:.2g}; argmax equal on {agree:.0%} (need {min_agree:.0%})",
            max_diff(zip(lp_one, lp_many)),
        )

        # 01: clean runs sharing each few-shot prefix.
        zh = PromptSet.build(ds.zhang_prompts(ops=["+", "-"], n_per_template=4, seed=0, fewshot=2), tok)
        batch = max(zh.batches(16, device), key=lambda x: len(x.index))
        groups = E.prefix_groups(zh, batch.index)
        spec = PP.path_end_captures(cfg.n_layers, attention=True)
        one = roofline.measure(lambda: E.clean_run(b, batch.tokens, spec, share_prefix=False), args.repeats, device)
        many = roofline.measure(lambda: E.grouped_clean_run(b, batch.tokens, groups, spec), args.repeats, device)
        pairs = [(one[2].final, many[2].final)] + ([] if one[2].resid is None else [(one[2].resid, many[2].resid)])
        atol = tol if not low else tol * scale([x for x, _ in pairs])
        same = all(torch.allclose(x, y, atol=atol) for x, y in pairs)
        add(
            "01 clean run: each few-shot prefix once (`grouped_clean_run`) vs whole rows",
            f"{len(batch.index)} prompts x {batch.tokens.shape[1]} tokens, {sum(len(g) > 1 for g in groups)} "
            f"shared prefixes",
            one,
            many,
            same,
            "final hidden state" + (", residual stream" if len(pairs) > 1 else "") + f", atol {atol:.2g}",
            max_diff(pairs),
        )

    peak, source = roofline.flop_peak(device, dtype, cfg.d_model, cfg.d_mlp)
    label, dname = roofline.device_label(device), roofline.dtype_name(dtype)
    for r in rows:
        r.update(model=args.model, device=label, dtype=dname, peak_tflops=peak, peak_source=source)
        for v in ("baseline", "new"):
            r[f"{v}_tflops"], r[f"{v}_fraction"] = roofline.rate(r[f"{v}_flops"], r[f"{v}_s"], peak)
    table = [
        "| model | device | dtype | what | size | baseline (s) | new (s) | speedup | baseline GFLOP | new GFLOP "
        "| baseline TFLOP/s | new TFLOP/s | baseline / peak | new / peak | same values (compared, max diff) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {args.model} | {r['device']} | {r['dtype']} | {r['what']} | {r['size']} | {r['baseline_s']:.2f} | "
        f"{r['new_s']:.2f} | {r['speedup']:.1f}x | {roofline.num(r['baseline_flops'] / 1e9)} | {roofline.num(r['new_flops'] / 1e9)} | "
        f"{roofline.num(r['baseline_tflops'])} | {roofline.num(r['new_tflops'])} | {roofline.pct(r['baseline_fraction'])} | "
        f"{roofline.pct(r['new_fraction'])} | {r['same']} ({r['compared']}; {r['max_diff']:.2g}) |"
        for r in rows
    ]
    note = (
        f"FLOP peak (TFLOP/s, {dname}): {roofline.peak_cell(peak, source)}. FLOPs counted by torch's per-operator formulas (arithlib.engine.flops) "
        "(matrix products and attention) over one extra call of each variant."
    )
    text = results.section(
        "Stacked interventions and shared prefixes (notebooks 01, 03, 04)", table, argv=argv, note=note
    )
    print(text)
    if not all(r["same"] for r in rows):
        raise SystemExit("a pair disagrees: not appended")
    if not args.no_append:
        results.append(text)
    return rows


if __name__ == "__main__":
    main()
