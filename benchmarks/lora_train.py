#!/usr/bin/env python
"""Benchmark: training LoRA on attention layer L with full forward+backward passes
against passes that start at block L from the frozen model's recorded residual stream
(``arithlib.engine.LayerInputs``; notebook 05 trains one LoRA model per layer, notebook 06 four
more on the pruned models).

A LoRA adapter on layer L changes that layer's keys and values at every position, so
blocks L.. run on the whole sequence (few-shot prefix included); blocks below L are the
frozen model's and give the same stream in every step, every epoch (``finetune_data.epoch_batches``
keeps each batch's prompts), every learning rate and every layer's run. The recording
run (the first one) computes it; the timed runs below use it. Data: notebook 05's
training split (Yu's 2-digit prompts with negatives, 2-shot), batch 16, AdamW.

Per start layer, the same ``--steps`` optimizer steps are trained both ways; the table
gives seconds per step (``FineTuned.train_seconds``: forward, backward and step; best of
``--repeats``), the ratio, and whether the trained weights are identical bit for bit
(float32). The last row is the mean over the layers timed, the per-layer ratio of the
whole sweep when they are spread over the depth. Appends to ``benchmarks/RESULTS.md``.

    python benchmarks/lora_train.py --model smollm2-135m
    python benchmarks/lora_train.py --model random-llama --no-append      # tiny code-path check
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

import arithlib.methods.finetune as FT  # noqa: E402
import arithlib.methods.finetune_data as FD  # noqa: E402
import arithlib.yu.lora as LO  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import LayerInputs  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_arguments(ap, "smollm2-135m")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps timed per run")
    ap.add_argument("--batch-size", type=int, default=16, help="training batch (05's)")
    ap.add_argument(
        "--layers",
        type=float,
        nargs="+",
        default=[0.0, 9 / 32, 17 / 32, 28 / 32],
        help="LoRA layers as fractions of the depth (default: first, Yu's reference, first deep, late)",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model, a.device, a.dtype)
    hf = FT.shared_hf_model(loaded.bridge)
    n_layers = len(FT.decoder_layers(hf))
    layers = sorted({min(n_layers - 1, max(0, round(f * n_layers))) for f in a.layers})
    n = a.steps * a.batch_size
    train = PromptSet.build(FD.yu_lora_data(n_train=n, n_test=0, seed=0, fewshot=2)["train"], loaded.tokenizer)
    cfg = FT.TrainConfig(lr=1e-3, epochs=1, batch_size=a.batch_size, seed=0)
    inputs = LayerInputs(layers)
    LO.train_lora(hf, max(layers), train, cfg, progress=False, inputs=inputs)  # records every layer's input

    def per_step(layer: int, late: bool) -> tuple[float, FT.FineTuned]:
        best = None
        for _ in range(a.repeats):
            ft = LO.train_lora(hf, layer, train, cfg, progress=False, inputs=inputs if late else None)
            t = ft.train_seconds / max(1, len(ft.history))
            best = (t, ft) if best is None or t < best[0] else best
        return best

    rows = []
    for layer in layers:
        t_full, full = per_step(layer, False)
        t_late, late = per_step(layer, True)
        same = all(torch.equal(full.weights[k], late.weights[k]) for k in full.weights)
        rows.append({"layer": layer, "full": t_full, "late": t_late, "ratio": t_late / t_full, "same": same})
    mean_full = sum(r["full"] for r in rows) / len(rows)
    mean_late = sum(r["late"] for r in rows) / len(rows)
    lines = [
        "| model | threads | prompts x steps | LoRA layer (of n) | full fwd+bwd (s/step) | "
        "from recorded stream (s/step) | late / full | speedup | same weights |",
        "|" + "---|" * 9,
    ]
    lines += [
        f"| {a.model} | {torch.get_num_threads()} | {a.batch_size} x {a.steps} | {r['layer']} of {n_layers} | "
        f"{r['full']:.3g} | {r['late']:.3g} | {r['ratio']:.2f} | {1 / r['ratio']:.2f}x | {r['same']} |"
        for r in rows
    ]
    lines.append(
        f"| {a.model} | {torch.get_num_threads()} | | mean of the {len(rows)} layers | {mean_full:.3g} | "
        f"{mean_late:.3g} | {mean_late / mean_full:.2f} | {mean_full / mean_late:.2f}x | |"
    )
    print("\n".join(lines))
    if not all(r["same"] for r in rows):
        raise SystemExit("a late start changed the trained weights: not appended")
    if not a.no_append:
        results.append(
            results.section(
                "LoRA training step on layer L: full forward+backward vs start at L",
                lines,
                where=f"{platform.machine()}, {torch.get_num_threads()} threads",
                argv=argv,
            )
        )
    rows.append({"layer": "mean", "full": mean_full, "late": mean_late, "ratio": mean_late / mean_full, "same": True})
    return rows


if __name__ == "__main__":
    main()
