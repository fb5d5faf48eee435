"""Does a circuit neuron's heuristic label beat chance? A permutation test of Nikankin
et al.'s (2025, Sec. 4.1) labels, with the false-discovery rate controlled over the circuit.

A label (neuron n, rule h) is a match score S(n, h) >= t (:func:`arithlib.nikankin.heuristics.match_scores`:
the share of the neuron's s_h top-activating grid prompts that satisfy h). On a small grid
many rules pass t by chance, so a label must also beat a null.

Null hypothesis for a neuron: its activations are unrelated to the operands, i.e. every
assignment of its activations to the grid's operand pairs is equally likely. Test: its
match scores on B seeded shuffled-operand grids (the operand pairs permuted over the
prompts). The statistic is the neuron's best score over every usable rule, so a p-value
is adjusted for the number of rules tried (single-step max-T, Westfall & Young 1993):

    p(n, h) = (1 + #{b : max_h' S_b(n, h') >= S(n, h)}) / (B + 1),     p(n) = min_h p(n, h).

A score reads only the order of the prompts by activation, and on a shuffled grid that
order is uniformly random whatever the neuron, so the B shuffled grids give every neuron
the same null distribution and are scored once (:func:`null_best_scores`).

Benjamini-Hochberg (:func:`scipy.stats.false_discovery_control`) over every circuit neuron's
p(n) at level ``fdr`` (default 5 %) decides which neurons are *labelled*: q(n) <= fdr and
their best score >= t. A labelled neuron keeps the rules with S(n, h) >= t and p(n, h) at or
below the BH cut-off (the largest p(n) among the labelled neurons). The same permutations
serve every neuron of an operator (each neuron's test is an exact permutation test on its own).

The null's share: the same procedure run on each neuron's activations shuffled once over the
grid (seeded), so "labelled share" is set against what the procedure labels when there is
nothing to find (about ``fdr`` of the neurons at most), and the share passing t alone
(:func:`arithlib.nikankin.operator_analysis.matched_share` with ``null``) against its shuffled level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from .heuristics import match_scores, top_counts

#: False-discovery rate at which a label must beat the shuffled-operand null (ours: the usual 5 %).
LABEL_FDR = 0.05
#: Fewest permutations per operator (ours). The smallest p-value is 1 / (B + 1), and BH at level
#: q over M neurons can label a single neuron only when that is at most q / M, so
#: :func:`n_permutations_for` takes at least M / q.
N_PERMUTATIONS = 1000


def n_permutations_for(n_neurons: int, fdr: float = LABEL_FDR) -> int:
    """Permutations for a circuit of ``n_neurons``: max(:data:`N_PERMUTATIONS`, ceil(M / fdr)),
    so that one neuron beating every permutation survives BH on its own."""
    return max(N_PERMUTATIONS, int(np.ceil(n_neurons / fdr)))


@dataclass(frozen=True)
class LabelTest:
    """The permutation test of one operator's circuit neurons (rows) against its rules (columns)."""

    scores: np.ndarray  # [M, H] observed match scores
    p_label: np.ndarray  # [M, H] max-T permutation p-value of each score
    p_neuron: np.ndarray  # [M] p-value of the neuron's best score (min over its rules)
    q_neuron: np.ndarray  # [M] Benjamini-Hochberg adjusted p(n)
    labelled: np.ndarray  # [M] bool: best score >= t and q(n) <= fdr
    cutoff: float  # BH cut-off on the p-values (0 when no neuron is labelled)
    t: float
    fdr: float
    n_permutations: int

    @property
    def label_mask(self) -> np.ndarray:
        """[M, H] bool: the labels that beat the null (score >= t, neuron labelled, p(n, h) <= cut-off)."""
        return (self.scores >= self.t) & self.labelled[:, None] & (self.p_label <= self.cutoff)

    @property
    def labelled_share(self) -> float:
        return float(self.labelled.mean()) if len(self.labelled) else float("nan")


def null_best_scores(assoc: np.ndarray, n_permutations: int, seed: int = 0, chunk: int | None = None) -> np.ndarray:
    """[B]: the best match score over the rules (rows of ``assoc`` [H, N]) of a neuron on B
    shuffled-operand grids. A neuron's score reads only the order of the prompts by its
    activation (ties broken at random); on a grid whose operand pairs are permuted at random
    that order is a uniformly random one whatever the activations, so one set of B seeded
    random orders pi_b serves every neuron: S_b(h) = #{r < s_h : assoc[h, pi_b(r)]} / s_h,
    the neuron's top-s_h prompts being the first s_h of pi_b (what :func:`match_scores` gives a
    neuron whose activations fall along pi_b; the counts are :func:`top_counts`'). ``chunk``:
    orders drawn per step (None: 4096); it does not change the result."""
    h, n = assoc.shape
    best = np.zeros(n_permutations)
    sizes = assoc.sum(1).astype(int)
    rows = np.nonzero(sizes > 0)[0]
    if not len(rows) or not n_permutations:
        return best
    rng = np.random.default_rng(seed)
    a = assoc[rows]
    denom = sizes[rows].astype(np.float32)
    chunk = 4096 if chunk is None else max(1, int(chunk))
    for c0 in range(0, n_permutations, chunk):
        perms = np.stack([rng.permutation(n) for _ in range(min(chunk, n_permutations - c0))])  # [C, N]
        best[c0 : c0 + len(perms)] = (top_counts(perms, a) / denom).max(1)
    return best


