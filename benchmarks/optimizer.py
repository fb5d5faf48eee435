#!/usr/bin/env python
"""Benchmark: one AdamW step over every weight of a model (full SFT's optimizer step).

``arithlib.methods.finetune.make_optimizer`` uses torch's fused AdamW kernel, one pass over each
parameter and its two moments; the baseline is the single-tensor loop
(``foreach=False``), a pass per elementwise operation. Both step the model's own
parameters (copies) with the same random gradients (drawn on the CPU, then moved to the
parameters' device and dtype); the first step (which allocates the moments) is timed
apart from the mean of the next ones, each step synchronised with the GPU
(``roofline.best_time``), and the largest difference between the two results is
reported, with a tolerance of about one rounding of the largest weight per step in the
model's dtype. Appends the row to benchmarks/RESULTS.md.

An optimizer step does almost no matrix arithmetic: what bounds it is memory traffic.
The table gives the bytes AdamW must move per step (it reads param, grad, exp_avg,
exp_avg_sq and writes param, exp_avg, exp_avg_sq; counted from the tensors' element
sizes), the achieved GB/s of each variant and their fraction of the memory bandwidth
(a GPU's datasheet, ``roofline.GPU_PEAKS``, or on the CPU the copy rate measured now,
``roofline.measure_peak``). ``--blocks N`` steps only the parameters of the first N
decoder blocks: Llama-3-8B's 8 B parameters with gradients, two moments and the
benchmark's copies need about 130 GB.

    python benchmarks/optimizer.py --model qwen2.5-coder-0.5b
    python benchmarks/optimizer.py --model random-llama --steps 2 --no-append    # tiny code-path check
    python benchmarks/optimizer.py --model random-llama:llama3-8b --device cuda --dtype bfloat16 --blocks 8
"""

from __future__ import annotations

import argparse
import gc
import platform
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

import arithlib.methods.finetune as FT  # noqa: E402
import arithlib.methods.model_weights as MW  # noqa: E402
from arithlib.methods.finetune import TrainConfig, make_optimizer  # noqa: E402

LR = 1e-4


def stepped_weights(hf, blocks: int | None) -> list[torch.Tensor]:
    """The parameters to step (tied tensors once): all of the model's (``blocks`` None),
    or those of its first ``blocks`` decoder blocks, found by their names' block prefix."""
    if blocks is None:
        return [p.detach() for p in {p.data_ptr(): p for p in hf.parameters()}.values()]
    prefixes = tuple(MW.layer_prefix(hf, layer) for layer in range(min(blocks, len(FT.decoder_layers(hf)))))
    chosen = {p.data_ptr(): p for n, p in MW.params_by_clean_name(hf).items() if n.startswith(prefixes)}
    return [p.detach() for p in chosen.values()]


