#!/usr/bin/env python
"""The measured learning curve behind notebook 05's "cpu" training size: validation
accuracy of the LoRA model of Yu's reference layer against the number of training
prompts (``lora.learning_curve``), on Yu's 2-digit data with negative results
(notebook 05's split, 2-shot prefix). Prints the table and writes it as CSV.

    python scripts/lora_learning_curve.py --model smollm2-135m --sizes 64 128 256 512

The validation split is the one notebook 05 chooses the learning rate on; the test split
(what the report judges) is never read here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import arithlib.methods.finetune as FT  # noqa: E402
import arithlib.methods.finetune_data as FD  # noqa: E402
import arithlib.run.scales as SC  # noqa: E402
import arithlib.yu.lora as LO  # noqa: E402
from arithlib.core import papers  # noqa: E402
from arithlib.core.models import load_model  # noqa: E402
from arithlib.core.prompt_sets import PromptSet  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--n-val", type=int, default=SC.FINETUNE_SCALES["cpu"]["n_val"])
    ap.add_argument("--lr", type=float, default=papers.YU_LR_GRID[0])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--layer", type=int, default=None, help="LoRA layer (default: Yu's reference layer, scaled)")
    ap.add_argument("--fewshot", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="CSV path (default: /tmp/lora_learning_curve_<model>.csv)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    m = load_model(a.model)
    n_layers = m.info.n_layers
    layer = LO.reference_layer(n_layers) if a.layer is None else a.layer
    s = SC.FINETUNE_SCALES["cpu"]
    splits = FD.yu_lora_data(n_train=max(a.sizes), n_test=s["n_test"], n_val=a.n_val, seed=0, fewshot=a.fewshot)
    train, val = (PromptSet.build(splits[k], m.tokenizer) for k in ("train", "val"))
    cfg = FT.TrainConfig(lr=a.lr, epochs=a.epochs, batch_size=a.batch_size, seed=0)
    t0 = time.time()
    curve = LO.learning_curve(m.bridge, layer, train, val, a.sizes, cfg)
    print(
        f"{a.model}: LoRA layer {layer} of {n_layers}, lr {a.lr:g}, {a.epochs} epoch(s), batch {a.batch_size}, "
        f"{len(val)} validation prompts, {a.threads} thread(s), {time.time() - t0:.0f} s"
    )
    print(curve.to_string(index=False))
    out = Path(a.out or f"/tmp/lora_learning_curve_{a.model}.csv")
    curve.to_csv(out, index=False)
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
