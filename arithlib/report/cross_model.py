"""Across models: the findings side by side, the size-axis metrics and trends, CROSS_MODEL.md
and the README's verdict table."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.papers import PAPERS, PAPERS_SHORT
from ..run.outputs import write_text
from .findings import FINDINGS, findings_table
from .render import RULES_TEXT, markdown_table
from .run_times import TIMES_END, TIMES_START, run_time_markdown
from .tables import VERDICTS, NotRun, Tables

# --------------------------------------------------------------------------- across models


def cross_model_table(fig_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Findings side by side for N models: columns finding, quantity, paper (the paper's
    number, on the "ours" row) and one per model (its folder name); rows: the model's
    size, then per finding its verdict, our one-line summary and every metric (layer
    positions as layer / n_layers, so models of different depth compare)."""
    names, columns = [], []
    for d in fig_dirs:
        tables = Tables(d)
        info = tables.info()
        col: dict[tuple[str, str], object] = {
            ("model", "n_layers"): info.get("n_layers", ""),
            ("model", "n_heads"): info.get("n_heads", ""),
            ("model", "d_mlp"): info.get("d_mlp", ""),
            ("model", "quick notebooks"): ",".join(sorted(nb for nb, p in tables.params().items() if p.get("quick"))),
        }
        for f, row in zip(FINDINGS, findings_table(d).itertuples()):
            col[(f.id, "verdict")] = row.verdict
            col[(f.id, "interval")] = row.interval
            col[(f.id, "ours")] = row.ours
            for k, v in row.metrics.items():
                col[(f.id, k)] = v
        names.append(Path(d).name)
        columns.append(col)
    keys: list[tuple[str, str]] = []
    for col in columns:  # rows in first-seen order: a metric only one model has still gets its row
        keys += [k for k in col if k not in keys]
    order = {f.id: i for i, f in enumerate(FINDINGS)}
    rank = {"verdict": 0, "interval": 1, "ours": 2}
    keys.sort(key=lambda k: (-1 if k[0] == "model" else order.get(k[0], len(order)), rank.get(k[1], 2)))
    paper = {f.id: f.paper_number for f in FINDINGS}
    frame = pd.DataFrame(
        {
            "finding": [k[0] for k in keys],
            "quantity": [k[1] for k in keys],
            "paper": [paper[k[0]] if k[1] == "ours" else "" for k in keys],
        }
    )
    for name, col in zip(_unique(names), columns):
        frame[name] = [col.get(k, "") for k in keys]
    return frame


def verdict_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The verdicts of :func:`cross_model_table`'s ``frame`` in one compact table: one row
    per finding (its paper and section, the paper's number, each model's verdict followed
    by the 95 % interval of the number it read, "reproduced [0.1, 0.3] (n = 48)") and a
    last row counting each model's verdicts."""
    models = [c for c in frame.columns if c not in ("finding", "quantity", "paper")]
    verdicts = frame[frame["quantity"] == "verdict"].set_index("finding")
    intervals = frame[frame["quantity"] == "interval"].set_index("finding")
    where = {f.id: (f"{PAPERS_SHORT[f.paper]}, {f.where}", f.paper_number) for f in FINDINGS}

    def cell(f: str, m: str) -> str:
        ci = str(intervals.at[f, m]) if f in intervals.index else ""
        return f"{verdicts.at[f, m]} {ci}" if ci and ci not in ("none", "nan") else str(verdicts.at[f, m])

    rows = [
        {"finding": f, "paper": where[f][0], "paper's number": where[f][1], **{m: cell(f, m) for m in models}}
        for f in verdicts.index
    ]
    counts = {
        m: ", ".join(f"{(verdicts[m] == v).sum()} {v}" for v in VERDICTS if (verdicts[m] == v).any()) for m in models
    }
    rows.append({"finding": "**all**", "paper": "", "paper's number": "", **counts})
    return pd.DataFrame(rows)


README_START = (
    "<!-- verdicts: written by `python -m arithlib.report --cross-in figures --readme README.md`; do not edit -->"
)
README_END = "<!-- /verdicts -->"


