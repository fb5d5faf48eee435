#!/usr/bin/env python
"""Benchmark: notebook 03's grid pass, the clean answer position of an operand grid with
both correctness criteria, two ways.

* ``literal``: :meth:`arithlib.engine.AnswerPositionRunner.collect` (the answer position's
  activations and full logits) and then :meth:`~arithlib.engine.AnswerPositionRunner.greedy_correct`
  (greedy decoding, one pass per answer token and one more for the stop check, the first of
  them repeating the collected pass).
* ``teacher-forced``: :meth:`~arithlib.engine.AnswerPositionRunner.check_answers`, one pass per
  batch over the last prompt token and the answer's tokens, keeping no logits.

The runners' prefix caches are built before the clock starts (both methods read them).
Checks that the two agree prompt by prompt and on the activations, and appends the row to
benchmarks/RESULTS.md.

    python benchmarks/grid_pass.py --model qwen2.5-coder-0.5b
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

import arithlib.methods.neurons as N  # noqa: E402
import arithlib.nikankin.heuristic_grids as HG  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import AnswerPositionRunner  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name, local dir, or random-<arch> (tiny)")
    ap.add_argument("--op", default="+", choices=["+", "-", "*", "/"])
    ap.add_argument("--operand-max", type=int, default=99, help="operands 0..this (notebook 03: 99)")
    ap.add_argument("--prompts", type=int, default=256, help="grid prompts (seeded subsample)")
    ap.add_argument("--batch-size", type=int, default=64, help="notebook 03's batch size")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    a = ap.parse_args(argv)
    loaded = bench_model.load(a.model)  # on the CPU, in float32
    b = loaded.bridge
    recs = HG.subsample(HG.grid_records(a.op, (0, a.operand_max), fewshot=2), a.prompts, 0)
    grid = PromptSet.build(recs, loaded.tokenizer)
    layers = N.default_layers(b.cfg.n_layers)
    names = [N.post_hook(x) for x in layers] + ["ln_final.hook_scale"]
    with torch.no_grad():  # not torch.set_grad_enabled(False): main() also runs inside the tests
        runner = AnswerPositionRunner(b, grid, batch_size=a.batch_size)

        def literal():
            clean = runner.collect(names)
            return clean, N.correct_first(clean["logits"], grid.first_answer_ids).numpy(), runner.greedy_correct()

        f_lit, t_lit, (clean, first, full) = roofline.measure(literal, a.repeats)
        f_new, t_new, check = roofline.measure(lambda: runner.check_answers(names), a.repeats)
    same = bool((check.correct_first == first).all() and (check.correct_full == full).all())
    diff = max(float((check.acts[n] - clean[n]).abs().max()) for n in names)
    line = (
        f"| {a.model} | cpu ({torch.get_num_threads()} threads) | {len(grid)} x {a.op} | {t_lit:.2f} | {t_new:.2f} | "
        f"{t_lit / t_new:.2f}x | {f_lit / 1e9:.0f} | {f_new / 1e9:.0f} | {'yes' if same else 'NO'} | {diff:.1e} |"
    )
    table = [
        "| model | device | prompts | literal (s) | teacher-forced (s) | speedup | literal GFLOP | "
        "teacher-forced GFLOP | same correctness | max abs activation diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
        line,
    ]
    print("\n".join(table))
    if not a.no_append:
        results.append(results.section("Grid pass (notebook 03): collect + greedy decoding vs teacher forcing", table))
    return {"same": same, "literal_s": t_lit, "fast_s": t_new, "max_diff": diff, "literal_gflop": f_lit / 1e9}


if __name__ == "__main__":
    main()
