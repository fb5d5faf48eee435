#!/usr/bin/env python
"""Benchmark: the teacher-forced answer pass of notebooks 05 and 06
(``arithlib.finetune.answer_logits``) with each few-shot group's prefix run once per
batch (``share_prefix=True``, the default) against every row's whole prompt
(``share_prefix=False``), on the test and training sets of notebook 05's quick scale
(Yu's 2-digit prompts, 2-shot, 4 templates x 3 operators: groups of a few prompts, so
a batch of 32 spans about a dozen prefixes). Times an evaluation
(``answer_accuracy``) and one training step (loss and backward with LoRA-like
gradients on one attention matrix); checks that both give the same accuracy and
losses within float rounding; prints a markdown table and appends it, with the
command, to ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/answer_logits.py --model qwen2.5-coder-0.5b
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

import arithlib.datasets as ds  # noqa: E402
import arithlib.finetune as FT  # noqa: E402
from arithlib.models import load_model  # noqa: E402
import results  # noqa: E402


def time_both(model, train: ds.PromptSet, test: ds.PromptSet, batch_size: int, train_batch: int,
              repeats: int = 2) -> dict:
    """Best-of-``repeats`` seconds of an evaluation and of a training step, with and
    without prefix sharing, and the values each gives."""
    hf = FT.shared_hf_model(model)
    layers = FT.decoder_layers(hf)
    weight = next(layers[len(layers) // 4].parameters())  # the gradient flows down to a quarter of the depth
    index = FT.answer_batches(train, train_batch, shuffle=True, seed=0)[0]
    flags = {p: p.requires_grad for p in hf.parameters()}
    for p in flags:
        p.requires_grad_(False)  # gradients for the one matrix only, as in LoRA / precise SFT
    out: dict = {}
    for share in (False, True):
        ev, st = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            with torch.no_grad():
                frame = FT.answer_accuracy(hf, test, batch_size, share_prefix=share)
            ev.append(time.perf_counter() - t0)
            weight.requires_grad_(True)
            t0 = time.perf_counter()
            loss = FT.answer_loss(hf, train, index, share_prefix=share)
            loss.backward()
            st.append(time.perf_counter() - t0)
            weight.requires_grad_(False)
            weight.grad = None
        out[share] = {"eval_s": min(ev), "step_s": min(st), "accuracy": float(frame.correct_full.mean()),
                      "logprob": float(frame.answer_logprob.sum()), "loss": loss.item()}
    for p, flag in flags.items():
        p.requires_grad_(flag)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n", type=int, default=48, help="prompts in the test and in the training set (05's quick scale)")
    ap.add_argument("--batch-size", type=int, default=32, help="evaluation batch (05's)")
    ap.add_argument("--train-batch", type=int, default=16, help="training batch (05's)")
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args()

    loaded = load_model(args.model, device=args.device)
    splits = FT.yu_lora_data(n_train=args.n, n_test=args.n, n_val=0, ops=["+", "-", "*", "/"], seed=0, fewshot=2)
    train, test = (ds.PromptSet.build(splits[k], loaded.tokenizer) for k in ("train", "test"))
    r = time_both(loaded.bridge, train, test, args.batch_size, args.train_batch)
    whole, shared = r[False], r[True]
    device = f"{args.device} ({torch.get_num_threads()} threads)" if args.device == "cpu" else args.device
    same = whole["accuracy"] == shared["accuracy"] and abs(whole["loss"] - shared["loss"]) < 1e-4 * abs(whole["loss"])
    table = results.section("Teacher-forced answer pass (notebooks 05, 06): one prefix per few-shot group vs whole rows", [
        "| model | device | pass | whole rows (s) | prefix per group (s) | speedup | same accuracy and loss |",
        "|---|---|---|---|---|---|---|",
        f"| {args.model} | {device} | evaluate {len(test)} prompts, batch {args.batch_size} | {whole['eval_s']:.2f} | "
        f"{shared['eval_s']:.2f} | {whole['eval_s'] / shared['eval_s']:.1f}x | {same} |",
        f"| {args.model} | {device} | one training step, batch {args.train_batch} | {whole['step_s']:.2f} | "
        f"{shared['step_s']:.2f} | {whole['step_s'] / shared['step_s']:.1f}x | {same} |"])
    print(table)
    print(f"accuracy {whole['accuracy']:.4f} / {shared['accuracy']:.4f}; summed answer log p {whole['logprob']:.5f} / "
          f"{shared['logprob']:.5f}; loss {whole['loss']:.6f} / {shared['loss']:.6f}")
    if not same:
        raise SystemExit("the two passes disagree: not appended")
    if not args.no_append:
        results.append(table)


if __name__ == "__main__":
    main()
