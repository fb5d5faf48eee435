"""Figures of notebook 05 (LoRA mechanism and precise fine-tuning). Each function takes
the table the notebook also saves as CSV and returns a matplotlib Figure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

sns.set_theme(context="notebook", style="whitegrid")

_BAND_COLOURS = {"shallow": "#4c72b0", "middle": "#dd8452", "deep": "#55a868"}


def lora_accuracy_curve(frame: pd.DataFrame, bands: Mapping[str, Sequence[int]] | None = None, title: str = ""):
    """Yu Fig. 2: test accuracy (%) of the LoRA model of each attention layer, with the
    original model as a dashed line, accuracy on negative-result prompts as a second
    curve, and Yu's layer bands shaded. ``frame``: layer (-1 = original), accuracy,
    accuracy_negative."""
    lora = frame[frame.layer >= 0].sort_values("layer")
    base = frame[frame.layer == -1]
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(lora) + 3), 3.8))
    for name, layers in (bands or {}).items():
        ax.axvspan(
            min(layers) - 0.5,
            max(layers) + 0.5,
            color=_BAND_COLOURS.get(name, "grey"),
            alpha=0.12,
            label=f"{name} band ({min(layers)}-{max(layers)})",
        )
    ax.plot(lora.layer, 100 * lora.accuracy, "o-", color="black", label="LoRA model: all test prompts")
    if "accuracy_negative" in lora and lora.accuracy_negative.notna().any():
        ax.plot(
            lora.layer,
            100 * lora.accuracy_negative,
            "s--",
            color="tab:red",
            ms=4,
            alpha=0.8,
            label="LoRA model: negative results",
        )
    if len(base):
        ax.axhline(100 * float(base.accuracy.iloc[0]), color="black", ls=":", label="original: all")
        if "accuracy_negative" in base and not np.isnan(float(base.accuracy_negative.iloc[0])):
            ax.axhline(
                100 * float(base.accuracy_negative.iloc[0]),
                color="tab:red",
                ls=":",
                alpha=0.8,
                label="original: negative results",
            )
    ax.set_xlabel("layer whose attention carries the LoRA (index)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(-2, 102)
    if len(lora):
        ax.set_xticks(lora.layer.tolist())
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def coefficient_bars(table: pd.DataFrame, models: Sequence[str], title: str = ""):
    """Yu Table 9 as bars: coefficient score of each neuron (rows of ``table``) in each
    model (columns ``models``)."""
    long = table.melt(id_vars=["neuron"], value_vars=list(models), var_name="model", value_name="coefficient")
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(long) / max(1, len(models)) * len(models) * 0.4 + 3), 3.6))
    sns.barplot(data=long, x="neuron", y="coefficient", hue="model", ax=ax, errorbar=None)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("FFN neuron (layer_index)")
    ax.set_ylabel("coefficient score (activation, a.u.)")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=45)
    ax.legend(title="model", fontsize=7, title_fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def band_increase_bars(table: pd.DataFrame, title: str = ""):
    """Yu Table 10 as bars: mean coefficient increase (%) of the top-k neurons per band
    of LoRA layers. ``table``: band, layers, top50, top30, ... columns."""
    ks = [c for c in table.columns if c.startswith("top")]
    long = table.melt(id_vars=["band"], value_vars=ks, var_name="top-k neurons", value_name="increase")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    sns.barplot(
        data=long,
        x="top-k neurons",
        y="increase",
        hue="band",
        ax=ax,
        errorbar=None,
        palette={b: _BAND_COLOURS.get(b, "grey") for b in long.band.unique()},
    )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("neurons compared (top-k per case)")
    ax.set_ylabel("coefficient increase over original (%)")
    ax.set_title(title)
    for container in ax.containers:
        ax.bar_label(container, fmt="%.0f", fontsize=7)
    ax.legend(title="LoRA layers", fontsize=7, title_fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def sft_comparison(table: pd.DataFrame, math_cols: Sequence[str], general_cols: Sequence[str], title: str = ""):
    """Zhang Tables 1/2 as figure: per method, math accuracies (%), general-ability
    scores (factual recall %, LM loss in nats/token), and tuned parameters vs training
    throughput. ``table``: method, n_trainable, samples_per_second and the columns."""
    methods = table.method.tolist()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    long = table.melt(id_vars=["method"], value_vars=list(math_cols), var_name="test set", value_name="acc")
    sns.barplot(data=long.assign(acc=100 * long.acc), x="method", y="acc", hue="test set", ax=ax, errorbar=None)
    ax.set_ylabel("math accuracy (%)")
    ax.set_xlabel("")
    ax.set_ylim(0, 105)
    ax.tick_params(axis="x", rotation=60)
    ax.legend(fontsize=7, title_fontsize=8)
    ax.set_title("held-out math")
    ax = axes[1]
    pct = [c for c in general_cols if c != "lm_loss"]
    if pct:
        long = table.melt(id_vars=["method"], value_vars=pct, var_name="probe", value_name="acc")
        sns.barplot(data=long.assign(acc=100 * long.acc), x="method", y="acc", hue="probe", ax=ax, errorbar=None)
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 105)
        ax.legend(fontsize=7, loc="lower left")
    if "lm_loss" in general_cols:
        ax2 = ax.twinx()
        ax2.plot(range(len(methods)), table.lm_loss, "kD-", label="LM loss on prose")
        ax2.set_ylabel("LM loss on pydoc prose (nats/token)")
        ax2.grid(False)
        ax2.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("")
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, rotation=60, ha="right")
    ax.set_title("general ability")
    ax = axes[2]
    ax.scatter(table.n_trainable, table.samples_per_second, color="tab:blue")
    for _, r in table.iterrows():
        ax.annotate(
            r.method, (r.n_trainable, r.samples_per_second), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.set_xscale("log")
    ax.set_xlabel("tuned parameters (count, log scale)")
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_title("cost")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def loss_curves(histories: Mapping[str, pd.DataFrame], title: str = "", smooth: int = 5):
    """Training loss (answer-token cross-entropy, nats/token) vs optimizer step per
    method, smoothed by a running mean of ``smooth`` steps."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, h in histories.items():
        if len(h):
            ax.plot(h.step, h.loss.rolling(smooth, min_periods=1).mean(), label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("answer-token loss (nats/token)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig
