#!/usr/bin/env python
"""Benchmark: activation patching of every attention head at the answer position,
the fast path of :mod:`arithlib.methods.patching` against one full forward pass per head.

Baselines (same model, prompts, heads, metric = the answer token's logit):

* ``tl``:  TransformerLens 4.3 ``transformer_lens.patching.generic_activation_patch``
  (the engine of ``get_act_patch_attn_head_out_by_pos``) restricted to the answer
  position: one ``run_with_hooks`` per head, full logits at every position.
* ``own``: the same loop with :func:`arithlib.methods.patching.run_edits_full` (one forward per
  head, logits at the last position only).

The fast path (:func:`arithlib.engine.clean_run` + :func:`arithlib.methods.patching.run_variants`)
runs the clean and the counterfactual prompts once, then every head's patch as one
token per prompt over the reused KV cache, from the head's layer up, all heads batched.

Modes:

* ``--mode cpu`` (default): a registry model (default qwen2.5-coder-0.5b) on the CPU.
* ``--mode gpu``: a random-weight Llama-3-8B-shaped model in bf16 (1,024 heads, 100
  prompts of 16 tokens by default) on ``cuda``; reports time, achieved TFLOP/s and the
  roofline bound from analytic FLOP and byte counts (peaks from the GPU's datasheet;
  on a CPU, the matmul and copy rates measured in the same run, ``roofline.measure_peak``).
  ``--shape tiny --device cpu
  --dtype float32`` runs the same code path on a tiny model (tested in the suite).

The loop may be timed on ``--loop-components`` evenly spaced heads and extrapolated
linearly (every loop iteration is one identical forward pass); the table says so.
Prints a markdown table and appends its row with the command to benchmarks/RESULTS.md.

    python benchmarks/patching.py --mode cpu --prompts 8 --tokens 16 --loop-components 24
    python benchmarks/patching.py --mode gpu
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import arithlib.engine as E  # noqa: E402
import arithlib.methods.patching as P  # noqa: E402
from arithlib.core.models import load_model  # noqa: E402
from arithlib.core.random_models import load_random_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import gpu_datasheet, measure_peak, sync  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


# --------------------------------------------------------------------------- FLOPs and bytes


def layer_flops(cfg, ctx: int) -> float:
    """FLOPs of one decoder layer for one new token attending to ``ctx`` positions."""
    d, H, KV, dh, m = cfg.d_model, cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads, cfg.d_head, cfg.d_mlp
    proj = 2 * d * (H * dh + 2 * KV * dh) + 2 * H * dh * d
    attn = 2 * 2 * H * dh * ctx
    mlp = 2 * (3 if cfg.gated_mlp else 2) * d * m
    return float(proj + attn + mlp)


def layer_param_count(cfg) -> float:
    d, H, KV, dh, m = cfg.d_model, cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads, cfg.d_head, cfg.d_mlp
    return float(d * (H * dh + 2 * KV * dh) + H * dh * d + (3 if cfg.gated_mlp else 2) * d * m)


def full_forward_flops(cfg, B: int, T: int, unembed_positions: int) -> float:
    """One forward pass of ``B`` prompts of ``T`` tokens, unembedding ``unembed_positions`` each."""
    per_prompt = sum(cfg.n_layers * layer_flops(cfg, t + 1) for t in range(T))
    return B * (per_prompt + unembed_positions * 2 * cfg.d_model * cfg.d_vocab)


def fast_cost(cfg, B: int, T: int, layers: list[int], max_rows: int, bytes_per: int) -> tuple[float, float]:
    """(FLOPs, bytes) of the variant phase of the fast path, mirroring
    :func:`arithlib.methods.patching.run_variants`'s sorting and chunking; bytes count the
    weights of the layers each chunk runs and the expanded KV cache it writes and reads."""
    per_chunk = max(1, max_rows // B)
    order = sorted(layers)
    flops = bytes_ = 0.0
    kv = cfg.n_key_value_heads or cfg.n_heads
    for s in range(0, len(order), per_chunk):
        chunk = order[s : s + per_chunk]
        first = chunk[0]
        rows = len(chunk) * B
        n = cfg.n_layers - first
        flops += rows * n * layer_flops(cfg, T) + rows * 2 * cfg.d_model
        kv_bytes = rows * (T - 1) * 2 * kv * cfg.d_head * bytes_per
        bytes_ += n * (layer_param_count(cfg) * bytes_per + 3 * kv_bytes)
    return flops, bytes_


def _timed(fn, device: str):
    sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    return out, time.perf_counter() - w0, time.process_time() - c0


def run_benchmark(
    mode: str = "cpu",
    model: str = "qwen2.5-coder-0.5b",
    arch: str = "llama",
    shape: str = "llama3-8b",
    device: str = "cpu",
    dtype: str = "float32",
    n_prompts: int = 8,
    n_tokens: int = 16,
    max_components: int | None = None,
    loop_components: int | None = None,
    max_rows: int = 1024,
    loop: str = "both",
    seed: int = 0,
    peak_tflops: float | None = None,
    bandwidth_tbs: float | None = None,
) -> dict:
    """Time the fast path and the full-forward loop(s); return one result row (dict)."""
    import transformer_lens.patching as tlp

    torch_dtype = getattr(torch, dtype)
    if mode == "gpu":
        loaded = load_random_model(arch, shape, seed=seed, device=device, dtype=torch_dtype)
        name = f"random {arch}/{shape}"
    elif mode == "cpu":
        loaded = load_model(model, device=device, dtype=torch_dtype)
        name = model
    else:
        raise ValueError("mode must be 'cpu' or 'gpu'")
    b = loaded.bridge
    cfg = b.cfg
    g = torch.Generator().manual_seed(seed)
    hi = min(cfg.d_vocab, 30000)
    clean = torch.randint(10, hi, (n_prompts, n_tokens), generator=g)
    cf = clean.clone()
    for p in (n_tokens // 3, 2 * n_tokens // 3):
        cf[:, p] = torch.randint(10, hi, (n_prompts,), generator=g)
    answers = torch.randint(10, hi, (n_prompts,), generator=g)
    clean, cf, answers = clean.to(device), cf.to(device), answers.to(device)
    heads = P.head_components(cfg.n_layers, cfg.n_heads)
    if max_components is not None and max_components < len(heads):
        heads = [heads[i] for i in np.linspace(0, len(heads) - 1, max_components).round().astype(int)]
    n_loop = len(heads) if loop_components is None else min(loop_components, len(heads))
    loop_heads = [heads[i] for i in np.linspace(0, len(heads) - 1, n_loop).round().astype(int)]
    T = n_tokens
    z_names = sorted({c.hook_name for c in heads})
    un = P.Unembed(b)

    def fast():
        with torch.no_grad():
            run = E.clean_run(b, clean)
            src = E.clean_run(b, cf, {n: (lambda a: a[:, -1]) for n in z_names}).captured
            variants = [[P.Edit(c, -1, src[c.hook_name][:, c.index])] for c in heads]
            h = P.run_variants(b, run, variants, max_rows=max_rows)
            return un.token_logits(h, answers)

    def own_loop():
        with torch.no_grad():
            src = P.cache_activations(b, cf, z_names)
            out = []
            for c in loop_heads:
                logits = P.run_edits_full(b, clean, [P.Edit(c, -1, src[c.hook_name][:, -1, c.index])])
                out.append(logits.gather(1, answers[:, None])[:, 0])
            return torch.stack(out)

    def tl_loop():
        with torch.no_grad():
            _, cache = b.run_with_cache(cf)
            idx = pd.DataFrame([(c.layer, T - 1, c.index) for c in loop_heads], columns=["layer", "pos", "head"])
            res = tlp.generic_activation_patch(
                b,
                clean,
                cache,
                lambda logits: logits[:, -1].gather(1, answers[:, None])[:, 0].float(),
                patch_setter=tlp.layer_pos_head_vector_patch_setter,
                activation_name="z",
                index_df=idx,
                reduce="none",
            )
            return res.values

    fast()  # warm-up (allocations, kernels)
    fast_out, fast_s, fast_cpu = _timed(fast, device)
    row: dict = {
        "mode": mode,
        "model": name,
        "device": device,
        "dtype": dtype,
        "prompts": n_prompts,
        "tokens": n_tokens,
        "components": len(heads),
        "loop_components": n_loop,
        "fast_s": fast_s,
        "fast_cpu_s": fast_cpu,
    }
    pos = {c: i for i, c in enumerate(heads)}
    sel = [pos[c] for c in loop_heads]
    scale = len(heads) / n_loop
    diffs = []
    for kind, fn in (("own", own_loop), ("tl", tl_loop)):
        if loop not in (kind, "both"):
            continue
        out, s, cpu = _timed(fn, device)
        row[f"loop_{kind}_s"] = s * scale
        row[f"loop_{kind}_cpu_s"] = cpu * scale
        row[f"ratio_{kind}"] = s * scale / fast_s
        row[f"ratio_{kind}_cpu"] = cpu * scale / max(fast_cpu, 1e-9)
        diffs.append(float((out.to(fast_out.device).float() - fast_out[sel].float()).abs().max()))
    row["max_abs_diff"] = max(diffs) if diffs else float("nan")
    bytes_per = torch.finfo(torch_dtype).bits // 8
    var_flops, var_bytes = fast_cost(cfg, n_prompts, T, [c.layer for c in heads], max_rows, bytes_per)
    base_flops = 2 * full_forward_flops(cfg, n_prompts, T, 0)
    row["flops_fast"] = var_flops + base_flops
    row["flops_loop_own"] = len(heads) * full_forward_flops(cfg, n_prompts, T, 1)
    row["achieved_tflops"] = row["flops_fast"] / fast_s / 1e12
    row["peak_source"] = "given" if peak_tflops and bandwidth_tbs else None
    sheet = gpu_datasheet(device)
    if peak_tflops is None and sheet is not None and dtype in sheet[1]:
        peak_tflops, bandwidth_tbs = sheet[1][dtype], bandwidth_tbs or sheet[1]["bandwidth"]
        row["peak_source"] = f"{sheet[0]} datasheet"
    if (peak_tflops is None or bandwidth_tbs is None) and not device.startswith("cuda"):
        pk, bw = measure_peak(cfg.d_model, cfg.d_mlp, device, torch_dtype)
        peak_tflops, bandwidth_tbs = peak_tflops or pk, bandwidth_tbs or bw
        row["peak_source"] = "measured"
    row["peak_tflops"], row["bandwidth_tbs"] = peak_tflops, bandwidth_tbs
    if peak_tflops and bandwidth_tbs:
        weights = cfg.n_layers * layer_param_count(cfg) * bytes_per
        t_lower = max(var_flops / (peak_tflops * 1e12), var_bytes / (bandwidth_tbs * 1e12)) + max(
            base_flops / (peak_tflops * 1e12), 2 * weights / (bandwidth_tbs * 1e12)
        )
        row["roofline_s"] = t_lower
        row["roofline_tflops"] = row["flops_fast"] / t_lower / 1e12
        row["fraction_of_roofline"] = t_lower / fast_s
        row["intensity_flop_per_byte"] = var_flops / var_bytes
    else:
        row["roofline_tflops"] = row["fraction_of_roofline"] = float("nan")
    return row


def markdown_row(row: dict, command: str) -> str:
    def f(key, fmt="{:.2f}"):
        v = row.get(key)
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    peak = f" ({row['peak_source']})" if row.get("peak_source") else ""
    loop_note = (
        ""
        if row["loop_components"] == row["components"]
        else f" (loop timed on {row['loop_components']}, extrapolated)"
    )
    return (
        f"| {row['mode']} | {row['model']} | {row['device']} {row['dtype']} | {row['prompts']}x{row['tokens']} | "
        f"{row['components']}{loop_note} | {f('fast_s')} | {f('loop_own_s')} | {f('loop_tl_s')} | "
        f"{f('ratio_own', '{:.1f}x')} | {f('ratio_tl', '{:.1f}x')} | {f('ratio_own_cpu', '{:.1f}x')} | "
        f"{f('achieved_tflops', '{:.3f}')} | {f('roofline_tflops', '{:.3f}')}{peak} | {f('fraction_of_roofline', '{:.0%}')} | "
        f"{f('max_abs_diff', '{:.1e}')} | "
        f"`{command}` |"
    )


HEADER = (
    "| mode | model | device | prompts x tokens | heads | fast (s) | loop own (s) | loop TL (s) | "
    "speed-up vs own | speed-up vs TL | speed-up vs own (CPU time) | achieved TFLOP/s | roofline TFLOP/s | "
    "achieved / roofline | max abs diff | command |\n|" + "---|" * 16
)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry model (cpu mode)")
    ap.add_argument("--arch", default="llama", help="random model architecture (gpu mode)")
    ap.add_argument("--shape", default="llama3-8b", help="random model shape (gpu mode); 'tiny' for a code-path check")
    ap.add_argument("--device", default=None, help="default: cpu for --mode cpu, cuda for --mode gpu")
    ap.add_argument("--dtype", default=None, help="default: float32 (cpu), bfloat16 (gpu)")
    ap.add_argument("--prompts", type=int, default=None, help="default: 8 (cpu), 100 (gpu)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-components", type=int, default=None, help="patch only this many heads (evenly spaced)")
    ap.add_argument(
        "--loop-components",
        type=int,
        default=None,
        help="time the loop on this many heads and extrapolate (default: all; cpu default 24)",
    )
    ap.add_argument("--max-rows", type=int, default=None, help="rows per fast-path chunk (default 1024 cpu, 4096 gpu)")
    ap.add_argument("--loop", choices=["both", "own", "tl"], default="both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--bandwidth-tbs", type=float, default=None)
    ap.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    gpu = a.mode == "gpu"
    row = run_benchmark(
        mode=a.mode,
        model=a.model,
        arch=a.arch,
        shape=a.shape,
        device=a.device or ("cuda" if gpu else "cpu"),
        dtype=a.dtype or ("bfloat16" if gpu else "float32"),
        n_prompts=a.prompts or (100 if gpu else 8),
        n_tokens=a.tokens,
        max_components=a.max_components,
        loop_components=a.loop_components if a.loop_components is not None else (None if gpu else 24),
        max_rows=a.max_rows or (4096 if gpu else 1024),
        loop=a.loop,
        seed=a.seed,
        peak_tflops=a.peak_tflops,
        bandwidth_tbs=a.bandwidth_tbs,
    )
    command = "python benchmarks/patching.py " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])
    )
    line = markdown_row(row, command.strip())
    print(HEADER)
    print(line)
    print()
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    if not a.no_write:
        stamp = datetime.now(UTC).strftime("%Y-%m-%d")
        if not RESULTS.exists():
            RESULTS.write_text(
                "# Benchmark results\n\nActivation patching of every head at the answer position: "
                "fast path vs one full forward per head (`benchmarks/patching.py`). "
                "Times in seconds (wall clock); loops timed on a subset are extrapolated linearly.\n\n" + HEADER + "\n"
            )
        insert_row(RESULTS, line.replace("| `python", f"| ({stamp}) `python", 1))
    return row


def insert_row(path: Path, line: str) -> None:
    """Add ``line`` after the last row of the file's first table (the patching table),
    which later sections (other benchmarks) follow."""
    lines = path.read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("|"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    path.write_text("\n".join(lines[:end] + [line] + lines[end:]) + "\n")


if __name__ == "__main__":
    main()
