#!/usr/bin/env python
"""Benchmark: CNA of many LoRA models against the original, jointly vs one model at a time.

Notebook 05 compares each of its per-layer LoRA models with the original by CNA (Yu &
Ananiadou Sec. 5, Tables 9-10): for every model, the importance of the deep FFN neurons
in it and in the original (two-stage: a first-order screen of every neuron, then the
exact importance of each case's candidates). The literal loop calls
``cna.importance_from_runs([model, original])`` once per model, so the original's rows
are screened again for every model and each layer's products are a few dozen rows tall.
:func:`arithlib.yu.lora.joint_importance` (what ``lora_cna`` calls) scores all models in one call: the original's rows
once, every model's rows in the same products, the original's exact importance once per
(case, neuron) any model needs. The time of the forward passes that record each model's
rows (the same in both) is left out.

The models are the original with its attention projections perturbed in one layer each
(trained LoRA weights are not needed to time the arithmetic: a model's cost does not
depend on its weights' values). This times both ways in the same run, counts their GFLOP,
checks that each model's importances agree (same candidates, largest difference) and
appends the row to benchmarks/RESULTS.md.

    python benchmarks/lora_cna.py --model qwen2.5-coder-0.5b --models 6
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
import results  # noqa: E402
import roofline  # noqa: E402

import arithlib.yu.cna as C  # noqa: E402
import arithlib.yu.lora as LO  # noqa: E402
from arithlib.engine import clean_param_name, shared_hf_model  # noqa: E402
from arithlib.run.floor import matmul_peak  # noqa: E402


def perturbed_models(bridge, layers: list[int], seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """One model per layer: the original's attention projections of that layer plus
    Gaussian noise (0.01), as clean HF names (what ``lora_cna`` takes)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(shared_hf_model(bridge).named_parameters())
    return {
        f"L{layer}": {
            clean_param_name(n): p.detach() + 0.01 * torch.randn(p.shape, generator=g)
            for n, p in params.items()
            if f"layers.{layer}.self_attn." in n and n.endswith("proj.weight")
        }
        for layer in layers
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--models", type=int, default=6, help="LoRA models compared (spread over the layers)")
    ap.add_argument("--cases", type=int, default=24, help="CNA cases (notebook 05's cpu scale: 24)")
    ap.add_argument("--candidates", type=int, default=100, help="exact candidates per case (05's cpu scale: 100)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    bridge, tok, cfg = loaded.bridge, loaded.tokenizer, loaded.bridge.cfg
    n_layers = int(cfg.n_layers)
    layers = sorted({round(i * (n_layers - 1) / max(1, a.models - 1)) for i in range(a.models)})
    models = perturbed_models(bridge, layers)
    cases = LO.yu_cna_cases(tok, fewshot=2, n_cases=a.cases, seed=0)
    deep = C.deep_layers(n_layers)
    kw = dict(mode="two_stage", n_candidates=a.candidates, layers=deep)
    targets = cases.first_answer_ids
    with torch.no_grad():  # not torch.set_grad_enabled(False): main() also runs inside the tests
        run_o = LO._last_position_run(bridge, cases, None, 32)
        runs = {name: LO._last_position_run(bridge, cases, w, 32) for name, w in models.items()}

        def literal():
            return {
                name: C.importance_from_runs(bridge, [r, run_o], targets, select="change", scale_from=1, **kw)[
                    "importance"
                ]
                for name, r in runs.items()
            }

        def joint():
            return {
                name: torch.stack(pair)
                for name, pair in LO.joint_importance(bridge, runs, run_o, targets, **kw).items()
            }

        f_lit, t_lit, v_lit = roofline.measure(literal, a.repeats)
        f_joint, t_joint, v_joint = roofline.measure(joint, a.repeats)
    same = all(torch.equal(torch.isfinite(v_lit[n]), torch.isfinite(v_joint[n])) for n in runs)
    diff = max(float((v_lit[n] - v_joint[n]).nan_to_num().abs().max()) for n in runs)
    peak = matmul_peak(int(cfg.d_model), int(cfg.d_mlp))["gflop_s"]
    row = {
        "model": a.model,
        "threads": torch.get_num_threads(),
        "models x cases": f"{len(models)} x {a.cases}",
        "literal_s": t_lit,
        "joint_s": t_joint,
        "speedup": t_lit / t_joint,
        "literal_gflop": f_lit / 1e9,
        "joint_gflop": f_joint / 1e9,
        "literal_ratio": t_lit / (f_lit / 1e9 / peak),
        "joint_ratio": t_joint / (f_joint / 1e9 / peak),
        "peak_gflop_s": peak,
        "same_candidates": same,
        "max_abs_diff": diff,
    }
    line = (
        f"| {row['model']} | cpu ({row['threads']} threads) | {row['models x cases']} | {t_lit:.1f} | {t_joint:.1f} | "
        f"{row['speedup']:.2f}x | {row['literal_gflop']:.0f} | {row['joint_gflop']:.0f} | "
        f"{row['literal_ratio']:.2f} / {row['joint_ratio']:.2f} ({peak:.0f} GFLOP/s) | "
        f"{'yes' if same else 'no'} | {diff:.1e} |"
    )
    table = [
        "| model | device | models x cases | one at a time (s) | joint (s) | speedup | one at a time GFLOP | "
        "joint GFLOP | ratio to floor (peak) | same candidates | max abs diff (nats) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        line,
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(results.section("CNA of many LoRA models: jointly vs one model at a time", table))
    return row


if __name__ == "__main__":
    main()
