"""Figures of notebook 06 (pruning with CNA, Yu & Ananiadou 2024 Sec. 6.1, Table 11).
Each function takes the table the notebook also saves as CSV and returns a matplotlib
Figure."""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

sns.set_theme(context="notebook", style="whitegrid")

_COLOURS = {
    "original": "#7f7f7f",
    "LoRA": "#4c72b0",
    "LoRA on CNA-pruned": "#55a868",
    "LoRA on CNA-masked": "#8fbc8f",
    "LoRA on random-pruned": "#c44e52",
}
_SEL = {"cna": ("#55a868", "CNA union"), "random": ("#c44e52", "random")}


def table11_plot(table: pd.DataFrame, title: str = ""):
    """Yu Table 11 with costs, three panels: test accuracy (%) per model (random-pruned:
    mean over seeds, seeds as dots; Yu's Llama-7B values as open diamonds), parameters
    (M; deep-FFN part hatched) and forward time (ms). ``table``: model, accuracy, paper,
    n_params, n_deep_ffn_params, forward_min_s (the fastest timed pass; NaN where not
    timed)."""
    order = [m for m in _COLOURS if m in set(table.model)]
    agg = (
        table.groupby("model", sort=False)
        .agg(
            accuracy=("accuracy", "mean"),
            paper=("paper", "first"),
            n_params=("n_params", "first"),
            n_deep=("n_deep_ffn_params", "first"),
            forward_min_s=("forward_min_s", "median"),
        )
        .reindex(order)
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    x = np.arange(len(order))
    colours = [_COLOURS[m] for m in order]
    ax = axes[0]
    ax.bar(x, 100 * agg.accuracy, color=colours)
    for i, m in enumerate(order):
        pts = table[table.model == m].accuracy
        if len(pts) > 1:
            ax.scatter(
                np.full(len(pts), i) + np.linspace(-0.15, 0.15, len(pts)),
                100 * pts,
                color="black",
                s=12,
                zorder=3,
                label="seeds" if m == "LoRA on random-pruned" else None,
            )
        ax.text(i, 100 * agg.accuracy.iloc[i] + 1.5, f"{100 * agg.accuracy.iloc[i]:.1f}", ha="center", fontsize=8)
    paper = agg.paper.to_numpy(dtype=float)
    ok = ~np.isnan(paper)
    ax.scatter(
        x[ok],
        paper[ok],
        marker="D",
        facecolors="none",
        edgecolors="black",
        s=40,
        zorder=4,
        label="Yu Table 11 (Llama-7B)",
    )
    ax.set_xticks(x, order, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("2-digit test accuracy (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="upper right")
    ax = axes[1]
    ax.bar(x, agg.n_params / 1e6, color=colours, alpha=0.5, label="other parameters")
    ax.bar(x, agg.n_deep / 1e6, color=colours, hatch="//", edgecolor="black", lw=0.3, label="deep FFN")
    ax.set_xticks(x, [m.replace("LoRA on ", "") for m in order], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("parameters (M)")
    ax.legend(fontsize=7)
    ax = axes[2]
    ms = 1000 * agg.forward_min_s.to_numpy(dtype=float)
    ax.bar(x, np.nan_to_num(ms), color=colours)
    for i, v in enumerate(ms):
        ax.text(
            i,
            (0 if np.isnan(v) else v) * 1.01,
            "n/a" if np.isnan(v) else f"{v:.0f}" if v >= 10 else f"{v:.1f}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, [m.replace("LoRA on ", "") for m in order], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("forward pass (ms, fastest of the repeats)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def share_sweep_plot(
    sweep: pd.DataFrame,
    reference: Mapping[str, float] | None = None,
    main_share: float | None = None,
    paper: Mapping[str, float] | None = None,
    title: str = "",
):
    """Accuracy (%) vs share of the deep FFN neurons kept (log axis), CNA union vs random
    (mean over seeds, seeds as dots): after LoRA (solid) and before it (dashed);
    horizontal lines for the unpruned models (``reference``: name -> accuracy in 0..1),
    Yu's LoRA9-p / LoRA9-r at 5 % as open diamonds (``paper``: model -> %)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for sel, (colour, label) in _SEL.items():
        sub = sweep[sweep.selection == sel]
        if sub.empty:
            continue
        for col, ls, tag in (("accuracy", "-", "after LoRA"), ("accuracy_pruned", "--", "before LoRA")):
            g = sub.groupby("share")[col].mean().dropna()
            if g.empty:
                continue
            ax.plot(
                100 * g.index,
                100 * g.values,
                ls,
                marker="o" if ls == "-" else "s",
                ms=4,
                color=colour,
                label=f"{label}, {tag}",
                alpha=1 if ls == "-" else 0.7,
            )
            if sub.seed.nunique() > 1 and sel == "random":
                pts = sub.dropna(subset=[col])
                ax.scatter(100 * pts.share, 100 * pts[col], color=colour, s=8, alpha=0.5)
    for (name, acc), ls in zip((reference or {}).items(), (":", "-.")):
        ax.axhline(100 * acc, color="black", ls=ls, lw=1, label=f"{name} (unpruned)")
    if paper:
        for name, (colour, _) in (("LoRA on CNA-pruned", _SEL["cna"]), ("LoRA on random-pruned", _SEL["random"])):
            if name in paper:
                ax.scatter(
                    [5],
                    [paper[name]],
                    marker="D",
                    facecolors="none",
                    edgecolors=colour,
                    s=50,
                    zorder=4,
                    label=f"Yu Table 11: {name} (Llama-7B)",
                )
    if main_share is not None:
        ax.axvline(100 * main_share, color="grey", lw=0.8, alpha=0.6)
    ax.set_xscale("log")
    shares = sorted(sweep.share.unique())
    ax.set_xticks([100 * s for s in shares], [f"{100 * s:g}" for s in shares])
    ax.set_xlabel("deep FFN neurons kept (%)")
    ax.set_ylabel("2-digit test accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def union_size(
    curve: pd.DataFrame, main: tuple[int, float] | None = None, scaled_k: int | None = None, title: str = ""
):
    """Share of the deep neurons in the union of every case's top-K, vs K (log axis);
    ``main`` = (K, share) of the kept set, ``scaled_k`` Yu's 500 scaled to this model."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(curve.k, 100 * curve.share, "-", color="black")
    if main is not None:
        ax.scatter(
            [main[0]],
            [100 * main[1]],
            color=_SEL["cna"][0],
            zorder=3,
            label=f"kept set: K = {main[0]}, {100 * main[1]:.1f} %",
        )
    if scaled_k is not None:
        ax.axvline(scaled_k, color="grey", ls="--", label=f"Yu's top-500 scaled to this model: K = {scaled_k}")
    ax.axhline(5, color="grey", ls=":", label="Yu: about 5 % kept")
    ax.set_xscale("log")
    ax.set_xlabel("per-case top-K (CNA change, LoRA vs original)")
    ax.set_ylabel("union of all cases' top-K (% of deep neurons)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def kept_by_layer_plot(frame: pd.DataFrame, title: str = ""):
    """Share (%) of each deep layer's neurons kept, per selection (``frame`` from
    ``pruning_selection.kept_by_layer``)."""
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * frame.layer.nunique() + 3), 3.6))
    data = frame.assign(share=100 * frame.share)
    sns.barplot(data=data, x="layer", y="share", hue="selection", ax=ax, errorbar=None)
    ax.set_xlabel("layer")
    ax.set_ylabel("neurons kept (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, title=None)
    fig.tight_layout()
    return fig
