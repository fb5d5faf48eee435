"""Figures of notebook 01 (identify heads). Each function takes the DataFrame the
notebook also saves as CSV and returns a matplotlib Figure (save with
:func:`arithlib.run.outputs.save_figure`)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import TwoSlopeNorm

from ..core.papers import KEY_HEAD_THRESHOLD

CLASS_COLORS = {"A": "#d62728", "B": "#ff7f0e", "operator": "#2ca02c", "other": "#9e9e9e", "prefix": "#d9d9d9"}


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    cols = min(n, max_cols)
    return int(np.ceil(n / cols)), cols


def layer_head_matrix(
    frame: pd.DataFrame, value: str, n_layers: int, n_heads: int, mlp_column: bool = True
) -> np.ndarray:
    """``[n_layers, n_heads (+1)]`` matrix of ``value`` from rows with ``kind``, ``layer``,
    ``head`` (MLP rows go to the last column); missing cells are NaN."""
    m = np.full((n_layers, n_heads + (1 if mlp_column else 0)), np.nan)
    for r in frame.itertuples():
        kind = getattr(r, "kind", "head")
        if kind == "head":
            m[int(r.layer), int(r.head)] = getattr(r, value)
        elif kind == "mlp" and mlp_column:
            m[int(r.layer), n_heads] = getattr(r, value)
    return m


def effect_heatmaps(
    means: pd.DataFrame,
    n_layers: int,
    n_heads: int,
    panel_col: str = "op",
    panels: Sequence[str] | None = None,
    threshold: float = KEY_HEAD_THRESHOLD,
    title: str = "",
):
    """Zhang et al. Fig. 2 / 15: mean relative logit change (%) of path-patching each head
    (layers x heads) with the MLP of each layer as the last column; one panel per value
    of ``panel_col``. Red = patching lowers the answer logit; dots mark key heads
    (effect below ``threshold``)."""
    panels = list(panels) if panels is not None else list(dict.fromkeys(means[panel_col]))
    rows, cols = _grid(len(panels))
    mats = [layer_head_matrix(means[means[panel_col] == p], "effect", n_layers, n_heads) * 100 for p in panels]
    vmax = max(1e-6, max(np.nanmax(np.abs(m)) for m in mats))
    norm = TwoSlopeNorm(vmin=-vmax, vcenter=0.0, vmax=vmax)
    fig, axes = plt.subplots(
        rows, cols, figsize=(0.28 * (n_heads + 1) * cols + 2.0, 0.22 * n_layers * rows + 1.4), squeeze=False
    )
    for ax, p, m in zip(axes.flat, panels, mats):
        im = ax.imshow(m, cmap="RdBu", norm=norm, aspect="auto", interpolation="nearest")
        ax.grid(False)
        ax.axvline(n_heads - 0.5, color="k", lw=1.0)
        key = np.argwhere(m[:, :n_heads] < threshold * 100)
        ax.scatter(key[:, 1], key[:, 0], s=6, c="k", marker="o")
        ax.set_title(f"{panel_col} = {p}", fontsize=10)
        ax.set_xlabel("head index (last column: MLP)")
        ax.set_ylabel("layer")
        ax.set_xticks(list(range(0, n_heads, max(1, n_heads // 7))) + [n_heads])
        ax.set_xticklabels([str(i) for i in range(0, n_heads, max(1, n_heads // 7))] + ["MLP"], fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="relative logit change of the answer (%)")
    fig.suptitle(title)
    return fig


def knockout_plot(curves: pd.DataFrame, title: str = ""):
    """Zhang et al. Fig. 3: accuracy vs number of heads mean-ablated, in effect order
    (line) and in random orders (mean with min-max band, each order thin)."""
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    eff = curves[curves["order"] == "effect"].sort_values("k")
    rnd = curves[curves["order"] == "random"]
    for _, g in rnd.groupby("order_name"):
        g = g.sort_values("k")
        ax.plot(g["k"], g["accuracy"] * 100, color="#9e9e9e", lw=0.6, alpha=0.6)
    if len(rnd):
        s = rnd.groupby("k")["accuracy"].agg(["mean", "min", "max", "std"]).reset_index()
        ax.fill_between(
            s["k"], s["min"] * 100, s["max"] * 100, color="#9e9e9e", alpha=0.25, label="random-rank (min-max)"
        )
        ax.plot(s["k"], s["mean"] * 100, color="#555555", marker="s", ms=3, label="random-rank (mean)")
    ax.plot(eff["k"], eff["accuracy"] * 100, color="#d62728", marker="o", ms=4, label="effect-rank")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("number of heads knocked out (mean ablation)")
    ax.set_ylabel("first-token accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def transfer_plot(transfer: pd.DataFrame, heads_label: str, title: str = ""):
    """Zhang et al. Fig. 4 with its control: first-token accuracy per format before any
    knockout, after knocking out ``heads_label``, and after knocking out as many random
    heads (mean, error bar = sd over the random sets); ``transfer`` is the table of
    :func:`arithlib.zhang.transfer_sets.transfer_knockout`."""
    tr = transfer.dropna(subset=["accuracy_before"]).reset_index(drop=True)
    bars = [
        ("no knockout", "accuracy_before", None, "#4c72b0"),
        (heads_label, "accuracy_after", None, "#d62728"),
        ("as many random heads", "accuracy_random", "accuracy_random_sd", "#9e9e9e"),
    ]
    x = np.arange(len(tr))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(tr) + 2.5), 3.8))
    for i, (label, col, sd, color) in enumerate(bars):
        err = None if sd is None else tr[sd] * 100
        rect = ax.bar(x + (i - 1) * width, tr[col] * 100, width, yerr=err, capsize=2, color=color, label=label)
        ax.bar_label(rect, fmt="%.0f", fontsize=7, padding=2 if sd is None else 6)
    ax.set_xticks(x, tr["format"], rotation=20, ha="right")
    ax.set_xlabel("prompt format")
    ax.set_ylabel("first-token accuracy (%)")
    ax.set_ylim(0, 110)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def attention_class_plot(frame: pd.DataFrame, label: str = "label", title: str = ""):
    """Zhang et al. Fig. 5: stacked mean attention of the END query of each head (rows
    of ``frame`` with ``label`` and the class columns) over operand A, operand B,
    operator, other query tokens and the few-shot prefix."""
    classes = [c for c in CLASS_COLORS if c in frame.columns]
    fig, ax = plt.subplots(figsize=(6.5, 0.35 * len(frame) + 1.3))
    left = np.zeros(len(frame))
    y = np.arange(len(frame))
    for c in classes:
        vals = frame[c].to_numpy() * 100
        ax.barh(y, vals, left=left, color=CLASS_COLORS[c], label=c)
        left += vals
    ax.set_yticks(y)
    ax.set_yticklabels(frame[label], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("mean attention from the answer position (%)")
    ax.set_ylabel("head (type)")
    ax.set_xlim(0, 100)
    ax.legend(fontsize=7, ncol=len(classes), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.set_title(title, pad=22)
    fig.tight_layout()
    return fig


def sweep_heatmaps(
    acc: pd.DataFrame,
    n_layers: int,
    n_heads: int,
    value: str = "accuracy_drop",
    row: str = "n_digits",
    col: str = "op",
    title: str = "",
):
    """Yu & Ananiadou Sec. 3.3: accuracy drop (percentage points) when one head is
    zeroed, layers x heads, one panel per ``row`` x ``col`` setting."""
    rows_v = sorted(acc[row].unique())
    cols_v = list(dict.fromkeys(acc[col]))
    fig, axes = plt.subplots(
        len(rows_v),
        len(cols_v),
        figsize=(0.25 * n_heads * len(cols_v) + 2.2, 0.17 * n_layers * len(rows_v) + 1.4),
        squeeze=False,
    )
    vmax = max(1e-6, float(acc[value].abs().max() * 100))
    norm = TwoSlopeNorm(vmin=-vmax, vcenter=0.0, vmax=vmax)
    im = None
    for i, rv in enumerate(rows_v):
        for j, cv in enumerate(cols_v):
            ax = axes[i, j]
            sub = acc[(acc[row] == rv) & (acc[col] == cv)]
            m = layer_head_matrix(sub.assign(kind="head"), value, n_layers, n_heads, mlp_column=False) * 100
            im = ax.imshow(m, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
            ax.grid(False)
            ax.set_title(f"{col} {cv}, {row} {rv}", fontsize=8)
            ax.set_xlabel("head index", fontsize=7)
            ax.set_ylabel("layer", fontsize=7)
            ax.tick_params(labelsize=6)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy drop when zeroed (pp)")
    fig.suptitle(title)
    return fig


def ie_heatmaps(ie: pd.DataFrame, n_layers: int, n_heads: int, positions: Sequence[str], title: str = ""):
    """Nikankin et al. Fig. 2-style: mean indirect effect of patching each head (layers x
    heads) and each MLP (last column) at each position; blank = not patched there."""
    fig, axes = plt.subplots(
        1, len(positions), figsize=(0.28 * (n_heads + 1) * len(positions) + 2.2, 0.2 * n_layers + 1.5), squeeze=False
    )
    mats = [layer_head_matrix(ie[ie["position"] == p], "ie", n_layers, n_heads) for p in positions]
    vmax = max(1e-6, max(np.nanmax(np.abs(m)) if np.isfinite(m).any() else 0 for m in mats))
    norm = TwoSlopeNorm(vmin=-vmax, vcenter=0.0, vmax=vmax)
    im = None
    for ax, p, m in zip(axes.flat, positions, mats):
        im = ax.imshow(m, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
        ax.grid(False)
        ax.axvline(n_heads - 0.5, color="k", lw=1.0)
        ax.set_title(f"position {p}", fontsize=10)
        ax.set_xlabel("head index (last column: MLP)")
        ax.set_ylabel("layer")
        ax.set_xticks([0, n_heads // 2, n_heads])
        ax.set_xticklabels(["0", str(n_heads // 2), "MLP"], fontsize=7)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="mean indirect effect (Stolfo et al.)")
    fig.suptitle(title)
    return fig


def faithfulness_plot(frame: pd.DataFrame, x: str = "k", title: str = "", target: float | None = None):
    """Nikankin et al.: circuit faithfulness (%) vs the number of heads kept in the circuit."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, g in frame.groupby("curve") if "curve" in frame else [("circuit", frame)]:
        g = g.sort_values(x)
        ax.plot(g[x], g["faithfulness"] * 100, marker="o", ms=4, label=name)
    if target is not None:
        ax.axhline(target * 100, color="k", ls="--", lw=0.8, label=f"{target:.0%}")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("heads kept in the circuit (by indirect effect)")
    ax.set_ylabel("faithfulness (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
