"""LoRA per layer, Yu & Ananiadou 2024 Sec. 5: a LoRA adapter on one attention layer trained on
arithmetic (Fig. 2: accuracy per layer, in bands of layers), and CNA on the LoRA models
(Tables 9-10: which deep neurons' coefficients rise). Training runs through
:mod:`arithlib.methods.finetune`.
"""

from __future__ import annotations

import math
import random
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core import datasets as ds
from ..core.components import Neuron
from ..core.papers import YU_BANDS_32, YU_LR_GRID, YU_REFERENCE_LAYER_FRACTION
from ..core.prompt_sets import PromptSet
from ..engine import LayerInputs, clean_param_name, resumable, shared_hf_model
from ..methods.answer_runs import LastPosition, run_weight_variants
from ..methods.finetune import (
    FineTuned,
    Trainable,
    TrainConfig,
    accuracy_row,
    cached_training,
    choose_lr,
    evaluate_weights,
    train_parameters,
    training_key,
)
from ..methods.model_weights import (
    LORA_TARGETS,
    architecture,
    model_shape,
    params_by_clean_name,
    training_state,
    use_weights,
)

if TYPE_CHECKING:
    from ..run.stored import Store


@dataclass(frozen=True)
class LoraSpec:
    """LoRA hyper-parameters (Hu et al. 2021). Yu & Ananiadou do not give r or alpha;
    their Sec. 6.1 LoRA in one layer of Llama-7B adds 0.015 % parameters, i.e. r = 32 on
    q/k/v/o (1.0 M). The default here, r = 16 on q/k/v/o, is the same order of
    magnitude for a 0.5B model (90 k = 0.018 %); ``targets=None`` picks the
    architecture's attention projections (:data:`LORA_TARGETS`)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None


def train_lora(
    model,
    layer: int,
    train_set: PromptSet,
    config: TrainConfig,
    val_set: PromptSet | None = None,
    lora: LoraSpec = LoraSpec(),
    *,
    progress: bool = True,
    cache_dir: str | Path | Store | None = None,
    inputs: LayerInputs | None = None,
    unchanged_below: int | None = None,
    val_inputs: LayerInputs | None = None,
) -> FineTuned:
    """Yu & Ananiadou Sec. 5: LoRA (peft) on the attention projections of block ``layer``
    only (``layers_to_transform=[layer]``), trained on ``train_set``. ``model`` is an HF
    model or a bridge (trained through :func:`shared_hf_model`; base weights untouched).
    Returns the merged weights of the layer's projections (W + scaling * B A).
    ``inputs``, ``unchanged_below``, ``val_inputs``: as in :func:`train_parameters`."""
    from peft import LoraConfig, get_peft_model

    hf = shared_hf_model(model)
    n_layers = model_shape(hf)["n_layers"]
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} out of range 0..{n_layers - 1}")
    arch = architecture(hf)
    targets = lora.targets or LORA_TARGETS.get(arch)
    if targets is None:
        raise NotImplementedError(f"no LoRA target modules known for {arch!r}; pass LoraSpec(targets=...)")
    leaf = sorted({t.split(".")[-1] for t in targets})
    key = {**training_key(hf, "lora", train_set, val_set, config), "layer": layer, "lora": asdict(lora)}

    def build(ckdir: Path | None) -> FineTuned:
        with training_state(hf):  # peft freezes the base weights, unload() does not undo it
            return _train_lora(ckdir)

    def _train_lora(ckdir: Path | None) -> FineTuned:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            peft_cfg = LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=leaf,
                layers_to_transform=[layer],
                bias="none",
            )
            with warnings.catch_warnings():  # peft asks transformers' deprecated alias; nothing to act on here
                warnings.filterwarnings(
                    "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
                )
                pm = get_peft_model(hf, peft_cfg)
        try:
            lora_params = {n: p for n, p in hf.named_parameters() if "lora_" in n}
            if not lora_params:
                raise RuntimeError(f"peft added no LoRA weights to layer {layer} for targets {leaf}")
            trainable = Trainable(lora_params)
            state, record = train_parameters(
                hf,
                trainable,
                train_set,
                config,
                val_set,
                progress=progress,
                desc=f"LoRA L{layer}",
                checkpoint_dir=ckdir,
                inputs=inputs,
                unchanged_below=unchanged_below,
                val_inputs=val_inputs,
            )
            with torch.no_grad():
                for n, v in state.items():
                    lora_params[n].copy_(v.to(lora_params[n].device))
            weights = merged_lora_weights(hf, pm)
            n_trainable = trainable.n_trainable()
        finally:
            pm.unload()
        return FineTuned(
            method=f"lora_L{layer}",
            weights=weights,
            history=record["history"],
            epochs=record["epochs"],
            best_epoch=record["best_epoch"],
            n_trainable=n_trainable,
            samples_per_second=record["samples_per_second"],
            train_seconds=record["train_seconds"],
            n_samples=record["n_samples"],
            config=config,
            info={"layer": layer, "lora_r": lora.r, "lora_alpha": lora.alpha},
        )

    return cached_training(cache_dir, key, build)


def merged_lora_weights(hf, peft_model) -> dict[str, torch.Tensor]:
    """W + delta of every LoRA-wrapped linear layer (what ``merge_and_unload`` writes)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in hf.named_modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            base = module.get_base_layer()
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            clean = clean_param_name(name)
            out[f"{clean}.weight"] = (base.weight.detach() + delta.detach()).cpu().clone()
    return out


