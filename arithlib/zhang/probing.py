"""What the MLPs read and write at the answer position, layer by layer.

Implements the "Key MLPs behavior" analysis of Zhang et al. 2024 (Sec. 5.2, Fig. 6,
13, 14) and linear probes of the residual stream (the probing side of Nikankin et al.
2025):

* :func:`cache_answer_position` runs a prompt set once and keeps only the
  activations at the answer position (the last token): ``resid_pre``,
  ``resid_mid``, ``resid_post``, ``mlp_in``, ``mlp_out``, ``attn_out`` of every
  layer, plus the final norm's scale (for direct logit attribution) and whether the
  model answers each prompt (first token, and the whole answer by greedy decoding).
* :func:`unembed_cosines`: cos(MLP_in, W_U[A]), cos(MLP_in, W_U[B]), cos(MLP_out, ...),
  cos(MLP write, W_U[C]) and cos(MLP write, W_U[other numbers]) with the MLP's write
  resid_post - resid_mid, and the same for the literal MLP_out - MLP_in, per prompt and
  layer (Fig. 6a, 6b, 13, 14); :func:`summarise_curves` gives the mean and a confidence
  band; :func:`curve_points` finds where a curve starts, turns and ends.
* :func:`number_projection` / :func:`top_numbers` / :func:`coarse_to_fine`: the
  single-case view of Fig. 6c; :func:`distance_profile` the same over many prompts.
* :func:`linear_probes`: per-layer scikit-learn probes with a held-out split grouped by
  operand pair and a shuffled-label baseline.

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
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.evaluate import continues_number
from ..core.prompt_sets import PromptSet
from ..core.readout import unembedding
from ..engine import PrefixRunner

#: Activation kinds cached at the answer position and the bridge hook of each
#: (``{L}`` is the layer).
ACT_HOOKS: dict[str, str] = {
    "resid_pre": "blocks.{L}.hook_resid_pre",
    "resid_mid": "blocks.{L}.hook_resid_mid",
    "resid_post": "blocks.{L}.hook_resid_post",
    "mlp_in": "blocks.{L}.mlp.hook_in",
    "mlp_out": "blocks.{L}.hook_mlp_out",
    "attn_out": "blocks.{L}.hook_attn_out",
}
#: The final norm's per-position scale (RMS, or std for LayerNorm), for DLA.
FINAL_SCALE_HOOK = "ln_final.hook_scale"


# --------------------------------------------------------------------------- caching


@dataclass
class AnswerCache:
    """Answer-position activations of a prompt set, aligned with its prompts.

    ``acts[kind]`` is [N, n_layers, d_model] (float32, CPU); ``final_scale`` [N] is the
    final norm's scale at the answer position; ``answer_logit`` [N] and ``pred_ids`` [N]
    come from the model's own logits there; ``correct_first`` [N] is "the first answer
    token is the argmax"; ``correct_full`` [N] (or None) is "greedy decoding spells the
    whole answer and then stops", the criterion of :func:`arithlib.core.evaluate.evaluate`.
    """

    acts: dict[str, torch.Tensor]
    final_scale: torch.Tensor
    answer_logit: torch.Tensor
    pred_ids: torch.Tensor
    correct_first: torch.Tensor
    correct_full: torch.Tensor | None = None
    generated: list[list[int]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.pred_ids)

    @property
    def n_layers(self) -> int:
        return next(iter(self.acts.values())).shape[1]

    @property
    def correct(self) -> torch.Tensor:
        """``correct_full`` where it was checked, else ``correct_first``."""
        return self.correct_full if self.correct_full is not None else self.correct_first

    def subset(self, index: Sequence[int] | torch.Tensor) -> AnswerCache:
        """The rows at ``index`` (ints or a bool mask), in that order."""
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            index = index.nonzero().flatten()
        idx = torch.as_tensor(list(index) if not isinstance(index, torch.Tensor) else index, dtype=torch.long)
        return AnswerCache(
            acts={k: v[idx] for k, v in self.acts.items()},
            final_scale=self.final_scale[idx],
            answer_logit=self.answer_logit[idx],
            pred_ids=self.pred_ids[idx],
            correct_first=self.correct_first[idx],
            correct_full=None if self.correct_full is None else self.correct_full[idx],
            generated=None if self.generated is None else [self.generated[i] for i in idx.tolist()],
        )


@torch.no_grad()
def cache_answer_position(
    bridge,
    prompts: PromptSet,
    kinds: Iterable[str] = tuple(ACT_HOOKS),
    batch_size: int = 32,
    share_prefix: bool = True,
    check_full_answer: bool = True,
    progress: bool = True,
) -> AnswerCache:
    """Run every prompt once and keep the answer-position activations of ``kinds``.

    Why not ``bridge.run_with_cache``: it stores every position of every hook and
    unembeds every position; here hooks copy only the last position and the model
    is asked for the last position's logits only (``logits_to_keep=1``).

    The batches are those of :class:`arithlib.engine.PrefixRunner`: with
    ``share_prefix`` each few-shot prefix runs once and the rest of every prompt on top
    of its key/value cache (the recording hooks are off during the prefix, so the last
    position's activations are those of a full forward pass, tested to float
    tolerance). With ``check_full_answer`` the same key/value cache checks greedy
    decoding of the whole answer in one teacher-forced pass
    (:meth:`~arithlib.engine.PrefixRunner.forced_continuation`; hooks record nothing
    then) to set ``correct_full``, as :func:`arithlib.core.evaluate.evaluate` does.
    """
    kinds = list(kinds)
    unknown = [k for k in kinds if k not in ACT_HOOKS]
    if unknown:
        raise ValueError(f"unknown activation kind(s) {unknown}; choose from {list(ACT_HOOKS)}")
    if len(prompts) == 0:
        raise ValueError("cache_answer_position got an empty prompt set")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    n_layers, d_model, n = int(bridge.cfg.n_layers), int(bridge.cfg.d_model), len(prompts)
    acts = {k: torch.zeros(n, n_layers, d_model) for k in kinds}
    final_scale = torch.zeros(n)
    answer_logit = torch.zeros(n)
    pred_ids = torch.zeros(n, dtype=torch.long)
    generated: list[list[int]] = [[] for _ in range(n)]

    state: dict = {"on": False, "rows": None}

    @contextmanager
    def recording():
        state["on"] = True
        try:
            yield
        finally:
            state["on"] = False

    def make_hook(kind: str, layer: int):
        def hook(x, hook=None):
            if state["on"]:
                acts[kind][state["rows"], layer] = x[:, -1].detach().float().cpu()
            return x

        return hook

    def scale_hook(x, hook=None):
        if state["on"]:
            final_scale[state["rows"]] = x[:, -1].detach().float().reshape(-1).cpu()
        return x

    fwd_hooks = [(ACT_HOOKS[k].format(L=layer), make_hook(k, layer)) for k in kinds for layer in range(n_layers)]
    fwd_hooks.append((FINAL_SCALE_HOOK, scale_hook))
    runner = PrefixRunner(bridge, prompts, batch_size, share=share_prefix)

    with bridge.hooks(fwd_hooks=fwd_hooks):
        for p, index in tqdm(runner.plan, desc="answer-position cache", disable=not progress, leave=False):
            state["rows"] = torch.tensor(index)
            logits, past = runner.first_step(p, index, suffix_context=recording)
            answers = torch.tensor([prompts.answer_ids[i][0] for i in index], device=logits.device)
            answer_logit[index] = logits.gather(1, answers[:, None]).squeeze(1).cpu()
            pred_ids[index] = logits.argmax(-1).cpu()
            if check_full_answer:
                for i, gen in zip(index, runner.forced_continuation(logits, past, index)):
                    generated[i] = gen

    first = torch.tensor([a[0] for a in prompts.answer_ids])
    correct_full = None
    if check_full_answer:
        tok = prompts.tokenizer
        correct_full = torch.tensor(
            [g[: len(a)] == a and not continues_number(tok, g[len(a)]) for g, a in zip(generated, prompts.answer_ids)],
            dtype=torch.bool,
        )
    return AnswerCache(
        acts,
        final_scale,
        answer_logit,
        pred_ids,
        pred_ids == first,
        correct_full,
        generated if check_full_answer else None,
    )


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


def stratified_indices(prompts: PromptSet, n_total: int, by: str = "op", seed: int = 0) -> list[int]:
    """At most ``n_total`` prompt indices, the same number (n_total // groups) drawn at
    random (seeded) from each value of the record field ``by``; sorted."""
    if n_total < 1:
        raise ValueError("n_total must be at least 1")
    groups: dict = {}
    for i, r in enumerate(prompts.records):
        groups.setdefault(getattr(r, by), []).append(i)
    if not groups:
        return []
    per = max(1, n_total // len(groups))
    rng = np.random.default_rng(seed)
    out = []
    for key in sorted(groups, key=str):
        idx = groups[key]
        out += rng.choice(idx, size=min(per, len(idx)), replace=False).tolist() if len(idx) > per else list(idx)
    return sorted(int(i) for i in out)


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


# --------------------------------------------------------------------------- linear probes


#: Probe targets: record field -> (kind, description). "regression" is scored by
#: held-out R^2, "classification" by held-out accuracy.
PROBE_TARGETS: dict[str, tuple[str, str]] = {
    "a": ("regression", "operand A (value)"),
    "b": ("regression", "operand B (value)"),
    "result": ("regression", "result C (value)"),
    "result_last_digit": ("classification", "last digit of C"),
    "a_last_digit": ("classification", "last digit of A"),
    "b_last_digit": ("classification", "last digit of B"),
}


def probe_labels(
    prompts: PromptSet, targets: Sequence[str] = ("a", "b", "result", "result_last_digit")
) -> pd.DataFrame:
    """One row per prompt with the label of each probe target (:data:`PROBE_TARGETS`)
    and a ``group`` column (operator and operand pair) for the grouped split."""
    bad = [t for t in targets if t not in PROBE_TARGETS]
    if bad:
        raise ValueError(f"unknown probe target(s) {bad}; choose from {list(PROBE_TARGETS)}")
    cols = {"a": [], "b": [], "result": [], "result_last_digit": [], "a_last_digit": [], "b_last_digit": []}
    for r in prompts.records:
        cols["a"].append(r.a)
        cols["b"].append(r.b)
        cols["result"].append(r.answer)
        cols["result_last_digit"].append(abs(r.answer) % 10)
        cols["a_last_digit"].append(abs(r.a) % 10)
        cols["b_last_digit"].append(abs(r.b) % 10)
    frame = pd.DataFrame({t: cols[t] for t in targets})
    frame["group"] = [f"{r.op}|{r.a}|{r.b}" for r in prompts.records]
    return frame


def grouped_split(groups: Sequence, test_frac: float = 0.25, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train and test row indices with every group wholly on one side (scikit-learn's
    GroupShuffleSplit): a prompt's operand pair never appears in both, so a probe
    cannot pass by remembering pairs seen in another template."""
    from sklearn.model_selection import GroupShuffleSplit

    if not 0 < test_frac < 1:
        raise ValueError("test_frac must be in (0, 1)")
    groups = np.asarray(groups)
    if len(np.unique(groups)) < 2:
        raise ValueError("a grouped split needs at least two distinct groups")
    split = GroupShuffleSplit(n_splits=1, test_size=test_frac, random_state=seed)
    train, test = next(split.split(np.zeros(len(groups)), groups=groups))
    return train, test


def _fit_score(kind: str, x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray) -> float:
    """Held-out R^2 (ridge, alpha chosen by efficient leave-one-out CV on the training
    rows) or accuracy (multinomial logistic regression), on standardised features."""
    from sklearn.linear_model import LogisticRegression, RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "regression":
        model = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-1, 5, 13)))
    else:
        if len(np.unique(y_tr)) < 2:
            return float(np.mean(y_te == y_tr[0]))
        model = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=300))
    model.fit(x_tr, y_tr)
    return float(model.score(x_te, y_te))


