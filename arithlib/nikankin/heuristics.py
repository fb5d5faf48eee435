"""Heuristic neurons (Nikankin et al. 2025, ICLR, Sec. 4-5): a catalogue of heuristic
types as data, the classification of circuit neurons by match score, and each prompt's
associated heuristic neurons. The analysis of one operator that finds and classifies the
circuit neurons is in :mod:`arithlib.nikankin.operator_analysis` (on the grids of
:mod:`arithlib.nikankin.heuristic_grids`), the heuristic ablation of Sec. 4.2 (Fig. 7) and
Sec. 4.3 in :mod:`arithlib.nikankin.heuristic_ablation`, the test of the labels against a
shuffled-operand null in :mod:`arithlib.nikankin.heuristic_nulls`, the prompt knockout of
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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ..core.components import Neuron
from ..core.datasets import PromptRecord

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


def _orders(acts: np.ndarray, seed: int) -> np.ndarray:
    """The prompts of each neuron by falling activation, ties broken at random (seeded).
    ``acts`` [N, M] -> orders [M, N] (row m: the prompt at rank 0, 1, ...)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(acts.shape[0])
    return perm[np.argsort(-acts[perm], axis=0, kind="stable")].T  # [M, N]


def top_counts(orders: np.ndarray | torch.Tensor, assoc: np.ndarray, chunk: int = 256) -> np.ndarray:
    """[R, H] float32: for each order (a row of ``orders`` [R, N], prompts by rank) and rule h
    (a row of ``assoc`` [H, N]), #{r < s_h : assoc[h, order(r)]}, the number of h's prompts
    among the order's first s_h (s_h = the number of prompts satisfying h; 0 for s_h = 0).

    The numerator of the match score, computed as matrix products: the rules are taken by
    size s ascending, the indicator of each row's first s prompts is grown by the ranks since
    the last size (one scatter), and multiplied by the rules of that size. Counts are exact
    integers in float32 (N < 2**24). ``chunk``: rows per step; it does not change the result.
    Written here because it is the one step of the label tests that costs time: gathering
    the rules along every order and summing prefixes costs a memory pass per rule and rank."""
    orders = torch.as_tensor(np.asarray(orders), dtype=torch.int64)
    r, n = orders.shape
    if assoc.shape[1] != n:
        raise ValueError(f"assoc must be [H, {n}] for orders over {n} prompts, got {assoc.shape}")
    sizes = assoc.sum(1).astype(int)
    out = np.zeros((r, assoc.shape[0]), dtype=np.float32)
    groups = [
        (int(s), idx, torch.from_numpy(assoc[idx].astype(np.float32)).T.contiguous())
        for s in np.unique(sizes[sizes > 0])
        for idx in [np.nonzero(sizes == s)[0]]
    ]
    for c0 in range(0, r, max(1, int(chunk))):
        o = orders[c0 : c0 + max(1, int(chunk))]
        top = torch.zeros(o.shape[0], n)
        prev = 0
        for s, idx, a in groups:
            top.scatter_(1, o[:, prev:s], 1.0)
            prev = s
            out[c0 : c0 + o.shape[0], idx] = (top @ a).numpy()
    return out


def match_scores(
    acts: np.ndarray | torch.Tensor, assoc: np.ndarray, seed: int = 0, min_std: float = 1e-6
) -> np.ndarray:
    """Match score of each neuron with each heuristic, [M, H]: the share of the neuron's
    s_h top-activating prompts that satisfy h (s_h = the number of prompts satisfying h),
    :func:`top_counts` / s_h. ``acts`` [N prompts, M neurons]; neurons whose activation is
    constant over the grid (std < ``min_std``) score 0."""
    acts = np.asarray(acts, dtype=np.float64)
    if acts.ndim != 2 or acts.shape[0] != assoc.shape[1]:
        raise ValueError(f"acts must be [N, M] with N = {assoc.shape[1]} prompts, got {acts.shape}")
    sizes = assoc.sum(1)
    out = top_counts(_orders(acts, seed), assoc).astype(np.float64)
    out[:, sizes > 0] /= sizes[sizes > 0]
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
