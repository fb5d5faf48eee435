#!/usr/bin/env python
"""Benchmark: the teacher-forced answer pass of notebooks 05 and 06
(``arithlib.methods.answer_loss.teacher_forced_logits``) with each few-shot group's prefix run once per
batch (``share_prefix=True``, the default) against every row's whole prompt
(``share_prefix=False``), on the test and training sets of notebook 05's quick scale
(Yu's 2-digit prompts, 2-shot, 4 templates x 3 operators: groups of a few prompts, so
a batch of 32 spans about a dozen prefixes). Times an evaluation
(``answer_accuracy``) and one training step (loss and backward with LoRA-like
gradients on one attention matrix) with ``roofline.best_time`` (the GPU synchronised
around each call), counts each one's FLOPs (``roofline.counted_flops``, one extra
untimed call, backward included) and reports achieved TFLOP/s and the fraction of the
FLOP peak (``roofline.flop_peak``); checks that both give the same accuracy, summed
answer log-probability and loss within the dtype's rounding (:func:`tolerance`); prints
a markdown table and appends it, with the command, to ``benchmarks/RESULTS.md``.
``main(argv)`` returns the two rows (evaluation, training step) as dicts.

    .venv/bin/python benchmarks/answer_logits.py --model qwen2.5-coder-0.5b
    python benchmarks/answer_logits.py --model random-llama:llama3-8b --device cuda --dtype bfloat16
    python benchmarks/answer_logits.py --model random-llama --n 12 --no-append   # tiny code-path check
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

import arithlib.methods.answer_loss as AL  # noqa: E402
import arithlib.methods.finetune as FT  # noqa: E402
import arithlib.methods.finetune_data as FD  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402


def time_both(
    model,
    train: PromptSet,
    test: PromptSet,
    batch_size: int,
    train_batch: int,
    repeats: int = 2,
    flops: bool = True,
) -> dict:
    """Per ``share_prefix`` (False, True): best-of-``repeats`` seconds of an evaluation
    and of a training step (``eval_s``, ``step_s``), their FLOPs (``eval_flops``,
    ``step_flops``, counted in one extra call each, which also warms up; 0 without
    ``flops``), and the values each gives (``accuracy``, ``logprob``, ``loss``)."""
    hf = FT.shared_hf_model(model)
    device = next(hf.parameters()).device
    layers = FT.decoder_layers(hf)
    weight = next(layers[len(layers) // 4].parameters())  # the gradient flows down to a quarter of the depth
    index = FD.answer_batches(train, train_batch, shuffle=True, seed=0)[0]
    flags = {p: p.requires_grad for p in hf.parameters()}
    out: dict = {}
    try:
        for p in flags:
            p.requires_grad_(False)  # gradients for the one matrix only, as in LoRA / precise SFT
        weight.requires_grad_(True)
        for share in (False, True):

            def evaluate():
                with torch.no_grad():
                    return AL.answer_accuracy(hf, test, batch_size, share_prefix=share)

            def step():
                weight.grad = None
                loss = AL.answer_loss(hf, train, index, share_prefix=share)
                loss.backward()
                return loss.detach()

            eval_flops = roofline.counted_flops(evaluate) if flops else 0.0
            eval_s, frame = roofline.best_time(evaluate, repeats, device)
            step_flops = roofline.counted_flops(step) if flops else 0.0
            step_s, loss = roofline.best_time(step, repeats, device)
            out[share] = {
                "eval_s": max(eval_s, 1e-9),
                "step_s": max(step_s, 1e-9),
                "eval_flops": eval_flops,
                "step_flops": step_flops,
                "accuracy": float(frame.correct_full.mean()),
                "logprob": float(frame.answer_logprob.sum()),
                "loss": loss.item(),
            }
    finally:
        weight.grad = None
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return out


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the two passes' loss and summed answer log-probability:
    1e-4 in float32 (the check this benchmark always made), 4 units of the dtype's
    rounding in bfloat16 / float16 (0.031 / 0.0039): the passes differ in batch shapes,
    hence in matrix-product kernels and their rounding."""
    return 1e-4 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


