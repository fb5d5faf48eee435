#!/usr/bin/env python
"""Benchmark: how far notebook 01's Yu head sweep is from the least time its arithmetic
needs on this machine.

The sweep zeroes one head at every position (Yu Sec. 3.2), so for each (head, prompt)
pair the tokens after the shared few-shot prefix must pass through every layer from the
head's own layer up. This counts exactly those token-layers for the pairs notebook 01's
committed run swept (stage 1: every head on ``yu_screen_n`` prompts per setting; stage 2:
the rows of ``01_yu_head_sweep_rows.csv``; the recall check: every head on the
``yu_recall_setting`` prompts), batched as :func:`arithlib.yu.head_sweep.exact_head_sweep`
batches them, and multiplies by the FLOPs of one token through one layer's weight
matrices (2 per multiply-add). That is a lower bound: it leaves out the ablated prefix,
the clean runs, attention scores and the readout. Divided by the best matrix-product
rate measured in the same run on the model's MLP shape (``roofline.measure_peak``), it
gives the fewest seconds any engine could take on these cores; the notebook's measured
section times (``01_timings.csv``) are set beside it.

    python benchmarks/head_sweep_bound.py --model qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402
import roofline  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import arithlib.core.datasets as ds  # noqa: E402
import arithlib.yu.head_sweep as HS  # noqa: E402
import arithlib.zhang.transfer_sets as TS  # noqa: E402
from arithlib.core.models import load_model  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402
from arithlib.engine import common_prefix  # noqa: E402


def layer_macs(cfg) -> int:
    """Multiply-adds of one token through one block's weight matrices (Q, K, V, O and a
    gated MLP's three projections; a plain MLP's two)."""
    d, dh = cfg.d_model, cfg.d_head
    kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
    gated = bool(getattr(cfg, "gated_mlp", False))
    return d * dh * cfg.n_heads * 2 + d * dh * kv * 2 + d * cfg.d_mlp * (3 if gated else 2)


def query_tokens(prompts: PromptSet, batch_size: int = 128) -> list[int]:
    """Per prompt (in order), the tokens the sweep recomputes after its batch's shared
    prefix, batched as ``exact_head_sweep`` batches (by length and few-shot prefix)."""
    q = [0] * len(prompts)
    for batch in prompts.batches(batch_size, by_prefix=True):
        rows = batch.tokens.tolist()
        T = len(rows[0])
        n = min(common_prefix(rows), T - 1)
        for i in batch.index.tolist():
            q[i] = T - n
    return q


def token_layers(prompts: PromptSet, layers: list[int], n_layers: int) -> int:
    """Sum over (head layer l, prompt) pairs of query tokens x (n_layers - l)."""
    q = query_tokens(prompts)
    per_prompt = sum(q)
    return sum(per_prompt * (n_layers - l) for l in layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--figures", default=str(ROOT / "figures"))
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args(argv)
    fig = Path(args.figures) / args.model
    p = json.loads((fig / "01_identify_heads_params.json").read_text())
    params = p.get("params", p)
    torch.set_grad_enabled(False)
    m = load_model(args.model)
    cfg, tok = m.bridge.cfg, m.tokenizer
    L, H = cfg.n_layers, cfg.n_heads
    every_layer = [l for l in range(L) for _ in range(H)]
    seed, fewshot = int(params.get("seed", 0)), int(params["fewshot"])
    records = []
    for n in (1, 2, 3):
        records += ds.yu_prompts(
            params["ops"],
            n_digits=n,
            n_per_template=None if n == 1 else params["yu_multi_per_setting"],
            seed=seed,
            fewshot=fewshot,
            templates=[3],
        )
    yu_ps, _ = TS.build_tolerant(records, tok)
    screen = HS.sample_settings(yu_ps, int(params["yu_screen_n"]), seed)
    parts = {"stage 1 (every head, screen prompts)": token_layers(screen, every_layer, L)}
    rows = pd.read_csv(fig / "01_yu_head_sweep_rows.csv")
    exact = 0
    for (op, nd), g in rows.groupby(["op", "n_digits"]):
        sub = yu_ps.where(op=op, n_digits=int(nd))
        q = query_tokens(sub)
        exact += int(sum(q[int(r.prompt)] * (L - int(r.layer)) for r in g.itertuples()))
    parts["stage 2 (top heads, every prompt)"] = exact
    setting = params.get("yu_recall_setting") or ""
    if setting:
        parts[f"recall check (every head, {setting})"] = token_layers(
            yu_ps.where(op=setting[:-1], n_digits=int(setting[-1])), every_layer, L
        )
    flop_per = 2 * layer_macs(cfg)
    peak, _ = roofline.measure_peak(cfg.d_model, cfg.d_mlp, "cpu", torch.float32)
    timings = pd.read_csv(fig / "01_timings.csv").set_index("section")["wall_s"]
    sweep_parts = {"stage 1 (every head, screen prompts)", "stage 2 (top heads, every prompt)"}  # one timed section
    sweep_s = float(timings.get("5 head sweep", float("nan")))
    recall_s = float(timings.get("5 screen recall", float("nan")))
    table = [
        "| part | token-layers | TFLOP (lower bound) | least seconds at the measured peak | measured seconds "
        "(01_timings.csv) | measured / least |",
        "|---|---|---|---|---|---|",
    ]
    sweep_bound = 0.0
    for name, tl in parts.items():
        tf = tl * flop_per / 1e12
        least = tf / peak
        if name in sweep_parts:
            sweep_bound += least
            cells = ["", ""]
        else:
            cells = [f"{recall_s:,.0f}", f"{recall_s / least:.1f}x"]
        table.append(f"| {name} | {tl:,} | {tf:.1f} | {least:,.0f} | {cells[0]} | {cells[1]} |")
    table.append(
        f"| head sweep section (stages 1 + 2) | | | {sweep_bound:,.0f} | {sweep_s:,.0f} | "
        f"{sweep_s / sweep_bound:.1f}x |"
    )
    runs = pd.read_csv(fig / "timings.csv").set_index("notebook")
    threads = runs.loc["01_identify_heads", "threads"] if "01_identify_heads" in runs.index else "?"
    note = (
        f"{args.model}: {L} layers x {H} heads, {layer_macs(cfg) / 1e6:.1f} M multiply-adds per token and layer; "
        f"peak {peak * 1e3:.0f} GFLOP/s (float32, {torch.get_num_threads()} threads, best of the MLP product at "
        f"256-4096 rows, measured in this run); measured seconds from the committed run of notebook 01 "
        f"({threads} torch thread(s), the cores shared part of the time, so the ratio is an upper bound on the "
        f"engine's overhead). The bound counts only the query tokens through the blocks' weight matrices."
    )
    text = results.section(
        "Yu head sweep: least time its arithmetic needs vs the committed run", table, note=note, argv=argv
    )
    print(text)
    if not args.no_append:
        results.append(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