def replace_readme_block(
    text: str, block: str, start_line: str = README_START, end_line: str = README_END, what: str = "verdict"
) -> str:
    """``text`` with what lies between the lines ``start_line`` and ``end_line`` (default:
    the verdict block) replaced by ``block``; a clear error when the markers are missing or
    out of order."""
    start, end = text.find(start_line), text.find(end_line)
    if start < 0 or end < start:
        raise ValueError(
            f"the README has no {what} block: add the two lines\n{start_line}\n{end_line}\n"
            "where the table should go, then rerun"
        )
    head = text[: start + len(start_line)]
    return head + "\n" + block.rstrip("\n") + "\n" + text[end:]


TOY_FOLDER = "toy-arith"  # arithlib.core.models.TOY_MODEL (not imported: the report needs no torch)


def model_folders(figures: str | os.PathLike) -> list[Path]:
    """The folders of ``figures`` holding a real model's run (a notebook's
    ``NN_*_params.json``; the toy model's folder left out): the models of the cross-model
    report and of the README's verdict table."""
    root = Path(figures)
    return sorted(
        d for d in root.iterdir() if d.is_dir() and d.name != TOY_FOLDER and any(d.glob("[0-9][0-9]_*_params.json"))
    )


def _linked_models(
    table: pd.DataFrame, fig_dirs: Sequence[str | os.PathLike], link_from: str | os.PathLike
) -> pd.DataFrame:
    """``table`` with each model column named as a link to its ``REPORT.md``, relative to
    the folder ``link_from`` of the Markdown file that shows it."""
    links = {
        Path(d).name: Path(os.path.relpath(Path(d).resolve() / "REPORT.md", Path(link_from).resolve())).as_posix()
        for d in fig_dirs
    }
    return table.rename(columns={m: f"[{m}]({link})" for m, link in links.items()})


def _verdict_markdown(
    frame: pd.DataFrame, fig_dirs: Sequence[str | os.PathLike], link_from: str | os.PathLike | None
) -> str:
    table = verdict_table(frame)
    return markdown_table(table if link_from is None else _linked_models(table, fig_dirs, link_from))


def verdict_markdown(fig_dirs: Sequence[str | os.PathLike], link_from: str | os.PathLike | None = None) -> str:
    """:func:`verdict_table` of ``fig_dirs`` (models from the smallest up) as Markdown;
    with ``link_from`` (the folder of the file that shows it) the model names link to
    their reports. The README's verdict block is this with ``link_from`` its folder
    (``tests/notebooks/test_report.py`` checks the committed one)."""
    fig_dirs = models_by_size(fig_dirs)
    return _verdict_markdown(cross_model_table(fig_dirs), fig_dirs, link_from)


def n_params(info: dict) -> float:
    """Parameter count from a model's shapes (``model_info`` of the params files):
    attention (Q, O: d_model x n_heads d_head; K, V: d_model x n_kv_heads d_head),
    MLP (3 or 2 matrices of d_model x d_mlp) per layer, plus one embedding matrix;
    norms and biases are left out (< 0.1 %). NaN when a shape is missing."""
    try:
        L, d, h, kv = (int(info[k]) for k in ("n_layers", "d_model", "n_heads", "n_kv_heads"))
        dh, dm, V = int(info["d_head"]), int(info["d_mlp"]), int(info["d_vocab"])
    except (KeyError, TypeError, ValueError):
        return float("nan")
    attn = 2 * d * h * dh + 2 * d * kv * dh
    mlp = (3 if info.get("gated_mlp", True) else 2) * d * dm
    return float(L * (attn + mlp) + V * d)


def _heuristic_share(t: Tables, _metrics: dict[str, dict]) -> dict[str, float]:
    """Share of circuit neurons with a label that passes t and beats the shuffled-operand null
    (Nikankin Sec. 4.1 with the null of :mod:`arithlib.nikankin.heuristic_nulls`), against the same
    procedure on shuffled activations; NaN for a run older than the test (its share at t alone
    is no label)."""
    ms = t.csv("03_matched_share")
    if "labelled_share" not in ms:
        return {"labelled (t and null)": float("nan"), "labelled, shuffled activations": float("nan")}
    return {
        "labelled (t and null)": float(ms["labelled_share"].mean()),
        "labelled, shuffled activations": float(ms["labelled_share_null"].mean()),
    }


