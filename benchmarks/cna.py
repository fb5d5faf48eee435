#!/usr/bin/env python
"""Benchmark: CNA importance (Yu & Ananiadou 2024, Sec. 4.1) of every FFN neuron for N
prompts, batched (``arithlib.yu.cna_importance.exact_importance``: shared value projections, vocabulary
in chunks, online logsumexp) against the per-neuron loop through the model's own
``ln_final`` and unembedding (``arithlib.yu.cna_importance.importance_loop``). Both are exact; the
script checks they agree (within a tolerance scaled to the model's dtype: the loop
rounds the residual stream and the final norm's output to it), prints a markdown table
and appends it, with the command, to ``benchmarks/RESULTS.md``.

The table also gives the FLOPs of each variant (counted with torch's per-operator formulas,
:mod:`arithlib.engine.flops`, over one extra, untimed call: ``roofline.counted_flops``), the achieved TFLOP/s and
their fraction of the float32 peak (the CNA arithmetic is float32 whatever the model's
dtype: ``roofline.flop_peak``, a GPU's datasheet or measured on the CPU).
``--loop-neurons K`` times the loop on K evenly spaced neurons per layer and
extrapolates linearly to all of them (by the number of log-prob evaluations,
(d_mlp + 1) / (K + 1) per layer); the batched result is compared on those neurons only.
On Llama-3-8B the full loop (32 x 14,336 neurons) would take hours.

    .venv/bin/python benchmarks/cna.py --model toy-arith --n-prompts 64
    python benchmarks/cna.py --model random-llama --no-append          # tiny code-path check
    python benchmarks/cna.py --model random-llama:llama3-8b --device cuda --dtype bfloat16 --loop-neurons 64
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import results  # noqa: E402
import roofline  # noqa: E402

import arithlib.core.datasets as ds  # noqa: E402
import arithlib.methods.answer_runs as AR  # noqa: E402
import arithlib.methods.neurons as N  # noqa: E402
import arithlib.yu.cna_importance as CI  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.core.readout import final_norm, unembedding  # noqa: E402

#: Allowed |batched - loop| per unit of logit spread, by the model's dtype: the batched
#: path is float32 throughout, the loop feeds ``ln_final`` in the model's dtype (the
#: residual r + m v and the normed vector are rounded to it), so a log-probability may be
#: off by a few roundings of the logits. float32: the paths differ in summation order only.
TOLERANCE = {"float32": 1e-4, "bfloat16": 8 * 2.0**-7, "float16": 8 * 2.0**-10}
#: The smallest logit spread the tolerance is scaled by (float32's summation errors do
#: not shrink with the logits).
MIN_SPREAD = 0.1


def loop_neurons(d_mlp: int, k: int | None) -> list[int] | None:
    """``k`` evenly spaced neuron indices of ``range(d_mlp)`` (None: all of them)."""
    if k is None or k >= d_mlp:
        return None
    return [int(i) for i in np.linspace(0, d_mlp - 1, max(1, k)).round()]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_model.add_arguments(ap, "toy-arith")
    ap.add_argument("--n-prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-chunk", type=int, default=8192)
    ap.add_argument(
        "--loop-neurons",
        type=int,
        default=None,
        help="time the per-neuron loop on this many evenly spaced neurons per layer and extrapolate "
        "(default: all neurons)",
    )
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args(argv)
    if args.loop_neurons is not None and args.loop_neurons < 1:
        ap.error("--loop-neurons must be at least 1")

    loaded = bench_model.load(args.model, args.device, args.dtype)
    b, info = loaded.bridge, loaded.info
    cfg = b.cfg
    dev = torch.device(loaded.device)
    recs = ds.yu_prompts(ops=["+", "-"], n_digits=1, n_per_template=None, templates=[3], fewshot=2)
    ps = PromptSet.build(recs, loaded.tokenizer)
    ps = ps.subset(list(range(min(args.n_prompts, len(ps)))))
    run = AR.run_last_position(b, ps, batch_size=64)  # resid_mid, coef: float32, on the CPU
    norm, (W_U, b_U) = final_norm(b), unembedding(b)  # float32, on the model's device
    t = ps.first_answer_ids.to(dev)
    resid = run.resid_mid.to(dev)
    coef = run.coef.to(dev)
    idx = loop_neurons(info.d_mlp, args.loop_neurons)
    k = info.d_mlp if idx is None else len(idx)
    scale = (info.d_mlp + 1) / (k + 1)  # log-prob evaluations per layer: all neurons / the timed ones

    def batched():
        return torch.stack(
            [
                CI.exact_importance(
                    resid[:, l], coef[:, l], N.w_out(b, l), t, norm, W_U, b_U, vocab_chunk=args.vocab_chunk
                )
                for l in range(info.n_layers)
            ],
            1,
        )

    def loop():
        return torch.stack(
            [CI.importance_loop(b, resid[:, l], coef[:, l], l, t, neurons=idx) for l in range(info.n_layers)], 1
        )

    with torch.no_grad():
        flops_b, t_batched, imp_b = roofline.measure(batched, args.repeats, dev)
        flops_sub, t_sub, imp_l = roofline.measure(loop, max(1, args.repeats // 3), dev)
        flops_l = flops_sub * scale
        # the logit spread the tolerance is scaled by: largest std over the vocabulary
        # of the baseline logits norm(resid) W_U + b_U, over prompts and layers
        spread = max(float((norm(resid[:, l]) @ W_U + b_U).std(-1).max()) for l in range(info.n_layers))
    t_loop = t_sub * scale
    sel = imp_b if idx is None else imp_b[:, :, torch.tensor(idx, device=imp_b.device)]
    diff = float((sel.float() - imp_l.float()).abs().max())
    tol = TOLERANCE[args.dtype] * max(MIN_SPREAD, spread)
    peak, source = roofline.flop_peak(dev, torch.float32, cfg.d_model, cfg.d_mlp)
    tf_b, frac_b = roofline.rate(flops_b, t_batched, peak)
    tf_l, frac_l = roofline.rate(flops_l, t_loop, peak)
    n_neurons = info.n_layers * info.d_mlp
    row = {
        "model": args.model,
        "device": roofline.device_label(dev),
        "dtype": args.dtype,
        "prompts": len(ps),
        "layers": info.n_layers,
        "d_mlp": info.d_mlp,
        "neurons": n_neurons,
        "vocab": info.d_vocab,
        "loop_neurons": k,
        "batched_s": t_batched,
        "loop_s": t_loop,
        "loop_timed_s": t_sub,
        "speedup": t_loop / t_batched,
        "flops_batched": flops_b,
        "flops_loop": flops_l,
        "tflops_batched": tf_b,
        "tflops_loop": tf_l,
        "frac_batched": frac_b,
        "frac_loop": frac_l,
        "peak_tflops": peak,
        "peak_source": source,
        "max_abs_diff": diff,
        "tolerance": tol,
        "logit_spread": spread,
        "max_abs_importance": float(imp_l.float().abs().max()),
        "close": bool(diff <= tol),
    }
    loop_note = "" if idx is None else f" (timed on {k} per layer, extrapolated)"
    compared = (
        f"importance of {'all' if idx is None else k} neurons/layer x {len(ps)} prompts x {info.n_layers} "
        f"layers (max abs importance {row['max_abs_importance']:.2g}), tol {TOLERANCE[args.dtype]:.0e} x "
        f"logit std {max(MIN_SPREAD, spread):.2f}"
    )
    header = (
        "| model | device | dtype | prompts | neurons (L x d_mlp) | vocab | batched (s) | per-neuron loop (s) "
        "| speedup | batched GFLOP | loop GFLOP | batched TFLOP/s | loop TFLOP/s | batched / peak | loop / peak "
        "| float32 peak TFLOP/s | compared | max abs diff | within tol |\n|" + "---|" * 19
    )
    line = (
        f"| {args.model} | {row['device']} | {args.dtype} | {len(ps)} | {info.n_layers} x {info.d_mlp} = "
        f"{n_neurons} | {info.d_vocab} | {t_batched:.3f} | {t_loop:.3f}{loop_note} | {row['speedup']:.1f}x "
        f"| {flops_b / 1e9:.3g} | {flops_l / 1e9:.3g} | {tf_b:.3g} | {tf_l:.3g} | {frac_b:.1%} | {frac_l:.1%} "
        f"| {roofline.peak_cell(peak, source)} | {compared} | {diff:.1e} | {row['close']} |"
    )
    print(header)
    print(line)
    if not math.isfinite(diff):
        print("warning: non-finite difference between batched and loop importances")
    if not args.no_append:
        results.append(
            results.section(
                "CNA importance, all neurons x prompts: batched vs per-neuron loop",
                [*header.split("\n"), line],
                argv=argv,
            )
        )
        print(f"appended to {results.RESULTS}")
    return row


if __name__ == "__main__":
    main()
