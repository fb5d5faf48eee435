"""Figures of the report across models (:func:`arithlib.report.write_cross_model`): the
size-axis quantities, one panel each, from the long tables of
:func:`arithlib.report.cross_model_metrics` and :func:`arithlib.report.cross_model_curves`."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

sns.set_theme(context="notebook", style="whitegrid")


def _label(model: str, size: float) -> str:
    return f"{model}\n({size / 1e6:.0f} M)" if np.isfinite(size) else model


def cross_model_figure(metrics: pd.DataFrame, curves: pd.DataFrame, order: list[str], ncols: int = 4):
    """One panel per quantity: bars per model (in ``order``: the report's, by parameter
    count, :func:`arithlib.report.cross_model.size_order`; one bar per series) for
    ``metrics``, and per-layer lines on normalised depth (layer / n_layers) for
    ``curves``. A model whose study did not run has no bar (the panel says so)."""
    sizes = metrics.drop_duplicates("model").set_index("model")["n_params"]
    order = list(order)
    labels = {m: _label(m, sizes[m]) for m in order}
    panels = list(dict.fromkeys(metrics["panel"]))
    curve_titles = list(dict.fromkeys(curves["curve"])) if len(curves) else []
    n = len(panels) + len(curve_titles)
    nrows = max(1, math.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
    palette = dict(zip(order, sns.color_palette("viridis", len(order))))
    for ax, panel in zip(axes.flat, panels):
        part = metrics[metrics["panel"] == panel].dropna(subset=["value"])
        ax.set_title(panel, fontsize=9)
        ax.set_ylabel(metrics.loc[metrics["panel"] == panel, "ylabel"].iloc[0], fontsize=8)
        missing = [m for m in order if m not in set(part["model"])]
        if not part.empty:
            data = part.assign(model=part["model"].map(labels))
            sns.barplot(
                data=data,
                x="model",
                y="value",
                hue="series",
                order=[labels[m] for m in order],
                ax=ax,
                errorbar=None,
                palette="Set2",
            )
            for container in ax.containers:
                ax.bar_label(container, fmt="%.2g", fontsize=6)
            if (part["value"] >= 0).all():  # all-zero bars sit on the axis; headroom above the bars for the legend
                ax.set_ylim(bottom=0, top=max(1.35 * float(part["value"].max()), 1e-3))
            ax.legend(fontsize=6, title=None, loc="upper right")
        if missing:
            ax.text(
                0.5,
                -0.32,
                "not run: " + ", ".join(missing),
                transform=ax.transAxes,
                ha="center",
                va="top",
                fontsize=6,
                color="grey",
            )  # below the axis labels, clear of the legend
        ax.set_xlabel("model (parameters)", fontsize=8)
        ax.tick_params(axis="x", labelsize=6)
    for ax, title in zip(list(axes.flat)[len(panels) :], curve_titles):
        part = curves[curves["curve"] == title]
        for m in order:
            c = part[part["model"] == m].sort_values("depth")
            if len(c):
                ax.plot(c["depth"], c["value"], marker=".", color=palette[m], label=labels[m].replace("\n", " "))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer / n_layers", fontsize=8)
        ax.set_ylabel(part["ylabel"].iloc[0], fontsize=8)
        ax.set_xlim(0, 1)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig
