#!/usr/bin/env python
"""Benchmark: evaluating a model that differs from the original from block L on, with a
full pass against a pass that starts at block L from the original's recorded stream
(``arithlib.engine.LayerInputs``; notebooks 05 and 06 evaluate a dozen such models: LoRA on
one layer, FFN neurons pruned from the deep layers on).

The test set is notebook 05's at its quick scale (Yu's 2-digit prompts, 2-shot). The
original is evaluated once, recording the stream entering each start layer; then, per
start layer, a model whose weights in that block are perturbed is evaluated both ways
(best of ``--repeats``, timings synchronised with the GPU: ``roofline.best_time``). In
float32 the results must be equal bit for bit; in bfloat16/float16 the two passes should
still be (same kernels on the same inputs), and the check allows the answers'
log-probabilities to differ by a few roundings (``TOLERANCE``) with no prompt's verdict
changed. The FLOPs of each pass (counted with torch's
per-operator formulas, :mod:`arithlib.engine.flops`, over one extra, untimed call before the timed ones: ``roofline.measure``), the achieved TFLOP/s and
their fraction of the peak in the model's dtype (``roofline.flop_peak``: a GPU's datasheet, or measured on
the CPU) are in the table. Prints a markdown table and appends it, with the command, to
``benchmarks/RESULTS.md``.

    python benchmarks/layer_inputs.py --model qwen2.5-coder-0.5b
    python benchmarks/layer_inputs.py --model random-llama --no-append        # tiny code-path check
    python benchmarks/layer_inputs.py --model random-llama:llama3-8b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
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
import arithlib.methods.finetune_data as FD  # noqa: E402
import arithlib.methods.model_weights as MW  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import LayerInputs  # noqa: E402

#: Allowed |full - late| of a log-probability, by the model's dtype (see the docstring):
#: float32 must be bit-identical.
TOLERANCE = {"float32": 0.0, "bfloat16": 4 * 2.0**-7, "float16": 4 * 2.0**-10}
LOGPROBS = ("answer_logprob", "first_logprob")
VERDICTS = ("correct_first", "correct_full")


def perturbed(hf, layer: int) -> dict[str, torch.Tensor]:
    """Every weight matrix of block ``layer``, slightly changed (what an adapter or a
    pruning there changes); the noise is drawn on the CPU (the same on every device) and
    added on the parameter's device in its dtype."""
    prefix = MW.layer_prefix(hf, layer)
    gen = torch.Generator().manual_seed(layer)
    return {
        n: p.detach() + (1e-3 * torch.randn(p.shape, generator=gen)).to(p.device, p.dtype)
        for n, p in MW.params_by_clean_name(hf).items()
        if n.startswith(prefix) and p.dim() == 2
    }


def compare(full, late, dtype: str) -> dict:
    """Bit identity, the largest log-probability difference, the prompts whose verdict
    differs, and whether that is within ``TOLERANCE[dtype]``."""
    same = bool(full.equals(late))
    diff = max(float((full[c] - late[c]).abs().max()) for c in LOGPROBS) if len(full) else 0.0
    flips = int((full[list(VERDICTS)] != late[list(VERDICTS)]).any(axis=1).sum())
    ok = same if TOLERANCE[dtype] == 0 else (diff <= TOLERANCE[dtype] and flips == 0)
    return {"same": same, "max_diff": diff, "flips": flips, "ok": bool(ok)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--n", type=int, default=48, help="test prompts (05's quick scale)")
    ap.add_argument("--batch-size", type=int, default=32, help="evaluation batch (05's)")
    ap.add_argument(
        "--layers",
        type=float,
        nargs="+",
        default=[9 / 32, 17 / 32],
        help="start layers as fractions of the depth (default: Yu's LoRA layer and first deep layer)",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model, a.device, a.dtype)
    dev = torch.device(loaded.device)
    cfg = loaded.bridge.cfg
    hf = FT.shared_hf_model(loaded.bridge)
    n_layers = len(FT.decoder_layers(hf))
    starts = sorted({min(n_layers - 1, max(1, round(f * n_layers))) for f in a.layers})
    test = PromptSet.build(FD.yu_lora_data(n_train=0, n_test=a.n, seed=0, fewshot=2)["test"], loaded.tokenizer)
    inputs = {"test": LayerInputs(starts)}
    t_record, _ = roofline.best_time(
        lambda: FT.evaluate_weights(hf, None, {"test": test}, a.batch_size, inputs=inputs), 1, dev
    )
    peak, source = roofline.flop_peak(dev, loaded.dtype, cfg.d_model, cfg.d_mlp)
    rows = []
    for layer in starts:
        w = perturbed(hf, layer)

        def full_pass():
            return FT.evaluate_weights(hf, w, {"test": test}, a.batch_size)  # noqa: F821 (the loop's w)

        def late_pass():
            return FT.evaluate_weights(hf, w, {"test": test}, a.batch_size, inputs=inputs)  # noqa: F821

        flops_full, t_full, full = roofline.measure(full_pass, a.repeats, dev)
        flops_late, t_late, late = roofline.measure(late_pass, a.repeats, dev)
        tf_full, frac_full = roofline.rate(flops_full, t_full, peak)
        tf_late, frac_late = roofline.rate(flops_late, t_late, peak)
        rows.append(
            {
                "layer": layer,
                "full": t_full,
                "late": t_late,
                "speedup": t_full / t_late,
                "flops_full": flops_full,
                "flops_late": flops_late,
                "tflops_full": tf_full,
                "tflops_late": tf_late,
                "frac_full": frac_full,
                "frac_late": frac_late,
                "peak_tflops": peak,
                "peak_source": source,
                **compare(full, late, a.dtype),
            }
        )
        del w
    label = roofline.device_label(dev)
    lines = [
        "| model | device | dtype | prompts | start block (of n) | full pass (s) | from recorded stream (s) | "
        "speedup | full GFLOP | late GFLOP | full TFLOP/s | late TFLOP/s | full / peak | late / peak | "
        "peak TFLOP/s | bit-identical | max abs diff of log p (answer, first token) | verdicts changed | "
        "within tol |",
        "|" + "---|" * 19,
    ]
    tol = f"tol {TOLERANCE[a.dtype]:.0e}" + (", bit-identical required" if TOLERANCE[a.dtype] == 0 else "")
    lines += [
        f"| {a.model} | {label} | {a.dtype} | {len(test)} | {r['layer']} of {n_layers} | {r['full']:.3g} | "
        f"{r['late']:.3g} | {r['speedup']:.2f}x | {r['flops_full'] / 1e9:.3g} | {r['flops_late'] / 1e9:.3g} | "
        f"{r['tflops_full']:.3g} | {r['tflops_late']:.3g} | {r['frac_full']:.1%} | {r['frac_late']:.1%} | "
        f"{roofline.peak_cell(peak, source)} | {r['same']} | {r['max_diff']:.1e} | {r['flips']} | "
        f"{r['ok']} ({tol}) |"
        for r in rows
    ]
    note = (
        f"The original's evaluation, recording the stream entering blocks {starts}, took {t_record:.2f} s; "
        "it is needed anyway (every table has the original's row)."
    )
    print("\n".join(lines))
    print(note)
    if not all(r["ok"] for r in rows):
        raise SystemExit("a late start changed the results: not appended")
    if not a.no_append:
        results.append(
            results.section(
                "Evaluating a model changed from block L on: full pass vs start at L",
                lines,
                where=f"{platform.machine()}, {torch.get_num_threads()} threads",
                argv=argv,
                note=note,
            )
        )
    return rows


if __name__ == "__main__":
    main()