def _metric(finding_id: str, **series: str) -> Callable[[Tables, dict[str, dict]], dict[str, float]]:
    """Panel values from one finding's metrics: ``series label=metric key``."""

    def values(_t: Tables, metrics: dict[str, dict]) -> dict[str, float]:
        m = metrics[finding_id]
        return {label: float(m.get(key, float("nan"))) for label, key in series.items()}

    return values


#: The quantities compared across model sizes (a size axis), one panel each:
#: (panel title, y-axis label, values from a folder's tables and its findings' metrics).
CROSS_METRICS: tuple[tuple[str, str, Callable[[Tables, dict[str, dict]], dict[str, float]]], ...] = (
    (
        "Key heads (Zhang Sec. 5.1)",
        "share of heads",
        _metric("zhang_key_heads", **{"key-head share": "key-head share"}),
    ),
    (
        "Knockout gap (Zhang Fig. 3)",
        "accuracy drop",
        _metric("zhang_knockout", **{"effect order": "effect-rank drop", "random order": "random-rank drop"}),
    ),
    (
        "Answer direction rises (Zhang Fig. 6b)",
        "layer / n_layers",
        _metric(
            "zhang_mlp_answer",
            start="answer-writing start layer / n_layers",
            inflection="answer-writing inflection layer / n_layers",
            peak="answer-writing peak layer / n_layers",
        ),
    ),
    (
        "Neuron circuit size (Nikankin Fig. 4b)",
        "share of neurons per layer",
        _metric(
            "nikankin_faithfulness",
            **{"smallest share reaching faithfulness 0.9": "smallest share per layer reaching 0.9"},
        ),
    ),
    ("Heuristic neurons (Nikankin Sec. 4)", "share of circuit neurons", _heuristic_share),
    (
        "CNA mask / keep, top 99 (Yu Table 5)",
        "accuracy decrease (%)",
        _metric(
            "yu_mask_keep",
            mask="mask accuracy decrease (%)",
            keep="keep accuracy decrease (%)",
            **{"random mask": "random-mask accuracy decrease (%)"},
        ),
    ),
    (
        "Gender-bias edit (Yu Table 13)",
        "bias reduction (%)",
        _metric(
            "yu_gender_bias", **{"CNA neurons": "CNA bias reduction (%)", "random neurons": "random bias reduction (%)"}
        ),
    ),
)

#: Per-layer curves compared across sizes on normalised depth (layer / n_layers):
#: title -> (table, filter column, filter value, y column, y label).
CROSS_CURVES: dict[str, tuple[str, str | None, str | None, str, str]] = {
    "LoRA in one attention layer (Yu Fig. 2)": ("05_lora_accuracy_by_layer", None, None, "accuracy", "test accuracy"),
    "cos(MLP write, W_U[C]) (Zhang Fig. 6b)": ("02_mlp_cosines", "measure", "write_C", "mean", "mean cosine"),
    "cos(MLP_out - ln2(MLP_in), W_U[C]), literal reading": (
        "02_mlp_cosines",
        "measure",
        "delta_C",
        "mean",
        "mean cosine",
    ),
    "Logit lens: answer probability (Zhang Sec. 5.2)": ("02_logit_lens", None, None, "mean_prob", "mean p(answer)"),
}


