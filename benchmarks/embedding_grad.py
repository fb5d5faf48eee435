#!/usr/bin/env python
"""Benchmark: full SFT with the embeddings' gradients added into buffers kept for the
training (:func:`arithlib.engine.kept_gradients`), against torch's own backward.

Full SFT (notebook 08) trains every weight, the input embedding and the unembedding
included. torch makes each of their gradients a new ``vocabulary x d_model`` matrix per
step (544 MB each for Qwen2.5's 151,936 tokens; the embedding's as zeros with the batch's
rows added in); the fresh memory is faulted in and zeroed page by page. The library now
gives each one buffer per training, zeroed in place: the embedding sends its rows into it
(torch's ``sparse=True`` backward) and the unembedding adds its product into it. The
baseline, in the same run, is torch's own backward (``kept_gradients`` replaced by a
context that chooses no weight, as before).

On notebook 08's data (Yu's 2-digit prompts with negatives plus word problems, 2-shot;
batch 16, AdamW with weight decay 0.1, clipping at 1): ``--steps`` steps of full SFT
each way, ``--rounds`` times alternately (the first training of a process also pays for
its optimizer's first allocation). The table gives each training's seconds (the
training loop's own, without the copies full SFT makes of the weights before and after),
counted GFLOP, the ratio to the floor at the machine's matrix-product peak
(:func:`arithlib.run.floor.matmul_peak`), minor page faults, and the largest
differences of the losses and trained weights between the two. Appends to
benchmarks/RESULTS.md.

    python benchmarks/embedding_grad.py --model qwen2.5-coder-0.5b
    python benchmarks/embedding_grad.py --model random-qwen2 --steps 2 --rounds 1 --no-append   # code-path check
"""

from __future__ import annotations

import argparse
import resource
import sys
from contextlib import contextmanager
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
import arithlib.zhang.sft as SFT  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import KeptGradients, counted_flops, counting  # noqa: E402
from arithlib.run.floor import matmul_peak  # noqa: E402

KEPT = FT.kept_gradients


@contextmanager
def torch_backward(model, trained):
    """The baseline: no weight chosen, so both embeddings run torch's own backward."""
    yield KeptGradients()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    ap.add_argument("--steps", type=int, default=12, help="full-SFT steps per training")
    ap.add_argument("--rounds", type=int, default=2, help="trainings of each way, alternately")
    bench_model.add_run_arguments(ap)
    a = ap.parse_args(argv)
    with bench_model.torch_threads(a.threads), bench_model.restored(FT, "kept_gradients"):
        return _run(a, argv)


def _run(a: argparse.Namespace, argv: list[str] | None) -> list[dict]:
    loaded = bench_model.load(a.model, a.device, a.dtype)
    hf = FT.shared_hf_model(loaded.bridge)
    tok = loaded.tokenizer
    splits = FD.yu_lora_data(n_train=16 * a.steps, n_test=16, n_val=0, seed=0, fewshot=2)
    words = FD.word_problem_data(8, 8, seed=0)
    train = PromptSet.build(splits["train"], tok) + PromptSet.build(words["train"], tok, drop_unsplittable=True)
    cfg = FT.TrainConfig(lr=4e-6, epochs=1, batch_size=16, weight_decay=0.1, seed=0, max_steps=a.steps)
    d = hf.config
    peak = matmul_peak(d.hidden_size, d.intermediate_size, device=a.device)["gflop_s"]
    ways = {"torch backward": torch_backward, "kept buffers": KEPT}
    runs: list[dict] = []
    first: dict[str, SFT.FineTuned] = {}
    for round_ in range(a.rounds):
        for way, fn in ways.items():
            FT.kept_gradients = fn
            with counting():
                g0, f0 = counted_flops(), _faults()
                res = SFT.full_sft(loaded.bridge, train, cfg, progress=False, check_memory=False)
                gflop, faults = (counted_flops() - g0) / 1e9, _faults() - f0
            runs.append(
                {
                    "round": round_ + 1,
                    "way": way,
                    "seconds": res.train_seconds,
                    "gflop": gflop,
                    "ratio": res.train_seconds / (gflop / peak),
                    "faults": faults,
                }
            )
            if way not in first:
                first[way] = res
            del res
    old, new = first["torch backward"], first["kept buffers"]
    loss_diff = float((torch.tensor(old.history.loss.values) - torch.tensor(new.history.loss.values)).abs().max())
    weight_diff = max(float((old.weights[n] - new.weights[n]).abs().max()) for n in old.weights)
    lines = [
        f"| model | threads | round | way | {a.steps} steps (s) | GFLOP | x floor | minor page faults |",
        "|" + "---|" * 8,
    ]
    lines += [
        f"| {a.model} | {torch.get_num_threads()} | {r['round']} | {r['way']} | {r['seconds']:.2f} | "
        f"{r['gflop']:,.0f} | {r['ratio']:.2f} | {r['faults']:,} |"
        for r in runs
    ]
    print("\n".join(lines))
    print(f"max loss diff {loss_diff:.1e}, max trained-weight diff {weight_diff:.1e}")
    if not a.no_append:
        results.append(
            results.section(
                "Full SFT: the embeddings' gradients into buffers kept for the training vs torch's backward",
                lines,
                argv=argv,
                note=(
                    f"Notebook 08's data and settings ({len(train)} prompts), {a.steps} steps each training. Seconds are "
                    "the training loop's own (FineTuned.train_seconds); 'x floor' is seconds over counted GFLOP / peak "
                    f"({peak:.1f} GFLOP/s, this machine's [M, d_model] @ [d_model, d_mlp] best rate). Between the "
                    f"first training of each way: largest loss difference {loss_diff:.1e}, largest trained-weight "
                    f"difference {weight_diff:.1e}."
                ),
            )
        )
    return runs


if __name__ == "__main__":
    main()
