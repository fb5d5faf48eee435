"""Precise SFT, Zhang et al. 2024 Sec. 5: fine-tune only the key heads' slices of W_Q, W_K,
W_V, W_O found by path patching (:func:`rank_components` reads notebook 01's table), against
full SFT of every parameter, on the same data and budget; and the general-ability check
of each result (:func:`evaluate_method`). Training runs through :mod:`arithlib.methods.finetune`.

Grouped-query attention
-----------------------
Zhang's head (i, j) owns four slices: rows of W_Q, W_K, W_V (d_head x d each) and
columns of W_O. With GQA (Qwen2: 14 query heads share 2 KV heads, 7 per group) a query
head has no K/V of its own; here a head's K/V slice is **the K/V rows of the KV group
it reads** (``kv="group"``): selecting any head of a group trains that group's K/V
rows, which all 7 heads of the group read, and a group shared by several selected heads
is counted once. ``kv="none"`` trains only the Q and O slices. Biases of the selected
rows (Qwen2 has q/k/v biases) are trained with them. The gradient of a layer's slices
is multiplied by H/h (H heads in the layer, h of them selected), Zhang's rescaling
(following Yu et al. 2023). Under Adam that factor cancels (Adam divides by the
gradient's running RMS) except against ``eps``; with ``optimizer="sgd"`` (Alg. 2's
literal update) it scales the step. Whole MLPs can be added (Zhang's Table 2/5); they
are trained unscaled. Weight decay touches only the trained entries.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from ..core.components import Head
from ..core.papers import KEY_HEAD_THRESHOLD, ZHANG_TOTAL_HEADS
from ..core.prompt_sets import PromptSet
from ..core.stats import encode_correct
from ..engine import LayerInputs, shared_hf_model
from ..engine import hf_module as _hf
from ..methods.finetune import (
    FineTuned,
    Trainable,
    TrainConfig,
    available_memory,
    cached_training,
    evaluate_weights,
    release_free_memory,
    train_parameters,
    training_key,
)
from ..methods.model_weights import (
    ATTENTION_PROJECTIONS,
    architecture,
    count_parameters,
    layer_prefix,
    model_shape,
    params_by_clean_name,
    use_weights,
)
from ..run.outputs import find_table, read_table

if TYPE_CHECKING:
    from ..run.stored import Store


def rank_components(
    path: str | Path | pd.DataFrame, threshold: float = KEY_HEAD_THRESHOLD
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Heads and MLPs ranked by Zhang's path-patching effect (notebook 01's
    ``01_path_patching.csv``: layer, head, op, effect, and ``kind`` "head"/"mlp" or
    head = -1 for MLPs): mean of the per-operator mean effects (rows with op "all",
    pooled over operators, are left out), most negative first. Heads get a
    ``key`` flag (mean effect < ``threshold``, Zhang's -5 %). Raises FileNotFoundError
    telling the user to run notebook 01 when the file is missing."""
    if isinstance(path, pd.DataFrame):
        frame = path
    else:
        found = find_table(path)  # .csv or .csv.gz
        if found is None:
            raise FileNotFoundError(
                f"{path} not found. Precise SFT tunes the key heads found by Zhang's path patching in notebook 01; "
                "run notebook 01 (notebooks/01_identify_heads.ipynb) with the same model and out_dir first (it writes "
                "01_path_patching.csv next to this notebook's outputs)."
            )
        frame = read_table(found)
    need = {"layer", "head", "effect"}
    if need - set(frame.columns):
        raise ValueError(f"{path}: path-patching table lacks columns {sorted(need - set(frame.columns))}")
    op_col = "op" if "op" in frame.columns else None
    if op_col and (frame[op_col] != "all").any():
        frame = frame[frame[op_col] != "all"]  # notebook 01 adds rows pooled over operators (op "all")
    if "kind" in frame.columns:
        is_head = frame["kind"].astype(str).str.lower() == "head"
        is_mlp = frame["kind"].astype(str).str.lower() == "mlp"
    else:
        heads_col = pd.to_numeric(frame["head"], errors="coerce")
        is_head = heads_col >= 0
        is_mlp = heads_col.isna() | (heads_col < 0)

    def rank(part: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
        if part.empty:
            return pd.DataFrame(columns=keys + ["effect", "n_ops"])
        if op_col:
            per_op = part.groupby(keys + [op_col])["effect"].mean().reset_index()
            g = per_op.groupby(keys)["effect"]
            out = g.mean().reset_index().merge(g.size().rename("n_ops").reset_index(), on=keys)
        else:
            out = part.groupby(keys)["effect"].mean().reset_index().assign(n_ops=1)
        out = out.sort_values(["effect"] + keys).reset_index(drop=True)
        out["rank"] = np.arange(1, len(out) + 1)
        return out

    heads = rank(
        frame[is_head].assign(layer=lambda f: f.layer.astype(int), head=lambda f: f["head"].astype(int)),
        ["layer", "head"],
    )
    heads["key"] = heads["effect"] < threshold
    mlps = rank(frame[is_mlp].assign(layer=lambda f: f.layer.astype(int)), ["layer"])
    return heads, mlps


def scaled_head_counts(
    counts: Sequence[int], total_heads: int, reference_total: int = ZHANG_TOTAL_HEADS
) -> dict[int, int]:
    """Zhang's head counts (out of LLaMA2-7B's 1024 heads) scaled to a model with
    ``total_heads`` heads, keeping the fraction: k -> max(1, round_half_up(k * total /
    1024)). Returns {paper count: scaled count}."""
    return {k: max(1, int(math.floor(k * total_heads / reference_total + 0.5))) for k in counts}


def head_slices(
    model, heads: Sequence[Head], kv: str = "group"
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict]:
    """Masks over the attention weights that precise SFT trains (Zhang Alg. 2) for
    ``heads`` (layer, head): per parameter (clean name) a 0/1 mask of its shape, the
    per-layer gradient factor H/h, and counts. Q: the head's d_head rows of W_Q (and
    of its bias); O: its d_head columns of W_O; K and V: with ``kv="group"`` the rows
    of the KV group the head reads (GQA; its own rows without GQA), with ``"none"``
    none. Separate q/k/v/o projections only (Llama, Mistral, Qwen2, GPT-J)."""
    if kv not in ("group", "none"):
        raise ValueError("kv must be 'group' or 'none'")
    hf = _hf(model)
    arch = architecture(hf)
    if arch not in ATTENTION_PROJECTIONS:
        raise NotImplementedError(f"precise SFT needs separate q/k/v/o projections; {arch!r} fuses them")
    shape = model_shape(hf)
    H, Hkv, dh = shape["n_heads"], shape["n_kv_heads"], shape["d_head"]
    group = H // Hkv
    params = params_by_clean_name(hf)
    q, k, v, o = ATTENTION_PROJECTIONS[arch]
    by_layer: dict[int, set[int]] = {}
    for layer, head in heads:
        if not (0 <= layer < shape["n_layers"] and 0 <= head < H):
            raise ValueError(f"head ({layer}, {head}) out of range ({shape['n_layers']} layers x {H} heads)")
        by_layer.setdefault(int(layer), set()).add(int(head))
    masks: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    n_q = n_kv = 0
    for layer, hs in sorted(by_layer.items()):
        pre = layer_prefix(hf, layer)
        factor = H / len(hs)
        groups = sorted({h // group for h in hs})
        for proj, units, size in ((q, sorted(hs), dh), (k, groups, dh), (v, groups, dh), (o, sorted(hs), dh)):
            if kv == "none" and proj in (k, v):
                continue
            for suffix in ("weight", "bias"):
                name = f"{pre}{proj}.{suffix}"
                if name not in params:
                    continue
                p = params[name]
                m = torch.zeros(p.shape, dtype=torch.bool)
                for u in units:
                    sl = slice(u * size, (u + 1) * size)
                    if proj == o and suffix == "weight":
                        m[:, sl] = True
                    elif proj == o:
                        continue  # the output bias is shared by all heads: not a head's
                    else:
                        m[sl] = True
                if m.any():
                    masks[name] = m
                    scales[name] = factor
        n_q += len(hs)
        n_kv += len(groups) if kv == "group" else 0
    return masks, scales, {"n_heads": len(heads), "n_layers_touched": len(by_layer), "n_kv_groups": n_kv}


def mlp_parameters(model, layers: Sequence[int]) -> list[str]:
    """Clean names of every parameter of the MLPs of ``layers``."""
    hf = _hf(model)
    names = []
    for layer in layers:
        pre = layer_prefix(hf, layer)
        found = [n for n in params_by_clean_name(hf) if n.startswith(pre) and (".mlp." in n[len(pre) - 1 :])]
        if not found:
            raise NotImplementedError(f"no '.mlp.' parameters in block {layer} of {type(hf).__name__}")
        names.extend(found)
    return names


def precise_sft(
    model,
    heads: Sequence[Head],
    train_set: PromptSet,
    config: TrainConfig,
    val_set: PromptSet | None = None,
    mlps: Sequence[int] = (),
    kv: str = "group",
    rescale: bool = True,
    *,
    progress: bool = True,
    cache_dir: str | Path | Store | None = None,
    inputs: LayerInputs | None = None,
) -> FineTuned:
    """Zhang et al. Alg. 2: train only the Q/K/V/O slices of ``heads`` (see
    :func:`head_slices` for GQA), their gradients multiplied by H/h per layer
    (``rescale``), plus every parameter of the MLPs of layers ``mlps``. The model's
    weights are restored afterwards; the trained ones are returned. ``inputs``: as in
    :func:`train_parameters`."""
    hf = shared_hf_model(model)
    masks, scales, counts = head_slices(hf, heads, kv)
    if not rescale:
        scales = {}
    mlp_names = mlp_parameters(hf, mlps) if mlps else []
    params = params_by_clean_name(hf)
    chosen = {n: params[n] for n in list(masks) + mlp_names}
    if not chosen:
        raise ValueError("precise SFT needs at least one head or MLP")
    key = {
        **training_key(hf, "precise", train_set, val_set, config),
        "heads": sorted(map(list, heads)),
        "mlps": sorted(mlps),
        "kv": kv,
        "rescale": rescale,
    }

    def build(ckdir: Path | None) -> FineTuned:
        backup = {n: p.detach().clone() for n, p in chosen.items()}
        trainable = Trainable(chosen, masks=masks, scales=scales)
        try:
            state, record = train_parameters(
                hf,
                trainable,
                train_set,
                config,
                val_set,
                progress=progress,
                desc=f"precise SFT {len(heads)}h+{len(mlps)}mlp",
                checkpoint_dir=ckdir,
                inputs=inputs,
            )
        finally:
            with torch.no_grad():
                for n, v in backup.items():
                    chosen[n].copy_(v)
        return FineTuned(
            method=f"precise_{len(heads)}h_{len(mlps)}mlp",
            weights=state,
            history=record["history"],
            epochs=record["epochs"],
            best_epoch=record["best_epoch"],
            n_trainable=trainable.n_trainable(),
            samples_per_second=record["samples_per_second"],
            train_seconds=record["train_seconds"],
            n_samples=record["n_samples"],
            config=config,
            info={
                "n_heads": len(heads),
                "n_mlps": len(mlps),
                "kv": kv,
                "n_layers_touched": counts["n_layers_touched"],
                "n_kv_groups": counts["n_kv_groups"],
            },
        )

    return cached_training(cache_dir, key, build)


def precise_param_count(model, heads: Sequence[Head], mlps: Sequence[int] = (), kv: str = "group") -> int:
    """Number of weights precise SFT trains for ``heads`` and ``mlps`` (without training)."""
    hf = _hf(model)
    masks, _, _ = head_slices(hf, heads, kv)
    params = params_by_clean_name(hf)
    return int(sum(int(m.sum()) for m in masks.values())) + sum(params[n].numel() for n in mlp_parameters(hf, mlps))


def full_sft_memory(model, optimizer: str = "adamw") -> int:
    """Extra bytes full SFT allocates on top of the model: gradients plus, for AdamW, its
    two moment estimates (one copy of every weight each), plus 10 % slack. The original
    weights wait on disk meanwhile, and the trained copy is made after the optimizer is
    gone."""
    hf = _hf(model)
    nbytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in hf.parameters()}.values())
    copies = 3 if optimizer == "adamw" else 1
    return int(1.1 * copies * nbytes)


def full_sft(
    model,
    train_set: PromptSet,
    config: TrainConfig,
    val_set: PromptSet | None = None,
    *,
    progress: bool = True,
    check_memory: bool = True,
    cache_dir: str | Path | Store | None = None,
) -> FineTuned:
    """Full SFT, Zhang's comparison: every parameter trained with the same loop, the
    last epoch's weights kept (Zhang trains a fixed 2 epochs). Like the other methods
    it returns the trained weights (every parameter, clean HF names) and leaves the
    model as it was (the original weights wait in a temporary file while it trains), so
    several learning rates can be tried on one model (:func:`choose_lr`). Memory:
    :func:`full_sft_memory`; with ``check_memory`` a MemoryError says so before training
    when the machine has less available after :func:`release_free_memory` (a process
    killed for memory half-way through says nothing). Cached under ``cache_dir`` like
    the others (one copy of the model per key; a cached result needs no check)."""
    hf = shared_hf_model(model)
    params = params_by_clean_name(hf)
    # the embeddings' gradients go into kept buffers (arithlib.engine.gradients), which sum a
    # repeated token's rows in another order than torch's backward of earlier results
    key = {**training_key(hf, "full", train_set, val_set, config), "vocab_grads": "kept"}

    def build(_ckdir: Path | None) -> FineTuned:  # no per-epoch checkpoints: each would hold AdamW's two moments
        if check_memory:
            release_free_memory()
            need, have = full_sft_memory(hf, config.optimizer), available_memory()
            if have is not None and need > have:
                raise MemoryError(
                    f"full SFT needs about {need / 2**30:.1f} GiB more memory (gradients"
                    f"{' and AdamW moments' if config.optimizer == 'adamw' else ''}) but {have / 2**30:.1f} GiB are "
                    "available; free memory, use a larger machine or a GPU, or pass check_memory=False to try anyway."
                )
        with tempfile.TemporaryDirectory(prefix="arithlib-full-sft-") as tmp:
            original = Path(tmp) / "original.pt"
            torch.save({n: p.detach() for n, p in params.items()}, original)
            try:
                _, record = train_parameters(
                    hf,
                    Trainable(params),
                    train_set,
                    config,
                    val_set,
                    progress=progress,
                    desc="full SFT",
                    keep_state=False,
                )
                weights = {n: p.detach().cpu().clone() for n, p in params.items()}
            finally:
                saved = torch.load(original, map_location="cpu", mmap=True, weights_only=True)
                with torch.no_grad():
                    for n, v in saved.items():
                        params[n].copy_(v)
                del saved
        return FineTuned(
            method="full_sft",
            weights=weights,
            history=record["history"],
            epochs=record["epochs"],
            best_epoch=record["best_epoch"],
            n_trainable=count_parameters(hf),
            samples_per_second=record["samples_per_second"],
            train_seconds=record["train_seconds"],
            n_samples=record["n_samples"],
            config=config,
            info={},
        )

    return cached_training(cache_dir, key, build)


def evaluate_method(
    model,
    tokenizer,
    weights: Mapping[str, torch.Tensor] | None,
    math_sets: Mapping[str, PromptSet],
    prose=None,
    facts=None,
    *,
    chunk_tokens: int = 128,
    max_chunks: int | None = 4,
    benchmarks: Mapping[str, str | Path | None] | None = None,
    batch_size: int = 32,
    inputs: Mapping[str, LayerInputs] | None = None,
) -> dict:
    """One row of Zhang's Table 1/2 for a model (``weights`` swapped into ``model``;
    None = as it is): ``correct_full`` accuracy on each of ``math_sets`` (column =
    set name) and the general-ability numbers of
    :func:`arithlib.methods.general_ability.general_ability` (LM loss on the prose sample,
    factual recall, and GSM8K/SVAMP/MMLU when ``benchmarks`` gives their paths), with
    each math set's per-prompt correctness (``<set>_by_prompt``) and each fact's
    (``facts_by_prompt``) as ``stats.encode_correct`` cells.
    ``inputs``: a :class:`~arithlib.engine.LayerInputs` per math set, recorded
    from ``model`` as it is (pass none once ``model`` itself has changed, e.g. after
    :func:`full_sft`): the math sets' passes start at the first block ``weights``
    change (:func:`evaluate_weights`)."""
    from ..methods import general_ability as ga

    hf = shared_hf_model(model)
    row: dict = {}
    frame = evaluate_weights(hf, weights, math_sets, batch_size, inputs=inputs)
    for name, ps in math_sets.items():
        part = frame.loc[frame.set == name, "correct_full"] if len(frame) else pd.Series(dtype=bool)
        row[name] = float(part.mean()) if len(ps) else float("nan")
        # per prompt, in the set's order: the paired intervals of the report (zhang_precise_sft)
        row[f"{name}_by_prompt"] = encode_correct(part.to_numpy()) if len(ps) else ""
    with use_weights(hf, weights):
        bench = dict(benchmarks or {})
        row.update(
            ga.general_ability(
                hf,
                tokenizer,
                prose,
                facts,
                chunk_tokens=chunk_tokens,
                max_chunks=max_chunks,
                gsm8k=bench.get("gsm8k"),
                svamp=bench.get("svamp"),
                mmlu=bench.get("mmlu"),
                per_item=True,
            )
        )
    return row