def cross_model_metrics(fig_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Long table of :data:`CROSS_METRICS` for N model folders: model, n_params
    (:func:`n_params`), panel, ylabel, series, value (NaN where a study did not run)."""
    rows = []
    for name, d in zip(_unique([Path(d).name for d in fig_dirs]), fig_dirs):
        tables = Tables(d)
        metrics = findings_table(d).set_index("id")["metrics"].to_dict()
        size = n_params(tables.info())
        for panel, ylabel, values in CROSS_METRICS:
            try:
                got = values(tables, metrics)
            except (NotRun, KeyError, ValueError):
                got = {}
            for series, v in (got or {"": float("nan")}).items():
                rows.append(
                    {"model": name, "n_params": size, "panel": panel, "ylabel": ylabel, "series": series, "value": v}
                )
    return pd.DataFrame(rows)


def cross_model_curves(fig_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Long table of :data:`CROSS_CURVES`: model, n_params, curve, ylabel, layer,
    depth (= layer / n_layers) and value; layers < 0 (the "original" row) are dropped."""
    frames = []
    for name, d in zip(_unique([Path(d).name for d in fig_dirs]), fig_dirs):
        tables = Tables(d)
        for title, (table, col, val, y, ylabel) in CROSS_CURVES.items():
            if not tables.has(table):
                continue
            tab = tables.csv(table)
            if col is not None:
                tab = tab[tab[col].astype(str) == val]
            if "op" in tab.columns:  # per-operator rows: the pooled row if present, else the mean over operators
                tab = tab[tab["op"].astype(str) == "all"] if (tab["op"].astype(str) == "all").any() else tab
            tab = tab[pd.to_numeric(tab["layer"], errors="coerce") >= 0]
            if tab.empty or y not in tab:
                continue
            curve = tab.groupby("layer")[y].mean().reset_index()
            L = tables.n_layers(curve["layer"])
            frames.append(
                pd.DataFrame(
                    {
                        "model": name,
                        "n_params": n_params(tables.info()),
                        "curve": title,
                        "ylabel": ylabel,
                        "layer": curve["layer"].astype(int),
                        "depth": curve["layer"] / L,
                        "value": curve[y],
                    }
                )
            )
    cols = ["model", "n_params", "curve", "ylabel", "layer", "depth", "value"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)


#: A step between two models counts as a change when it exceeds this share of the
#: quantity's largest absolute value over the models (smaller steps are "flat").
TREND_TOLERANCE = 0.01


def size_trend(values: Sequence[float], tolerance: float = TREND_TOLERANCE) -> str:
    """How a quantity moves from the smallest model to the largest, ``values`` ordered by
    size (NaN = not run, skipped): "rises with size" / "falls with size" when every step
    between consecutive models goes that way by more than ``tolerance`` x max |value|,
    "flat" when no step does, "mixed" otherwise; "fewer than 3 models" when fewer
    than three have a value (two points always look monotone)."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if len(v) < 3:
        return "fewer than 3 models"
    tol = tolerance * float(np.abs(v).max())
    steps = np.diff(v)
    up, down = steps > tol, steps < -tol
    if up.all():
        return "rises with size"
    if down.all():
        return "falls with size"
    if not (up | down).any():
        return "flat"
    return "mixed"


def size_order(metrics: pd.DataFrame) -> list[str]:
    """The models of a :func:`cross_model_metrics` table by parameter count, smallest
    first, models of unknown size last (the column order of the report and its figure)."""
    sizes = metrics.drop_duplicates("model").set_index("model")["n_params"]
    return sorted(sizes.index, key=lambda m: (not np.isfinite(sizes[m]), sizes[m] if np.isfinite(sizes[m]) else 0.0))


def size_trends(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per panel and series of :func:`cross_model_metrics`: the value of each
    model (columns from the smallest model up) and :func:`size_trend` over them."""
    order = size_order(metrics)
    part = metrics[metrics["series"] != ""]
    rows = []
    for (panel, series), g in part.groupby(["panel", "series"], sort=False):
        by_model = g.set_index("model")["value"]
        vals = [float(by_model.get(m, float("nan"))) for m in order]
        rows.append({"panel": panel, "series": series, **dict(zip(order, vals)), "trend": size_trend(vals)})
    return pd.DataFrame(rows, columns=["panel", "series", *order, "trend"])


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def _size_key(tables: Tables) -> tuple[bool, float]:
    """Sort key: parameter count, models of unknown size last."""
    size = n_params(tables.info())
    return (not np.isfinite(size), size if np.isfinite(size) else 0.0)


def models_by_size(fig_dirs: Sequence[str | os.PathLike]) -> list[str | os.PathLike]:
    """``fig_dirs`` from the smallest model up (its parameter count; models of unknown size
    last): the column order of the verdict table, ``CROSS_MODEL.md`` and the README's
    run-time table."""
    return sorted(fig_dirs, key=lambda d: _size_key(Tables(d)))


def write_cross_model(
    fig_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    readme: str | os.PathLike | None = None,
) -> tuple[Path, Path]:
    """Write ``CROSS_MODEL.md`` and ``CROSS_MODEL.csv`` (the findings side by side, one
    column per model from the smallest up),
    ``CROSS_MODEL_metrics.csv`` / ``CROSS_MODEL_curves.csv`` (the size-axis quantities),
    ``CROSS_MODEL_trends.csv`` (each quantity's trend with size, :func:`size_trends`)
    and the figure ``CROSS_MODEL.png`` / ``.pdf`` (one panel per quantity, models
    ordered by size) into ``out_dir`` (default: the folder holding the first model
    folder); with ``readme``, the same verdict table goes into that file's verdict block
    (:func:`replace_readme_block`) and, where it has one, the models' run times into its
    run-time block (:func:`.run_times.run_time_markdown`); return the paths of the Markdown and the CSV."""
    from ..plots.report import cross_model_figure
    from ..run.outputs import save_figure, save_table

    out = Path(out_dir) if out_dir is not None else Path(fig_dirs[0]).resolve().parent
    fig_dirs = models_by_size(fig_dirs)  # columns from the smallest model up
    frame = cross_model_table(fig_dirs)
    metrics, curves = cross_model_metrics(fig_dirs), cross_model_curves(fig_dirs)
    save_table(metrics, out, "CROSS_MODEL_metrics")
    save_table(curves, out, "CROSS_MODEL_curves")
    save_figure(cross_model_figure(metrics, curves, size_order(metrics)), out, "CROSS_MODEL")
    sizes = metrics.drop_duplicates("model").set_index("model")["n_params"]
    papers = {f.id: f"{PAPERS[f.paper]}, {f.where}: {f.paper_number}" for f in FINDINGS}
    md = [
        "# Findings across models",
        "",
        RULES_TEXT,
        "",
        "Models (parameters from their shapes): "
        + ", ".join(f"{m} ({v / 1e6:.0f} M)" if np.isfinite(v) else m for m, v in sizes.items())
        + ".",
        "",
        "## Verdicts",
        "",
        _verdict_markdown(frame, fig_dirs, out),
        "",
        "![The size-axis quantities, one panel each](CROSS_MODEL.png)",
        "",
        "Layer positions are given as layer / n_layers. Paper numbers:",
        "",
    ]
    md += [f"- **{k}**: {v}" for k, v in papers.items()]
    trends = size_trends(metrics)
    if len(trends):
        save_table(trends, out, "CROSS_MODEL_trends")
        shown = trends.copy()
        for m in sizes.index:
            if m in shown:
                shown[m] = shown[m].map(lambda x: "not run" if not np.isfinite(x) else f"{x:.3g}")
        md += [
            "",
            "## Across sizes",
            "",
            "Each size-axis quantity by model, smallest first, and its trend by a fixed rule: "
            "'rises' / 'falls with size' when every step between consecutive models goes that way by more than "
            f"{TREND_TOLERANCE:.0%} of the quantity's largest absolute value, 'flat' when no step does, 'mixed' "
            "otherwise (some steps flat or opposite). With three models this describes these models; it is not "
            "a scaling law.",
            "",
            markdown_table(shown),
        ]
    md += ["", "## All findings", "", markdown_table(frame), ""]
    if readme is not None:
        path = Path(readme)
        text = replace_readme_block(path.read_text(), _verdict_markdown(frame, fig_dirs, path.parent))
        if TIMES_START in text:  # a README with a run-time block gets the committed runs' times
            text = replace_readme_block(text, run_time_markdown(fig_dirs), TIMES_START, TIMES_END, "run-time")
        write_text(path, text)
    md_path = write_text(out / "CROSS_MODEL.md", "\n".join(md))
    csv_path = write_text(out / "CROSS_MODEL.csv", frame.to_csv(index=False, float_format="%.6g"))
    return md_path, csv_path
