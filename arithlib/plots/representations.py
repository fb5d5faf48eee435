"""Figures of notebook 09 (number representations): Fourier spectra against the shuffled
null, the helix patch beside the layer, PCA and random patches, the frequency filters,
and the heuristic neurons' Fourier weight shares. Each function takes the table the
notebook saves and returns a matplotlib Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

sns.set_theme(context="notebook", style="whitegrid")


def spectra_plot(spectra: pd.DataFrame, title: str = ""):
    """Share of the non-DC Fourier power per period (log scale), one panel per source
    (the embedding, then the residual stream by layer), with the shuffled null's 95th
    percentile."""
    sources = list(dict.fromkeys(spectra["source"]))
    n = len(sources)
    cols = min(n, 4)
    rows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.6 * rows), squeeze=False, sharey=False)
    for ax, src in zip(axes.flat, sources):
        sub = spectra[spectra.source == src].sort_values("period")
        ax.vlines(sub.period, 0, sub.share, color="tab:blue", lw=1.2)
        ax.plot(sub.period, sub.null_q95, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_title(str(src), fontsize=9)
        ax.set_xlabel("period (numbers)", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes[0, 0].set_ylabel("share of power")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def helix_patch_plot(summary: pd.DataFrame, title: str = ""):
    """Share of the layer patch's effect restored per layer, one line per method, with
    95 % intervals."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for m, sub in summary[summary.method != "layer"].groupby("method", sort=False):
        sub = sub.sort_values("layer")
        style = dict(lw=2) if m == "helix" else dict(lw=1, alpha=0.8)
        ax.plot(sub.layer, sub.share, marker="o", label=m, **style)
        if m in ("helix", "pca", "random"):
            ax.fill_between(sub.layer, sub.share_low, sub.share_high, alpha=0.15)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("layer (residual stream entering it, at a's last token)")
    ax.set_ylabel("share of the layer patch restored")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def filtering_plot(summary: pd.DataFrame, title: str = ""):
    """Accuracy and last-digit-right share under each filter condition."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    x = np.arange(len(summary))
    ax.bar(x - 0.2, summary.accuracy, 0.4, label="first-token accuracy")
    ax.bar(x + 0.2, summary.last_digit_right, 0.4, label="last digit right")
    ax.errorbar(
        x - 0.2,
        summary.accuracy,
        yerr=[summary.accuracy - summary.accuracy_low, summary.accuracy_high - summary.accuracy],
        fmt="none",
        color="k",
        lw=0.8,
    )
    ax.set_xticks(x, summary.condition, rotation=20, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bridge_plot(neurons: pd.DataFrame, title: str = ""):
    """Per heuristic neuron: the share of its input weight in the Fourier directions of
    its rule divided by the mean share of random neurons of its layer (1 = chance), by
    kind of rule."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    sns.stripplot(data=neurons, x="kind", y="ratio", ax=ax, size=3, alpha=0.6)
    ax.axhline(1, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("")
    ax.set_ylabel("share / random neurons' share")
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
