"""Figures from tables. Each function takes a DataFrame (the table a notebook also
saves as CSV) and returns a matplotlib Figure; saving is :func:`arithlib.run.outputs.save_figure`."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

sns.set_theme(context="notebook", style="whitegrid")


def accuracy_bars(
    frame: pd.DataFrame,
    x: str,
    hue: str | None = None,
    y: str = "accuracy",
    title: str = "",
    xlabel: str | None = None,
    ylim: Sequence[float] = (0, 1),
):
    """Bar chart of an accuracy table (one row per bar; ``y`` in 0..1, shown in %)."""
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * frame[x].nunique() * (frame[hue].nunique() if hue else 1)), 3.6))
    data = frame.assign(**{y: frame[y] * 100})
    sns.barplot(data=data, x=x, y=y, hue=hue, ax=ax, errorbar=None)
    ax.set_ylim(ylim[0] * 100, ylim[1] * 100)
    ax.set_ylabel("accuracy (%)")
    ax.set_xlabel(xlabel or x)
    ax.set_title(title)
    for container in ax.containers:
        ax.bar_label(container, fmt="%.0f", fontsize=7)
    if hue:
        ax.legend(title=hue, fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def heatmap(
    frame: pd.DataFrame,
    index: str,
    columns: str,
    values: str,
    title: str = "",
    cbar_label: str = "",
    fmt: str = ".0f",
    cmap: str = "viridis",
    center: float | None = None,
    figsize: tuple[float, float] | None = None,
    annot: bool = True,
):
    """Heatmap of ``values`` pivoted to ``index`` x ``columns``."""
    table = frame.pivot_table(index=index, columns=columns, values=values, aggfunc="mean")
    fig, ax = plt.subplots(figsize=figsize or (1.0 + 0.7 * table.shape[1], 0.8 + 0.35 * table.shape[0]))
    sns.heatmap(table, annot=annot, fmt=fmt, cmap=cmap, center=center, ax=ax, cbar_kws={"label": cbar_label})
    ax.set_title(title)
    fig.tight_layout()
    return fig
