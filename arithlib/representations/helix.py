"""The helix of a number and its causal test (Kantamneni & Tegmark 2025, "Language Models
Use Trigonometry to Do Addition", arXiv:2502.00873; their code: subhashk01/LLM-addition,
``experimentation/helix_fitting.ipynb``).

**Helix basis.** Number a is represented as a linear image of

    B(a) = [a / a_max, cos(2 pi a / T_1), sin(2 pi a / T_1), ..., cos(2 pi a / T_P), sin(2 pi a / T_P), 1]

(:func:`helix_basis`; periods T = 2, 5, 10, 100 in the paper), so the helix has 2P + 1
dimensions besides the constant (on integers sin(2 pi a / 2) = 0, so one of them is empty,
as in the authors' basis; the least squares below handle the rank deficiency). **Fit** (:func:`fit_helix`, as the authors' code): the
activations X [n, d] (one row per prompt, the residual stream at a's token) are centred
and projected on their top ``n_pca`` principal components, the projections are
regressed on B(a) by least squares (one linear map C), and the fit of a number is
mean + (B(a) C) V, back in the model's space (V: the principal directions).

**Causal test** (:func:`patch_values`, :func:`restored_share`): on a clean prompt "a+b="
the residual stream at a's token of one layer is replaced by a value that stands for
another number a' (same b):

* *layer*: the activation of the prompt "a'+b=" itself (the whole layer's patch);
* *helix*: the helix fit of a';
* *pca*: that activation's projection on the top k principal components (plus the mean),
  k = 2P + 1, the helix's dimension;
* *random*: its projection on a random k-dimensional subspace (plus the mean);
* *helix without T*: the fit with one period left out (which periods matter).

The effect of each is the logit difference of the answer a' + b, patched minus clean
(the authors' ``calc_log_diff``); the share restored is mean effect / mean effect of the
layer patch (:func:`restored_share`).

**Neuron fits** (:func:`neuron_fit_r2`): a neuron's activation over "a+b=" prompts is
regressed on [B(a), B(b), B(a + b)] (the paper fits neuron preactivations with the
helices of a, b and a + b); the R^2 is measured on held-out prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.papers import KT_N_PCA, KT_PERIODS  # noqa: E402  (the periods 2, 5, 10, 100 and NUM_PCA = 100)

_QUARTER_COS = np.array([1.0, 0.0, -1.0, 0.0])  # cos and sin at 0, 1/4, 1/2, 3/4 of a turn
_QUARTER_SIN = np.array([0.0, 1.0, 0.0, -1.0])


def helix_basis(
    a: Sequence[float] | np.ndarray,
    periods: Sequence[float] = KT_PERIODS,
    a_max: float | None = None,
    linear: bool = True,
    constant: bool = True,
) -> np.ndarray:
    """B(a) [n, 2P + linear + constant]: a / a_max (``a_max`` default max(a)), then
    cos and sin of 2 pi a / T for each period T, then a column of ones."""
    x = np.asarray(a, dtype=np.float64)
    cols = []
    if linear:
        scale = float(a_max) if a_max is not None else float(max(np.abs(x).max(), 1.0))
        cols.append(x / scale)
    for T in periods:
        # the phase reduced to one turn first, and values at a multiple of a quarter turn set
        # exactly: sin(2 pi a / 2) of an integer a is 0, not 1e-14 (a column lstsq would
        # otherwise have to recognise as noise to drop)
        turn = np.mod(x / T, 1.0)
        q = np.round(turn * 4)
        on_quarter = np.abs(turn * 4 - q) < 1e-12
        k = q.astype(int) % 4
        cos = np.where(on_quarter, _QUARTER_COS[k], np.cos(2 * math.pi * turn))
        sin = np.where(on_quarter, _QUARTER_SIN[k], np.sin(2 * math.pi * turn))
        cols += [cos, sin]
    if constant:
        cols.append(np.ones_like(x))
    return np.stack(cols, 1) if cols else np.zeros((len(x), 0))


def helix_dim(periods: Sequence[float], linear: bool = True) -> int:
    """Dimension of the helix without the constant: 2P + 1 (the PCA and random baselines' k)."""
    return 2 * len(periods) + int(linear)


def pca(X: np.ndarray | torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean [d], components [k', d]) of the rows of X, k' = min(k, rank): the top
    principal directions, orthonormal rows."""
    x = np.asarray(X, dtype=np.float64)
    mean = x.mean(0)
    _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    rank = int((s > s[0] * 1e-10).sum()) if len(s) and s[0] > 0 else 0
    return mean, vt[: min(k, rank)]


@dataclass(frozen=True)
class HelixFit:
    """A fitted helix: ``predict(a)`` = mean + B(a) @ coef @ components."""

    periods: tuple[float, ...]
    a_max: float
    mean: np.ndarray  # [d]
    components: np.ndarray  # [p, d] principal directions the fit lives in
    coef: np.ndarray  # [n_basis, p]
    linear: bool = True

    def basis(self, a: Sequence[float] | np.ndarray) -> np.ndarray:
        return helix_basis(a, self.periods, self.a_max, self.linear)

    def predict(self, a: Sequence[float] | np.ndarray) -> np.ndarray:
        """Fitted activations [n, d] of the numbers ``a``."""
        return self.mean + self.basis(a) @ self.coef @ self.components


def fit_helix(
    X: np.ndarray | torch.Tensor,
    a: Sequence[float] | np.ndarray,
    periods: Sequence[float] = KT_PERIODS,
    n_pca: int = KT_N_PCA,
    a_max: float | None = None,
    linear: bool = True,
) -> HelixFit:
    """Least-squares helix fit of the activations ``X`` [n, d] of the numbers ``a`` [n]
    in their top ``n_pca`` principal components (module docstring)."""
    x = np.asarray(X, dtype=np.float64)
    a = np.asarray(a, dtype=np.float64)
    mean, comps = pca(x, n_pca)
    coords = (x - mean) @ comps.T
    a_max = float(a_max) if a_max is not None else float(max(np.abs(a).max(), 1.0))
    B = helix_basis(a, periods, a_max, linear)
    coef, *_ = np.linalg.lstsq(B, coords, rcond=None)
    return HelixFit(tuple(float(t) for t in periods), a_max, mean, comps, coef, linear)


def fit_helix_literal(
    X: np.ndarray,
    a: np.ndarray,
    periods: Sequence[float] = KT_PERIODS,
    n_pca: int = KT_N_PCA,
    a_max: float | None = None,
) -> np.ndarray:
    """The fitted activations of the rows of ``X``, computed one PCA coordinate at a time
    as the authors' code does (one regression per coordinate, eigenvectors of the
    covariance for the PCA): the reference that :func:`fit_helix` is tested equal to."""
    x = np.asarray(X, dtype=np.float64)
    mean = x.mean(0)
    cov = (x - mean).T @ (x - mean)
    w, v = np.linalg.eigh(cov)
    order = np.argsort(w)[::-1]
    keep = [i for i in order if w[i] > w[order[0]] * 1e-20][:n_pca]
    comps = v[:, keep].T
    coords = (x - mean) @ comps.T
    B = helix_basis(a, periods, a_max)
    pred = np.zeros_like(coords)
    for j in range(coords.shape[1]):  # sin(2 pi a / 2) = 0 for integers: B is rank-deficient, so least squares
        beta, *_ = np.linalg.lstsq(B, coords[:, j], rcond=None)
        pred[:, j] = B @ beta
    return mean + pred @ comps


def r2(y: np.ndarray, pred: np.ndarray) -> float:
    """Coefficient of determination, summed over columns: 1 - SS_res / SS_tot."""
    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    tot = ((y - y.mean(0)) ** 2).sum()
    return float(1 - ((y - pred) ** 2).sum() / tot) if tot > 0 else float("nan")


# --------------------------------------------------------------------------- patch values


def subspace_projection(X: np.ndarray | torch.Tensor, mean: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """mean + the projection of X - mean on the row space of ``basis`` [k, d] (orthonormal
    rows): the PCA and random baselines' replacement values."""
    x = np.asarray(X, dtype=np.float64)
    return mean + ((x - mean) @ basis.T) @ basis


def random_subspace(d: int, k: int, seed: int = 0) -> np.ndarray:
    """k orthonormal rows [k, d] spanning a uniformly random subspace (seeded)."""
    g = np.random.default_rng(seed).standard_normal((d, k))
    q, _ = np.linalg.qr(g)
    return q.T


def patch_values(
    source_X: np.ndarray,
    source_a: np.ndarray,
    fit_X: np.ndarray,
    fit_a: np.ndarray,
    periods: Sequence[float] = KT_PERIODS,
    n_pca: int = KT_N_PCA,
    drop_one: bool = True,
    seed: int = 0,
    a_max: float | None = None,
) -> dict[str, np.ndarray]:
    """Replacement values [n, d] of every method (module docstring) for the source
    prompts' activations ``source_X`` of the numbers ``source_a``, with the helix, PCA
    and mean fitted on ``fit_X`` / ``fit_a``: keys "layer", "helix", "pca", "random" and,
    with ``drop_one``, "helix without T" for each period T."""
    fit = fit_helix(fit_X, fit_a, periods, n_pca, a_max)
    k = helix_dim(periods)
    mean, comps = pca(fit_X, k)
    out = {
        "layer": np.asarray(source_X, dtype=np.float64),
        "helix": fit.predict(source_a),
        "pca": subspace_projection(source_X, mean, comps),
        "random": subspace_projection(source_X, mean, random_subspace(len(mean), k, seed)),
    }
    if drop_one and len(periods) > 1:
        for T in periods:
            rest = [t for t in periods if t != T]
            out[f"helix without {T:g}"] = fit_helix(fit_X, fit_a, rest, n_pca, fit.a_max).predict(source_a)
    return out


def restored_share(effect: np.ndarray, layer_effect: np.ndarray) -> float:
    """Share of the layer patch's effect a method restores: mean(effect) / mean(layer
    effect) over the same prompt pairs (NaN when the layer patch has no mean effect)."""
    d = float(np.mean(layer_effect))
    return float(np.mean(effect)) / d if d != 0 else float("nan")


# --------------------------------------------------------------------------- neuron fits


def neuron_features(a: np.ndarray, b: np.ndarray, periods: Sequence[float] = KT_PERIODS) -> np.ndarray:
    """[B(a), B(b), B(a + b)] with one constant column (the paper's neuron-fit basis)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    s = a + b
    parts = [helix_basis(v, periods, a_max=float(max(s.max(), 1.0)), constant=False) for v in (a, b, s)]
    return np.concatenate(parts + [np.ones((len(a), 1))], 1)


def neuron_fit_r2(
    acts: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    periods: Sequence[float] = KT_PERIODS,
    seed: int = 0,
    test_share: float = 0.5,
) -> np.ndarray:
    """Held-out R^2 of each neuron's activation (columns of ``acts`` [n, m]) regressed on
    :func:`neuron_features`: fitted on a seeded ``1 - test_share`` of the prompts, scored
    on the rest. Returns [m]."""
    y = np.asarray(acts, dtype=np.float64)
    F = neuron_features(a, b, periods)
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(y))
    n_test = max(1, int(round(test_share * len(y))))
    test, train = idx[:n_test], idx[n_test:]
    coef, *_ = np.linalg.lstsq(F[train], y[train], rcond=None)
    pred = F[test] @ coef
    yt = y[test]
    tot = ((yt - yt.mean(0)) ** 2).sum(0)
    res = ((yt - pred) ** 2).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, 1 - res / tot, np.nan)
