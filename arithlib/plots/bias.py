"""Figures of notebook 07 (gender-bias editing with CNA, Yu & Ananiadou 2024 Sec. 6.2,
App. D). Each function takes the table the notebook saves and returns a figure with
labelled axes and units."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import font_safe

GENDER_COLORS = {"woman": "#c44e52", "man": "#4c72b0"}
KIND_COLORS = {"original": "#7f7f7f", "cna": "#dd8452", "random": "#55a868"}


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=10)


def profession_counts(top: pd.DataFrame, biased: pd.DataFrame, title: str) -> plt.Figure:
    """Per Table-22 prompt and gender: profession tokens among the top-k predictions,
    and how many of them are only in that gender's list (App. D)."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    prompts = sorted(top.prompt_id.unique())
    genders = sorted(top.gender.unique(), reverse=True)
    width = 0.8 / max(1, len(genders))
    prof = top[top.is_profession]
    for j, g in enumerate(genders):
        counts = [int(((prof.gender == g) & (prof.prompt_id == p)).sum()) for p in prompts]
        other = [set(prof[(prof.gender != g) & (prof.prompt_id == p)].token_id) for p in prompts]
        only = [
            int(sum(t not in other[i] for t in prof[(prof.gender == g) & (prof.prompt_id == p)].token_id))
            for i, p in enumerate(prompts)
        ]
        x = np.arange(len(prompts)) + (j - (len(genders) - 1) / 2) * width
        ax.bar(x, counts, width, color=GENDER_COLORS.get(g, None), alpha=0.35, label=f"{g}: professions in top-k")
        ax.bar(x, only, width, color=GENDER_COLORS.get(g, None), label=f"{g}: only in this gender's top-k")
    ax.set_xticks(range(len(prompts)))
    ax.set_xticklabels([f"P{p + 1}" for p in prompts])
    ax.set_xlabel("Table-22 prompt")
    ax.set_ylabel("profession tokens (count)")
    ax.set_title(title)
    if prof.empty:
        _empty(ax, "no profession token in any top-k list")
    else:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def bias_before_after(t13: pd.DataFrame, genders: Sequence[str], title: str) -> plt.Figure:
    """Table 13 as bars: total and per-gender bias (mean |delta log p|, nats) of the
    original model, the CNA edit and the random control (error bar: sd over seeds)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    cols = ["total", *genders]
    width = 0.8 / max(1, len(t13))
    for i, row in enumerate(t13.itertuples()):
        x = np.arange(len(cols)) + (i - (len(t13) - 1) / 2) * width
        vals = [getattr(row, c) for c in cols]
        err = None
        if "total_sd" in t13.columns and not pd.isna(getattr(row, "total_sd", np.nan)):
            err = [row.total_sd] + [0] * len(genders)
        kind = "original" if row.model == "original" else "cna" if row.model.startswith("CNA") else "random"
        ax.bar(x, vals, width, yerr=err, color=KIND_COLORS[kind], label=row.model, capsize=3)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(["all professions"] + [f"{g} professions" for g in genders])
    ax.set_ylabel("bias: mean |log p(w|woman) - log p(w|man)| (nats)")
    ax.set_title(title)
    if t13.empty:
        _empty(ax, "no biased professions")
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bias_sweep(summary: pd.DataFrame, title: str) -> plt.Figure:
    """Total bias (nats) against the number of zeroed neurons: CNA top-K vs random
    layer-matched neurons (mean and sd over seeds); dashed line: original model."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    orig = summary[summary.kind == "original"]
    cna = summary[summary.kind == "cna"].sort_values("K")
    rnd = summary[summary.kind == "random"].groupby("K").total.agg(["mean", "std"]).reset_index()
    if len(orig):
        ax.axhline(float(orig.total.iloc[0]), color=KIND_COLORS["original"], ls="--", label="original")
    if len(cna):
        ax.plot(cna.K, cna.total, "o-", color=KIND_COLORS["cna"], label="CNA top-K zeroed")
    if len(rnd):
        ax.errorbar(
            rnd.K,
            rnd["mean"],
            yerr=rnd["std"].fillna(0),
            fmt="s-",
            color=KIND_COLORS["random"],
            capsize=3,
            label="random K zeroed (mean ± sd)",
        )
    ax.set_xlabel("neurons zeroed (K)")
    ax.set_ylabel("bias, all 8 prompts (nats)")
    ax.set_title(title)
    if summary.empty or (len(cna) == 0 and len(rnd) == 0):
        _empty(ax, "no edit was run")
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def profession_shift(before: pd.DataFrame, after: pd.DataFrame, title: str) -> plt.Figure:
    """Per biased profession: mean signed bias towards its stereotyped gender (nats,
    over the 8 prompts) in the original and the edited model."""
    b = before.groupby(["token", "bias_gender"]).toward.mean().rename("original")
    a = after.groupby(["token", "bias_gender"]).toward.mean().rename("edited")
    frame = pd.concat([b, a], axis=1).reset_index().sort_values(["bias_gender", "original"])
    fig, ax = plt.subplots(figsize=(6.5, max(2.5, 0.22 * len(frame) + 1)))
    y = np.arange(len(frame))
    ax.barh(y - 0.2, frame.original, 0.4, color=KIND_COLORS["original"], label="original")
    ax.barh(y + 0.2, frame.edited, 0.4, color=KIND_COLORS["cna"], label="CNA edit")
    ax.set_yticks(y)
    ax.set_yticklabels([font_safe(f"{t} ({g[0].upper()})") for t, g in zip(frame.token, frame.bias_gender)], fontsize=7)
    ax.axvline(0, color="black", lw=0.5)
    ax.set_xlabel("log p(w | its gender) - log p(w | other gender), mean over prompts (nats)")
    ax.set_title(title)
    if frame.empty:
        _empty(ax, "no biased professions")
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def side_effects_plot(side: pd.DataFrame, title: str) -> plt.Figure:
    """Side effects per condition: LM loss change (nats/token), arithmetic accuracy
    (%), and the profession tokens' probability on gender-free prompts (ratio to the
    original model)."""
    labels = [
        (
            "original"
            if r.kind == "original"
            else f"{'CNA' if r.kind == 'cna' else 'random'} K={r.K}" + (f" s{r.seed}" if r.kind == "random" else "")
        )
        for r in side.itertuples()
    ]
    colors = [KIND_COLORS.get(k, "gray") for k in side.kind]
    panels = [
        ("lm_loss_change", "LM loss change (nats/token)"),
        ("arith_accuracy", "arithmetic accuracy (%)"),
        ("profession_mass_ratio", "P(profession) on 'A person ...'\n(ratio to original)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, (col, label) in zip(axes, panels):
        vals = side[col].to_numpy(dtype=float) * (100 if col == "arith_accuracy" else 1)
        ax.bar(range(len(side)), np.nan_to_num(vals), color=colors)
        ax.set_xticks(range(len(side)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(label)
        ax.set_xlabel("condition")
        if np.all(np.isnan(vals)):
            _empty(ax, "not measured")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def heldout(table: pd.DataFrame, title: str) -> plt.Figure:
    """Held-out check: bias (nats) on the professions / prompts used to choose the
    neurons and on those not used, original vs edited vs random control."""
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    if table.empty:
        _empty(ax, "no held-out split (too few biased professions)")
        ax.set_xlabel("subset")
        ax.set_ylabel("bias (nats)")
        fig.tight_layout()
        return fig
    cells = list(dict.fromkeys(table.cell))
    kinds = ["original", "cna", "random"]
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        sub = table[table.kind == kind].groupby("cell", sort=False).total.agg(["mean", "std"]).reindex(cells)
        x = np.arange(len(cells)) + (j - 1) * width
        ax.bar(
            x,
            sub["mean"],
            width,
            yerr=sub["std"].fillna(0) if kind == "random" else None,
            capsize=3,
            color=KIND_COLORS[kind],
            label={"original": "original", "cna": "CNA edit (selection half)", "random": "random (mean ± sd)"}[kind],
        )
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(cells, fontsize=8)
    ax.set_xlabel("professions x prompts")
    ax.set_ylabel("bias: mean |delta log p| (nats)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def edit_set(table: pd.DataFrame, title: str, n_tokens: int = 4) -> plt.Figure:
    """The edit set: each neuron's gender-balanced mean CNA change (nats) with its layer
    and the first top tokens of its value on the vocabulary."""
    fig, ax = plt.subplots(figsize=(7.5, max(2.5, 0.28 * len(table) + 1)))
    if table.empty:
        _empty(ax, "no neurons")
    else:
        y = np.arange(len(table))[::-1]
        ax.barh(y, table.mean_change, color=KIND_COLORS["cna"])
        labels = [
            font_safe(f"{r.name}: " + ", ".join(str(r.top_tokens).split(", ")[:n_tokens])[:40])
            for r in table.itertuples()
        ]  # tokens outside the font as \uXXXX, not empty boxes
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("mean CNA change imp(own gender) - imp(other gender) (nats)")
    ax.set_ylabel("neuron (layer_index: top tokens)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def layer_diagnostic_plot(diag: pd.DataFrame, genders: Sequence[str], title: str) -> plt.Figure:
    """Per layer: the RMS of the residual the importance is read from (log scale, each
    gender), a neuron's typical write relative to it, and the pooled CNA change with the
    edit set's neurons per layer (``bias_cna.layer_diagnostic``)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for g in genders:
        axes[0].plot(diag.layer, diag[f"resid_rms_{g}"], marker="o", ms=3, label=g)
        axes[1].plot(diag.layer, diag[f"write_to_resid_{g}"], marker="o", ms=3, label=g)
    axes[0].set(yscale="log", xlabel="layer", ylabel="RMS of x^{l-1} + A^l", title="residual read by the importance")
    axes[1].set(
        yscale="log",
        xlabel="layer",
        ylabel="median |m_k fc2_k| / |x^{l-1} + A^l|",
        title="a neuron's write vs that residual",
    )
    axes[0].legend(fontsize=8)
    ax = axes[2]
    ax.bar(diag.layer, diag.n_in_edit_set, color="tab:red", alpha=0.5, label="edit-set neurons")
    ax.set(xlabel="layer", ylabel="neurons in the edit set")
    ax2 = ax.twinx()
    ax2.plot(diag.layer, diag.max_change, color="k", marker=".", label="max pooled change")
    ax2.plot(diag.layer, diag.mean_abs_change, color="gray", marker=".", label="mean |pooled change|")
    ax2.set(yscale="log", ylabel="nats")
    ax2.legend(fontsize=8, loc="upper center")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def edit_effects(effects: pd.DataFrame, paper_pct: float, title: str) -> plt.Figure:
    """Bias reduction (%) with 95 % intervals per edit (``bias.reduction_intervals`` rows
    with a ``professions`` column) beside its random control, and the paper's number."""
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(effects) + 2), 4))
    if effects.empty:
        _empty(ax, "no edit")
        return fig
    labels = [f"{r.kind} K={r.K}\n{r.professions}" for r in effects.itertuples()]
    x = np.arange(len(effects))
    for off, col, color, name in ((-0.18, "reduction", "tab:red", "CNA edit"), (0.18, "random", "gray", "random sets")):
        est = effects["reduction_pct" if col == "reduction" else "random_pct"].to_numpy(float)
        lo, hi = effects[f"{col}_low"].to_numpy(float), effects[f"{col}_high"].to_numpy(float)
        err = np.vstack([est - lo, hi - est])
        ax.bar(x + off, est, 0.36, yerr=np.nan_to_num(err), capsize=3, color=color, label=name)
    ax.axhline(paper_pct, color="tab:blue", ls="--", label=f"paper (Llama-7B): {paper_pct} %")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set(ylabel="bias reduction (%)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