def linear_probes(
    acts: torch.Tensor,
    labels: pd.DataFrame,
    targets: Sequence[str] | None = None,
    test_frac: float = 0.25,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    layer_labels: Sequence[int] | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Per-layer linear probes on answer-position activations ``acts`` [N, L, d].

    For each target of ``labels`` (:func:`probe_labels`) and each layer: a probe
    trained on the training rows of a split grouped by operand pair
    (:func:`grouped_split`) is scored on the held-out rows (R^2 for values, accuracy
    for digits); the same probe trained on randomly permuted training labels gives
    the ``baseline``. Uses scikit-learn (RidgeCV; LogisticRegression with C=0.1):
    TransformerLens's ``tools.analysis.sparse_probing`` fits k-sparse *binary*
    probes, while these targets are multi-class digits and real values.

    ``layers`` picks indices of the second axis of ``acts`` (default all);
    ``layer_labels[i]`` names index i in the output (default i; e.g. -1 for the embedding
    of :func:`arithlib.zhang.lens.lens_stack`). Returns columns
    ``target, kind, metric, layer, score, baseline, n_train, n_test``.
    """
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    if acts.ndim != 3 or acts.shape[0] != len(labels):
        raise ValueError(f"acts must be [N, L, d] with N = len(labels) = {len(labels)}; got {tuple(acts.shape)}")
    targets = [t for t in labels.columns if t in PROBE_TARGETS] if targets is None else list(targets)
    if not targets:
        raise ValueError("no probe target columns in labels")
    train, test = grouped_split(labels["group"].to_numpy(), test_frac, seed)
    rng = np.random.default_rng(seed)
    x = acts.float().numpy()
    layers = list(range(acts.shape[1])) if layers is None else list(layers)
    if layer_labels is not None and len(layer_labels) != acts.shape[1]:
        raise ValueError(f"layer_labels has {len(layer_labels)} entries for {acts.shape[1]} layers")
    names = list(range(acts.shape[1])) if layer_labels is None else list(layer_labels)
    rows = []
    jobs = [(t, layer) for t in targets for layer in layers]
    # one BLAS thread: these fits are small, and multi-threaded BLAS on a shared CPU
    # is ten times slower than one thread (measured on 2 busy cores)
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        for target, layer in tqdm(jobs, desc="probes", disable=not progress, leave=False):
            kind = PROBE_TARGETS[target][0]
            y = labels[target].to_numpy()
            xl = x[:, layer]
            score = _fit_score(kind, xl[train], y[train], xl[test], y[test])
            shuffled = rng.permutation(y[train])
            base = _fit_score(kind, xl[train], shuffled, xl[test], y[test])
            rows.append(
                {
                    "target": target,
                    "kind": kind,
                    "metric": "R2" if kind == "regression" else "accuracy",
                    "layer": names[layer],
                    "score": score,
                    "baseline": base,
                    "n_train": len(train),
                    "n_test": len(test),
                }
            )
    return pd.DataFrame(rows)


def best_layers(probes: pd.DataFrame) -> pd.DataFrame:
    """Per target, the layer with the highest held-out score, its score and baseline."""
    idx = probes.groupby("target")["score"].idxmax()
    return probes.loc[idx, ["target", "metric", "layer", "score", "baseline", "n_train", "n_test"]].reset_index(
        drop=True
    )
