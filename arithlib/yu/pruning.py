"""Pruning the deep FFN layers to the neurons CNA finds, Yu & Ananiadou 2024 (EMNLP),
Sec. 6.1, Table 11.

The paper's recipe: CNA between the original Llama-7B and its LoRA model of layer 9
on every 1D+, 1D-, 1D* and 1D/ case; the union of each case's top-500 neurons is kept
in the deep FFN layers 17-31 (about 5 % of their neurons), every other neuron of those
layers is pruned; LoRA is added on layer 9 of the pruned model and fine-tuned on the
2-digit training set. Table 11: original 62.9 %, LoRA9 89.3 %, LoRA9 on the pruned
model 82.3 %, LoRA9 on a randomly pruned model with as many neurons 17.1 %.

Pieces
------
The selection is :mod:`arithlib.yu.pruning_selection`'s, the pruned model, its masking form
and its cost :mod:`arithlib.yu.pruned_model`'s; notebook 06's scales, Table 11 and the share
sweep are here.

* **Selection** (:func:`lora_cna_scores`, :func:`union_ranking`): the CNA change
  imp_LoRA - imp_orig (Sec. 4.1, ``arithlib.yu.cna``) of every deep neuron for every
  case; a neuron's *best rank* is its best position in any case's ranking, so the
  union of every case's top-K is exactly the set of neurons with best rank <= K, and
  ordering neurons by best rank (ties: mean rank over cases) gives one nested order
  whose prefixes are those unions. A share of neurons to keep (the paper's 5 %, or a
  sweep) is a prefix of that order; :func:`union_size_curve` gives the union size per
  K. In the two-stage mode of ``arithlib.yu.cna`` only each case's ``n_candidates``
  neurons have an exact score; the rest of that case's ranking follows the stage-1
  (first-order) change, after the exact ones.
* **Real pruning** (:func:`prune_ffn`): a new HF model whose pruned layers have
  smaller MLP matrices (rows of gate/up or fc_in, columns of down or fc_out; biases
  of the input projections sliced); every other tensor is shared with the original
  (no copy). Layers keep different intermediate sizes, which HF's Llama/Qwen2/GPT
  modules execute as they are (the config's ``intermediate_size`` is only read at
  construction). A TransformerBridge booted on such a model runs and its hooks fire
  (each ``hook_post`` has its layer's width), but its stacked weight views
  (``W_in``, ``W_out``) and ``cfg.d_mlp`` assume one width, so ``arithlib.yu.cna``'s
  weight-reading functions do not apply to it; the pruned model is therefore kept as a
  plain HF model and evaluated and fine-tuned through ``arithlib.methods.finetune``
  (``answer_accuracy``, ``train_lora``), the same functions that score the unpruned
  models.
* **Masking form** (:func:`mask_weights`): the same neurons removed by zeroing their
  output columns in the full-size model (for ``model_weights.use_weights``); equal in
  function to the pruned model (tested), equal in size and speed to the original.
* **Cost** (:func:`parameter_counts`, :func:`forward_seconds`): parameter counts
  (total, FFN, deep FFN) and the wall time of a forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.papers import YU_DEEP_NEURONS, YU_TABLE11, YU_TOP_K
from ..core.prompt_sets import PromptSet
from ..engine import LayerInputs, shared_hf_model
from ..methods import finetune as FT
from ..methods import model_weights as MW

if TYPE_CHECKING:
    from ..run.stored import Store
from . import lora as LO
from .pruned_model import Keep, ffn_width, forward_seconds, keep_digest, mask_weights, parameter_counts, prune_ffn
from .pruning_selection import k_of_prefix, keep_from_ranking, n_for_share, random_keep

#: Shares of the deep FFN neurons kept in the sweep.
DEFAULT_SHARES: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2)

#: Sizes of notebook 06 per scale (the data and LoRA settings are notebook 05's,
#: ``scales.FINETUNE_SCALES``). ``cases_per_op``: 1D cases per operator for CNA (None: all 336);
#: ``n_candidates``: exact CNA scores per case in two-stage mode; ``random_seeds``: random
#: prunings at the main share (LoRA-tuned); ``sweep_seeds``: random prunings per share
#: in the sweep; ``sweep_lora``: fine-tune LoRA at every share of the sweep (else the
#: sweep reports the pruned models before fine-tuning, and LoRA only at the main share);
#: ``lr_search``: choose the pruned models' lr from Yu's grid on the validation split
#: (else notebook 05's lr at the reference layer); ``timing_batch`` prompts of one
#: length per timed forward pass, ``timing_repeats`` passes (median). "paper": Yu's
#: setting (all 336 1D cases, lr grid, LoRA at every share), for a GPU. "cpu" (the
#: judged CPU scale, notebook 05's default there): 12 cases per operator, 3 random seeds
#: at 5 % (the report's interval resamples them), the sweep before fine-tuning only (one
#: random seed per share): about 20 evaluations on notebook 05's 385 test sentences and 4
#: LoRA trainings of 32 steps (512 sentences) from the reference layer's recorded stream
#: (the README gives the measured time per model). "quick": a smoke test of every section
#: (seconds on the toy model), never judged.
PRUNING_SCALES: dict[str, dict] = {
    "paper": dict(
        cases_per_op=None,
        n_candidates=1000,
        random_seeds=3,
        sweep_seeds=3,
        sweep_lora=True,
        lr_search=True,
        timing_batch=32,
        timing_repeats=10,
    ),
    "cpu": dict(
        cases_per_op=12,
        n_candidates=300,
        random_seeds=3,
        sweep_seeds=1,
        sweep_lora=False,
        lr_search=False,
        timing_batch=4,
        timing_repeats=5,
    ),
    "quick": dict(
        cases_per_op=8,
        n_candidates=50,
        random_seeds=2,
        sweep_seeds=1,
        sweep_lora=True,
        lr_search=False,
        timing_batch=8,
        timing_repeats=3,
    ),
}
PRUNING_SCALES["cpu-bands"] = PRUNING_SCALES["cpu"]  # 06 trains LoRA on the reference layer only either way


def pruning_scale(scale: str) -> dict:
    """Notebook 06's sizes for a resolved scale name (``scales.scale_settings(...)["scale"]``)."""
    if scale not in PRUNING_SCALES:
        raise ValueError(f"scale must be one of {sorted(PRUNING_SCALES)}, got {scale!r}")
    return dict(PRUNING_SCALES[scale], scale=scale)


