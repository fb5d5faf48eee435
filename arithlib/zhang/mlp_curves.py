"""What the MLPs read and write at the answer position, layer by layer, seen through the
unembedding.

Implements the "Key MLPs behavior" analysis of Zhang et al. 2024 (Sec. 5.2, Fig. 6,
13, 14), on the activations of :func:`arithlib.zhang.answer_cache.cache_answer_position`:

* :func:`unembed_cosines`: cos(MLP_in, W_U[A]), cos(MLP_in, W_U[B]), cos(MLP_out, ...),
  cos(MLP write, W_U[C]) and cos(MLP write, W_U[other numbers]) with the MLP's write
  resid_post - resid_mid, and the same for the literal MLP_out - MLP_in, per prompt and
  layer (Fig. 6a, 6b, 13, 14); :func:`summarise_curves` gives the mean and a confidence
  band; :func:`curve_points` finds where a curve starts, turns and ends (App. C).
* :func:`number_projection` / :func:`top_numbers` / :func:`coarse_to_fine`: the
  single-case view of Fig. 6c; :func:`distance_profile` the same over many prompts.

Naming. ``MLP_in`` is the MLP module's input, hook ``blocks.L.mlp.hook_in``: the
residual stream after the attention sublayer (``resid_mid``) passed through the
block's second norm *including its learned weight* (``blocks.L.ln2.hook_normalized``
is the same vector before the weight, so it is not the MLP's input). ``MLP_out`` is
the MLP module's output, ``blocks.L.hook_mlp_out``. Zhang et al. (Sec. 4.2) take
MLP_in as what the MLP receives from the residual stream and MLP_out as what it adds
back, and subtract them "to isolate the specific contribution of MLP": the isolated
contribution is the MLP's *write*, ``resid_post - resid_mid`` (measures ``write_*``,
read by the report's verdict; equal to ``MLP_out`` in a sequential block). The
literal ``MLP_out - MLP_in`` (output minus the normalised input; measures ``delta_*``)
is kept as a sensitivity reading: on Qwen2.5 the normalised input dominates it.

W_U direction of a number: the unembedding column ``W_U[:, t]`` of the number's first
token ``t``, tokenized without a leading space (per-digit tokenizers such as Qwen's
and SmolLM2's: operands 1..9 are single tokens, a result such as 12 is read through
its first token "1"; the toy model has one token per integer 0..999).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..core.prompt_sets import PromptSet
from ..core.readout import unembedding
from .answer_cache import AnswerCache

# --------------------------------------------------------------------------- number tokens


def first_token_id(tokenizer, n: int) -> int:
    """Id of the first token of ``str(n)`` tokenized alone, without special tokens."""
    ids = tokenizer(str(n), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{n} tokenizes to nothing")
    return int(ids[0])


def unembed_matrix(bridge) -> torch.Tensor:
    """``W_U`` [d_model, vocab] as a float32 CPU tensor (:func:`arithlib.core.readout.unembedding`)."""
    return unembedding(bridge)[0].cpu()


# --------------------------------------------------------------------------- Zhang Fig. 6 cosines

#: Measures of :func:`unembed_cosines`: (vector, direction) and the label used in figures.
COSINE_MEASURES: dict[str, tuple[str, str, str]] = {
    "in_A": ("mlp_in", "A", "cos(MLP_in, W_U[A])"),
    "in_B": ("mlp_in", "B", "cos(MLP_in, W_U[B])"),
    "out_A": ("mlp_out", "A", "cos(MLP_out, W_U[A])"),
    "out_B": ("mlp_out", "B", "cos(MLP_out, W_U[B])"),
    "delta_C": ("delta", "C", "cos(MLP_out - MLP_in, W_U[C])"),
    "delta_other": ("delta", "other", "cos(MLP_out - MLP_in, W_U[other])"),
    "out_C": ("mlp_out", "C", "cos(MLP_out, W_U[C])"),
    "out_other": ("mlp_out", "other", "cos(MLP_out, W_U[other])"),
    # the MLP's write into the residual stream (Zhang Sec. 4.2's isolated contribution)
    "write_C": ("write", "C", "cos(resid_post - resid_mid, W_U[C])"),
    "write_other": ("write", "other", "cos(resid_post - resid_mid, W_U[other])"),
    # excess over the other numbers: cos(v, W_U[X]) - mean over numbers n != X of cos(v, W_U[n])
    "in_A_x": ("mlp_in", "A-other", "cos(MLP_in, W_U[A]) - mean cos(MLP_in, W_U[n != A])"),
    "in_B_x": ("mlp_in", "B-other", "cos(MLP_in, W_U[B]) - mean cos(MLP_in, W_U[n != B])"),
    "delta_C_x": ("delta", "C-other", "cos(MLP_out - MLP_in, W_U[C]) - mean over n != C"),
    "out_C_x": ("mlp_out", "C-other", "cos(MLP_out, W_U[C]) - mean over n != C"),
    "write_C_x": ("write", "C-other", "cos(resid_post - resid_mid, W_U[C]) - mean over n != C"),
}


def _unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x / x.norm(dim=dim, keepdim=True).clamp_min(1e-12)


def unembed_cosines(
    cache: AnswerCache, prompts: PromptSet, W_U: torch.Tensor, numbers: Mapping[int, int]
) -> pd.DataFrame:
    """Zhang et al. Sec. 5.2 (Fig. 6a/b, 13, 14): per prompt and layer, the cosine of
    MLP_in, MLP_out, MLP_out - MLP_in and the MLP's write resid_post - resid_mid with
    the unembedding directions of operand A, operand B, the answer C (its first token)
    and the other candidate numbers.

    ``W_U[other]`` is the mean cosine over the number tokens in ``numbers``
    (:func:`arithlib.core.prompt_sets.single_token_numbers`) other than C's first token. The ``*_x`` measures are the
    excess of a target's cosine over that mean for the numbers other than the target
    (not in the paper: a control for the direction that all number tokens share, which
    dominates raw cosines when the embeddings are tied, as in Qwen2.5). Returns a long frame:
    ``prompt, op, template_id, a, b, answer, layer, measure, value`` (measures:
    :data:`COSINE_MEASURES`; the ``write_*`` ones only when the cache holds ``resid_mid``
    and ``resid_post``).
    """
    for kind in ("mlp_in", "mlp_out"):
        if kind not in cache.acts:
            raise ValueError(f"unembed_cosines needs {kind!r} in the cache")
    if len(cache) != len(prompts):
        raise ValueError(f"cache has {len(cache)} rows, prompts {len(prompts)}")
    tok = prompts.tokenizer
    recs = prompts.records
    a_ids = torch.tensor([first_token_id(tok, r.a) for r in recs])
    b_ids = torch.tensor([first_token_id(tok, r.b) for r in recs])
    c_ids = prompts.first_answer_ids
    num_ids = torch.tensor(list(numbers.values()))
    WU = _unit(W_U.float(), dim=0)  # unit columns
    vecs = {
        "mlp_in": _unit(cache.acts["mlp_in"]),
        "mlp_out": _unit(cache.acts["mlp_out"]),
        "delta": _unit(cache.acts["mlp_out"] - cache.acts["mlp_in"]),
    }
    if "resid_post" in cache.acts and "resid_mid" in cache.acts:
        vecs["write"] = _unit(cache.acts["resid_post"] - cache.acts["resid_mid"])
    dirs = {"A": WU[:, a_ids].T, "B": WU[:, b_ids].T, "C": WU[:, c_ids].T}  # [N, d]
    num_dirs = WU[:, num_ids]  # [d, K]
    ids = {"A": a_ids, "B": b_ids, "C": c_ids}
    n, n_layers = len(prompts), cache.n_layers
    num_cos = {k: torch.einsum("nld,dk->nlk", v, num_dirs) for k, v in vecs.items()}  # [N, L, K]

    def mean_other(vec: str, target: str) -> torch.Tensor:
        keep = (num_ids[None, :] != ids[target][:, None]).float()  # [N, K]
        return (num_cos[vec] * keep[:, None, :]).sum(-1) / keep.sum(-1).clamp_min(1)[:, None]

    frames = []
    for key, (vec, target, _) in COSINE_MEASURES.items():
        if vec not in vecs:
            continue
        v = vecs[vec]  # [N, L, d]
        if target == "other":
            vals = mean_other(vec, "C")
        elif target.endswith("-other"):
            t = target.split("-")[0]
            vals = torch.einsum("nld,nd->nl", v, dirs[t]) - mean_other(vec, t)
        else:
            vals = torch.einsum("nld,nd->nl", v, dirs[target])
        frames.append(
            pd.DataFrame(
                {
                    "prompt": np.repeat(np.arange(n), n_layers),
                    "layer": np.tile(np.arange(n_layers), n),
                    "measure": key,
                    "value": vals.reshape(-1).numpy(),
                }
            )
        )
    out = pd.concat(frames, ignore_index=True)
    meta = pd.DataFrame(
        {
            "prompt": np.arange(n),
            "op": [r.op for r in recs],
            "template_id": [r.template_id for r in recs],
            "a": [r.a for r in recs],
            "b": [r.b for r in recs],
            "answer": [r.answer for r in recs],
        }
    )
    return out.merge(meta, on="prompt")[
        ["prompt", "op", "template_id", "a", "b", "answer", "layer", "measure", "value"]
    ]


def summarise_curves(
    frame: pd.DataFrame, by: Sequence[str] = ("measure", "layer"), value: str = "value", level: float = 0.95
) -> pd.DataFrame:
    """Mean of ``value`` per group with a ``level`` confidence band for the mean
    (Student t: mean +- t * sd / sqrt(n)); columns ``mean, sd, n, lo, hi``."""
    from scipy import stats

    if not 0 < level < 1:
        raise ValueError("level must be in (0, 1)")
    g = frame.groupby(list(by))[value].agg(["mean", "std", "count"]).reset_index()
    g = g.rename(columns={"std": "sd", "count": "n"})
    t = stats.t.ppf(0.5 + level / 2, np.maximum(g["n"] - 1, 1))
    half = np.where(g["n"] > 1, t * g["sd"].fillna(0) / np.sqrt(g["n"]), 0.0)
    g["lo"], g["hi"] = g["mean"] - half, g["mean"] + half
    return g


@dataclass(frozen=True)
class CurvePoints:
    """Where a per-layer curve starts to rise, rises fastest, peaks and settles
    (Zhang et al.'s "start-inflection-end" pivot points, App. C); see :func:`curve_points`."""

    start: int
    inflection: int
    peak: int
    end: int
    rise: float  # max - min of the curve

    def as_dict(self) -> dict:
        return {
            "start": self.start,
            "inflection": self.inflection,
            "peak": self.peak,
            "end": self.end,
            "rise": self.rise,
        }


#: First layer searched by :func:`curve_points` (fixed in advance, the same for every
#: curve and model): the MLP of layer 0 reads the token embedding after a single attention
#: layer, and with tied input/output embeddings (Qwen2.5, SmolLM2) its cosine with any
#: W_U column measures the embedding's similarity with itself, not a computation (on
#: Qwen-0.5B cos(MLP_out - MLP_in, W_U[C]) jumps from -0.49 at layer 0 to -0.03 at
#: layer 1, which alone decided the old inflection). Zhang's curves (Fig. 6, 13, 14) are
#: flat over the first dozen layers, so excluding layer 0 removes no turn they describe.
FIRST_CURVE_LAYER = 1


def curve_points(
    y: Sequence[float], direction: str = "rise", frac: float = 0.1, first_layer: int = FIRST_CURVE_LAYER
) -> CurvePoints:
    """Start, inflection, peak and end of a per-layer curve, by this rule.

    Only layers ``first_layer``.. are searched (:data:`FIRST_CURVE_LAYER`: layer 0,
    whose MLP reads the raw embedding, is left out); returned layers are indices into
    ``y``. With R = max(y) - min(y) over those layers and tolerance ``frac`` * R (10 %):

    * ``peak``: the layer of the maximum;
    * ``start``: the layer after the last layer before the peak whose value is below
      min(y[:peak + 1]) + frac * R, i.e. where the final climb to the peak begins
      (``first_layer`` if the curve never is that low). This is Zhang et al.'s
      "inflection" of the answer curve (App. C, Fig. 14: "initial stabilization
      followed by an increase"; Sec. 5.2: "starting from the 17th layer ... a noticeable
      increase"): the layer where the plateau turns into the climb;
    * ``inflection``: the layer of the largest one-layer increase y[l] - y[l-1] in
      start..peak (the steepest point of the climb; the peak itself if start == peak);
    * ``end``: the first layer at or after the inflection from which the curve stays
      within frac * R of its last value (where a rise-then-fall curve has settled, or
      where a rising curve reaches its plateau).

    ``direction="fall"`` applies the rule to -y (for a curve that drops, such as
    cos(MLP_out - MLP_in, W_U[other])).
    """
    if direction not in ("rise", "fall"):
        raise ValueError("direction must be 'rise' or 'fall'")
    if not 0 < frac < 1:
        raise ValueError("frac must be in (0, 1)")
    full = np.asarray(y, dtype=float)
    if full.ndim != 1 or not 0 <= first_layer <= len(full) - 2 or not np.all(np.isfinite(full[first_layer:])):
        raise ValueError(f"curve_points needs a 1-d curve with at least 2 finite values from layer {first_layer} on")
    arr = full[first_layer:]
    off = first_layer
    if direction == "fall":
        arr = -arr
    rng = float(arr.max() - arr.min())
    peak = int(np.argmax(arr))
    if rng == 0:
        return CurvePoints(off, off, off + peak, off, 0.0)
    tol = frac * rng
    low = arr[: peak + 1].min() + tol
    below = [i for i in range(peak) if arr[i] < low]
    start = below[-1] + 1 if below else 0
    if peak > start:
        steps = np.diff(arr[start : peak + 1])
        inflection = start + 1 + int(np.argmax(steps))
    else:
        inflection = peak
    final = arr[-1]
    end = len(arr) - 1
    for i in range(inflection, len(arr)):
        if np.all(np.abs(arr[i:] - final) <= tol):
            end = i
            break
    return CurvePoints(off + start, off + inflection, off + peak, off + end, rng)


#: Which way each measure's curve is expected to move (Zhang et al. Sec. 5.2): the
#: operand and answer similarities rise, the similarity with other numbers falls.
CURVE_DIRECTIONS: dict[str, str] = {
    "in_A": "rise",
    "in_B": "rise",
    "out_A": "rise",
    "out_B": "rise",
    "delta_C": "rise",
    "delta_other": "fall",
    "out_C": "rise",
    "out_other": "fall",
    "in_A_x": "rise",
    "in_B_x": "rise",
    "delta_C_x": "rise",
    "out_C_x": "rise",
    "write_C": "rise",
    "write_other": "fall",
    "write_C_x": "rise",
}


def curve_point_table(
    summary: pd.DataFrame,
    directions: Mapping[str, str] = CURVE_DIRECTIONS,
    frac: float = 0.1,
    first_layer: int = FIRST_CURVE_LAYER,
) -> pd.DataFrame:
    """:func:`curve_points` of the mean curve of every measure of a
    :func:`summarise_curves` frame (by measure and layer) present in ``directions``.
    Columns ``measure, label, direction, first_layer, start, inflection, peak, end, rise``
    (``first_layer``: where the search began, :data:`FIRST_CURVE_LAYER` unless the model
    is too shallow for it, which is warned about)."""
    rows = []
    for m, direction in directions.items():
        curve = summary[summary.measure == m].sort_values("layer")["mean"].to_numpy()
        if len(curve) < 2:
            continue
        first = first_layer
        if len(curve) - first < 2:  # a 2-layer model (the toy): no curve after layer 0; said, and recorded
            first = len(curve) - 2
            warnings.warn(
                f"{m}: {len(curve)} layers leave no curve from layer {first_layer} on; "
                f"curve points searched from layer {first}",
                stacklevel=2,
            )
        rows.append(
            {
                "measure": m,
                "label": COSINE_MEASURES[m][2],
                "direction": direction,
                "first_layer": first,
                **curve_points(curve, direction, frac, first).as_dict(),
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- Fig. 6c single case


def number_projection(
    cache: AnswerCache, index: int, W_U: torch.Tensor, numbers: Mapping[int, int], vector: str = "delta"
) -> pd.DataFrame:
    """Zhang et al. Fig. 6c: for prompt ``index``, the cosine of MLP_out - MLP_in
    (``vector="delta"``; or "mlp_out", "mlp_in") with the unembedding direction of every
    number in ``numbers`` at every layer. Columns ``layer, number, value, rank`` (rank 1
    = the most aligned number at that layer)."""
    if not 0 <= index < len(cache):
        raise IndexError(f"prompt index {index} out of range 0..{len(cache) - 1}")
    if vector == "delta":
        v = cache.acts["mlp_out"][index] - cache.acts["mlp_in"][index]
    elif vector in cache.acts:
        v = cache.acts[vector][index]
    else:
        raise ValueError(f"unknown vector {vector!r}")
    nums = list(numbers)
    dirs = _unit(W_U.float()[:, list(numbers.values())], dim=0)
    cos = _unit(v) @ dirs  # [L, K]
    ranks = (-cos).argsort(-1).argsort(-1) + 1
    L = cos.shape[0]
    return pd.DataFrame(
        {
            "layer": np.repeat(np.arange(L), len(nums)),
            "number": np.tile(nums, L),
            "value": cos.reshape(-1).numpy(),
            "rank": ranks.reshape(-1).numpy(),
        }
    )


def top_numbers(projection: pd.DataFrame, k: int = 3) -> pd.DataFrame:
    """The ``k`` most aligned numbers per layer of a :func:`number_projection` frame:
    columns ``layer, top`` (a list, best first) and ``top_values``."""
    rows = []
    for layer, g in projection.groupby("layer"):
        g = g.sort_values("value", ascending=False).head(k)
        rows.append({"layer": int(layer), "top": g["number"].tolist(), "top_values": g["value"].round(4).tolist()})
    return pd.DataFrame(rows)


def coarse_to_fine(projection: pd.DataFrame, answer: int) -> dict:
    """Does the answer form coarse-to-fine in a :func:`number_projection` (Zhang et al.
    Sec. 5.2: neighbours of C come up with or before C, then C stays on top while they
    fall back)? Returns, for the answer's number C:

    * ``first_top1``: first layer from which C is the most aligned number at every
      later layer (None if it is not top-1 at the last layer);
    * ``neighbour_top_layers``: layers before ``first_top1`` where C - 1 or C + 1 is in
      the top 3;
    * ``rank_by_layer``: C's rank per layer;
    * ``coarse_to_fine``: True when ``first_top1`` exists and some neighbour was in the
      top 3 before it (the pattern of Fig. 6c).
    """
    if answer not in set(projection["number"]):
        raise ValueError(f"answer {answer} is not among the projected numbers")
    layers = sorted(projection["layer"].unique())
    ranks = projection[projection.number == answer].set_index("layer")["rank"].reindex(layers)
    first = None
    for layer in reversed(layers):
        if ranks[layer] == 1:
            first = int(layer)
        else:
            break
    neighbours = {answer - 1, answer + 1}
    near = []
    for layer in layers:
        if first is not None and layer >= first:
            break
        top3 = set(projection[(projection.layer == layer) & (projection["rank"] <= 3)]["number"])
        if top3 & neighbours:
            near.append(int(layer))
    return {
        "answer": answer,
        "first_top1": first,
        "neighbour_top_layers": near,
        "rank_by_layer": [int(r) for r in ranks.tolist()],
        "coarse_to_fine": bool(first is not None and near),
    }


def distance_profile(
    cache: AnswerCache,
    prompts: PromptSet,
    W_U: torch.Tensor,
    numbers: Mapping[int, int],
    vector: str = "delta",
    max_distance: int = 3,
) -> pd.DataFrame:
    """Fig. 6c over many prompts: per layer, the mean cosine of MLP_out - MLP_in with
    the unembedding of numbers at distance d = |n - C| from the answer C (d = 0, 1, ...,
    ``max_distance`` and above pooled), over prompts whose answer is one number token
    in ``numbers``. Coarse-to-fine predicts that d = 1 rises above d >= 2 before the
    d = 0 curve separates from d = 1. Columns ``layer, distance, mean, n``."""
    keep = [
        i for i, r in enumerate(prompts.records) if r.answer in numbers and prompts.answer_ids[i] == [numbers[r.answer]]
    ]
    if not keep:
        return pd.DataFrame(columns=["layer", "distance", "mean", "n"])
    nums = torch.tensor(list(numbers))
    dirs = _unit(W_U.float()[:, list(numbers.values())], dim=0)
    idx = torch.tensor(keep)
    if vector == "delta":
        v = cache.acts["mlp_out"][idx] - cache.acts["mlp_in"][idx]
    else:
        v = cache.acts[vector][idx]
    cos = torch.einsum("nld,dk->nlk", _unit(v), dirs)  # [n, L, K]
    answers = torch.tensor([prompts.records[i].answer for i in keep])
    dist = (nums[None, :] - answers[:, None]).abs().clamp_max(max_distance)  # [n, K]
    rows = []
    for d in range(max_distance + 1):
        mask = (dist == d).float()  # [n, K]
        cnt = mask.sum(-1)  # per prompt
        ok = cnt > 0
        if not ok.any():
            continue
        per_prompt = (cos * mask[:, None, :]).sum(-1)[ok] / cnt[ok][:, None]  # [n_ok, L]
        for layer, val in enumerate(per_prompt.mean(0).tolist()):
            rows.append({"layer": layer, "distance": d, "mean": val, "n": int(ok.sum())})
    return pd.DataFrame(rows)
