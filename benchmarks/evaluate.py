#!/usr/bin/env python
"""Benchmark: whole-answer evaluation of a prompt set, greedy decoding step by step
(``arithlib.core.evaluate.greedy_answers``: one forward call per answer token) against the
one-pass teacher-forced check (``arithlib.core.evaluate.checked_answers``: the prompt, then
the whole answer in one call). Both share the few-shot prefix. Each is timed with
``roofline.best_time`` (the GPU synchronised around each call) and its FLOPs counted
by ``roofline.counted_flops`` (one extra, untimed call); the table gives GFLOP,
achieved TFLOP/s and the fraction of the FLOP peak (``roofline.flop_peak``). The script
checks that both give the same whole-answer verdict per prompt (in float32 every
prompt; in lower precision near-tied argmaxes may flip a few, ``bench_model.allowed_flips``),
prints a markdown table and appends it, with the command, to
``benchmarks/RESULTS.md``. ``main(argv)`` returns the row as a dict.

On a random-weight model (``random-<arch>[:<shape>]``: the random byte-level tokenizer,
one token per digit) the answers are wrong and the accuracy 0 %, but timings, FLOPs and
the equality of the two verdicts still hold.

    .venv/bin/python benchmarks/evaluate.py --model qwen2.5-coder-0.5b --digits 3
    python benchmarks/evaluate.py --model random-llama:llama3-8b --device cuda --dtype bfloat16
    python benchmarks/evaluate.py --model random-llama --digits 1 --n-per-template 1 --no-append   # tiny check
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

import arithlib.core.datasets as ds  # noqa: E402
from arithlib.core.evaluate import checked_answers, continues_number, greedy_answers  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402


def _correct(prompts: PromptSet, generated: list[list[int]]) -> list[bool]:
    tok = prompts.tokenizer
    return [
        g[: len(a)] == a and len(g) > len(a) and not continues_number(tok, g[len(a)])
        for g, a in zip(generated, prompts.answer_ids)
    ]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--digits", type=int, default=3, help="operand digits of the Yu prompts (answers of up to 2x)")
    ap.add_argument("--n-per-template", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed calls of each method (the best counts)")
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args(argv)

    loaded = bench_model.load(args.model, args.device, args.dtype)
    device, dtype, cfg, b = loaded.device, loaded.dtype, loaded.bridge.cfg, loaded.bridge
    recs = ds.yu_prompts(n_digits=args.digits, n_per_template=args.n_per_template, seed=0, fewshot=2)
    ps = PromptSet.build(recs, loaded.tokenizer)
    if len(ps) == 0:
        raise SystemExit("no prompt left after tokenization")

    def greedy():
        return greedy_answers(b, ps, 1, args.batch_size)[1]

    def checked():
        return checked_answers(b, ps, args.batch_size)[1]

    with torch.no_grad():
        flops_greedy, t_greedy, gen_greedy = roofline.measure(greedy, args.repeats, device)
        flops_checked, t_checked, gen_checked = roofline.measure(checked, args.repeats, device)
    ok_g, ok_c = _correct(ps, gen_greedy), _correct(ps, gen_checked)
    same = sum(x == y for x, y in zip(ok_g, ok_c))
    flips = bench_model.allowed_flips(len(ps), dtype)
    answer_tokens = sum(map(len, ps.answer_ids)) / len(ps)
    peak, source = roofline.flop_peak(device, dtype, cfg.d_model, cfg.d_mlp)
    tf_g, frac_g = roofline.rate(flops_greedy, t_greedy, peak)
    tf_c, frac_c = roofline.rate(flops_checked, t_checked, peak)
    row = {
        "model": args.model,
        "device": roofline.device_label(device),
        "dtype": roofline.dtype_name(dtype),
        "prompts": len(ps),
        "answer_tokens": answer_tokens,
        "greedy_s": t_greedy,
        "checked_s": t_checked,
        "speedup": t_greedy / t_checked,
        "greedy_flops": flops_greedy,
        "checked_flops": flops_checked,
        "greedy_tflops": tf_g,
        "checked_tflops": tf_c,
        "greedy_fraction": frac_g,
        "checked_fraction": frac_c,
        "peak_tflops": peak,
        "peak_source": source,
        "accuracy": sum(ok_c) / len(ps),
        "same_verdicts": same,
        "allowed_flips": flips,
        "same": len(ps) - same <= flips,
    }
    table = results.section(
        "Whole-answer evaluation: step-by-step greedy vs one teacher-forced pass",
        [
            "| model | device | dtype | prompts | mean answer tokens | greedy (s) | teacher-forced (s) | speedup | "
            "greedy GFLOP | teacher-forced GFLOP | greedy TFLOP/s | teacher-forced TFLOP/s | greedy / peak | "
            "teacher-forced / peak | FLOP peak (TFLOP/s) | accuracy | same verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {args.model} | {row['device']} | {row['dtype']} | {len(ps)} (Yu {args.digits}-digit, 2-shot) | "
            f"{answer_tokens:.1f} | {t_greedy:.1f} | {t_checked:.1f} | {row['speedup']:.1f}x | {roofline.num(flops_greedy / 1e9)} | "
            f"{roofline.num(flops_checked / 1e9)} | {roofline.num(tf_g)} | {roofline.num(tf_c)} | {roofline.pct(frac_g)} | {roofline.pct(frac_c)} | "
            f"{roofline.peak_cell(peak, source)} | {row['accuracy']:.0%} | {same} of {len(ps)}"
            + (f" (up to {flips} may differ in {row['dtype']})" if flips else "")
            + " |",
        ],
        argv=argv,
    )
    print(table)
    if not row["same"]:
        raise SystemExit("the two methods disagree on some prompt: not appended")
    if not args.no_append:
        results.append(table)
    return row


if __name__ == "__main__":
    main()
