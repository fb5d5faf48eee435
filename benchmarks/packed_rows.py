#!/usr/bin/env python
"""Benchmark: fine-tuning's teacher-forced passes with each batch's prefixes and rows
packed into one sequence, against the two passes they replaced.

Every training step and every answer-token evaluation of notebooks 05, 06 and 08 runs
:func:`arithlib.engine.rows_on_prefixes`: the distinct few-shot prefixes of a batch once
each, and every row's remaining tokens on them. It used to take two passes (the prefixes
right-padded into one batch, then the rows, right-padded, on the prefixes' keys and
values gathered per row); it now takes one packed sequence with a mask that lets each
row see its prefix and itself (no padding; the prefixes' tokens join the rows' in every
matrix product). The two-pass run is kept here, as it was, as the baseline.

On notebook 05's data (Yu's 2-digit prompts with negatives, 2-shot; training batch 16,
evaluation batch 32, AdamW), per LoRA layer: ``--steps`` training steps and the test-set
evaluation of the trained weights, both ways, each from its own recorded stream of the
original model (as the notebook runs them). The table gives seconds, counted GFLOP, the
rate against the machine's matrix-product peak (:func:`arithlib.run.floor.matmul_peak`,
``ratio_to_floor``), the largest differences of the losses and answer log-probabilities,
and the verdicts that differ. Appends to benchmarks/RESULTS.md.

    python benchmarks/packed_rows.py --model qwen2.5-coder-0.5b
    python benchmarks/packed_rows.py --model random-qwen2 --no-append      # tiny code-path check
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import results  # noqa: E402

import arithlib.methods.answer_loss as AL  # noqa: E402
import arithlib.methods.finetune as FT  # noqa: E402
import arithlib.methods.finetune_data as FD  # noqa: E402
import arithlib.yu.lora as LO  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import LayerInputs, counted_flops, counting  # noqa: E402
from arithlib.engine.adapter import input_device, select_cache_rows  # noqa: E402
from arithlib.engine.passes import can_start_late, run_decoder  # noqa: E402
from arithlib.run.floor import matmul_peak  # noqa: E402


def _padded(rows, device):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[k, : len(r)] = 1
    return ids.to(device), mask.to(device)


def two_pass_rows_on_prefixes(hf, seqs, plen, *, inputs=None, key=None, same_below=0):
    """The two-pass run rows_on_prefixes replaced, as it was: the distinct prefixes,
    right-padded into one batch; then every row's remaining tokens, right-padded, on its
    prefix's keys and values (gathered per row; padded keys masked out)."""
    device = input_device(hf)
    suffix, suffix_mask = _padded([s[p:] for s, p in zip(seqs, plen)], device)
    late = inputs is not None and can_start_late(hf)
    start = inputs.start(key, same_below) if late else 0
    record = inputs.wanted(key, start, same_below) if late else []
    recorded: dict[int, dict[str, torch.Tensor]] = {}

    def run(part: str, **kw):
        h0 = inputs.get(key, start, part) if start else None
        hidden, past, rec = run_decoder(hf, start=start, hidden=h0, record=record, **kw)
        for layer, h in rec.items():
            recorded.setdefault(layer, {})[part] = h
        return hidden, past

    if any(plen):
        keys = [tuple(s[:p]) for s, p in zip(seqs, plen)]
        distinct = list(dict.fromkeys(q for q in keys if q))
        which = {q: k for k, q in enumerate(distinct)}
        prefix, prefix_mask = _padded(distinct, device)
        _, cache = run("prefix", input_ids=prefix, attention_mask=prefix_mask, keep_cache=True)
        rows = torch.tensor([which.get(q, 0) for q in keys], device=device)
        row_prefix_mask = (
            prefix_mask.index_select(0, rows)
            * torch.tensor([p > 0 for p in plen], dtype=torch.long, device=device)[:, None]
        )
        positions = torch.tensor(plen, device=device)[:, None] + torch.arange(suffix.shape[1], device=device)
        hidden, _ = run(
            "rows",
            input_ids=suffix,
            attention_mask=torch.cat([row_prefix_mask, suffix_mask], 1),
            position_ids=positions,
            past=select_cache_rows(hf.config, cache, rows),
            keep_cache=True,
        )
    else:
        hidden, _ = run("rows", input_ids=suffix)
    for layer, parts in recorded.items():
        inputs.put(key, layer, parts)
    return hidden


def _timed(fn: Callable[[], object]) -> tuple[float, float, object]:
    with counting():
        f0, t0 = counted_flops(), time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, (counted_flops() - f0) / 1e9, out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--layers", type=float, nargs="+", default=[0.0, 0.5, 20 / 24], help="fractions of the depth")
    ap.add_argument("--steps", type=int, default=8, help="training steps per layer and method")
    ap.add_argument("--n-test", type=int, default=385, help="test prompts evaluated (05's)")
    bench_model.add_run_arguments(ap)
    a = ap.parse_args(argv)
    with bench_model.torch_threads(a.threads), bench_model.restored(AL, "rows_on_prefixes"):
        return _run(a, argv)