def scaled_top_k(n_deep_neurons: int, k: int = YU_TOP_K, reference: int = YU_DEEP_NEURONS) -> int:
    """Yu's per-case top-``k`` scaled to a model with ``n_deep_neurons`` deep FFN neurons
    (the same share of the deep neurons per case: 500 / 165,120 = 0.30 %)."""
    return max(1, int(round(k * n_deep_neurons / reference)))


# --------------------------------------------------------------------------- prune, fine-tune, evaluate


def evaluate_row(
    model,
    weights: Mapping[str, torch.Tensor] | None,
    test_set: PromptSet,
    layers: Sequence[int],
    *,
    tokens: torch.Tensor | None = None,
    repeats: int = 3,
    batch_size: int = 32,
    inputs: Mapping[str, LayerInputs] | None = None,
    unchanged_below: int | None = None,
) -> dict:
    """One row of Table 11 for ``model`` (a bridge or an HF model, pruned or not) with
    ``weights`` swapped in (None: as it is): accuracy on ``test_set`` (whole answer,
    ``answer_loss.answer_accuracy``'s ``correct_full``; also first token, negative /
    non-negative results), parameter counts, and, with ``tokens``, the forward time.
    ``inputs`` / ``unchanged_below``: the original's recorded streams (``"test"``: on
    ``test_set``) and the first block in which ``model`` differs from it
    (``finetune.evaluate_weights``)."""
    hf = shared_hf_model(model)
    frame = FT.evaluate_weights(
        hf, weights, {"test": test_set}, batch_size, inputs=inputs, unchanged_below=unchanged_below
    )
    row = FT.accuracy_row(frame)
    row.update(parameter_counts(hf, layers))
    if tokens is not None:
        with MW.use_weights(hf, weights):
            row.update(forward_seconds(hf, tokens, repeats=repeats))
    return row


def lora_on(
    model,
    layer: int,
    train_set: PromptSet,
    config: FT.TrainConfig,
    *,
    val_set: PromptSet | None = None,
    lrs: Sequence[float] = (),
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | Store | None = None,
    progress: bool = False,
    inputs: LayerInputs | None = None,
    unchanged_below: int | None = None,
    val_inputs: LayerInputs | None = None,
) -> FT.FineTuned:
    """Yu Sec. 6.1's last step: LoRA on attention layer ``layer`` of ``model`` (a pruned
    HF model or the original), trained on ``train_set`` with ``config`` (its lr), or
    with the lr of ``lrs`` that scores best on ``val_set`` (Yu's grid) when more than
    one is given. ``lora.train_lora``; cached under ``cache_dir``; ``inputs``,
    ``unchanged_below`` and ``val_inputs`` as there."""

    def fit(lr: float) -> FT.FineTuned:
        return LO.train_lora(
            model,
            layer,
            train_set,
            replace(config, lr=lr),
            val_set,
            lora,
            progress=progress,
            cache_dir=cache_dir,
            inputs=inputs,
            unchanged_below=unchanged_below,
            val_inputs=val_inputs,
        )

    search = len(lrs) > 1 and val_set is not None and len(val_set) > 0
    return FT.choose_lr(
        model,
        fit,
        list(lrs) if search else [config.lr],
        val_set,
        config.eval_batch_size,
        val_inputs=val_inputs,
        unchanged_below=unchanged_below,
    )[0]


