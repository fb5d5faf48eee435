#!/usr/bin/env python
"""Benchmark: the answer-position runs of many one-block models, stacked vs one full run each.

Notebook 05's CNA (Yu & Ananiadou Sec. 5, Tables 9-10) reads every LoRA model's residual
stream and FFN coefficients at the answer position. A LoRA model of layer L computes below L
exactly what the original does, so :func:`arithlib.methods.answer_runs.run_weight_variants`
runs all models of a batch in one pass that each joins at its layer from a clean run of the
original (:func:`arithlib.engine.variant_passes`): fewer blocks per model, and every block's
products as many models tall as are present there. The literal way is one full run per model
with its weights swapped in (``lora._last_position_run``).

The models are the original with its attention projections perturbed in one layer each
(``benchmarks/lora_cna.py``'s ``perturbed_models``: a run's cost does not depend on the
weights' values). Both ways are timed in the same run, their GFLOP counted; the check is
that every field of every model's run is identical. Appends the row to benchmarks/RESULTS.md.

    python benchmarks/weight_variants.py --model qwen2.5-coder-0.5b --models 24
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import lora_cna  # noqa: E402
import results  # noqa: E402
import roofline  # noqa: E402

import arithlib.yu.lora as LO  # noqa: E402
from arithlib.run.floor import matmul_peak  # noqa: E402

FIELDS = ("pred", "logprob", "resid_mid", "coef", "final_resid")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--models", type=int, default=24, help="one-block models (spread over the layers; 05: every layer)")
    ap.add_argument("--cases", type=int, default=24, help="CNA cases (notebook 05's cpu scale: 24)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    bridge, tok, cfg = loaded.bridge, loaded.tokenizer, loaded.bridge.cfg
    n_layers = int(cfg.n_layers)
    layers = sorted({round(i * (n_layers - 1) / max(1, a.models - 1)) for i in range(a.models)})
    models = lora_cna.perturbed_models(bridge, layers)
    cases = LO.yu_cna_cases(tok, fewshot=2, n_cases=a.cases, seed=0)
    with torch.no_grad():  # not torch.set_grad_enabled(False): main() also runs inside the tests
        base = LO._last_position_run(bridge, cases, None, 32)

        def literal():
            return {name: LO._last_position_run(bridge, cases, w, 32) for name, w in models.items()}

        def stacked():
            return LO._model_runs(bridge, cases, models, base, 32)

        f_lit, t_lit, v_lit = roofline.measure(literal, a.repeats)
        f_st, t_st, v_st = roofline.measure(stacked, a.repeats)
    same = all(torch.equal(getattr(v_lit[n], f), getattr(v_st[n], f)) for n in models for f in FIELDS)
    diff = max(
        float((getattr(v_lit[n], f).float() - getattr(v_st[n], f).float()).abs().max()) for n in models for f in FIELDS
    )
    peak = matmul_peak(int(cfg.d_model), int(cfg.d_mlp))["gflop_s"]
    row = {
        "model": a.model,
        "threads": torch.get_num_threads(),
        "models x cases": f"{len(models)} x {a.cases}",
        "literal_s": t_lit,
        "stacked_s": t_st,
        "speedup": t_lit / t_st,
        "literal_gflop": f_lit / 1e9,
        "stacked_gflop": f_st / 1e9,
        "literal_ratio": t_lit / (f_lit / 1e9 / peak),
        "stacked_ratio": t_st / (f_st / 1e9 / peak),
        "peak_gflop_s": peak,
        "identical": same,
        "max_abs_diff": diff,
    }
    table = [
        "| model | device | models x cases | one run each (s) | stacked (s) | speedup | one run each GFLOP | "
        "stacked GFLOP | ratio to floor (peak) | identical | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {a.model} | cpu ({row['threads']} threads) | {row['models x cases']} | {t_lit:.1f} | {t_st:.1f} | "
        f"{row['speedup']:.2f}x | {row['literal_gflop']:.0f} | {row['stacked_gflop']:.0f} | "
        f"{row['literal_ratio']:.2f} / {row['stacked_ratio']:.2f} ({peak:.0f} GFLOP/s) | "
        f"{'yes' if same else 'no'} | {diff:.1e} |",
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(results.section("Runs of many one-block models: stacked vs one full run each", table))
    return row


if __name__ == "__main__":
    main()