def label_test(
    acts: np.ndarray | torch.Tensor,
    assoc: np.ndarray,
    t: float = 0.6,
    fdr: float = LABEL_FDR,
    n_permutations: int | None = None,
    seed: int = 0,
    rank_seed: int = 0,
) -> LabelTest:
    """The permutation test and BH control of the module docstring for the neurons of
    ``acts`` [N prompts, M neurons] against the rules ``assoc`` [H, N] (scores ranked with
    ``rank_seed``, as :func:`match_scores` with ``seed=rank_seed``). ``n_permutations``:
    None for :func:`n_permutations_for` the number of neurons."""
    from scipy.stats import false_discovery_control

    if not 0 < fdr < 1:
        raise ValueError("fdr must be in (0, 1)")
    if n_permutations is None:
        n_permutations = n_permutations_for(np.asarray(acts).shape[1], fdr)
    if n_permutations < 1:
        raise ValueError("n_permutations must be at least 1")
    scores = match_scores(acts, assoc, seed=rank_seed)
    null = np.sort(null_best_scores(assoc, n_permutations, seed))
    m, h = scores.shape
    if m == 0:
        e = np.zeros(0)
        return LabelTest(scores, np.ones((0, h)), e, e, e.astype(bool), 0.0, t, fdr, n_permutations)
    # p(n, h): the share of shuffled grids whose best score reaches S(n, h) (1e-9: float noise);
    # a constant neuron scores 0 everywhere and gets p = 1
    reach = n_permutations - np.searchsorted(null, scores - 1e-9, side="left")
    const = np.asarray(acts, dtype=np.float64).std(0) < 1e-6
    reach[const] = n_permutations
    p_label = (1.0 + reach) / (n_permutations + 1.0)
    p_neuron = p_label.min(1) if h else np.ones(m)
    q = false_discovery_control(p_neuron, method="bh")
    best = scores.max(1) if h else np.zeros(m)
    labelled = (q <= fdr) & (best >= t)
    cutoff = float(p_neuron[labelled].max()) if labelled.any() else 0.0
    return LabelTest(scores, p_label, p_neuron, q, labelled, cutoff, t, fdr, n_permutations)


def null_label_test(
    acts: np.ndarray | torch.Tensor,
    assoc: np.ndarray,
    t: float = 0.6,
    fdr: float = LABEL_FDR,
    n_permutations: int | None = None,
    seed: int = 0,
) -> LabelTest:
    """:func:`label_test` on each neuron's activations shuffled once over the grid (seeded,
    independently per neuron): what the procedure labels when no neuron relates to the
    operands."""
    acts = np.asarray(acts, dtype=np.float64).copy()
    rng = np.random.default_rng([seed, 1])
    for j in range(acts.shape[1]):
        acts[:, j] = acts[rng.permutation(acts.shape[0]), j]
    return label_test(acts, assoc, t, fdr, n_permutations, seed=seed + 2, rank_seed=seed + 3)


def annotate_matches(matches: pd.DataFrame, neurons: list, test: LabelTest) -> pd.DataFrame:
    """``matches`` (:func:`arithlib.nikankin.heuristics.classify_neurons` on ``neurons`` with the
    test's scores) with each label's ``p_value`` (max-T, p(n, h)), the neuron's
    ``q_value`` (BH) and ``beats_null`` (the label survives the test)."""
    cols = ["p_value", "q_value", "beats_null"]
    if matches is None or matches.empty:
        return pd.DataFrame(columns=list(getattr(matches, "columns", [])) + cols)
    row = {(int(a), int(b)): i for i, (a, b) in enumerate(neurons)}
    i = np.array([row[(int(a), int(b))] for a, b in zip(matches["layer"], matches["neuron"])])
    h = matches["h_index"].astype(int).to_numpy()
    mask = test.label_mask
    return matches.assign(p_value=test.p_label[i, h], q_value=test.q_neuron[i], beats_null=mask[i, h])


def beating_null(matches: pd.DataFrame) -> pd.DataFrame:
    """The labels of an annotated ``matches`` table that beat the null (all rows of a table
    without ``beats_null``, e.g. one from an older run, are returned unchanged)."""
    if matches is None or matches.empty or "beats_null" not in matches:
        return matches
    return matches[matches["beats_null"].astype(bool)].reset_index(drop=True)


def share_row(test: LabelTest, null: LabelTest, shuffled_scores: np.ndarray | None = None) -> dict:
    """The labelled share against the null's, for ``03_matched_share.csv``: ``matched_share``
    (best score >= t), ``matched_share_null`` (the same on shuffled activations),
    ``labelled_share`` (t and BH), ``labelled_share_null`` (the procedure on shuffled
    activations), ``label_fdr``, ``n_permutations``."""

    def at_t(s: np.ndarray) -> float:
        return float((s >= test.t).any(1).mean()) if s.size else (0.0 if len(s) else float("nan"))

    sh = null.scores if shuffled_scores is None else shuffled_scores
    return {
        "matched_share": at_t(test.scores),
        "matched_share_null": at_t(sh),
        "labelled_share": test.labelled_share,
        "labelled_share_null": null.labelled_share,
        "n_labelled": int(test.labelled.sum()),
        "label_fdr": test.fdr,
        "n_permutations": test.n_permutations,
    }
