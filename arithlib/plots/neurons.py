"""Figures of notebook 03 (Nikankin et al. 2025): faithfulness vs neurons kept, the
gallery of circuit neurons (operand-grid heatmaps and logit-lens profiles), heuristic
counts and their sensitivity to t, the heuristic and per-prompt ablations, correct vs
incorrect prompts, and training dynamics. Each function takes the table the notebook
saves as CSV and returns a matplotlib Figure."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import MaxNLocator

sns.set_theme(context="notebook", style="whitegrid")


def faithfulness_curve_plot(
    curve: pd.DataFrame,
    column: str = "faithfulness",
    title: str = "",
    marker_share: float | None = 0.01,
    chosen_k: int | None = None,
):
    """Faithfulness (Eq. 2) vs share of neurons kept per layer, one line per operator (Fig. 4b)."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    data = curve[curve.share_per_layer > 0]
    for op, sub in data.groupby("op"):
        ax.plot(sub.share_per_layer * 100, sub[column], marker="o", label=op)
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(0.0, color="grey", lw=0.8)
    if marker_share:
        ax.axvline(marker_share * 100, color="tab:red", lw=0.8, ls=":", label=f"{marker_share:.0%} (paper)")
    if chosen_k is not None and len(data):
        share = chosen_k / (data.k_per_layer / data.share_per_layer).iloc[0]
        ax.axvline(share * 100, color="black", lw=0.8, ls="--", label=f"chosen: {chosen_k}/layer")
    ax.set_xlabel("neurons kept per analysed layer (% of the layer, log scale)")
    ax.set_ylabel("faithfulness (0 = all mean-ablated, 1 = full model)")
    ax.set_title(title)
    ax.legend(title="operator", fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def neuron_gallery(
    grids: Sequence[pd.DataFrame],
    lenses: Sequence[pd.DataFrame],
    titles: Sequence[str],
    ncols: int = 4,
    suptitle: str = "",
    annotate_values: bool = False,
):
    """Per neuron: its activation over the operand grid (rows op1, columns op2) and, below,
    its logit-lens profile over the number tokens (logit added per unit activation)."""
    n = len(grids)
    if n == 0:
        fig, ax = plt.subplots(figsize=(4, 2))
        ax.text(0.5, 0.5, "no neurons to show", ha="center", va="center")
        ax.axis("off")
        return fig
    ncols = min(ncols, n)
    nrows = int(np.ceil(n / ncols))
    fig, axes = plt.subplots(
        2 * nrows,
        ncols,
        figsize=(3.6 * ncols, 5.6 * nrows),
        gridspec_kw={"height_ratios": [3, 1.4] * nrows},
        squeeze=False,
    )
    for i in range(nrows * ncols):
        r, c = divmod(i, ncols)
        top, bottom = axes[2 * r, c], axes[2 * r + 1, c]
        if i >= n:
            top.axis("off")
            bottom.axis("off")
            continue
        g = grids[i]
        im = top.imshow(
            g.to_numpy(dtype=float),
            origin="lower",
            aspect="auto",
            cmap="viridis",
            extent=(g.columns.min() - 0.5, g.columns.max() + 0.5, g.index.min() - 0.5, g.index.max() + 0.5),
        )
        fig.colorbar(im, ax=top, fraction=0.046, pad=0.02, label="activation")
        top.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        top.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        top.set_xlabel("op2")
        top.set_ylabel("op1")
        top.set_title(titles[i], fontsize=8)
        top.grid(False)
        lens = lenses[i]
        bottom.plot(lens["value"], lens["lens"], lw=1, marker="." if len(lens) <= 30 else None)
        bottom.axhline(0, color="grey", lw=0.6)
        bottom.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        bottom.set_xlabel("result token (number)")
        bottom.set_ylabel("logit lens\n(per unit act.)")
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def heuristic_counts_plot(counts: pd.DataFrame, title: str = ""):
    """Number of circuit neurons matching each heuristic kind, per operator."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    if counts.empty:
        ax.text(0.5, 0.5, "no classified neurons", ha="center", va="center")
        return fig
    sns.barplot(data=counts, x="kind", y="n_neurons", hue="op", ax=ax, errorbar=None)
    ax.set_xlabel("heuristic type")
    ax.set_ylabel("circuit neurons matching (count)")
    ax.tick_params(axis="x", rotation=30)
    ax.set_title(title)
    ax.legend(title="operator", fontsize=8)
    fig.tight_layout()
    return fig


def threshold_plot(sens: pd.DataFrame, title: str = ""):
    """Share of circuit neurons matching some heuristic vs threshold t, real and shuffled
    activations, per operator."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    colors = dict(zip(sens.op.unique(), sns.color_palette(n_colors=sens.op.nunique())))
    for (op, kind), sub in sens.groupby(["op", "activations"], sort=False):
        ax.plot(
            sub.t,
            sub.share * 100,
            marker="o",
            color=colors[op],
            ls="-" if kind == "real" else ":",
            label=f"{op} ({kind})",
        )
    ax.axvline(0.6, color="tab:red", lw=0.8, ls=":")
    ax.set_xlabel("match threshold t")
    ax.set_ylabel("circuit neurons matching a heuristic (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def type_threshold_plot(counts: pd.DataFrame, title: str = ""):
    """Circuit neurons per heuristic type vs threshold t, one panel per operator."""
    ops = list(counts.op.unique())
    fig, axes = plt.subplots(1, len(ops), figsize=(3.6 * len(ops), 3.6), squeeze=False, sharey=True)
    for ax, op in zip(axes[0], ops):
        sub = counts[counts.op == op]
        for kind, k in sub.groupby("kind", sort=False):
            ax.plot(k.t, k.n_neurons, marker="o", label=kind)
        ax.axvline(0.6, color="tab:red", lw=0.8, ls=":")
        ax.set_title(f"operator {op}")
        ax.set_xlabel("match threshold t")
    axes[0, 0].set_ylabel("circuit neurons (count)")
    axes[0, -1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def heuristic_ablation_plot(abl: pd.DataFrame, title: str = ""):
    """Nikankin Fig. 7: per heuristic (sorted by the accuracy on its associated prompts),
    accuracy on associated vs other prompts with its neurons mean-ablated."""
    ops = list(abl.op.unique()) if not abl.empty else []
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(4 * max(1, len(ops)), 3.6), squeeze=False, sharey=True)
    for ax, op in zip(axes[0], ops):
        sub = abl[abl.op == op].sort_values("acc_assoc").reset_index(drop=True)
        x = np.arange(len(sub))
        ax.plot(x, sub.acc_assoc * 100, marker=".", label="associated prompts")
        ax.plot(x, sub.acc_other * 100, marker=".", label="other prompts")
        ax.set_xlabel("heuristic (sorted)")
        ax.set_title(f"operator {op}")
    axes[0, 0].set_ylabel("accuracy with its neurons ablated (%)")
    axes[0, 0].set_ylim(-3, 103)
    axes[0, 0].legend(fontsize=8)
    if not ops:
        axes[0, 0].text(0.5, 0.5, "no heuristic to ablate", ha="center", va="center")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def prompt_ablation_plot(summary: pd.DataFrame, title: str = "", verdict_cap: int | None = None):
    """Nikankin Fig. 8: accuracy per operator against the cap (neurons zeroed per layer), with
    each prompt's heuristic neurons zeroed (full lines) vs the layer-matched random control
    (dashed), over the testable prompts (:func:`arithlib.nikankin.prompt_knockout.summarise`)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (op, g) in enumerate(summary.sort_values("cap").groupby("op", sort=False)):
        color = f"C{i}"
        ax.plot(g.cap, 100 * g.acc_heuristic_ablated, marker="o", color=color, label=f"{op} heuristic neurons")
        ax.plot(g.cap, 100 * g.acc_random_ablated, marker="o", ls="--", color=color, label=f"{op} random (control)")
    if verdict_cap is not None:
        ax.axvline(verdict_cap, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("neurons zeroed per layer (cap)")
    ax.set_ylabel("first-token accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.legend(fontsize=6, ncol=2, loc="lower left")
    fig.tight_layout()
    return fig


def correct_incorrect_plot(frame: pd.DataFrame, title: str = ""):
    """Sec. 4.3: number of associated heuristic neurons and their summed direct logit
    contribution to the correct answer, for correct vs incorrect prompts, per operator."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    data = frame.assign(outcome=np.where(frame.correct, "correct", "incorrect"))
    sns.boxplot(data=data, x="op", y="n_assoc_neurons", hue="outcome", ax=axes[0], fliersize=1)
    axes[0].set_ylabel("associated heuristic neurons (count)")
    sns.boxplot(data=data, x="op", y="assoc_contribution", hue="outcome", ax=axes[1], fliersize=1)
    axes[1].set_ylabel("their direct contribution to the\ncorrect answer's logit (logits)")
    for ax in axes:
        ax.set_xlabel("operator")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def dynamics_plot(dyn: pd.DataFrame, overlap: pd.DataFrame | None = None, title: str = ""):
    """Sec. 5 / Fig. 10: accuracy, share of circuit neurons labelled with a heuristic that
    beats the shuffled-operand null (dotted: the same procedure on shuffled activations;
    tables without the test show the share passing t alone), share labelled with a result
    rule, faithfulness and the share of the final model's heuristics present, over training
    steps, per operator."""
    share = (
        ("labelled_share", "circuit neurons labelled\n(t and null, FDR) (%)")
        if "labelled_share" in dyn
        else ("matched_share", "circuit neurons\nmatching a heuristic at t (%)")
    )
    panels = [
        ("accuracy", "grid accuracy (%)", 100),
        (share[0], share[1], 100),
        ("result_label_share", "circuit neurons whose best\nrule is a result rule (%)", 100),
        ("faithfulness", "faithfulness of the circuit", 1),
    ]
    if overlap is not None:
        panels.append(("final_heuristics_present", "final model's heuristics\npresent (%)", 100))
        dyn = dyn.merge(overlap, on=["step", "op"], how="left")
    panels = [p for p in panels if p[0] in dyn.columns or p[0] == "final_heuristics_present"]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.8 * len(panels), 3.5))
    x = dyn.step.clip(lower=1)
    for ax, (col, label, scale) in zip(axes, panels):
        for op, sub in dyn.assign(x=x).groupby("op"):
            (line,) = ax.plot(sub.x, sub[col] * scale, marker="o", label=op)
            if col == share[0]:
                ax.plot(sub.x, sub[col + "_null"] * scale, ls=":", color=line.get_color())
        ax.set_xscale("log")
        ax.set_xlabel("training step (log; step 0 shown at 1)")
        ax.set_ylabel(label)
        if col == "faithfulness":  # undefined-ish (tiny denominators) before the model answers anything
            ax.set_ylim(-0.5, 1.2)
            ax.set_ylabel(label + "\n(axis clipped to -0.5..1.2)")
    axes[0].legend(title="operator", fontsize=8)
    axes[1].text(0.02, 0.02, "dotted: shuffled activations", transform=axes[1].transAxes, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def attribution_check_plot(frame: pd.DataFrame, title: str = ""):
    """Attribution-patching estimate vs the exact effect of mean-ablating one neuron."""
    fig, ax = plt.subplots(figsize=(4.5, 4))
    ax.scatter(frame.exact_effect, frame.attribution, s=14)
    lim = [
        min(frame.exact_effect.min(), frame.attribution.min()),
        max(frame.exact_effect.max(), frame.attribution.max()),
    ]
    ax.plot(lim, lim, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("exact drop of the answer margin (logits)")
    ax.set_ylabel("attribution estimate (logits)")
    ax.set_title(title)
    fig.tight_layout()
    return fig