def lora_layer_sweep(
    model,
    layers: Sequence[int],
    train_set: PromptSet,
    val_set: PromptSet | None,
    test_set: PromptSet,
    config: TrainConfig,
    lrs: Sequence[float] = YU_LR_GRID,
    lr_layers: Sequence[int] | None = None,
    lora: LoraSpec = LoraSpec(),
    *,
    cache_dir: str | Path | Store | None = None,
    progress: bool = True,
) -> tuple[pd.DataFrame, dict[int, FineTuned], pd.DataFrame]:
    """Yu & Ananiadou Fig. 2: one LoRA model per attention layer in ``layers``, test
    accuracy of each (``correct_full``) beside the original model's (layer -1).

    Learning rate: from ``lrs`` by validation accuracy (Yu: 1e-3 / 5e-4 / 1e-4) for each
    layer in ``lr_layers`` (default: every layer); the other layers reuse the lr chosen
    most often there. One lr without ``val_set``: used as is.
    Returns (per-layer table: layer, lr, accuracy, accuracy on negative / non-negative
    answers, n_trainable, samples/s, best_epoch; the FineTuned per layer; the lr table)."""
    layers = list(layers)
    lr_layers = layers if lr_layers is None else [l for l in lr_layers]
    lr_rows = []
    fitted: dict[int, FineTuned] = {}

    train_inputs = LayerInputs(layers)  # the original's stream entering the LoRA layers, per training batch
    val_inputs = LayerInputs(layers)  # and per validation batch

    def fit_at(layer: int, lr: float) -> FineTuned:
        return train_lora(
            model,
            layer,
            train_set,
            replace(config, lr=lr),
            val_set,
            lora,
            progress=progress,
            cache_dir=cache_dir,
            inputs=train_inputs,
            val_inputs=val_inputs,
        )

    search = len(lrs) > 1 and val_set is not None and len(val_set) > 0
    for layer in tqdm([l for l in layers if l in lr_layers], desc="LoRA lr search", disable=not (progress and search)):
        if search:
            ft, table = choose_lr(
                model, lambda lr: fit_at(layer, lr), lrs, val_set, config.eval_batch_size, val_inputs=val_inputs
            )
            lr_rows.append(table.assign(layer=layer))
            fitted[layer] = ft
    chosen_lrs = pd.concat(lr_rows)[lambda t: t.chosen]["lr"] if lr_rows else pd.Series([lrs[0]])
    default_lr = float(chosen_lrs.mode().iloc[0]) if len(chosen_lrs) else float(lrs[0])
    # deepest first: each run records the stream entering the shallower LoRA layers for the next
    for layer in tqdm(sorted(layers, reverse=True), desc="LoRA per layer", disable=not progress):
        if layer not in fitted:
            fitted[layer] = fit_at(layer, default_lr)
    inputs = {"test": LayerInputs(layers)}  # the original's stream entering each LoRA layer
    base = evaluate_weights(model, None, {"test": test_set}, config.eval_batch_size, inputs=inputs)
    rows = [
        accuracy_row(
            base,
            layer=-1,
            lr=float("nan"),
            n_trainable=0,
            samples_per_second=float("nan"),
            best_epoch=0,
            model="original",
        )
    ]
    for layer in layers:
        ft = fitted[layer]
        frame = evaluate_weights(model, ft.weights, {"test": test_set}, config.eval_batch_size, inputs=inputs)
        rows.append(
            accuracy_row(
                frame,
                layer=layer,
                lr=ft.config.lr,
                n_trainable=ft.n_trainable,
                samples_per_second=ft.samples_per_second,
                best_epoch=ft.best_epoch,
                model=f"LoRA L{layer}",
            )
        )
    lr_table = (
        pd.concat(lr_rows, ignore_index=True)
        if lr_rows
        else pd.DataFrame(
            {"lr": [default_lr], "val_accuracy": [float("nan")], "best_epoch": [0], "chosen": [True], "layer": [-1]}
        )
    )
    return pd.DataFrame(rows), fitted, lr_table


