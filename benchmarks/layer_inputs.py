#!/usr/bin/env python
"""Benchmark: evaluating a model that differs from the original from block L on, with a
full pass against a pass that starts at block L from the original's recorded stream
(``arithlib.layer_inputs``; notebooks 05 and 06 evaluate a dozen such models: LoRA on
one layer, FFN neurons pruned from the deep layers on).

The test set is notebook 05's at its quick scale (Yu's 2-digit prompts, 2-shot). The
original is evaluated once, recording the stream entering each start layer; then, per
start layer, a model whose weights in that block are perturbed is evaluated both ways
(best of ``--repeats``). The results must be equal bit for bit; prints a markdown table
and appends it, with the command, to ``benchmarks/RESULTS.md``.

    python benchmarks/layer_inputs.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import results  # noqa: E402
import arithlib.datasets as ds  # noqa: E402
import arithlib.finetune as FT  # noqa: E402
from arithlib.layer_inputs import LayerInputs  # noqa: E402
from arithlib.models import load_model, load_random_model  # noqa: E402


def perturbed(hf, layer: int) -> dict[str, torch.Tensor]:
    """Every weight matrix of block ``layer``, slightly changed (what an adapter or a
    pruning there changes)."""
    prefix = FT._layer_prefix(hf, layer)
    gen = torch.Generator().manual_seed(layer)
    return {n: p.detach() + 1e-3 * torch.randn(p.shape, generator=gen)
            for n, p in FT._params_by_clean_name(hf).items() if n.startswith(prefix) and p.dim() == 2}


def best_time(fn, repeats: int):
    out, best = None, float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--n", type=int, default=48, help="test prompts (05's quick scale)")
    ap.add_argument("--batch-size", type=int, default=32, help="evaluation batch (05's)")
    ap.add_argument("--layers", type=float, nargs="+", default=[9 / 32, 17 / 32],
                    help="start layers as fractions of the depth (default: Yu's LoRA layer and first deep layer)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = load_random_model(a.model.removeprefix("random-"), "tiny") if a.model.startswith("random-") \
        else load_model(a.model)
    hf = FT.shared_hf_model(loaded.bridge)
    n_layers = len(FT.decoder_layers(hf))
    starts = sorted({min(n_layers - 1, max(1, round(f * n_layers))) for f in a.layers})
    test = ds.PromptSet.build(FT.yu_lora_data(n_train=0, n_test=a.n, seed=0, fewshot=2)["test"], loaded.tokenizer)
    inputs = {"test": LayerInputs(starts)}
    t_record, _ = best_time(lambda: FT.evaluate_weights(hf, None, {"test": test}, a.batch_size, inputs=inputs), 1)
    rows = []
    for layer in starts:
        w = perturbed(hf, layer)
        t_full, full = best_time(lambda: FT.evaluate_weights(hf, w, {"test": test}, a.batch_size), a.repeats)
        t_late, late = best_time(lambda: FT.evaluate_weights(hf, w, {"test": test}, a.batch_size, inputs=inputs),
                                 a.repeats)
        rows.append({"layer": layer, "full": t_full, "late": t_late, "speedup": t_full / t_late,
                     "same": bool(full.equals(late))})
    lines = ["| model | threads | prompts | start block (of n) | full pass (s) | from recorded stream (s) | speedup | "
             "bit-identical |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {a.model} | {torch.get_num_threads()} | {len(test)} | {r['layer']} of {n_layers} | {r['full']:.2f} | "
              f"{r['late']:.2f} | {r['speedup']:.2f}x | {r['same']} |" for r in rows]
    note = (f"The original's evaluation, recording the stream entering blocks {starts}, took {t_record:.2f} s; "
            "it is needed anyway (every table has the original's row).")
    print("\n".join(lines))
    print(note)
    if not all(r["same"] for r in rows):
        raise SystemExit("a late start changed the results: not appended")
    if not a.no_append:
        results.append(results.section("Evaluating a model changed from block L on: full pass vs start at L",
                                       lines, where=f"{platform.machine()}, {torch.get_num_threads()} threads",
                                       argv=argv, note=note))
    return rows


if __name__ == "__main__":
    main()