def prune_and_finetune(
    model,
    keep: Keep,
    layer: int,
    train_set: PromptSet,
    test_set: PromptSet,
    config: FT.TrainConfig,
    *,
    fine_tune: bool = True,
    val_set: PromptSet | None = None,
    lrs: Sequence[float] = (),
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | Store | None = None,
    tokens: torch.Tensor | None = None,
    repeats: int = 3,
    batch_size: int = 32,
    progress: bool = False,
    return_model: bool = False,
    inputs: Mapping[str, LayerInputs] | None = None,
):
    """Prune ``model``'s FFN to ``keep`` (:func:`prune_ffn`), evaluate it before
    fine-tuning, add LoRA on ``layer`` and train it (``fine_tune``), evaluate again.
    ``inputs``: ``model``'s recorded streams on ``"train"``, ``"val"`` and ``"test"`` (see
    :func:`table11`); the pruned model equals ``model`` below its first pruned layer.
    Returns one row: n_kept, accuracy_pruned (before LoRA), accuracy / accuracy_first /
    ... after LoRA (NaN without fine-tuning), parameter counts of the pruned model,
    n_lora (trainable LoRA entries), lr, train_seconds, forward time (with ``tokens``);
    with ``return_model`` also the pruned model and the FineTuned (None without
    fine-tuning): ``(row, pruned, fine_tuned)``."""
    layers = sorted(int(l) for l in keep)
    pruned = prune_ffn(model, keep)
    same = dict(inputs=inputs, unchanged_below=min(layers, default=None))  # evaluate_weights reads "test"
    before = FT.accuracy_row(FT.evaluate_weights(pruned, None, {"test": test_set}, batch_size, **same))
    row = {
        "n_kept": sum(int(torch.as_tensor(v).numel()) for v in keep.values()),
        "keep_digest": keep_digest(keep),
        "accuracy_pruned": before["accuracy"],
        "accuracy_first_pruned": before["accuracy_first"],
    }
    row.update(parameter_counts(pruned, layers))
    if tokens is not None:
        row.update(forward_seconds(pruned, tokens, repeats=repeats))
    ft = None
    if fine_tune:
        ft = lora_on(
            pruned,
            layer,
            train_set,
            config,
            val_set=val_set,
            lrs=lrs,
            lora=lora,
            cache_dir=cache_dir,
            progress=progress,
            inputs=(inputs or {}).get("train"),
            unchanged_below=same["unchanged_below"],
            val_inputs=(inputs or {}).get("val"),
        )
        after = FT.accuracy_row(FT.evaluate_weights(pruned, ft.weights, {"test": test_set}, batch_size, **same))
        row.update(after)
        row.update(n_lora=ft.n_trainable, lr=ft.config.lr, train_seconds=ft.train_seconds)
    else:
        row.update(
            {
                k: float("nan")
                for k in (
                    "accuracy",
                    "accuracy_first",
                    "accuracy_negative",
                    "accuracy_nonnegative",
                    "mean_answer_logprob",
                )
            }
        )
        row.update(n_test=len(test_set), n_lora=0, lr=float("nan"), train_seconds=float("nan"))
    if return_model:
        return row, pruned, ft
    return row


def recorded_streams(lora_layer: int, layers: Sequence[int]) -> dict[str, LayerInputs]:
    """Empty :class:`~arithlib.engine.LayerInputs` for the training, validation and test
    sets of :func:`table11` / :func:`share_sweep`: the stream entering the LoRA layer
    (all three) and the first pruned layer (test: the pruned models before LoRA)."""
    return {
        "train": LayerInputs([lora_layer]),
        "val": LayerInputs([lora_layer]),
        "test": LayerInputs([lora_layer, min(layers)]),
    }