def learning_curve(
    model,
    layer: int,
    train_set: PromptSet,
    eval_set: PromptSet,
    sizes: Sequence[int],
    config: TrainConfig,
    lora: LoraSpec = LoraSpec(),
    *,
    cache_dir: str | Path | Store | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Accuracy of the LoRA model of ``layer`` against the number of training prompts,
    to choose a training-set size (Yu Sec. 5 trains on 18,000 sentences; a CPU run needs
    the smallest size past which more data no longer changes the verdict). For each ``n``
    of ``sizes``, LoRA is trained on the first ``n`` prompts of ``train_set`` (nested
    subsets) with ``config`` (no validation set: every run trains ``config.epochs``
    epochs) and scored on ``eval_set``, which should be the validation split, never the
    test split the verdicts read. Rows: n_train, steps, accuracy with its exact binomial
    95 % interval (low, high), train_seconds, samples_per_second; the first row (n_train
    0) is the original model."""
    from ..core.stats import accuracy_ci

    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1 or sizes[-1] > len(train_set):
        raise ValueError(f"sizes must lie in 1..{len(train_set)} (the training prompts), got {sizes}")
    hf = shared_hf_model(model)
    eval_inputs = {"eval": LayerInputs([layer])}  # every model differs from the original from ``layer`` on
    base = evaluate_weights(hf, None, {"eval": eval_set}, config.eval_batch_size, inputs=eval_inputs)
    ci = accuracy_ci(base.correct_full.to_numpy())
    rows = [
        {
            "n_train": 0,
            "steps": 0,
            "accuracy": ci.estimate,
            "low": ci.low,
            "high": ci.high,
            "train_seconds": 0.0,
            "samples_per_second": float("nan"),
        }
    ]
    for n in tqdm(sizes, desc=f"learning curve L{layer}", disable=not progress):
        ft = train_lora(
            hf, layer, train_set.subset(list(range(n))), config, None, lora, progress=False, cache_dir=cache_dir
        )
        frame = evaluate_weights(hf, ft.weights, {"eval": eval_set}, config.eval_batch_size, inputs=eval_inputs)
        ci = accuracy_ci(frame.correct_full.to_numpy())
        rows.append(
            {
                "n_train": n,
                "steps": len(ft.history),
                "accuracy": ci.estimate,
                "low": ci.low,
                "high": ci.high,
                "train_seconds": ft.train_seconds,
                "samples_per_second": ft.samples_per_second,
            }
        )
    return pd.DataFrame(rows)


def yu_bands(n_layers: int) -> dict[str, list[int]]:
    """Yu's LoRA-layer bands (1-9, 10-16, 17-30 of 32) scaled to ``n_layers``: band edges
    at round(edge / 32 * n_layers); the first and last layer stay outside as in the
    paper. Empty bands are dropped."""
    out = {}
    for name, (lo, hi) in YU_BANDS_32.items():
        a = int(math.floor(lo / 32 * n_layers + 0.5))
        b = int(math.floor(hi / 32 * n_layers + 0.5))
        a, b = max(a, 1 if n_layers > 2 else 0), min(b, n_layers - 1 if n_layers > 2 else n_layers)
        layers = list(range(a, b))
        if layers:
            out[name] = layers
    return out


def reference_layer(n_layers: int) -> int:
    """Yu's reference LoRA layer (9 of 32, Sec. 6.1) scaled to ``n_layers``."""
    return min(n_layers - 1, int(math.floor(YU_REFERENCE_LAYER_FRACTION * n_layers + 0.5)))


def accuracy_bands(frame: pd.DataFrame, bands: Mapping[str, Sequence[int]]) -> pd.DataFrame:
    """Fig. 2's description as numbers: per band of LoRA layers, the mean test accuracy,
    its minimum and maximum, the slope of accuracy vs layer (least squares, accuracy
    points per layer) and the mean gain over the original model (layer -1 row)."""
    base = float(frame.loc[frame.layer == -1, "accuracy"].iloc[0]) if (frame.layer == -1).any() else float("nan")
    rows = []
    for name, layers in bands.items():
        sub = frame[frame.layer.isin(layers)].sort_values("layer")
        if sub.empty:
            continue
        slope = float(np.polyfit(sub.layer, sub.accuracy, 1)[0]) if len(sub) > 1 else float("nan")
        rows.append(
            {
                "band": name,
                "layers": f"{min(layers)}-{max(layers)}",
                "n_models": len(sub),
                "mean_accuracy": float(sub.accuracy.mean()),
                "min_accuracy": float(sub.accuracy.min()),
                "max_accuracy": float(sub.accuracy.max()),
                "slope_per_layer": slope,
                "mean_gain_over_original": float(sub.accuracy.mean()) - base,
            }
        )
    for name, layer in (("first", 0), ("last", int(frame.layer.max()))):
        sub = frame[frame.layer == layer]
        if len(sub) and layer >= 0 and not any(layer in ls for ls in bands.values()):
            rows.append(
                {
                    "band": name,
                    "layers": str(layer),
                    "n_models": 1,
                    "mean_accuracy": float(sub.accuracy.iloc[0]),
                    "min_accuracy": float(sub.accuracy.iloc[0]),
                    "max_accuracy": float(sub.accuracy.iloc[0]),
                    "slope_per_layer": float("nan"),
                    "mean_gain_over_original": float(sub.accuracy.iloc[0]) - base,
                }
            )
    return pd.DataFrame(rows)


def yu_cna_cases(
    tokenizer,
    ops: Sequence[str] = ("+", "-"),
    fewshot: int = 2,
    n_cases: int | None = None,
    seed: int = 0,
    must_include: str = "3+5",
) -> PromptSet:
    """Yu's 1D+ and 1D- cases in the symbolic template "n1 + n2 =" (Table 14, last
    template) with the few-shot prefix; a random ``n_cases`` of them (``seed``), always
    including ``must_include`` ("3+5": Table 9's case)."""
    records = ds.yu_prompts(ops=ops, n_digits=1, n_per_template=None, seed=seed, fewshot=fewshot, templates=[3])
    rng = random.Random(seed)
    a, op, b = re.match(r"(\d+)\s*([+\-*/])\s*(\d+)", must_include).groups()
    first = [r for r in records if (r.op, r.a, r.b) == (op, int(a), int(b))]
    rest = [r for r in records if r not in first]
    rng.shuffle(rest)
    if n_cases is not None:
        rest = rest[: max(0, n_cases - len(first))]
    return PromptSet.build(first + rest, tokenizer)


def _mlp_weight_names(model) -> list[str]:
    return [n for n in params_by_clean_name(model) if ".mlp." in n or n.startswith("lm_head") or "norm.weight" in n]


def _last_position_run(bridge, prompts: PromptSet, weights, batch_size: int):
    from ..methods.answer_runs import run_last_position

    with use_weights(bridge, weights):
        return run_last_position(bridge, prompts, None, capture=("resid_mid", "coef"), batch_size=batch_size)


def _changed_block(weights: Mapping[str, torch.Tensor]) -> int | None:
    """The one decoder block all of ``weights`` lie in, or None (several, or none)."""
    blocks = {m.group(1) for m in (re.match(r"model\.layers\.(\d+)\.", n) for n in weights) if m}
    if len(blocks) != 1 or any(not n.startswith("model.layers.") for n in weights):
        return None
    return int(blocks.pop())


def _model_runs(bridge, cases: PromptSet, models, run_orig: LastPosition, batch_size: int) -> dict:
    """Each model's answer-position run on ``cases``: the models that change one block
    (a LoRA model of one layer) together, each joining at its block from the original's
    stream (:func:`arithlib.methods.answer_runs.run_weight_variants`), the others one full
    run each; the same numbers either way (tested)."""
    blocks = {name: _changed_block(w) for name, w in models.items()} if resumable(bridge) else {}
    one_block = {name: (blocks[name], models[name]) for name in models if blocks.get(name) is not None}
    runs = run_weight_variants(bridge, cases, one_block, run_orig, batch_size=batch_size) if one_block else {}
    runs |= {name: _last_position_run(bridge, cases, w, batch_size) for name, w in models.items() if name not in runs}
    return {name: runs[name] for name in models}


#: Elements of one importance tensor [models, cases, layers, d_mlp] in :func:`lora_cna`'s joint
#: calls (float32: 512 MiB); more models than fit are scored in groups.
_IMPORTANCE_ELEMS = 2**27


def lora_cna(
    bridge,
    cases: PromptSet,
    models: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    ks: Sequence[int] = (50, 30, 20, 10),
    layers: Sequence[int] | None = None,
    mode: str = "auto",
    n_candidates: int = 200,
    batch_size: int = 16,
    progress: bool = True,
    norm_reading: str = "final",
) -> tuple[pd.DataFrame, dict]:
    """Yu & Ananiadou Sec. 5 (Tables 9-10): CNA between each fine-tuned model and the
    original on ``cases`` (target: each case's correct first answer token).

    For model M and case i, every FFN neuron's importance (Sec. 4.1) is computed in M
    and in the original from their own answer-position residual streams
    (``cna.importance_from_runs``; the FFN values, final norm and unembedding are the
    original's, which LoRA in attention leaves unchanged: checked). Top-k neurons per
    case by two rules: ``select="cna"``, the largest importance increase imp_M - imp_orig
    (Yu's CNA between the two models), and ``select="original"``, the most important
    neurons of the original model (independent of M). Neurons are ranked within
    ``layers`` (default ``cna.deep_layers``: Yu's important neurons, Tables 4 and 9, are
    deep FFN neurons). ``norm_reading`` "final": both models' vectors are read with the
    original run's final norm scale (the authors' reading; ``cna_norm.NORM_READINGS``). For each, the coefficient increase
    (%) of those neurons from the original to M, sign-aware:
    100 * sum sign(m0) (m1 - m0) / sum |m0| over cases and neurons (the negative of
    ``cna.coefficient_decrease``). Returns (rows: model, selection, k, coef_increase,
    n_cases, accuracy_original, accuracy_model; details: runs and importances, and
    ``"per_case"``: rows model, selection, k, case, num = sum sign(m0) (m1 - m0), den =
    sum |m0| over the case's top-k neurons, so coef_increase = 100 sum num / sum den
    and the report can bootstrap it over cases)."""
    from . import cna

    names = _mlp_weight_names(bridge)
    for model_name, weights in models.items():
        touched = set(weights) & set(names)
        if touched:
            raise ValueError(
                f"{model_name} changes FFN/unembedding weights ({sorted(touched)[:3]}): lora_cna compares "
                "models that differ in attention only"
            )
    targets = cases.first_answer_ids
    n_layers = int(bridge.cfg.n_layers)
    layers = cna.deep_layers(n_layers) if layers is None else sorted(int(l) for l in layers)
    run_orig = _last_position_run(bridge, cases, None, batch_size)
    orig_imp = cna.importance_from_runs(
        bridge,
        [run_orig],
        targets,
        mode=mode,
        n_candidates=n_candidates,
        select="score",
        layers=layers,
        norm_reading=norm_reading,
    )["importance"][0]
    rows, details = [], {"original": {"run": run_orig, "importance": orig_imp}, "layers": layers}
    per_case: list[dict] = []
    model_runs = _model_runs(bridge, cases, models, run_orig, batch_size)
    joint = joint_importance(
        bridge,
        model_runs,
        run_orig,
        targets,
        mode=mode,
        n_candidates=n_candidates,
        layers=layers,
        norm_reading=norm_reading,
        progress=progress,
    )
    for model_name, (imp_m, imp_o) in joint.items():
        run_m = model_runs[model_name]
        details[model_name] = {"run": run_m, "importance": imp_m, "importance_orig": imp_o}
        _coefficient_rows(rows, per_case, model_name, run_orig, run_m, imp_m - imp_o, orig_imp, ks, len(cases))
    details["per_case"] = pd.DataFrame(per_case, columns=["model", "selection", "k", "case", "num", "den"])
    return pd.DataFrame(rows), details


def joint_importance(
    bridge,
    runs: Mapping[str, LastPosition],
    run_orig: LastPosition,
    targets: torch.Tensor,
    *,
    progress: bool = False,
    **kw,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """CNA importance (Sec. 4.1) of every model in ``runs`` (name -> LastPosition) against
    the original's ``run_orig``, all models in one ``cna.importance_from_runs`` call
    (``select="change"``, the original last; in groups when the importance tensors would
    pass :data:`_IMPORTANCE_ELEMS`), every row read with the original's final scale.
    Returns name -> (importance in the model [N, L, K], in the original at the same
    neurons, NaN elsewhere): what one call per model ``[model, original]`` gives
    (tested). ``kw``: mode, n_candidates, layers, norm_reading."""
    from . import cna

    names = list(runs)
    L, K = run_orig.coef.shape[1], run_orig.coef.shape[2]
    group = max(1, _IMPORTANCE_ELEMS // max(1, len(targets) * L * K) - 1)  # models per joint call
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for g0 in tqdm(range(0, len(names), group), desc="CNA per model group", disable=not progress):
        group_names = names[g0 : g0 + group]
        imp = cna.importance_from_runs(
            bridge,
            [runs[name] for name in group_names] + [run_orig],
            targets,
            select="change",
            scale_from=len(group_names),
            **kw,
        )["importance"]
        for j, name in enumerate(group_names):
            out[name] = (imp[j], torch.where(torch.isfinite(imp[j]), imp[-1], torch.nan))
    return out


def _coefficient_rows(
    rows: list[dict],
    per_case: list[dict],
    model_name: str,
    run_orig,
    run_m,
    change: torch.Tensor,
    orig_imp: torch.Tensor,
    ks: Sequence[int],
    n_cases: int,
) -> None:
    """Table 10's rows of one model (appended to ``rows``) and their per-case parts (to
    ``per_case``): the coefficient increase of each case's top-k neurons by CNA change
    and by the original's importance."""
    from . import cna

    for select, scores in (("cna", change), ("original", orig_imp)):
        for k in ks:
            before, after, cases_with_top = [], [], []
            for i in range(n_cases):
                top = cna.top_neurons(scores[i], k)
                if not top:
                    continue
                cases_with_top.append(i)
                L = torch.tensor([l for l, _ in top])
                N = torch.tensor([n for _, n in top])
                before.append(run_orig.coef[i, L, N])
                after.append(run_m.coef[i, L, N])
            for i, (b0, b1) in zip(cases_with_top, zip(before, after)):  # the ratio's parts per case
                per_case.append(
                    {
                        "model": model_name,
                        "selection": select,
                        "k": k,
                        "case": i,
                        "num": float((torch.sign(b0.float()) * (b1.float() - b0.float())).sum()),
                        "den": float(b0.float().abs().sum()),
                    }
                )
            inc = (-cna.coefficient_decrease(torch.cat(before), torch.cat(after))) if before else float("nan")
            rows.append(
                {
                    "model": model_name,
                    "selection": select,
                    "k": k,
                    "coef_increase": inc,
                    "n_cases": n_cases,
                    "accuracy_original": run_orig.accuracy,
                    "accuracy_model": run_m.accuracy,
                }
            )


def coefficient_table(
    bridge,
    case: PromptSet,
    models: Mapping[str, Mapping[str, torch.Tensor] | None],
    neurons: Sequence[Neuron],
    batch_size: int = 1,
) -> pd.DataFrame:
    """Yu Table 9: the coefficient scores (``mlp.hook_post`` at the answer position) of
    ``neurons`` for one case in each model (name -> weights; None = the original).
    Rows: neuron name ("layer_index"), one column per model."""
    if len(case) != 1:
        raise ValueError("coefficient_table takes a PromptSet with one case")
    table = {"neuron": [f"{l}_{n}" for l, n in neurons], "layer": [l for l, _ in neurons]}
    for name, weights in models.items():
        run = _last_position_run(bridge, case, weights, batch_size)
        table[name] = [float(run.coef[0, l, n]) for l, n in neurons]
    return pd.DataFrame(table)


def band_increase_table(
    rows: pd.DataFrame, layer_of: Mapping[str, int], bands: Mapping[str, Sequence[int]], selection: str = "cna"
) -> pd.DataFrame:
    """Yu Table 10: mean coefficient increase (%) of the top-k neurons over the LoRA
    models of each band of layers, one column per k (``rows`` from :func:`lora_cna`)."""
    sub = rows[rows["selection"] == selection].copy()
    sub["layer"] = sub.model.map(layer_of)
    out = []
    for band, layers in bands.items():
        part = sub[sub.layer.isin(layers)]
        if part.empty:
            continue
        row = {"band": band, "layers": f"{min(layers)}-{max(layers)}", "n_models": part.model.nunique()}
        for k, g in part.groupby("k"):
            row[f"top{k}"] = float(g.coef_increase.mean())
        out.append(row)
    frame = pd.DataFrame(out)
    ks = sorted([c for c in frame.columns if c.startswith("top")], key=lambda c: -int(c[3:]))
    return frame[["band", "layers", "n_models", *ks]] if len(frame) else frame


def curve_shape(frame: pd.DataFrame, bands: Mapping[str, Sequence[int]], tolerance: float = 0.02) -> dict:
    """Yu Fig. 2's claims checked on an accuracy-vs-layer table (:func:`lora_layer_sweep`):
    ``all_above_original`` (every LoRA model beats the original), the best and worst
    layers, band means, ``bands_decreasing`` (each band's mean at most the previous
    one's + ``tolerance``, in shallow -> middle -> deep order), ``slopes`` per band, and
    for the first and last layer their gap to the mean of their two nearest swept
    neighbours (``edge_gaps``; the paper calls layers 0 and 31 "special")."""
    base = float(frame.loc[frame.layer == -1, "accuracy"].iloc[0])
    lora = frame[frame.layer >= 0].sort_values("layer").reset_index(drop=True)
    out: dict = {"original": base, "n_models": len(lora)}
    if lora.empty:
        return out
    out["all_above_original"] = bool((lora.accuracy > base).all())
    out["share_above_original"] = float((lora.accuracy > base).mean())
    best, worst = lora.loc[lora.accuracy.idxmax()], lora.loc[lora.accuracy.idxmin()]
    out.update(
        best_layer=int(best.layer),
        best_accuracy=float(best.accuracy),
        worst_layer=int(worst.layer),
        worst_accuracy=float(worst.accuracy),
    )
    summary = accuracy_bands(frame, bands)
    main = summary[summary.band.isin(list(bands))]
    out["band_means"] = dict(zip(main.band, main.mean_accuracy))
    out["slopes"] = dict(zip(main.band, main.slope_per_layer))
    means = [m for m in main.mean_accuracy]
    out["bands_decreasing"] = bool(len(means) >= 2 and all(b <= a + tolerance for a, b in zip(means, means[1:])))
    gaps = {}
    for pos in (0, len(lora) - 1):
        neighbours = lora.drop(index=pos)
        near = neighbours.iloc[(neighbours.layer - lora.layer[pos]).abs().argsort()[:2]]
        if len(near):
            gaps[int(lora.layer[pos])] = float(lora.accuracy[pos] - near.accuracy.mean())
    out["edge_gaps"] = gaps
    return out