def compare(whole: dict, shared: dict, n_test: int, dtype: torch.dtype) -> tuple[bool, str]:
    """(same, what was compared): accuracy equal in float32 (in lower precision it may
    differ by near-tied argmaxes, at most max(1, 2 %) of the prompts), loss and summed
    answer log p within :func:`tolerance` of their magnitude."""
    rel = tolerance(dtype)
    flips = bench_model.allowed_flips(n_test, dtype)
    acc_ok = abs(whole["accuracy"] - shared["accuracy"]) * n_test <= flips + 1e-6
    loss_ok = abs(whole["loss"] - shared["loss"]) <= rel * max(abs(whole["loss"]), 1e-6)
    lp_ok = abs(whole["logprob"] - shared["logprob"]) <= rel * max(abs(whole["logprob"]), 1e-6)
    what = f"accuracy (±{flips} prompts), loss and sum of answer log p (rel. {rel:.2g})"
    return acc_ok and loss_ok and lp_ok, what


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--n", type=int, default=48, help="prompts in the test and in the training set (05's quick scale)")
    ap.add_argument("--batch-size", type=int, default=32, help="evaluation batch (05's)")
    ap.add_argument("--train-batch", type=int, default=16, help="training batch (05's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args(argv)

    loaded = bench_model.load(args.model, args.device, args.dtype)
    device, dtype, cfg = loaded.device, loaded.dtype, loaded.bridge.cfg
    splits = FD.yu_lora_data(n_train=args.n, n_test=args.n, n_val=0, ops=["+", "-", "*", "/"], seed=0, fewshot=2)
    train, test = (PromptSet.build(splits[k], loaded.tokenizer) for k in ("train", "test"))
    r = time_both(loaded.bridge, train, test, args.batch_size, args.train_batch, args.repeats)
    whole, shared = r[False], r[True]
    same, compared = compare(whole, shared, len(test), dtype)
    peak, source = roofline.flop_peak(device, dtype, cfg.d_model, cfg.d_mlp)
    label, dname = roofline.device_label(device), roofline.dtype_name(dtype)
    rows = []
    for key, what in (
        ("eval", f"evaluate {len(test)} prompts, batch {args.batch_size}"),
        ("step", f"one training step, batch {args.train_batch}"),
    ):
        row = {
            "model": args.model,
            "device": label,
            "dtype": dname,
            "pass": what,
            "whole_s": whole[f"{key}_s"],
            "shared_s": shared[f"{key}_s"],
            "speedup": whole[f"{key}_s"] / shared[f"{key}_s"],
            "whole_flops": whole[f"{key}_flops"],
            "shared_flops": shared[f"{key}_flops"],
            "peak_tflops": peak,
            "peak_source": source,
            "same": same,
            "compared": compared,
            "accuracy": shared["accuracy"],
            "loss": shared["loss"],
        }
        for v in ("whole", "shared"):
            row[f"{v}_tflops"], row[f"{v}_fraction"] = roofline.rate(row[f"{v}_flops"], row[f"{v}_s"], peak)
        rows.append(row)
    table = results.section(
        "Teacher-forced answer pass (notebooks 05, 06): one prefix per few-shot group vs whole rows",
        [
            "| model | device | dtype | pass | whole rows (s) | prefix per group (s) | speedup | whole rows GFLOP | "
            "prefix per group GFLOP | whole rows TFLOP/s | prefix per group TFLOP/s | whole rows / peak | "
            "prefix per group / peak | same accuracy and loss |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *[
                f"| {args.model} | {x['device']} | {x['dtype']} | {x['pass']} | {x['whole_s']:.2f} | {x['shared_s']:.2f} | "
                f"{x['speedup']:.1f}x | {roofline.num(x['whole_flops'] / 1e9)} | {roofline.num(x['shared_flops'] / 1e9)} | "
                f"{roofline.num(x['whole_tflops'])} | {roofline.num(x['shared_tflops'])} | {roofline.pct(x['whole_fraction'])} | "
                f"{roofline.pct(x['shared_fraction'])} | {x['same']} |"
                for x in rows
            ],
        ],
        argv=argv,
        note=f"FLOP peak (TFLOP/s, {dname}): {roofline.peak_cell(peak, source)}. FLOPs counted by torch's per-operator formulas (arithlib.engine.flops) "
        f"(matrix products and attention; the step's backward included). Compared: {compared}.",
    )
    print(table)
    print(
        f"accuracy {whole['accuracy']:.4f} / {shared['accuracy']:.4f}; summed answer log p {whole['logprob']:.5f} / "
        f"{shared['logprob']:.5f}; loss {whole['loss']:.6f} / {shared['loss']:.6f}"
    )
    if not same:
        raise SystemExit("the two passes disagree: not appended")
    if not args.no_append:
        results.append(table)
    return rows


if __name__ == "__main__":
    main()