PACKED = AL.rows_on_prefixes


def _run(a: argparse.Namespace, argv: list[str] | None) -> list[dict]:
    loaded = bench_model.load(a.model, a.device, a.dtype)
    hf = FT.shared_hf_model(loaded.bridge)
    n_layers = len(FT.decoder_layers(hf))
    layers = sorted({min(n_layers - 1, max(0, round(f * n_layers))) for f in a.layers})
    splits = FD.yu_lora_data(n_train=16 * a.steps, n_test=a.n_test, n_val=0, seed=0, fewshot=2)
    train, test = (PromptSet.build(splits[k], loaded.tokenizer) for k in ("train", "test"))
    cfg = FT.TrainConfig(lr=1e-3, epochs=1, batch_size=16, seed=0, eval_batch_size=32)
    d = hf.config
    peak = matmul_peak(d.hidden_size, d.intermediate_size, device=a.device)["gflop_s"]
    methods = {"two passes": two_pass_rows_on_prefixes, "packed": PACKED}
    streams = {m: (LayerInputs(layers), {"test": LayerInputs(layers)}) for m in methods}
    for m, fn in methods.items():  # the original model's streams, recorded as the notebook records them
        AL.rows_on_prefixes = fn
        LO.train_lora(hf, max(layers), train, cfg, progress=False, inputs=streams[m][0])
        FT.evaluate_weights(hf, None, {"test": test}, 32, inputs=streams[m][1])
    rows = []
    for layer in layers:
        got = {}
        for m, fn in methods.items():
            AL.rows_on_prefixes = fn
            t_train, g_train, ft = _timed(
                lambda: LO.train_lora(hf, layer, train, cfg, progress=False, inputs=streams[m][0])
            )
            t_eval, g_eval, frame = _timed(
                lambda ft=ft: FT.evaluate_weights(hf, ft.weights, {"test": test}, 32, inputs=streams[m][1])
            )
            got[m] = (t_train, g_train, ft, t_eval, g_eval, frame)
        (t0, g0, ft0, e0, h0, f0), (t1, g1, ft1, e1, h1, f1) = got["two passes"], got["packed"]
        rows.append(
            {
                "layer": layer,
                "train_old_s": t0,
                "train_new_s": t1,
                "train_old_ratio": t0 / (g0 / peak),
                "train_new_ratio": t1 / (g1 / peak),
                "eval_old_s": e0,
                "eval_new_s": e1,
                "eval_old_ratio": e0 / (h0 / peak),
                "eval_new_ratio": e1 / (h1 / peak),
                "loss_diff": float(
                    (torch.tensor(ft0.history.loss.values) - torch.tensor(ft1.history.loss.values)).abs().max()
                ),
                "logprob_diff": float((f0.answer_logprob - f1.answer_logprob).abs().max()),
                "flips": int((f0.correct_full != f1.correct_full).sum()),
            }
        )
    lines = [
        f"| model | threads | LoRA layer (of {n_layers}) | train {a.steps} steps: two passes (s) | packed (s) | "
        "speedup | x floor before -> after | test eval: two passes (s) | packed (s) | speedup | "
        "x floor before -> after | max loss diff | max log-prob diff | verdicts differing |",
        "|" + "---|" * 14,
    ]
    lines += [
        f"| {a.model} | {torch.get_num_threads()} | {r['layer']} | {r['train_old_s']:.2f} | {r['train_new_s']:.2f} | "
        f"{r['train_old_s'] / r['train_new_s']:.2f}x | {r['train_old_ratio']:.2f} -> {r['train_new_ratio']:.2f} | "
        f"{r['eval_old_s']:.2f} | {r['eval_new_s']:.2f} | {r['eval_old_s'] / r['eval_new_s']:.2f}x | "
        f"{r['eval_old_ratio']:.2f} -> {r['eval_new_ratio']:.2f} | {r['loss_diff']:.1e} | {r['logprob_diff']:.1e} | "
        f"{r['flips']} of {len(test)} |"
        for r in rows
    ]
    print("\n".join(lines))
    if not a.no_append:
        results.append(
            results.section(
                "Fine-tuning's teacher-forced passes: two passes (prefixes, then rows on their keys) vs one packed pass",
                lines,
                argv=argv,
                note=(
                    f"Notebook 05's data and batches; each way from its own recorded stream of the original model. "
                    f"'x floor' is seconds over counted GFLOP / peak ({peak:.1f} GFLOP/s, this machine's "
                    "[M, d_model] @ [d_model, d_mlp] best rate), as the notebooks' timings compute it."
                ),
            )
        )
    return rows


if __name__ == "__main__":
    main()
