#!/usr/bin/env python
"""Benchmark: whole-answer evaluation of a prompt set, greedy decoding step by step
(``arithlib.evaluate.greedy_answers``: one forward call per answer token) against the
one-pass teacher-forced check (``arithlib.evaluate.checked_answers``: the prompt, then
the whole answer in one call). Both share the few-shot prefix; the script checks that
they give the same whole-answer correctness, prints a markdown table and appends it,
with the command, to ``benchmarks/RESULTS.md``.

    .venv/bin/python benchmarks/evaluate.py --model qwen2.5-coder-0.5b --digits 3
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
from arithlib.evaluate import checked_answers, continues_number, greedy_answers  # noqa: E402
from arithlib.models import load_model  # noqa: E402
import results  # noqa: E402


def _correct(prompts: ds.PromptSet, generated: list[list[int]]) -> list[bool]:
    tok = prompts.tokenizer
    return [g[: len(a)] == a and len(g) > len(a) and not continues_number(tok, g[len(a)])
            for g, a in zip(generated, prompts.answer_ids)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--digits", type=int, default=3, help="operand digits of the Yu prompts (answers of up to 2x)")
    ap.add_argument("--n-per-template", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = ap.parse_args()

    loaded = load_model(args.model, device=args.device)
    recs = ds.yu_prompts(n_digits=args.digits, n_per_template=args.n_per_template, seed=0, fewshot=2)
    ps = ds.PromptSet.build(recs, loaded.tokenizer)
    with torch.no_grad():
        checked_answers(loaded.bridge, ps.subset(range(4)), args.batch_size)  # warm-up
        t0 = time.perf_counter()
        _, greedy = greedy_answers(loaded.bridge, ps, 1, args.batch_size)
        t_greedy = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, checked = checked_answers(loaded.bridge, ps, args.batch_size)
        t_checked = time.perf_counter() - t0
    ok_g, ok_c = _correct(ps, greedy), _correct(ps, checked)
    same = sum(a == b for a, b in zip(ok_g, ok_c))
    answer_tokens = sum(map(len, ps.answer_ids)) / len(ps)
    device = f"{args.device} ({torch.get_num_threads()} threads)" if args.device == "cpu" else args.device
    table = results.section("Whole-answer evaluation: step-by-step greedy vs one teacher-forced pass", [
        "| model | device | prompts | mean answer tokens | greedy (s) | teacher-forced (s) | speedup | accuracy | same verdict |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {args.model} | {device} | {len(ps)} (Yu {args.digits}-digit, 2-shot) | {answer_tokens:.1f} | {t_greedy:.1f} | "
        f"{t_checked:.1f} | {t_greedy / t_checked:.1f}x | {sum(ok_c) / len(ps):.0%} | {same} of {len(ps)} |"])
    print(table)
    if same != len(ps):
        raise SystemExit("the two methods disagree on some prompt: not appended")
    if not args.no_append:
        results.append(table)


if __name__ == "__main__":
    main()