def random_grads(weights: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Gradients ~ 1e-3 N(0, 1), drawn on the CPU (the same on every device) and moved
    to each weight's device and dtype."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(w.shape, generator=gen) * 1e-3).to(w.device, w.dtype) for w in weights]


def step_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes one AdamW step must move: read param, grad, exp_avg, exp_avg_sq; write
    param, exp_avg, exp_avg_sq."""
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            total += 2 * p.nbytes + p.grad.nbytes + 2 * (state["exp_avg"].nbytes + state["exp_avg_sq"].nbytes)
    return total


def run_steps(
    weights: list[torch.Tensor], grads: list[torch.Tensor], fused: bool, steps: int
) -> tuple[float, float, list[torch.Tensor], int]:
    """(first step s, mean of the later steps s, the parameters after ``steps``, bytes
    moved per step)."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g
    config = TrainConfig(lr=LR)
    opt = (
        make_optimizer(params, config)
        if fused
        else torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, foreach=False)
    )
    device = params[0].device
    times = [roofline.best_time(opt.step, 1, device)[0] for _ in range(steps)]
    nbytes = step_bytes(opt)
    del opt
    gc.collect()
    return times[0], sum(times[1:]) / max(1, len(times) - 1), [p.detach() for p in params], nbytes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (the first allocates AdamW's moments)")
    ap.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="step only the parameters of the first N decoder blocks (default: every parameter)",
    )
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error("--steps must be at least 2 (the first step is timed apart)")
    if a.blocks is not None and a.blocks < 1:
        ap.error("--blocks must be at least 1")
    loaded = bench_model.load(a.model, a.device, a.dtype)
    dev = torch.device(loaded.device)
    cfg = loaded.bridge.cfg
    hf = loaded.bridge.original_model
    n_blocks = len(FT.decoder_layers(hf))
    weights = stepped_weights(hf, a.blocks)
    n = sum(w.numel() for w in weights)
    grads = random_grads(weights)
    first_loop, later_loop, out_loop, nbytes = run_steps(weights, grads, fused=False, steps=a.steps)
    first_fused, later_fused, out_fused, _ = run_steps(weights, grads, fused=True, steps=a.steps)
    diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(out_loop, out_fused))
    # one rounding of the largest weight per step (plus the loop's rounded moments' share of the update)
    largest = max(float(x.float().abs().max()) for x in out_loop)
    tol = a.steps * torch.finfo(loaded.dtype).eps * (largest + 8 * LR)
    del out_loop, out_fused
    peak, source = roofline.bandwidth_peak(dev, loaded.dtype, cfg.d_model, cfg.d_mlp)
    gbs_loop, gbs_fused = nbytes / later_loop / 1e9, nbytes / later_fused / 1e9
    which = "all" if a.blocks is None else f"blocks 0-{min(a.blocks, n_blocks) - 1} of {n_blocks}"
    row = {
        "model": a.model,
        "device": roofline.device_label(dev),
        "dtype": a.dtype,
        "blocks": a.blocks,
        "stepped": which,
        "params": n,
        "first_loop": first_loop,
        "later_loop": later_loop,
        "first_fused": first_fused,
        "later_fused": later_fused,
        "speedup": later_loop / later_fused,
        "bytes_per_step": nbytes,
        "gbs_loop": gbs_loop,
        "gbs_fused": gbs_fused,
        "frac_loop": gbs_loop / (peak * 1e3),
        "frac_fused": gbs_fused / (peak * 1e3),
        "peak_gbs": peak * 1e3,
        "peak_source": source,
        "max_diff": diff,
        "tolerance": tol,
        "ok": bool(diff <= tol),
    }
    table = (
        "| model | device | dtype | parameters stepped | single-tensor: first step (s) | later steps (s) | "
        "fused: first step (s) | later steps (s) | speedup (later steps) | MB moved per step | "
        "single-tensor GB/s | fused GB/s | single-tensor / peak | fused / peak | peak GB/s | compared | "
        "max abs diff | within tol |\n|" + "---|" * 18 + "\n"
        f"| {a.model} | {row['device']} | {a.dtype} | {n / 1e6:.4g} M ({which}) | {first_loop:.3g} | "
        f"{later_loop:.3g} | {first_fused:.3g} | {later_fused:.3g} | {row['speedup']:.1f}x | {nbytes / 1e6:.4g} | "
        f"{gbs_loop:.3g} | {gbs_fused:.3g} | {row['frac_loop']:.1%} | {row['frac_fused']:.1%} | "
        f"{peak * 1e3:.4g} ({source}) | parameters after {a.steps} steps, tol {a.steps} x eps({a.dtype}) x "
        f"(max abs weight {largest:.3g} + 8 lr) = {tol:.1e} | {diff:.1e} | {row['ok']} |"
    )
    print(table)
    if not a.no_append:
        results.append(
            results.section(
                "Full SFT's AdamW step: fused kernel vs single-tensor loop",
                table.split("\n"),
                where=f"{platform.machine()}, {torch.get_num_threads()} threads",
                argv=argv,
            )
        )
    return row


if __name__ == "__main__":
    main()