def table11(
    model,
    ranking: pd.DataFrame,
    share: float,
    layers: Sequence[int],
    lora_layer: int,
    lora_weights: Mapping[str, torch.Tensor],
    train_set: PromptSet,
    test_set: PromptSet,
    config: FT.TrainConfig,
    *,
    random_seeds: Sequence[int] = (0, 1, 2),
    lrs: Sequence[float] = (),
    val_set: PromptSet | None = None,
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | Store | None = None,
    tokens: torch.Tensor | None = None,
    repeats: int = 3,
    batch_size: int = 32,
    n_lora_reference: int = 0,
    progress: bool = True,
    inputs: Mapping[str, LayerInputs] | None = None,
) -> tuple[pd.DataFrame, dict[str, dict[int, torch.Tensor]]]:
    """Yu Table 11 with costs: rows "original", "LoRA" (``lora_weights`` on the unpruned
    model), "LoRA on CNA-pruned" (the first ``share`` of the deep neurons in
    ``ranking``'s union order kept, really pruned, LoRA added on ``lora_layer`` and
    trained), "LoRA on CNA-masked" (the same neurons and LoRA weights in the full-size
    model with the others' output columns zeroed: equal accuracy, no savings) and
    "LoRA on random-pruned" once per seed of ``random_seeds`` (as many neurons drawn
    uniformly from ``layers``). Columns: model, selection, seed, share, n_kept, k,
    accuracy (whole answer), accuracy_first, accuracy_pruned (the pruned model before
    LoRA), parameter counts, n_lora, forward_s / forward_min_s (timed for all but the
    random seeds after the first: same shapes), speedup (the original's fastest pass over
    the model's), paper (Yu's %). Also returns the keep sets by name.

    Every model here equals ``model`` below ``lora_layer`` or below the first pruned
    layer, so each evaluation and training pass starts at one of those blocks from the
    stream recorded by the first pass that computes it (``inputs``: a
    :class:`~arithlib.engine.LayerInputs` for ``"train"``, ``"val"`` and ``"test"``, made
    here when None); the numbers are those of full passes."""
    widths = {int(l): ffn_width(model, l) for l in layers}
    pool = sum(widths.values())
    n = n_for_share(share, pool)
    k = k_of_prefix(ranking, n)
    inputs = inputs if inputs is not None else recorded_streams(lora_layer, layers)
    common = dict(
        val_set=val_set, lrs=lrs, lora=lora, cache_dir=cache_dir, repeats=repeats, batch_size=batch_size, inputs=inputs
    )
    rows = []
    jobs = ["original", "LoRA", "cna", *[("random", int(s)) for s in random_seeds]]
    keeps: dict[str, dict[int, torch.Tensor]] = {}
    for job in tqdm(jobs, desc="Table 11", disable=not progress):
        if job in ("original", "LoRA"):
            w = None if job == "original" else lora_weights
            row = evaluate_row(
                model, w, test_set, layers, tokens=tokens, repeats=repeats, batch_size=batch_size, inputs=inputs
            )
            rows.append(
                {
                    "model": job,
                    "selection": "none",
                    "seed": -1,
                    "share": 1.0,
                    "n_kept": pool,
                    "k": np.nan,
                    "accuracy_pruned": np.nan,
                    "n_lora": n_lora_reference if w else 0,
                    **row,
                    "paper": YU_TABLE11[job],
                }
            )
        elif job == "cna":
            keep = keep_from_ranking(ranking, n, layers)
            keeps["cna"] = keep
            row, pruned, ft = prune_and_finetune(
                model, keep, lora_layer, train_set, test_set, config, tokens=tokens, return_model=True, **common
            )
            rows.append(
                {
                    "model": "LoRA on CNA-pruned",
                    "selection": "cna",
                    "seed": -1,
                    "share": share,
                    "k": k,
                    **row,
                    "paper": YU_TABLE11["LoRA on CNA-pruned"],
                }
            )
            masked = {**mask_weights(model, keep), **ft.weights}
            mrow = evaluate_row(
                model, masked, test_set, layers, tokens=tokens, repeats=repeats, batch_size=batch_size, inputs=inputs
            )
            mrow["n_deep_neurons"] = row["n_deep_neurons"]  # zeroed neurons are not neurons any more
            rows.append(
                {
                    "model": "LoRA on CNA-masked",
                    "selection": "cna (masked)",
                    "seed": -1,
                    "share": share,
                    "n_kept": row["n_kept"],
                    "k": k,
                    "accuracy_pruned": row["accuracy_pruned"],
                    "n_lora": row["n_lora"],
                    "lr": row["lr"],
                    **mrow,
                    "paper": np.nan,
                }
            )
            del pruned
        else:
            seed = job[1]
            keep = random_keep(layers, widths, n, seed=seed)
            keeps[f"random seed {seed}"] = keep
            first = seed == int(random_seeds[0])
            row = prune_and_finetune(
                model, keep, lora_layer, train_set, test_set, config, tokens=tokens if first else None, **common
            )
            rows.append(
                {
                    "model": "LoRA on random-pruned",
                    "selection": "random",
                    "seed": seed,
                    "share": share,
                    "k": np.nan,
                    **row,
                    "paper": YU_TABLE11["LoRA on random-pruned"],
                }
            )
    table = pd.DataFrame(rows)
    base = table.loc[table.model == "original"].iloc[0]
    table["deep_ffn_share"] = table.n_deep_ffn_params / base.n_deep_ffn_params
    table["params_share"] = table.n_params / base.n_params
    table["lora_share"] = table.n_lora / base.n_params
    if "forward_min_s" in table:  # the fastest pass: the one least slowed by other work on the machine
        table["speedup"] = base.forward_min_s / table.forward_min_s
    return table, keeps


