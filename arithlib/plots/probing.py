"""Figures of notebook 02 (MLP probing). Each function takes the tables the notebook
also saves (one per model, in a dict keyed by model name, so two models are drawn
side by side) and returns a matplotlib Figure; saving is
:func:`arithlib.run.outputs.save_figure`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from ..zhang.mlp_curves import COSINE_MEASURES
from ..zhang.probing import PROBE_TARGETS

sns.set_theme(context="notebook", style="whitegrid")

#: Panels of Zhang et al. Fig. 6 (a: operands, b: answer) as lists of measures. Panel (b)
#: draws the MLP's write (resid_post - resid_mid, solid: the reading the report's verdict
#: takes, Zhang Sec. 4.2 "to isolate the specific contribution of MLP") beside the literal
#: MLP_out - MLP_in with the normalised input (dashed: the sensitivity reading), each with
#: its band.
PANELS: dict[str, list[str]] = {
    "(a) operands in MLP input/output": ["in_A", "in_B", "out_A", "out_B"],
    "(b) answer: MLP write (solid), MLP_out - MLP_in (dashed)": ["write_C", "write_other", "delta_C", "delta_other"],
    "(c) excess over the other numbers' mean": ["in_A_x", "in_B_x", "write_C_x", "delta_C_x"],
}
_STYLE = {
    "in_A": ("C3", "-"),
    "in_B": ("C0", "-"),
    "out_A": ("C3", ":"),
    "out_B": ("C0", ":"),
    "delta_C": ("C2", "--"),
    "delta_other": ("C7", "--"),
    "out_C": ("C2", ":"),
    "out_other": ("C7", ":"),
    "in_A_x": ("C3", "-"),
    "in_B_x": ("C0", "-"),
    "delta_C_x": ("C2", "--"),
    "out_C_x": ("C2", ":"),
    "write_C": ("C2", "-"),
    "write_other": ("C7", "-"),
    "write_C_x": ("C2", "-"),
}
_POINT_MARKERS = {"start": "^", "inflection": "s", "peak": "o", "end": "v"}


def short_name(model: str, width: int = 28) -> str:
    """A model name short enough for a panel title (the last part of a path)."""
    name = model.rstrip("/").split("/")[-1]
    return name if len(name) <= width else name[: width - 1] + "…"


def _grid(n_rows: int, n_cols: int, width: float = 5.2, height: float = 3.4):
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False)
    return fig, axes


def _key_layers(ax, layers: Sequence[int] | None) -> None:
    for i, layer in enumerate(sorted(set(layers or []))):
        ax.axvline(layer, color="C1", alpha=0.25, lw=3, label="key-head layer" if i == 0 else None)


def cosine_curves(
    summaries: Mapping[str, pd.DataFrame],
    key_layers: Mapping[str, Sequence[int]] | None = None,
    points: Mapping[str, pd.DataFrame] | None = None,
    panels: Mapping[str, list[str]] = PANELS,
    level: float = 0.95,
):
    """Zhang et al. Fig. 6a/6b (13, 14): mean cosine per layer with its confidence
    band, one row per model, one column per panel. ``summaries[model]`` is a
    :func:`arithlib.zhang.mlp_curves.summarise_curves` frame; ``key_layers[model]`` are marked
    as vertical bands; ``points[model]`` (columns ``measure, start, inflection, peak,
    end``) are marked on their curves."""
    fig, axes = _grid(len(summaries), len(panels))
    for r, (model, summary) in enumerate(summaries.items()):
        for c, (title, measures) in enumerate(panels.items()):
            ax = axes[r, c]
            _key_layers(ax, (key_layers or {}).get(model))
            for m in measures:
                s = summary[summary.measure == m].sort_values("layer")
                if s.empty:
                    continue
                color, ls = _STYLE.get(m, ("k", "-"))
                ax.plot(s.layer, s["mean"], color=color, ls=ls, label=COSINE_MEASURES[m][2])
                ax.fill_between(s.layer, s["lo"], s["hi"], color=color, alpha=0.2, lw=0)
                pts = (points or {}).get(model)
                if pts is not None and m in set(pts.measure):
                    row = pts[pts.measure == m].iloc[0]
                    for name, marker in _POINT_MARKERS.items():
                        layer = int(row[name])
                        y = s.set_index("layer")["mean"].get(layer, np.nan)
                        ax.plot([layer], [y], marker=marker, color=color, ms=6, ls="none")
            ax.axhline(0, color="k", lw=0.5)
            ax.set_xlabel("layer")
            ax.set_ylabel("cosine similarity" if c < 2 else "cosine difference")
            ax.set_title(f"{short_name(model)}: {title}", fontsize=9)
            ax.legend(fontsize=7, loc="best")
    fig.text(
        0.01,
        0.005,
        f"bands: {level:.0%} CI of the mean over prompts; markers: start ^, inflection s, peak o, end v",
        fontsize=7,
    )
    fig.tight_layout()
    return fig


def number_heatmap(
    projection: pd.DataFrame, answer: int, title: str = "", top_k: int = 3, vector_label: str = "MLP_out - MLP_in"
):
    """Zhang et al. Fig. 6c: cosine of MLP_out - MLP_in (or ``vector_label``'s vector)
    with each number's unembedding direction (columns) at each layer (rows); the top
    ``top_k`` numbers of each layer carry their rank, and the answer's column is outlined."""
    table = projection.pivot(index="layer", columns="number", values="value")
    ranks = projection.pivot(index="layer", columns="number", values="rank")
    annot = ranks.map(lambda r: str(int(r)) if r <= top_k else "")
    fig, ax = plt.subplots(figsize=(max(5.5, 1.2 + 0.45 * table.shape[1]), 1.2 + 0.28 * table.shape[0]))
    sns.heatmap(
        table,
        annot=annot,
        fmt="",
        cmap="RdBu_r",
        center=0,
        ax=ax,
        cbar_kws={"label": f"cos({vector_label}, W_U[n])"},
        annot_kws={"fontsize": 7},
    )
    if answer in list(table.columns):
        col = list(table.columns).index(answer)
        ax.add_patch(plt.Rectangle((col, 0), 1, table.shape[0], fill=False, edgecolor="k", lw=2))
    ax.set_xlabel("number token n (outlined: the answer's first token)")
    ax.set_ylabel("layer")
    ax.set_title(title or f"top-{top_k} numbers per layer (numbers in cells are ranks)", fontsize=9)
    fig.tight_layout()
    return fig


def distance_curves(profiles: Mapping[str, pd.DataFrame]):
    """Mean cos(MLP_out - MLP_in, W_U[n]) per layer for numbers n at distance
    |n - C| = 0, 1, 2, >= 3 from the answer C, one panel per model."""
    fig, axes = _grid(1, len(profiles))
    for c, (model, prof) in enumerate(profiles.items()):
        ax = axes[0, c]
        if prof.empty:
            ax.set_title(f"{short_name(model)}: no single-token answers", fontsize=9)
            continue
        top = prof.distance.max()
        for d, g in prof.groupby("distance"):
            label = f"|n - C| = {d}" if d < top else f"|n - C| >= {d}"
            ax.plot(g.layer, g["mean"], label=label, color=plt.cm.viridis(d / max(top, 1)))
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xlabel("layer")
        ax.set_ylabel("mean cos(MLP_out - MLP_in, W_U[n])")
        ax.set_title(f"{short_name(model)}: answer vs neighbouring numbers", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def lens_curves(summaries: Mapping[str, pd.DataFrame]):
    """Logit lens at the answer position: share of prompts where the answer is the
    top-1 / in the top-10 token, its mean probability (left), and its median rank
    (right, log scale), per layer (-1 = embedding); one row per model."""
    fig, axes = _grid(len(summaries), 2)
    for r, (model, s) in enumerate(summaries.items()):
        s = s.sort_values("layer")
        ax = axes[r, 0]
        ax.plot(s.layer, s.top1 * 100, label="answer is top-1 (%)", color="C2")
        ax.plot(s.layer, s.top10 * 100, label="answer in top-10 (%)", color="C2", ls=":")
        ax.plot(s.layer, s.mean_prob * 100, label="mean probability of answer (%)", color="C4")
        ax.set_ylim(-2, 102)
        ax.set_xlabel("layer (-1 = embedding)")
        ax.set_ylabel("% of prompts / probability (%)")
        ax.set_title(f"{short_name(model)}: logit lens at the answer position", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[r, 1]
        ax.plot(s.layer, s.median_rank + 1, color="C0", label="median rank + 1")
        ax.plot(s.layer, s.mean_rank + 1, color="C0", ls=":", label="mean rank + 1")
        ax.set_yscale("log")
        ax.set_xlabel("layer (-1 = embedding)")
        ax.set_ylabel("rank of the answer token + 1 (log)")
        ax.set_title(f"{short_name(model)}: rank of the answer token", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def dla_curves(summaries: Mapping[str, pd.DataFrame], key_layers: Mapping[str, Sequence[int]] | None = None):
    """Direct logit attribution to the answer token per layer: the attention and the
    MLP sublayer's mean contribution (logit units) with its confidence band; one panel
    per model. ``summaries[model]`` is a summarise_curves frame by (component, layer)."""
    fig, axes = _grid(1, len(summaries), width=6)
    for c, (model, s) in enumerate(summaries.items()):
        ax = axes[0, c]
        _key_layers(ax, (key_layers or {}).get(model))
        for comp, color in (("attn", "C0"), ("mlp", "C3")):
            g = s[s.component == comp].sort_values("layer")
            ax.plot(g.layer, g["mean"], color=color, label=f"{comp} output")
            ax.fill_between(g.layer, g["lo"], g["hi"], color=color, alpha=0.2, lw=0)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xlabel("layer")
        ax.set_ylabel("direct contribution to answer logit (logit units)")
        ax.set_title(f"{short_name(model)}: direct logit attribution", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def probe_curves(probes: Mapping[str, pd.DataFrame]):
    """Held-out probe score per layer (R^2 for values, accuracy for digits) with the
    shuffled-label baseline dashed; one row per model, one column per target."""
    targets = list(dict.fromkeys(t for p in probes.values() for t in p.target))
    fig, axes = _grid(len(probes), len(targets), width=3.8, height=3.0)
    for r, (model, p) in enumerate(probes.items()):
        for c, target in enumerate(targets):
            ax = axes[r, c]
            g = p[p.target == target].sort_values("layer")
            if g.empty:
                continue
            metric = g.metric.iloc[0]
            ax.plot(g.layer, g.score, color="C0", marker=".", label="probe")
            ax.plot(g.layer, g.baseline, color="C7", ls="--", label="shuffled labels")
            ax.set_ylim(min(-0.1, float(g[["score", "baseline"]].min().min())), 1.02)
            ax.set_xlabel("layer (-1 = embedding)")
            ax.set_ylabel(f"held-out {metric}" if c else f"{short_name(model)}\nheld-out {metric}")
            ax.set_title(PROBE_TARGETS[target][1], fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
