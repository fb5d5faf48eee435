#!/usr/bin/env python
"""Benchmark: what one LoRA model of notebook 05 costs on this machine - the seconds to
train it on ``--n`` training sentences (full passes, batch 16, one epoch, lr 1e-3) and to
evaluate it on ``--n`` test sentences, at layers ``--layers``. The "cpu-bands" scale
(``scales.CPU_FULL_SCALE_MAX_PARAMS``) rests on this for Qwen2.5-Coder-1.5B. Prints the
table; benchmarks/RESULTS.md holds the committed one.

    python benchmarks/lora_cost.py --model qwen2.5-coder-1.5b --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402

import arithlib.methods.finetune as FT  # noqa: E402
import arithlib.methods.finetune_data as FD  # noqa: E402
import arithlib.yu.lora as LO  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--layers", type=int, nargs="+", default=[10, 0])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = bench_model.load(args.model, args.device, args.dtype)
    splits = FD.yu_lora_data(n_train=args.n, n_test=args.n, n_val=0, seed=0, fewshot=2)
    train, test = (PromptSet.build(splits[k], loaded.tokenizer) for k in ("train", "test"))
    print("| layer | train (s) | s per sentence | evaluate (s) |\n|---|---|---|---|")
    for layer in args.layers:
        t0 = time.perf_counter()
        ft = LO.train_lora(
            loaded.bridge, layer, train, FT.TrainConfig(lr=1e-3, epochs=1, batch_size=16), progress=False
        )
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        FT.evaluate_weights(loaded.bridge, ft.weights, {"test": test}, 32)
        print(f"| {layer} | {t_train:.1f} | {t_train / len(train):.2f} | {time.perf_counter() - t0:.1f} |")


if __name__ == "__main__":
    main()
