"""Figures of the CNA study (Yu & Ananiadou 2024, Sec. 4; notebook 04). Each takes the
tables that :mod:`arithlib.yu.cna` returns and gives a matplotlib Figure with labelled
axes; the notebook saves them with :func:`arithlib.run.outputs.save_figure`."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from . import font_safe

COLORS = {
    "a": "#1f77b4",
    "b": "#d62728",
    "mask": "#d62728",
    "keep": "#2ca02c",
    "random mask": "#7f7f7f",
    "hidden-interpretable": "#9467bd",
    "random": "#7f7f7f",
}


def _short(tokens: str, n: int = 4, width: int = 28) -> str:
    parts = [t for t in str(tokens).split(", ")][:n]
    return textwrap.shorten(", ".join(parts), width=width, placeholder="…")


def _label(tokens: str, n: int = 4, width: int = 28) -> str:
    """:func:`_short` for a figure: tokens in scripts the font lacks (CJK) escaped
    (:func:`arithlib.plots.font_safe`), not drawn as empty boxes."""
    return font_safe(_short(tokens, n, width))


def case_neurons(
    frame: pd.DataFrame, title: str, label_a: str = "original", label_b: str = "head zeroed"
) -> plt.Figure:
    """Table 4 as bars: importance and coefficient of a case's top CNA neurons in both runs."""
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(frame) + 4), 4.2))
    x = np.arange(len(frame))
    labels = [f"{r['name']}\n{_label(r.get('top_tokens', ''), 3, 22)}" for _, r in frame.iterrows()]
    for ax, (col, ylabel) in zip(
        axes, [("imp", "importance Δ log p(w) (nats)"), ("coef", "coefficient m_k (activation)")]
    ):
        ax.bar(x - 0.2, frame[f"{col}_a"], 0.4, label=label_a, color=COLORS["a"])
        ax.bar(x + 0.2, frame[f"{col}_b"], 0.4, label=label_b, color=COLORS["b"])
        ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
        ax.set_xlabel("neuron (layer_index) and its top projected tokens")
        ax.set_ylabel(ylabel)
        ax.axhline(0, color="black", lw=0.5)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def mask_keep(table: pd.DataFrame, title: str) -> plt.Figure:
    """Table 5 / 15: accuracy decrease vs K for mask, keep and the random controls (mean
    and range over seeds), and the coefficient decrease of the top-K neurons, one column
    per operator group."""
    groups = list(table["group"].unique()) if "group" in table else [None]
    fig, axes = plt.subplots(2, len(groups), figsize=(4.5 * len(groups), 6.5), squeeze=False)
    for j, g in enumerate(groups):
        sub = table if g is None else table[table.group == g]
        ax = axes[0, j]
        for kind, part in sub.groupby("intervention"):
            agg = part.groupby("K")["accuracy_decrease"].agg(["mean", "min", "max"]).sort_index()
            ax.plot(
                agg.index,
                agg["mean"],
                "o-",
                label=kind + (" (mean, range over seeds)" if len(part) > len(agg) else ""),
                color=COLORS.get(kind),
            )
            if len(part) > len(agg):  # random controls: one row per seed
                ax.fill_between(agg.index, agg["min"], agg["max"], alpha=0.2, color=COLORS.get(kind))
        ax.set_xlabel("K (top CNA neurons per case)")
        ax.set_ylabel("accuracy decrease (%)")
        ax.set_title(f"{g or ''} (n = {int(sub.n_cases.iloc[0])} cases)")
        ax.legend(fontsize=8)
        ax = axes[1, j]
        part = sub[sub.intervention == "mask"].sort_values("K")
        ax.bar(part.K.astype(str), part.coef_decrease, color=COLORS["b"])
        ax.set_xlabel("K (top CNA neurons per case)")
        ax.set_ylabel("coefficient decrease, head zeroed (%)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def lowest_neuron_plot(summary: pd.DataFrame, title: str) -> plt.Figure:
    """Table 6 / 16: coefficient decrease of the top-K neurons when the lowest one is zeroed."""
    groups = list(summary["group"].unique()) if "group" in summary else [None]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    width = 0.8 / len(groups)
    ks = sorted(summary.K.unique(), reverse=True)
    for j, g in enumerate(groups):
        sub = summary if g is None else summary[summary.group == g]
        vals = [float(sub[sub.K == k].coef_decrease.iloc[0]) if (sub.K == k).any() else np.nan for k in ks]
        ax.bar(np.arange(len(ks)) + j * width, vals, width, label=str(g))
    ax.set_xticks(np.arange(len(ks)) + width * (len(groups) - 1) / 2, [f"top{k}" for k in ks])
    ax.set_xlabel("neuron set (top-K CNA neurons of each case)")
    ax.set_ylabel("coefficient decrease of higher top-K neurons (%)")
    ax.axhline(0, color="black", lw=0.5)
    ax.legend(title="operators", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def pe_dag_plot(nodes: pd.DataFrame, edges: pd.DataFrame, title: str) -> plt.Figure:
    """The prediction-enhancing DAG: neurons by layer (y), edges lower -> upper where the
    direct enhancement passes the threshold; edge width and label give its size."""
    fig, ax = plt.subplots(figsize=(8, 5.5))
    pos = {}
    for layer, part in nodes.groupby("layer"):
        xs = np.linspace(-1, 1, len(part) + 2)[1:-1] if len(part) > 1 else [0.0]
        for x, (_, r) in zip(xs, part.iterrows()):
            pos[r["name"]] = (x, layer)
    shown = edges[edges["edge"]] if len(edges) else edges
    for _, e in shown.iterrows():
        (x1, y1), (x2, y2) = pos[e["lower"]], pos[e["upper"]]
        ax.add_patch(
            FancyArrowPatch(
                (x1, y1),
                (x2, y2),
                arrowstyle="-|>",
                mutation_scale=12,
                lw=0.5 + 6 * min(1.0, e["enhancement"]),
                color="#ff7f0e",
                alpha=0.7,
                connectionstyle="arc3,rad=0.15",
            )
        )
        ax.text((x1 + x2) / 2, (y1 + y2) / 2, f"{100 * e['enhancement']:.0f}%", fontsize=7, color="#ff7f0e")
    sc = ax.scatter(
        [pos[n][0] for n in nodes["name"]],
        [pos[n][1] for n in nodes["name"]],
        s=500,
        c=nodes["change"],
        cmap="viridis",
        zorder=3,
        edgecolors="black",
    )
    for _, r in nodes.iterrows():
        ax.annotate(r["name"], pos[r["name"]], textcoords="offset points", xytext=(0, 14), ha="center", fontsize=8)
    fig.colorbar(sc, ax=ax, label="CNA change imp_ori - imp_inv (nats)")
    ax.set_xlim(-1.3, 1.3)
    lo, hi = nodes.layer.min(), nodes.layer.max()
    ax.set_ylim(lo - 1, hi + 1.5)
    ax.set_xticks([])
    ax.set_ylabel("layer")
    ax.set_xlabel("top CNA neurons of the case (edges: direct coefficient enhancement, % of the upper coefficient)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def m_sweep(table: pd.DataFrame, title: str) -> plt.Figure:
    """Table 8 / 17: accuracy decrease when zeroing hidden-interpretable shallow neurons
    (>= M concepts) vs random sets of the same size (mean over the seeds), per M; counts
    annotated."""
    groups = list(table["group"].unique()) if "group" in table else [None]
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for j, g in enumerate(groups):
        ax = axes[0, j]
        sub = table if g is None else table[table.group == g]
        ms = sorted(sub.M.unique())
        for k, kind in enumerate(["hidden-interpretable", "random"]):
            part = (
                sub[sub.set == kind]
                .groupby("M")
                .agg(accuracy_decrease=("accuracy_decrease", "mean"), n_neurons=("n_neurons", "first"))
                .reindex(ms)
            )
            bars = ax.bar(
                np.arange(len(ms)) + 0.4 * k - 0.2, part.accuracy_decrease, 0.4, label=kind, color=COLORS[kind]
            )
            if kind == "hidden-interpretable":
                for rect, n in zip(bars, part.n_neurons):
                    ax.annotate(
                        f"n={int(n)}",
                        (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(np.arange(len(ms)), [f"M={m}" for m in ms])
        ax.set_xlabel("minimum number/operation concepts among the top-50 projected tokens")
        ax.set_ylabel("accuracy decrease (%)")
        ax.set_title(str(g or ""))
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def logic_chain(
    case_text: str,
    answer: str,
    shallow: pd.DataFrame,
    head: tuple[int, int],
    head_drop: float,
    deep: pd.DataFrame,
    edges: pd.DataFrame,
    ov_layer: int,
    title: str,
) -> plt.Figure:
    """Yu's Fig. 1 / Sec. 4.5 for one case, from the computed tables: hidden-interpretable
    shallow neurons (tokens before -> after the OV map of ``ov_layer``), the key head,
    the deep neurons it activates (importance and coefficient, original -> head zeroed)
    and the prediction-enhancing edges among them."""
    fig, ax = plt.subplots(figsize=(15, 7))
    ax.set_xlim(0, 4)
    ax.set_ylim(0, 1)
    ax.axis("off")
    stages = [
        "1. feature enhancing\n(shallow FFN neurons)",
        f"2. feature transferring\n(attention layer {ov_layer} OV)",
        f"3. feature predicting\n(key head L{head[0]}.H{head[1]})",
        "4. prediction enhancing\n(deep FFN neurons)",
    ]
    for i, s in enumerate(stages):
        ax.text(i + 0.5, 0.97, s, ha="center", va="top", fontsize=10, weight="bold")

    def box(x, y, text, color, w=0.9, h=0.12):
        ax.add_patch(
            FancyBboxPatch(
                (x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.01", fc=color, ec="black", lw=0.6, alpha=0.9
            )
        )
        ax.text(x, y, text, ha="center", va="center", fontsize=7, wrap=True)

    def arrow(p, q, color="black", lw=1.0):
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=10, color=color, lw=lw))

    sh = shallow.head(4).reset_index(drop=True)
    ys_sh = np.linspace(0.78, 0.2, max(1, len(sh)))
    for y, (_, r) in zip(ys_sh, sh.iterrows()):
        box(0.5, y, f"{r['name']} @ operand {r['operand']}\nbefore: {_label(r['tokens_before'])}", "#e8e8e8")
        box(1.5, y, f"after OV L{ov_layer}:\n{_label(r['tokens_after_attention'])}", "#d9ecf7")
        arrow((0.95, y), (1.05, y))
        arrow((1.95, y), (2.2, 0.5), color="#555555", lw=0.6)
    box(
        2.5,
        0.5,
        f"head L{head[0]}.H{head[1]}\nzeroing it: accuracy -{head_drop:.0f} pts (1D)",
        "#fde0c5",
        w=0.6,
        h=0.16,
    )
    dp = deep.head(4).reset_index(drop=True)
    ys_dp = np.linspace(0.78, 0.2, max(1, len(dp)))
    ypos = {}
    for y, (_, r) in zip(ys_dp, dp.iterrows()):
        ypos[r["name"]] = y
        box(
            3.45,
            y,
            f"{r['name']}: imp {r['imp_a']:.2f}→{r['imp_b']:.2f}, coef {r['coef_a']:.2f}→{r['coef_b']:.2f}\n"
            f"{_label(r.get('top_tokens', ''), 5, 40)}",
            "#d8f0d2",
            w=0.95,
        )
        arrow((2.8, 0.5), (2.97, y), color="#d62728", lw=0.8)
    if len(edges):
        for _, e in edges[edges["edge"]].iterrows():
            if e["lower"] in ypos and e["upper"] in ypos:
                y1, y2 = ypos[e["lower"]], ypos[e["upper"]]
                ax.add_patch(
                    FancyArrowPatch(
                        (3.93, y1),
                        (3.93, y2),
                        arrowstyle="-|>",
                        mutation_scale=10,
                        color="#ff7f0e",
                        connectionstyle="arc3,rad=-0.5",
                        lw=1.2,
                    )
                )
    ax.text(
        2.0,
        0.04,
        f'case "{case_text}" → "{answer}".  Orange: prediction-enhancing edges (direct coefficient '
        "enhancement); red: neurons whose coefficient falls when the head is zeroed.",
        ha="center",
        fontsize=8,
    )
    ax.set_title(title)
    return fig