def share_sweep(
    model,
    ranking: pd.DataFrame,
    shares: Sequence[float],
    layers: Sequence[int],
    lora_layer: int,
    train_set: PromptSet,
    test_set: PromptSet,
    config: FT.TrainConfig,
    *,
    random_seeds: Sequence[int] = (0,),
    fine_tune: bool | Sequence[float] = True,
    lrs: Sequence[float] = (),
    val_set: PromptSet | None = None,
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | Store | None = None,
    batch_size: int = 32,
    progress: bool = True,
    inputs: Mapping[str, LayerInputs] | None = None,
) -> tuple[pd.DataFrame, dict[tuple, dict[int, torch.Tensor]]]:
    """Table 11 and its sweep: for each share of the deep neurons kept, the CNA union
    prefix of that size (:func:`keep_from_ranking`) and, for each of ``random_seeds``,
    as many neurons drawn uniformly from the same layers (:func:`random_keep`); each
    pruned (:func:`prune_ffn`), evaluated, LoRA-tuned on ``lora_layer`` and evaluated
    (``fine_tune`` True / False, or the shares at which to tune). Rows: selection
    ("cna" / "random"), seed, share, n_kept, k (CNA: the per-case top-K the prefix
    reaches) and :func:`prune_and_finetune`'s columns. Also returns the keep sets by
    (selection, share, seed). ``inputs``: as in :func:`table11`."""
    widths = {l: ffn_width(model, l) for l in layers}
    inputs = inputs if inputs is not None else recorded_streams(lora_layer, layers)
    pool = sum(widths.values())
    rows, keeps = [], {}
    jobs = []
    for share in shares:
        n = n_for_share(share, pool)
        jobs.append(("cna", share, -1, keep_from_ranking(ranking, n, layers), k_of_prefix(ranking, n)))
        for s in random_seeds:
            jobs.append(("random", share, int(s), random_keep(layers, widths, n, seed=int(s)), np.nan))
    tune_at = set(shares) if fine_tune is True else set() if fine_tune is False else set(fine_tune)
    for selection, share, seed, keep, k in tqdm(jobs, desc="prune + LoRA", disable=not progress):
        keeps[(selection, share, seed)] = keep
        row = prune_and_finetune(
            model,
            keep,
            lora_layer,
            train_set,
            test_set,
            config,
            fine_tune=share in tune_at,
            val_set=val_set,
            lrs=lrs,
            lora=lora,
            cache_dir=cache_dir,
            batch_size=batch_size,
            inputs=inputs,
        )
        rows.append({"selection": selection, "seed": seed, "share": share, "k": k, **row})
    return pd.DataFrame(rows), keeps


def summarize_sweep(sweep: pd.DataFrame) -> pd.DataFrame:
    """Mean, standard deviation and count over seeds of the accuracies, per selection and share."""
    g = sweep.groupby(["selection", "share"])
    out = g.agg(
        n_kept=("n_kept", "first"),
        n_seeds=("seed", "count"),
        accuracy_pruned=("accuracy_pruned", "mean"),
        accuracy_pruned_sd=("accuracy_pruned", "std"),
        accuracy=("accuracy", "mean"),
        accuracy_sd=("accuracy", "std"),
        n_params=("n_params", "first"),
        n_deep_ffn_params=("n_deep_ffn_params", "first"),
    ).reset_index()
    return out.sort_values(["selection", "share"]).reset_index(drop=True)
