"""Heuristic neurons (Nikankin et al. 2025, ICLR, Sec. 4-5): a catalogue of heuristic
types as data, the classification of circuit neurons by match score, the heuristic
ablation of Sec. 4.2 (Fig. 7) and Sec. 4.3. The test of the labels against a
shuffled-operand null is in :mod:`arithlib.nikankin.heuristic_nulls`, the prompt knockout of
Fig. 8 in :mod:`arithlib.nikankin.prompt_knockout`, the training dynamics of Sec. 5 in
:mod:`arithlib.nikankin.heuristic_dynamics`.

Catalogue (Sec. 4.1). A :class:`Heuristic` is a rule on a prompt's operands and
result: operand ranges, operand modulo and digit patterns, identical operands,
result ranges, result modulo and digit patterns. :func:`heuristic_catalogue` builds
them from the operand and result ranges with stated defaults (range widths as
shares of the span, moduli 2, 3, 4, 5, 10, the tens/hundreds digit).

Match score. For a neuron and a heuristic h satisfied by s_h prompts of the operand
grid, take the neuron's s_h top-activating prompts; the score is the share of them
that satisfy h (1 = the neuron fires exactly on h's prompts; a neuron whose
activations are unrelated to h scores h's base rate s_h / N on average). The top set
is matched to the rule's size so that rules of every width are judged alike; the
paper states the score as the share of top-activating prompts that satisfy the rule,
with threshold t = 0.6. Rules satisfied by more than ``max_base_rate`` of the grid
(default 0.5) are left out: they would pass t by chance. :func:`null_match_scores`
gives the chance level by shuffling each neuron's activations over the grid.

Association (Sec. 4.2). A prompt is associated with heuristic h when it satisfies h;
its associated heuristic neurons are the circuit neurons classified as some h it
satisfies.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ..core.components import Neuron
from ..core.datasets import PromptRecord, apply_op, fewshot_prefix, load_json
from ..core.prompt_sets import PromptSet
from ..engine import AnswerPositionRunner
from ..methods import neurons as N
from ..methods.ablation import mean_neurons_hooks

HEURISTIC_KINDS: tuple[str, ...] = (
    "operand_range",
    "operand_mod",
    "operand_digit",
    "identical_operands",
    "result_range",
    "result_mod",
    "result_digit",
)
FAMILY = {k: ("result" if k.startswith("result") else "operand") for k in HEURISTIC_KINDS}


@dataclass(frozen=True)
class Heuristic:
    """One rule. ``target``: "op1", "op2", "result" or "operands" (identical operands);
    ``params``: (lo, hi) for ranges, (modulus, residue) for modulo, (place, digit) for
    digits (place 1 = tens, 2 = hundreds)."""

    kind: str
    target: str
    params: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in HEURISTIC_KINDS:
            raise ValueError(f"unknown heuristic kind {self.kind!r}; one of {HEURISTIC_KINDS}")
        if self.target not in ("op1", "op2", "result", "operands"):
            raise ValueError(f"unknown target {self.target!r}")

    @property
    def family(self) -> str:
        return FAMILY[self.kind]

    @property
    def name(self) -> str:
        t, p = self.target, self.params
        if self.kind.endswith("range"):
            return f"{t} = {p[0]}" if p[0] == p[1] else f"{t} in [{p[0]}, {p[1]}]"
        if self.kind.endswith("mod"):
            return f"{t} = {p[1]} mod {p[0]}"
        if self.kind.endswith("digit"):
            return f"{t} {['units', 'tens', 'hundreds'][p[0]]} digit {p[1]}"
        return "op1 = op2"

    def mask(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Which prompts (operands ``a``, ``b``, result ``c``) satisfy the rule (bool array)."""
        if self.kind == "identical_operands":
            return np.asarray(a) == np.asarray(b)
        x = np.asarray({"op1": a, "op2": b, "result": c}[self.target])
        p = self.params
        if self.kind.endswith("range"):
            return (x >= p[0]) & (x <= p[1])
        if self.kind.endswith("mod"):
            return np.mod(x, p[0]) == p[1]
        return (np.abs(x) // 10 ** p[0]) % 10 == p[1]


def _ranges(lo: int, hi: int, width_shares: Sequence[float]) -> list[tuple[int, int]]:
    span = hi - lo + 1
    out = []
    for w in sorted({max(1, int(round(f * span))) for f in width_shares}):
        if w >= span:
            continue
        stride = max(1, w // 2)
        for start in range(lo, hi - w + 2, stride):
            out.append((start, start + w - 1))
    return out


def heuristic_catalogue(
    operand_range: tuple[int, int],
    result_range: tuple[int, int],
    width_shares: Sequence[float] = (0.1, 0.2, 0.3, 0.5),
    moduli: Sequence[int] = (2, 3, 4, 5, 10),
) -> list[Heuristic]:
    """Every heuristic of Nikankin's types (Sec. 4.1) for operands in ``operand_range``
    and results in ``result_range`` (inclusive): ranges of width ``share x span`` at a
    stride of half the width, residues mod each of ``moduli``, the tens (and hundreds)
    digit where the values reach them, and identical operands."""
    out: list[Heuristic] = []
    olo, ohi = map(int, operand_range)
    rlo, rhi = map(int, result_range)
    if olo > ohi or rlo > rhi:
        raise ValueError("ranges must be (lo, hi) with lo <= hi")
    for target, (lo, hi) in (("op1", (olo, ohi)), ("op2", (olo, ohi)), ("result", (rlo, rhi))):
        prefix = "result" if target == "result" else "operand"
        out += [Heuristic(f"{prefix}_range", target, r) for r in _ranges(lo, hi, width_shares)]
        out += [Heuristic(f"{prefix}_mod", target, (m, r)) for m in moduli if m <= hi - lo + 1 for r in range(m)]
        for place in (1, 2):
            if max(abs(lo), abs(hi)) >= 10**place:
                out += [Heuristic(f"{prefix}_digit", target, (place, d)) for d in range(10)]
    out.append(Heuristic("identical_operands", "operands"))
    return out


def association_matrix(catalogue: Sequence[Heuristic], records: Sequence[PromptRecord]) -> np.ndarray:
    """Bool [H, N]: does prompt n satisfy heuristic h?"""
    a = np.array([r.a for r in records])
    b = np.array([r.b for r in records])
    c = np.array([r.answer for r in records])
    if not len(catalogue):
        return np.zeros((0, len(records)), dtype=bool)
    return np.stack([h.mask(a, b, c) for h in catalogue])


def usable_heuristics(
    catalogue: Sequence[Heuristic], assoc: np.ndarray, max_base_rate: float = 0.5, min_prompts: int = 3
) -> tuple[list[Heuristic], np.ndarray]:
    """The heuristics that can be judged on this grid: satisfied by at least ``min_prompts``
    prompts and by at most ``max_base_rate`` of them, and not identical (same prompts) to
    an earlier one. Returns (heuristics, their rows of ``assoc``)."""
    keep, seen = [], set()
    n = assoc.shape[1]
    for i, h in enumerate(catalogue):
        s = int(assoc[i].sum())
        if s < min_prompts or s > max_base_rate * n:
            continue
        key = assoc[i].tobytes()
        if key in seen:
            continue
        seen.add(key)
        keep.append(i)
    return [catalogue[i] for i in keep], assoc[keep] if keep else np.zeros((0, n), dtype=bool)


def _ranks(acts: np.ndarray, seed: int) -> np.ndarray:
    """Rank of each prompt per neuron (0 = highest activation), ties broken at random.
    ``acts`` [N, M] -> ranks [M, N]."""
    rng = np.random.default_rng(seed)
    n = acts.shape[0]
    perm = rng.permutation(n)
    order = perm[np.argsort(-acts[perm], axis=0, kind="stable")]  # [N, M]: prompt at each rank
    ranks = np.empty_like(order)
    cols = np.arange(acts.shape[1])[None, :]
    ranks[order, cols] = np.arange(n)[:, None]
    return ranks.T


def match_scores(
    acts: np.ndarray | torch.Tensor, assoc: np.ndarray, seed: int = 0, min_std: float = 1e-6
) -> np.ndarray:
    """Match score of each neuron with each heuristic, [M, H]: the share of the neuron's
    s_h top-activating prompts that satisfy h (s_h = the number of prompts satisfying h).
    ``acts`` [N prompts, M neurons]; neurons whose activation is constant over the grid
    (std < ``min_std``) score 0."""
    acts = np.asarray(acts, dtype=np.float64)
    if acts.ndim != 2 or acts.shape[0] != assoc.shape[1]:
        raise ValueError(f"acts must be [N, M] with N = {assoc.shape[1]} prompts, got {acts.shape}")
    ranks = _ranks(acts, seed)
    sizes = assoc.sum(1)
    out = np.zeros((acts.shape[1], assoc.shape[0]))
    a = assoc.astype(np.float32)
    for s in np.unique(sizes):
        if s == 0:
            continue
        rows = np.nonzero(sizes == s)[0]
        top = (ranks < s).astype(np.float32)  # [M, N]
        out[:, rows] = (top @ a[rows].T) / s
    out[acts.std(0) < min_std] = 0.0
    return out


def null_match_scores(acts: np.ndarray | torch.Tensor, assoc: np.ndarray, seed: int = 0) -> np.ndarray:
    """Match scores after shuffling each neuron's activations over the prompts
    independently: the chance level of :func:`match_scores` for the same neurons."""
    acts = np.asarray(acts, dtype=np.float64).copy()
    rng = np.random.default_rng(seed)
    for j in range(acts.shape[1]):
        acts[:, j] = acts[rng.permutation(acts.shape[0]), j]
    return match_scores(acts, assoc, seed=seed + 1)


def classify_neurons(
    scores: np.ndarray, neurons: Sequence[Neuron], heuristics: Sequence[Heuristic], assoc: np.ndarray, t: float = 0.6
) -> pd.DataFrame:
    """Every (neuron, heuristic) pair with match score >= ``t`` (Nikankin's threshold 0.6).
    Columns: layer, neuron, heuristic, kind, family, score, base_rate, rank (1 = the
    neuron's best match)."""
    if not 0 < t <= 1:
        raise ValueError("t must be in (0, 1]")
    base = assoc.mean(1) if assoc.size else np.zeros(0)
    rows = []
    for i, (layer, k) in enumerate(neurons):
        hits = np.nonzero(scores[i] >= t)[0]
        # best first; among equal scores the narrower rule (smaller base rate)
        hits = sorted(hits, key=lambda h: (-scores[i, h], base[h]))
        for r, h in enumerate(hits):
            rows.append(
                {
                    "layer": int(layer),
                    "neuron": int(k),
                    "heuristic": heuristics[h].name,
                    "kind": heuristics[h].kind,
                    "family": heuristics[h].family,
                    "h_index": int(h),
                    "score": float(scores[i, h]),
                    "base_rate": float(base[h]),
                    "rank": r + 1,
                }
            )
    cols = ["layer", "neuron", "heuristic", "kind", "family", "h_index", "score", "base_rate", "rank"]
    return pd.DataFrame(rows, columns=cols)


def neuron_labels(matches: pd.DataFrame, mode: str = "best") -> pd.DataFrame:
    """The (neuron, heuristic) labels used for association and counting: ``"best"`` keeps
    each matched neuron's best rule only (rank 1: highest score, then the narrower rule),
    ``"all"`` every rule it matches at t."""
    if mode not in ("best", "all"):
        raise ValueError("mode must be 'best' or 'all'")
    if matches is None or matches.empty or mode == "all":
        return matches
    return matches[matches["rank"] == 1].reset_index(drop=True)


def type_counts(labels: pd.DataFrame) -> pd.DataFrame:
    """Number of distinct neurons per heuristic kind in ``labels`` (every kind listed)."""
    rows = []
    for kind in HEURISTIC_KINDS:
        sub = labels[labels["kind"] == kind] if labels is not None and not labels.empty else pd.DataFrame()
        n = len({(a, b) for a, b in zip(sub["layer"], sub["neuron"])}) if len(sub) else 0
        rows.append({"kind": kind, "family": FAMILY[kind], "n_neurons": n})
    return pd.DataFrame(rows)


def neuron_summary(
    scores: np.ndarray, neurons: Sequence[Neuron], heuristics: Sequence[Heuristic], assoc: np.ndarray, t: float = 0.6
) -> pd.DataFrame:
    """One row per neuron: its best heuristic, best score, whether it matches (>= t) and
    how many heuristics it matches."""
    base = assoc.mean(1) if assoc.size else np.zeros(0)
    rows = []
    for i, (layer, k) in enumerate(neurons):
        if scores.shape[1] == 0:
            rows.append(
                {
                    "layer": layer,
                    "neuron": k,
                    "best_heuristic": None,
                    "best_kind": None,
                    "best_score": 0.0,
                    "matched": False,
                    "n_matches": 0,
                }
            )
            continue
        best = max(range(scores.shape[1]), key=lambda h: (scores[i, h], -base[h]))
        rows.append(
            {
                "layer": int(layer),
                "neuron": int(k),
                "best_heuristic": heuristics[best].name,
                "best_kind": heuristics[best].kind,
                "best_score": float(scores[i, best]),
                "matched": bool(scores[i, best] >= t),
                "n_matches": int((scores[i] >= t).sum()),
            }
        )
    return pd.DataFrame(rows)


def threshold_sensitivity(
    scores: np.ndarray, heuristics: Sequence[Heuristic], ts: Sequence[float] = (0.4, 0.5, 0.6, 0.7, 0.8)
) -> pd.DataFrame:
    """Per threshold t and heuristic kind: how many neurons match at least one heuristic of
    that kind, plus the share of neurons matching any (kind "any")."""
    kinds = np.array([h.kind for h in heuristics])
    rows = []
    m = scores.shape[0]
    for t in ts:
        hit = scores >= t
        any_hit = hit.any(1) if hit.size else np.zeros(m, dtype=bool)
        rows.append(
            {"t": t, "kind": "any", "n_neurons": int(any_hit.sum()), "share": float(any_hit.mean()) if m else 0.0}
        )
        for kind in HEURISTIC_KINDS:
            cols = kinds == kind
            n = int(hit[:, cols].any(1).sum()) if cols.any() else 0
            rows.append({"t": t, "kind": kind, "n_neurons": n, "share": n / m if m else 0.0})
    return pd.DataFrame(rows)


def type_counts_by_threshold(
    scores: np.ndarray,
    neurons: Sequence[Neuron],
    heuristics: Sequence[Heuristic],
    assoc: np.ndarray,
    ts: Sequence[float] = (0.4, 0.5, 0.6, 0.7, 0.8),
    labels: str = "best",
) -> pd.DataFrame:
    """:func:`type_counts` of the circuit's labels (:func:`neuron_labels` mode ``labels``) at
    each threshold in ``ts``: the sensitivity of the per-type counts to t."""
    frames = [
        type_counts(neuron_labels(classify_neurons(scores, neurons, heuristics, assoc, t), labels)).assign(t=t)
        for t in ts
    ]
    return pd.concat(frames, ignore_index=True)


# --------------------------------------------------------------------------- prompts


def grid_records(
    op: str,
    operand_range: tuple[int, int],
    max_result: int | None = None,
    fewshot: int = 2,
    allow_negative: bool = False,
) -> list[PromptRecord]:
    """Nikankin's "{x}{op}{y}=" prompt for every operand pair of ``operand_range`` (the
    operand grid), with an integer result (exact division; non-negative unless
    ``allow_negative``; at most ``max_result``), and a ``fewshot`` prefix in the same
    template. Unlike :func:`arithlib.core.datasets.nikankin_prompts` no counterfactual is
    paired (its pairing is quadratic in the grid size; the grid is read without one)."""
    template = load_json("templates.json")["nikankin"][op][0]
    sep = load_json("templates.json")["nikankin"]["sep"]
    prefix = fewshot_prefix(template, op, sep, fewshot)
    lo, hi = operand_range
    out = []
    for a in range(lo, hi + 1):
        for b in range(lo, hi + 1):
            if op == "/" and (b == 0 or a % b):
                continue
            c = apply_op(a, b, op)
            if (c < 0 and not allow_negative) or (max_result is not None and c > max_result):
                continue
            text = template.replace("{A}", str(a)).replace("{B}", str(b))
            text = text.replace(f"[{op}]", op)
            out.append(
                PromptRecord(
                    family="nikankin",
                    op=op,
                    a=a,
                    b=b,
                    answer=c,
                    template_id=0,
                    template=template,
                    text=text + sep,
                    answer_text=str(c) if c >= 0 else f"-{-c}",
                    prefix=prefix,
                    n_digits=len(str(hi)),
                    meta=(("numerals", "digits"),),
                )
            )
    return out


def sample_indices(n: int, k: int | None, seed: int) -> list[int]:
    """``k`` indices of range(n) drawn without replacement (all when k is None or >= n), sorted."""
    if k is None or k >= n:
        return list(range(n))
    return sorted(random.Random(seed).sample(range(n), k))


# --------------------------------------------------------------------------- per-prompt neurons


def prompt_heuristic_neurons(
    matches: pd.DataFrame, heuristics: Sequence[Heuristic], records: Sequence[PromptRecord]
) -> list[list[Neuron]]:
    """For each prompt, its associated heuristic neurons: the neurons of ``matches`` (from
    :func:`classify_neurons`) classified as a heuristic the prompt satisfies (sorted)."""
    if matches is None or matches.empty:
        return [[] for _ in records]
    neurons = sorted({(int(a), int(b)) for a, b in zip(matches["layer"], matches["neuron"])})
    row = {n: i for i, n in enumerate(neurons)}
    used = sorted(set(matches["h_index"].astype(int)))
    col = {h: j for j, h in enumerate(used)}
    incidence = np.zeros((len(neurons), len(used)), dtype=np.float32)  # neuron x heuristic
    for a, b, h in zip(matches["layer"], matches["neuron"], matches["h_index"]):
        incidence[row[(int(a), int(b))], col[int(h)]] = 1.0
    assoc = association_matrix([heuristics[h] for h in used], records).astype(np.float32)  # [H_used, N]
    linked = (incidence @ assoc) > 0  # [n_neurons, N]
    return [[neurons[i] for i in np.nonzero(linked[:, p])[0]] for p in range(len(records))]


# --------------------------------------------------------------------------- ablations (Sec. 4.2, 4.3)


def heuristic_ablation_prompts(
    runner: AnswerPositionRunner,
    matches: pd.DataFrame,
    heuristics: Sequence[Heuristic],
    layers: Sequence[int],
    means: torch.Tensor,
    min_prompts: int = 3,
    max_heuristics: int | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Nikankin Fig. 7, per prompt: for each heuristic with classified neurons (every
    neuron of ``matches`` labelled with it: pass all matches at t for the paper's
    association), mean-ablate those neurons at the answer position and record, for every
    prompt of the runner, whether it satisfies the heuristic (``associated``) and whether
    its first answer token is still the argmax (``correct``; ``correct_base`` unablated).
    Heuristics with fewer than ``min_prompts`` prompts in either group are skipped;
    ``max_heuristics`` keeps those with the most neurons (then the highest mean match
    score, then the name). One row per heuristic and prompt: heuristic, kind, n_neurons,
    prompt (index into the runner's prompts), associated, correct, correct_base."""
    records = runner.prompts.records
    cache = N.runner_means(means, layers)
    assoc = association_matrix(heuristics, records)
    groups = []
    if matches is not None and not matches.empty:
        for h, sub in matches.groupby("h_index"):
            inside = assoc[int(h)]
            if inside.sum() >= min_prompts and (~inside).sum() >= min_prompts:
                groups.append((h, sub))
    groups.sort(key=lambda g: (-len(g[1]), -g[1]["score"].mean(), heuristics[int(g[0])].name))
    if max_heuristics is not None:
        groups = groups[:max_heuristics]
    cols = ["heuristic", "kind", "n_neurons", "prompt", "associated", "correct", "correct_base"]
    if not groups:
        return pd.DataFrame(columns=cols)
    neuron_sets = [sorted({(int(a), int(b)) for a, b in zip(sub["layer"], sub["neuron"])}) for _, sub in groups]
    base, *ablated = runner.logits_many(
        [None] + [mean_neurons_hooks(ns, cache, position=-1) for ns in neuron_sets], progress=progress
    )
    base_ok = N.correct_first(base, runner.answers).numpy()
    frames = []
    for (h, _), neurons, logits in zip(groups, neuron_sets, ablated):
        frames.append(
            pd.DataFrame(
                {
                    "heuristic": heuristics[int(h)].name,
                    "kind": heuristics[int(h)].kind,
                    "n_neurons": len(neurons),
                    "prompt": np.arange(len(records)),
                    "associated": assoc[int(h)],
                    "correct": N.correct_first(logits, runner.answers).numpy(),
                    "correct_base": base_ok,
                }
            )
        )
    return pd.concat(frames, ignore_index=True)[cols]


def heuristic_ablation(
    runner: AnswerPositionRunner,
    matches: pd.DataFrame,
    heuristics: Sequence[Heuristic],
    layers: Sequence[int],
    means: torch.Tensor,
    min_prompts: int = 3,
    max_heuristics: int | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Nikankin Fig. 7 per heuristic: :func:`summarise_heuristic_ablation` of
    :func:`heuristic_ablation_prompts`."""
    return summarise_heuristic_ablation(
        heuristic_ablation_prompts(runner, matches, heuristics, layers, means, min_prompts, max_heuristics, progress)
    )


def summarise_heuristic_ablation(rows: pd.DataFrame) -> pd.DataFrame:
    """Per heuristic (and ``op`` when present) of :func:`heuristic_ablation_prompts`' rows:
    first-token accuracy after the ablation on the associated prompts (``acc_assoc``) and
    on the others (``acc_other``), the same without ablation (``base_acc_*``), the group
    sizes and ``n_neurons``."""
    keys = [c for c in ("op", "heuristic", "kind", "n_neurons") if c in rows.columns]
    cols = keys + ["n_assoc", "n_other", "acc_assoc", "acc_other", "base_acc_assoc", "base_acc_other"]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    out = []
    for key, g in rows.groupby(keys, sort=False):
        a = g["associated"].astype(bool).to_numpy()
        c, b = g["correct"].astype(float).to_numpy(), g["correct_base"].astype(float).to_numpy()
        out.append(
            dict(
                zip(keys, key),
                n_assoc=int(a.sum()),
                n_other=int((~a).sum()),
                acc_assoc=float(c[a].mean()),
                acc_other=float(c[~a].mean()),
                base_acc_assoc=float(b[a].mean()),
                base_acc_other=float(b[~a].mean()),
            )
        )
    return pd.DataFrame(out, columns=cols)


def associated_contributions(
    contrib: torch.Tensor, per_prompt: Sequence[Sequence[Neuron]], layers: Sequence[int]
) -> np.ndarray:
    """Sum over each prompt's associated heuristic neurons of their direct logit
    contribution to the correct answer (``contrib`` [N, L, d_mlp] from
    :func:`arithlib.methods.neurons.neuron_logit_contributions`)."""
    if len(per_prompt) != contrib.shape[0]:
        raise ValueError(
            f"one neuron list per prompt of contrib: got {len(per_prompt)} lists for {contrib.shape[0]} prompts"
        )
    pos = {int(x): i for i, x in enumerate(layers)}
    outside = sorted({int(layer) for neurons in per_prompt for layer, _ in neurons} - set(pos))
    if outside:
        raise ValueError(
            f"neurons in layers {outside}, which contrib does not hold (layers {list(pos)}): "
            "compute contrib over every layer the heuristic neurons come from"
        )
    out = np.zeros(len(per_prompt))
    for p, neurons in enumerate(per_prompt):
        out[p] = sum(float(contrib[p, pos[int(layer)], int(k)]) for layer, k in neurons)
    return out


def correct_vs_incorrect(
    model, an: OperatorAnalysis, layers: Sequence[int], labels: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Nikankin Sec. 4.3, per grid prompt: whether the first answer token is correct, the
    number of its associated heuristic neurons (by ``labels``, default the circuit's
    matches) and their summed direct logit contribution to the correct answer
    (activation x logit lens of the value vector / final-norm scale,
    :func:`arithlib.methods.neurons.neuron_logit_contributions`)."""
    labels = an.matches if labels is None else labels
    per_prompt = prompt_heuristic_neurons(labels, an.heuristics, an.grid.records)
    contrib = N.neuron_logit_contributions(model, an.grid_acts, layers, an.grid.first_answer_ids, an.grid_scale)
    frame = an.grid.to_frame()[["op", "a", "b", "answer"]]
    return frame.assign(
        correct=an.grid_correct_first,
        correct_full=an.grid_correct_full,
        n_assoc_neurons=[len(x) for x in per_prompt],
        assoc_contribution=associated_contributions(contrib, per_prompt, layers),
    )


# --------------------------------------------------------------------------- one model, one operator


@dataclass
class OperatorAnalysis:
    """Everything the neuron-circuit analysis computes for one operator. ``grid_*`` arrays
    are over every operand pair; ``runner`` and ``attribution`` over the analysed prompts
    (``analysis_index`` into the grid)."""

    op: str
    grid: PromptSet
    grid_acts: torch.Tensor  # [N_grid, L, d_mlp] answer-position activations
    grid_scale: torch.Tensor  # [N_grid] final-norm scale at the answer position
    grid_correct_first: np.ndarray  # first answer token is the argmax
    grid_correct_full: np.ndarray  # greedy decoding writes the whole answer
    analysis_index: list[int]
    runner: AnswerPositionRunner | None = None
    #: correct prompts disjoint from the analysed ones: the circuit is chosen on the
    #: analysed prompts and scored (ablations) on these
    heldout_index: list[int] = field(default_factory=list)
    heldout_runner: AnswerPositionRunner | None = None
    attribution: torch.Tensor | None = None  # [N_analysis, L, d_mlp]
    scores: torch.Tensor | None = None  # [L, d_mlp] mean |attribution|
    circuit: list[Neuron] | None = None
    heuristics: list[Heuristic] | None = None  # usable heuristics on this grid
    assoc: np.ndarray | None = None  # [H, N_grid]
    circuit_scores: np.ndarray | None = None  # [n_circuit, H] match scores
    circuit_null: np.ndarray | None = None  # [n_circuit, H] chance-level match scores
    matches: pd.DataFrame | None = None  # classify_neurons on the circuit

    @property
    def analysis(self) -> PromptSet:
        return self.grid.subset(self.analysis_index)


def neuron_matrix(acts: torch.Tensor, neurons: Sequence[Neuron], layers: Sequence[int]) -> np.ndarray:
    """Columns of ``acts`` [N, L, d_mlp] for ``neurons``: [N, len(neurons)]."""
    pos = {int(x): i for i, x in enumerate(layers)}
    if not neurons:
        return np.zeros((acts.shape[0], 0))
    li = torch.tensor([pos[int(a)] for a, _ in neurons])
    ki = torch.tensor([int(b) for _, b in neurons])
    return acts[:, li, ki].numpy()


@dataclass
class GridPass:
    """What one clean pass over an operator's grid records at the answer position: the
    analysed layers' neuron activations, the final-norm scale, and whether the first
    answer token is the argmax and greedy decoding writes the whole answer. Small enough
    to store (:class:`arithlib.run.stored.Store`), unlike the grid's KV cache."""

    acts: torch.Tensor  # [N_grid, L, d_mlp]
    scale: torch.Tensor  # [N_grid]
    correct_first: np.ndarray  # [N_grid] bool
    correct_full: np.ndarray  # [N_grid] bool


def grid_pass(model, grid: PromptSet, layers: Sequence[int], batch_size: int = 64, decode: bool = True) -> GridPass:
    """One clean pass over ``grid`` (:class:`arithlib.engine.AnswerPositionRunner` with the
    layers' neuron activations and the final-norm scale recorded) and greedy correctness
    (``decode`` False: ``correct_full`` is the first-token correctness, nothing decoded)."""
    names = [N.post_hook(x) for x in layers]
    runner = AnswerPositionRunner(model, grid, batch_size=batch_size, record=names + ["ln_final.hook_scale"])
    clean = runner.clean
    first = N.correct_first(clean["logits"], grid.first_answer_ids).numpy()
    return GridPass(
        acts=torch.stack([clean[n] for n in names], 1),
        scale=clean["ln_final.hook_scale"].reshape(len(grid), -1)[:, 0],
        correct_first=first,
        correct_full=runner.greedy_correct() if decode else first.copy(),
    )


def prepare_operator(
    model,
    grid: PromptSet,
    layers: Sequence[int],
    n_analysis: int | None = None,
    criterion: str | None = "full",
    seed: int = 0,
    batch_size: int = 64,
    n_heldout: int | None = 0,
    clean: GridPass | None = None,
) -> OperatorAnalysis:
    """The grid's clean pass (``clean``, e.g. a stored one; None: :func:`grid_pass`) and
    the analysed prompts: up to ``n_analysis`` (seeded sample) of those answered
    correctly (``criterion`` "full" or "first"; None: all prompts), with their own
    runner. ``runner`` is None when no prompt qualifies. ``n_heldout``: up to that many
    further qualifying prompts (seeded sample of those not analysed; None: all of them)
    in ``heldout_index`` / ``heldout_runner``, to score the circuit on prompts it was not
    chosen on; they are reserved before the analysed sample is drawn (at most half of the
    qualifying prompts). The two runners are built on their own prompts, so a run that
    loads a stored pass computes what one that did not computes."""
    if criterion not in ("full", "first", None):
        raise ValueError("criterion must be 'full', 'first' or None")
    clean = grid_pass(model, grid, layers, batch_size, decode=criterion == "full") if clean is None else clean
    if len(clean.correct_first) != len(grid):
        raise ValueError(f"the grid pass has {len(clean.correct_first)} prompts, the grid {len(grid)}")
    first, full = clean.correct_first, clean.correct_full
    ok = {"full": full, "first": first, None: np.ones(len(grid), dtype=bool)}[criterion]
    pool = np.nonzero(ok)[0].tolist()
    # held-out prompts are reserved first (up to n_heldout, at most half of the pool), so a
    # small grid (per-digit tokenizers) keeps prompts to score on
    reserve = 0 if n_heldout == 0 else min(len(pool) // 2, len(pool) if n_heldout is None else n_heldout)
    n_sel = len(pool) - reserve if n_analysis is None else min(n_analysis, len(pool) - reserve)
    index = [pool[i] for i in sample_indices(len(pool), n_sel, seed)]
    rest = sorted(set(pool) - set(index))
    held = [rest[i] for i in sample_indices(len(rest), n_heldout, seed + 1)] if n_heldout != 0 else []
    an = OperatorAnalysis(
        op=grid.records[0].op,
        grid=grid,
        grid_acts=clean.acts,
        grid_scale=clean.scale,
        grid_correct_first=first,
        grid_correct_full=full,
        analysis_index=index,
    )
    an.runner = AnswerPositionRunner(model, grid.subset(index), batch_size=batch_size) if index else None
    an.heldout_index = held
    an.heldout_runner = AnswerPositionRunner(model, grid.subset(held), batch_size=batch_size) if held else None
    return an


def reference_means(analyses: dict[str, OperatorAnalysis]) -> torch.Tensor:
    """Mean answer-position activation [L, d_mlp] over the analysed prompts of every operator
    (the values mean ablation writes in)."""
    parts = [an.grid_acts[an.analysis_index] for an in analyses.values() if an.analysis_index]
    if not parts:
        raise ValueError("no analysed prompts: no operator has a prompt the model answers correctly")
    return N.last_position_means(torch.cat(parts))


def attribute(
    an: OperatorAnalysis,
    layers: Sequence[int],
    means: torch.Tensor,
    candidates: torch.Tensor | None = None,
    progress: bool = False,
) -> OperatorAnalysis:
    """Attribution patching against the mean on the analysed prompts; sets ``attribution`` and
    ``scores`` (in place)."""
    if an.runner is None:
        raise ValueError(f"operator {an.op!r} has no analysed prompts")
    an.attribution = N.neuron_attribution(an.runner, layers, means=means, candidates=candidates, progress=progress)
    an.scores = N.neuron_scores(an.attribution)
    return an


def classify_circuit(
    an: OperatorAnalysis,
    layers: Sequence[int],
    k_per_layer: int,
    t: float = 0.6,
    max_base_rate: float = 0.5,
    seed: int = 0,
    catalogue_kwargs: dict | None = None,
) -> OperatorAnalysis:
    """Set the circuit to the top ``k_per_layer`` neurons per layer (by ``scores``), build the
    catalogue on this grid's operand and result ranges, and score and classify the circuit
    neurons against it (and against shuffled activations for the chance level). In place."""
    if an.scores is None:
        raise ValueError("run attribute() first")
    an.circuit = N.top_neurons_per_layer(an.scores, layers, k_per_layer)
    recs = an.grid.records
    ops = [r.a for r in recs] + [r.b for r in recs]
    res = [r.answer for r in recs]
    cat = heuristic_catalogue((min(ops), max(ops)), (min(res), max(res)), **(catalogue_kwargs or {}))
    an.heuristics, an.assoc = usable_heuristics(cat, association_matrix(cat, recs), max_base_rate)
    acts = neuron_matrix(an.grid_acts, an.circuit, layers)
    an.circuit_scores = match_scores(acts, an.assoc, seed=seed)
    an.circuit_null = null_match_scores(acts, an.assoc, seed=seed)
    an.matches = classify_neurons(an.circuit_scores, an.circuit, an.heuristics, an.assoc, t)
    return an


def matched_share(an: OperatorAnalysis, t: float = 0.6, null: bool = False) -> float:
    """Share of the circuit's neurons that match at least one heuristic at threshold t
    (with ``null``: the chance level from shuffled activations)."""
    s = an.circuit_null if null else an.circuit_scores
    if s is None or s.shape[0] == 0:
        return float("nan")
    if s.shape[1] == 0:
        return 0.0
    return float((s >= t).any(1).mean())


def faithfulness_curves(
    analyses: dict[str, OperatorAnalysis],
    layers: Sequence[int],
    means: torch.Tensor,
    ks: Sequence[int],
    progress: bool = False,
) -> pd.DataFrame:
    """:func:`arithlib.methods.neurons.faithfulness_curve` for every operator with analysed prompts
    (an ``op`` column added)."""
    frames = [
        N.faithfulness_curve(an.runner, an.scores, layers, means, ks, progress).assign(op=op)
        for op, an in analyses.items()
        if an.runner is not None
    ]
    return pd.concat(frames, ignore_index=True)
